"""tokenizer_from_gguf against transformers' GGUF tokenizer (the oracle) and the Hugging Face checkpoint's
tokenizer.json: byte-level BPE as make-model writes it (pre-tokenizers qwen2 and gpt-2; qwen35 against transformers'
GGUF loader; GLM-4's, which transformers does not read, against llama.cpp's rules), and a SentencePiece-style `llama`
vocabulary (scores, byte fallback, no merges) written here."""

from __future__ import annotations

import json

import gguf
import pytest
from tokenizers import Tokenizer

from edgemoe.errors import EdgeMoEError
from edgemoe.models.gguf_tokenizer import bytes_to_unicode, tokenizer_from_gguf
from edgemoe.tools.make_model import make_model
from edgemoe.tools.presets import PRESETS
from edgemoe.tools.random_weights import tokenizer_files

TEXTS = [
    "Hello world",
    "  leading spaces, and trailing  ",
    "café naïve résumé Ünïcödé Ångström",
    "e\u0301 (a decomposed accent)",
    "日本語のテキスト、中文字符，한국어",
    "emoji 😀🚀👍🏽 and 🦙🦙",
    "line1\nline2\r\n\n\ttab\t\t end\n",
    "numbers 12345 3.14159 1,000,000 ٣٤",
    "I'm don't you'LL WE'RE they've",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "MiXeD CaSe___!!!???   ...",
    "",
]


def assert_same(ours: Tokenizer, oracle, original: Tokenizer | None = None) -> None:
    for text in TEXTS:
        ids = ours.encode(text).ids
        assert ids == oracle(text)["input_ids"], text
        if original is not None:
            assert ids == original.encode(text).ids, text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == oracle.decode(ids, skip_special_tokens=skip), text


@pytest.mark.parametrize("family, pre", [("qwen3_moe", "qwen2"), ("qwen2_moe", "qwen2"), ("mixtral", "gpt-2")])
def test_byte_level_as_transformers_and_the_tokenizer_json(tmp_path, family, pre) -> None:
    from transformers import AutoTokenizer

    path = make_model(tmp_path, family, "tiny", layers=1, dtype="float32", format="gguf", expert_dtype="q8_0")
    reader = gguf.GGUFReader(path)
    assert reader.fields["tokenizer.ggml.model"].contents() == "gpt2"
    assert reader.fields["tokenizer.ggml.pre"].contents() == pre
    text, config = tokenizer_from_gguf(reader)
    original, original_config = tokenizer_files(family)
    assert_same(Tokenizer.from_str(text), AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name),
                Tokenizer.from_str(original))  # fmt: skip
    expected = json.loads(original_config)
    for key in ("bos_token", "eos_token", "pad_token", "chat_template", "add_bos_token"):
        assert config[key] == expected[key], key


def test_unused_ids_of_a_larger_vocabulary(tmp_path, monkeypatch) -> None:
    """A model vocabulary larger than the tokenizer's (real geometries): the rest are unused `[PAD<id>]` tokens."""
    monkeypatch.setitem(PRESETS["tiny"], "vocab_size", 6200)
    path = make_model(tmp_path, "qwen3_moe", "tiny", layers=1, dtype="float32", format="gguf")
    reader = gguf.GGUFReader(path)
    assert reader.fields["tokenizer.ggml.tokens"].contents()[6150] == "[PAD6150]"
    assert reader.fields["tokenizer.ggml.token_type"].contents()[6150] == gguf.TokenType.UNUSED
    tok, original = (
        Tokenizer.from_str(tokenizer_from_gguf(reader)[0]),
        Tokenizer.from_str(tokenizer_files("qwen3_moe")[0]),
    )
    assert tok.get_vocab_size() == 6200 and tok.encode("hello [PAD6150]").ids == original.encode("hello [PAD6150]").ids


def sentencepiece_vocab() -> tuple[list[str], list[float], list[int]]:
    """A SentencePiece-style vocabulary from the demo tokenizer's: <unk>, <s>, </s>, the 256 byte tokens, then the
    pieces that are whole UTF-8 text (spaces as ▁), scored by rank; no merges, as llama.cpp's converter writes."""
    spec = json.loads(tokenizer_files("mixtral")[0])
    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    pieces = []
    for token in sorted(spec["model"]["vocab"], key=spec["model"]["vocab"].get):
        try:
            text = bytes(byte_of[c] for c in token).decode()
        except (KeyError, UnicodeDecodeError):
            continue
        pieces.append(text.replace(" ", "▁"))
    pieces = list(dict.fromkeys(p for p in pieces if p))
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    return tokens, scores, [*types, *[gguf.TokenType.BYTE] * 256, *[gguf.TokenType.NORMAL] * len(pieces)]


def write_tokenizer_gguf(path, model: str, pre: str, tokens, scores=None, types=None, **extra) -> None:
    w = gguf.GGUFWriter(path, "llama")
    w.add_tokenizer_model(model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    if scores is not None:
        w.add_token_scores(scores)
    if types is not None:
        w.add_token_types(types)
    for key, value in extra.items():
        getattr(w, f"add_{key}")(value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("space_prefix", [None, False])
def test_sentencepiece_as_transformers(tmp_path, space_prefix) -> None:
    from transformers import AutoTokenizer

    tokens, scores, types = sentencepiece_vocab()
    extra = dict(bos_token_id=1, eos_token_id=2, unk_token_id=0, add_bos_token=True, add_eos_token=False)
    if space_prefix is not None:
        extra["add_space_prefix"] = space_prefix
    write_tokenizer_gguf(tmp_path / "spm.gguf", "llama", "default", tokens, scores, types, **extra)
    text, config = tokenizer_from_gguf(gguf.GGUFReader(tmp_path / "spm.gguf"))
    assert config["bos_token"] == "<s>" and config["eos_token"] == "</s>" and config["unk_token"] == "<unk>"
    ours = Tokenizer.from_str(text)
    pieces = ours.encode("日本").tokens
    assert pieces[0] == "<s>" and all(t.startswith("<0x") for t in pieces[-6:])  # BOS, UTF-8 bytes (no such pieces)
    if space_prefix is None:  # transformers ignores add_space_prefix (always a prefix); llama.cpp honours it
        assert_same(ours, AutoTokenizer.from_pretrained(tmp_path, gguf_file="spm.gguf"))
    else:
        assert ours.encode("Hello").tokens[1] == "H" and ours.decode(ours.encode(" Hi").ids) == " Hi"


def test_unsupported_tokenizers_are_one_error(tmp_path) -> None:
    for model, pre in [("gpt2", "llama-bpe"), ("bert", "default"), ("gpt2", "default")]:
        write_tokenizer_gguf(tmp_path / "t.gguf", model, pre, ["a", "b"])
        with pytest.raises(EdgeMoEError, match=f"GGUF tokenizer model '{model}' with pre-tokenizer '{pre}'"):
            tokenizer_from_gguf(gguf.GGUFReader(tmp_path / "t.gguf"))


def byte_level_gguf(path, pre: str) -> None:
    """The demo vocabulary as make-model's GGUF writer stores it, its pre-tokenizer named `pre`."""
    from edgemoe.tools.make_gguf import _add_tokenizer

    tokenizer, tokenizer_config = tokenizer_files("qwen3_moe")
    size = Tokenizer.from_str(tokenizer).get_vocab_size()
    w = gguf.GGUFWriter(path, "llama")
    _add_tokenizer(w, dict(vocab_size=size, bos_token_id=0, eos_token_id=0), tokenizer, tokenizer_config, pre)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_qwen35_split_as_transformers(tmp_path) -> None:
    """Qwen3.5's files (`qwen35`: words keep their combining marks) read as transformers' GGUF loader reads them;
    the decomposed accent splits otherwise than under Qwen2's regex, so the name is not read as `qwen2`."""
    from transformers import AutoTokenizer

    byte_level_gguf(tmp_path / "q.gguf", "qwen35")
    ours = Tokenizer.from_str(tokenizer_from_gguf(gguf.GGUFReader(tmp_path / "q.gguf"))[0])
    assert_same(ours, AutoTokenizer.from_pretrained(tmp_path, gguf_file="q.gguf"))
    byte_level_gguf(tmp_path / "q2.gguf", "qwen2")
    qwen2 = Tokenizer.from_str(tokenizer_from_gguf(gguf.GGUFReader(tmp_path / "q2.gguf"))[0])
    marked = "nai\u0308ve"  # the diaeresis a combining mark: one word under qwen35, two under qwen2
    assert len(ours.pre_tokenizer.pre_tokenize_str(marked)) == 1
    assert len(qwen2.pre_tokenizer.pre_tokenize_str(marked)) == 2
    assert ours.decode(ours.encode(marked).ids) == marked


def test_glm4_split_and_whole_words(tmp_path) -> None:
    """GLM-4's files (`glm4`, as llama.cpp reads them): digits in runs of at most three, and a word found whole in
    the vocabulary is one token even where no merge leads to it (llama.cpp's ignore_merges)."""
    byte_level_gguf(tmp_path / "g.gguf", "glm4")
    reader = gguf.GGUFReader(tmp_path / "g.gguf")
    ours = Tokenizer.from_str(tokenizer_from_gguf(reader)[0])
    words = ours.pre_tokenizer.pre_tokenize_str("in 1234567 steps")
    assert [w for w, _ in words] == ["in", "Ġ", "123", "456", "7", "Ġsteps"]
    alphabet = list(bytes_to_unicode().values())  # a vocabulary of the 256 bytes, "ab" and "abc", one merge: a b
    for pre in ("glm4", "qwen2"):
        write_tokenizer_gguf(tmp_path / "w.gguf", "gpt2", pre, [*alphabet, "ab", "abc"], token_merges=["a b"])
        words = Tokenizer.from_str(tokenizer_from_gguf(gguf.GGUFReader(tmp_path / "w.gguf"))[0])
        assert words.encode("abc").tokens == (["abc"] if pre == "glm4" else ["ab", "c"]), pre
    for text in TEXTS:
        assert ours.decode(ours.encode(text).ids, skip_special_tokens=False) == text
