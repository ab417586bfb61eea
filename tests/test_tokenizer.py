"""Incremental detokenisation never splits a character, and deltas add up to the plain decode."""

from __future__ import annotations

import random

from edgemoe.tokenizer import IncrementalDetokenizer

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
