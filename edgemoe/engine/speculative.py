"""Speculative decoding's drafts: prompt lookup. A sequence whose last n tokens occurred earlier in it (its prompt or
its output: an agent copying a span of a file it read, a quoted passage) drafts the tokens that followed that
occurrence; one step then computes the sequence's next token and its k drafted positions together (`Batch.verify`),
and keeps the drafts up to the first one the model would not have chosen, plus the model's own token there.

Greedy sequences only: a draft is accepted where it equals the argmax at its position, so the output is the one plain
decoding gives (the verify step computes the positions as a prefill chunk does). Sampled sequences, and steps where a
logits processor (a grammar, a test's script) reads each sequence's logits, decode one token as before.
"""

from __future__ import annotations

from dataclasses import dataclass


def ngram_draft(tokens: list[int], max_n: int, k: int, min_n: int = 1) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of `tokens`' last n tokens, for the longest n from
    max_n down to min_n that occurs; [] when none does. The occurrence may overlap the tail (a repeating pattern
    drafts its continuation)."""
    length = len(tokens)
    if k <= 0:
        return []
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        tail = tokens[length - n :]
        for start in range(length - n - 1, -1, -1):  # the latest occurrence first
            if tokens[start : start + n] == tail:
                return tokens[start + n : start + n + k]
    return []


@dataclass
class SpeculativeStats:
    """Verify steps, tokens drafted, drafts accepted (each sequence's step counts once)."""

    steps: int = 0
    drafted: int = 0
    accepted: int = 0

    def add(self, drafted: int, accepted: int) -> None:
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted

    def as_dict(self) -> dict:
        rate = self.accepted / self.drafted if self.drafted else None
        per_step = (self.steps + self.accepted) / self.steps if self.steps else None  # tokens a verify step yields
        return {**self.__dict__, "acceptance": rate, "tokens_per_step": per_step}
