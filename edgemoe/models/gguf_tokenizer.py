"""A tokenizer from a GGUF file's metadata: the `tokenizer.json` and `tokenizer_config.json` the file implies.

A GGUF carries no tokenizer.json, only llama.cpp's `tokenizer.*` keys: the model kind (`gpt2`: byte-level BPE,
`llama`: SentencePiece BPE with byte fallback), the pre-tokenizer's name, tokens, token types, merges or scores,
special ids and the chat template. They are read here the way llama.cpp reads them and built with the `tokenizers`
library's own classes as transformers' GGUF loader (`integrations/gguf/gguf_tokenizer_mapping.py`, the tests'
oracle) builds them; transformers itself is not imported (a test dependency only), nor gguf (the GPU machines'
image lacks it; `edgemoe.tools.make_model` imports QWEN2_SPLIT from here).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from edgemoe.errors import EdgeMoEError

if TYPE_CHECKING:
    import gguf

# Qwen2's pre-tokenizer split (transformers' `tokenization_qwen2.PRETOKENIZE_REGEX`, llama.cpp's `qwen2` pre)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen3.5's (llama.cpp's `qwen35`): Qwen2's, with combining marks (\p{M}) kept in words
QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
# GLM-4's (llama.cpp's `chatglm-bpe`, `glm4`, `glm5`): Qwen2's, with digits in runs of up to three
GLM4_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)"
    r"|\s+"
)
# tokenizer.ggml.pre of a byte-level vocabulary -> the regex splitting text before BPE (None: GPT-2's own, inside
# the ByteLevel pre-tokenizer)
BYTE_LEVEL_SPLITS: dict[str, str | None] = {
    "qwen2": QWEN2_SPLIT,
    "qwen35": QWEN35_SPLIT,
    "gpt-2": None,
    "chatglm-bpe": GLM4_SPLIT,
    "glm4": GLM4_SPLIT,
    "glm5": GLM4_SPLIT,
}
# pre-tokenizers whose words found whole in the vocabulary are one token, merges or not (llama.cpp's ignore_merges)
WHOLE_WORDS = ("glm4", "glm5")
_CONTROL, _USER_DEFINED = 3, 4  # gguf.TokenType
_SPECIAL = ("bos", "eos", "unk", "pad")  # tokenizer_config's <name>_token from tokenizer.ggml.<key>_token_id
_ID_KEYS = {"bos": "bos_token_id", "eos": "eos_token_id", "unk": "unknown_token_id", "pad": "padding_token_id"}


def tokenizer_from_gguf(reader: gguf.GGUFReader) -> tuple[str, dict]:
    """(tokenizer.json content, tokenizer_config.json dict) of the tokenizer a GGUF file's metadata describes.
    EdgeMoEError for a tokenizer model or pre-tokenizer this does not build."""
    meta = {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}
    kind, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre")
    if kind == "gpt2" and pre in BYTE_LEVEL_SPLITS:
        tok, add_bos_default = _byte_level(meta, BYTE_LEVEL_SPLITS[pre], pre in WHOLE_WORDS), False
    elif kind == "llama":
        tok, add_bos_default = _sentencepiece(meta), True  # llama.cpp adds BOS to SentencePiece vocabularies
    else:
        raise EdgeMoEError(
            f"GGUF tokenizer model {kind!r} with pre-tokenizer {pre!r} is not supported "
            f"(supported: gpt2 with pre {' or '.join(BYTE_LEVEL_SPLITS)}; llama)"
        )
    tokens = meta["tokenizer.ggml.tokens"]
    special = {}
    for name in _SPECIAL:
        i = meta.get(f"tokenizer.ggml.{_ID_KEYS[name]}")
        special[name] = tokens[i] if i is not None and 0 <= i < len(tokens) else None
    _add_special_tokens(tok, meta, kind == "gpt2", [t for t in special.values() if t is not None])
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default)) and special["bos"] is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and special["eos"] is not None
    if add_bos or add_eos:
        tok.post_processor = _template(tok, special["bos"] if add_bos else None, special["eos"] if add_eos else None)
    config = {f"{name}_token": text for name, text in special.items()}
    config |= {"add_bos_token": add_bos, "add_eos_token": add_eos}
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    return tok.to_str(), config


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table: byte-level vocabularies spell every byte with one of these."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _byte_level(meta: dict, split: str | None, whole_words: bool = False) -> Tokenizer:
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {}
    for i, token in enumerate(meta["tokenizer.ggml.tokens"]):  # tokens outside the byte alphabet: spelled in it
        vocab[token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode())] = i
    merges = [tuple(m.split(" ")) for m in meta.get("tokenizer.ggml.merges", [])]
    bpe = models.BPE(
        vocab, merges, dropout=None, continuing_subword_prefix="", end_of_word_suffix="", ignore_merges=whole_words
    )
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = byte_level_pre_tokenizer(split)
    tok.decoder = decoders.ByteLevel()
    return tok


def byte_level_pre_tokenizer(split: str | None) -> pre_tokenizers.PreTokenizer:
    """Text split by `split` (None: GPT-2's regex, inside ByteLevel), then spelled in the byte alphabet."""
    if split is None:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _sentencepiece(meta: dict) -> Tokenizer:
    tokens = meta["tokenizer.ggml.tokens"]
    vocab = {token: i for i, token in enumerate(tokens)}
    if "tokenizer.ggml.merges" in meta:
        merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    else:
        merges = merges_from_scores(vocab, dict(zip(tokens, meta["tokenizer.ggml.scores"])))
    tok = Tokenizer(models.BPE(vocab, merges, dropout=None, fuse_unk=True, byte_fallback=True))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if prefix else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(content=" ", left=1)] if prefix else []))
    return tok


def merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """BPE merges of a SentencePiece vocabulary stored without them: every split of a token into two tokens,
    best-scored first (as SentencePiece merges by the score of the merged piece; transformers' `generate_merges`)."""
    merges = []
    for token, score in scores.items():
        local = [
            (token[:i], token[i:], score) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab
        ]
        merges += sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]]))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _add_special_tokens(tok: Tokenizer, meta: dict, byte_level: bool, named: list[str]) -> None:
    """Control tokens (and the named bos/eos/unk/pad) stay whole and are special; user-defined ones stay whole.
    A control token outside a byte-level vocabulary's alphabet is a mislabel and is skipped (as transformers)."""
    alphabet = set(bytes_to_unicode().values())
    types = meta.get("tokenizer.ggml.token_type") or []
    control = [t for t, ty in zip(meta["tokenizer.ggml.tokens"], types) if ty == _CONTROL]
    control = [t for t in control if not byte_level or set(t) <= alphabet]
    control += [t for t in named if t not in control and tok.token_to_id(t) is not None]
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    vocab = tok.get_vocab()
    user = [t for t, ty in zip(meta["tokenizer.ggml.tokens"], types) if ty == _USER_DEFINED and t in vocab]
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])


def _template(tok: Tokenizer, bos: str | None, eos: str | None) -> processors.TemplateProcessing:
    """Adds BOS / EOS around each sequence, as transformers' `update_post_processor`."""
    single = f"{f'{bos}:0 ' if bos else ''}$A:0{f' {eos}:0' if eos else ''}"
    pair = f"{single} {f'{bos}:1 ' if bos else ''}$B:1{f' {eos}:1' if eos else ''}"
    ids = [(t, tok.token_to_id(t)) for t in dict.fromkeys(x for x in (bos, eos) if x)]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=ids)
