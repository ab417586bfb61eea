"""Incremental detokenisation never splits a character, and deltas add up to the plain decode; what a tokenizer
folder or a prompt can get wrong is an `EdgeMoEError`."""

from __future__ import annotations

import json
import random
import shutil
import threading
import time

import pytest

from edgemoe import demo_model_path
from edgemoe.errors import EdgeMoEError
from edgemoe.tokenizer import IncrementalDetokenizer, Tokenizer

SAMPLES = [
    "plain words and spaces",
    "é ü ñ — “quotes” 日本語のテキスト 🎭🎭 emoji",
    "\n\n  indented\n\ttab",
    "mixed: naïve café, Ελληνικά, русский, עברית",
]


def test_deltas_concatenate_to_decode(demo_llm) -> None:
    tok = demo_llm.tokenizer
    for text in SAMPLES:
        prompt = tok.encode("Prompt: ")
        ids = tok.encode(text)
        detok = IncrementalDetokenizer(tok, prompt)
        deltas = [detok.step([i]) for i in ids]
        assert "".join(deltas) == tok.decode(ids) == text
        assert not any("\ufffd" in d for d in deltas)


def test_random_byte_tokens_are_never_split(demo_llm) -> None:
    """Random multi-byte characters tokenised into byte-level pieces, fed in random chunk sizes."""
    tok = demo_llm.tokenizer
    rng = random.Random(3)
    for _ in range(20):
        text = "".join(
            chr(rng.choice([rng.randint(0x4E00, 0x9FFF), rng.randint(0x1F300, 0x1F5FF), rng.randint(0x61, 0x7A)]))
            for _ in range(30)
        )
        ids = tok.encode(text)
        detok = IncrementalDetokenizer(tok, [])
        out, i = "", 0
        while i < len(ids):
            n = rng.randint(1, 3)
            out += detok.step(ids[i : i + n])
            i += n
        assert out == text


def _with_config(tmp_path, **fields) -> Tokenizer:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo_model_path() / name, tmp_path / name)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**cfg, **fields}))
    return Tokenizer(tmp_path)


@pytest.mark.parametrize(
    "template, message",
    [
        ("{{ 1/0 }}", "the chat template failed: ZeroDivisionError: division by zero"),
        ("{{ messages[0].content.upper(1) }}", "the chat template failed: TypeError"),
        ("{{ messages | no_such_filter }}", "the chat template does not compile: No filter named 'no_such_filter'"),
        ("{% for %}", "the chat template does not compile"),
        ("{{ raise_exception('roles must alternate') }}", "chat template: roles must alternate"),
        ("{{ ''.__class__.__mro__ }}", "chat template: access to attribute '__class__'"),
    ],
)
def test_chat_template_failures(tmp_path, template: str, message: str) -> None:
    tok = _with_config(tmp_path, chat_template=template)  # a template that does not compile still loads
    with pytest.raises(EdgeMoEError, match=message.replace("(", r"\(").replace(")", r"\)")):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert tok.encode("hi")  # plain prompts need no template


def test_malformed_tokenizer_config(tmp_path) -> None:
    _with_config(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(EdgeMoEError, match="malformed .*tokenizer_config.json"):
        Tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("[]")
    with pytest.raises(EdgeMoEError, match="expected a JSON object"):
        Tokenizer(tmp_path)


def test_text_that_was_not_utf8(demo_llm) -> None:
    """Bytes that are not UTF-8 arrive as lone surrogates (surrogateescape); tokenizers would raise a TypeError."""
    with pytest.raises(EdgeMoEError, match="not valid Unicode: a lone surrogate at character 3"):
        demo_llm.tokenizer.encode(b"caf\xe9".decode("utf-8", "surrogateescape"))


def test_encoding_lets_other_threads_run() -> None:
    """A long text is tokenized without holding the GIL (the server tokenizes on worker threads: its event loop must
    keep answering meanwhile); the ids are those of the plain encoding."""
    tok = Tokenizer(demo_model_path())
    text = "To be, or not to be, that is the question: " * 25_000  # ~1 MB
    gaps: list[float] = []
    done = threading.Event()

    def tick() -> None:
        last = time.perf_counter()
        while not done.is_set():
            time.sleep(0.002)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = threading.Thread(target=tick)
    ticker.start()
    start = time.perf_counter()
    ids = tok.encode(text, add_special_tokens=False)
    took = time.perf_counter() - start
    done.set()
    ticker.join()
    assert ids == tok._tok.encode(text, add_special_tokens=False).ids
    assert max(gaps) < took / 2, (max(gaps), took)  # holding the GIL, the ticker would wait the whole encoding
