"""Speculative decoding's drafts: prompt lookup. A sequence whose last n tokens occurred earlier in it (its prompt or
its output: an agent copying a span of a file it read, a quoted passage) drafts the tokens that followed that
occurrence; one step then computes the sequence's next token and its k drafted positions together (`Batch.verify`:
each position a row of a decode step, attending up to itself), and keeps the drafts up to the first one the model
would not have chosen, plus the model's own token there.

Greedy sequences only: a draft is accepted where it equals the argmax at its position, so the output is the one plain
decoding gives (a row computes its position as a decode step there would: the decode kernels are row-invariant).
Models whose layers keep a recurrent state verify a prefill chunk instead, their state stashed first (`StateCache.
stash`) and put back where a draft failed: the kept tokens are then computed again with the next step.
Sampled sequences, and steps where a logits processor (a grammar, a test's script) reads each sequence's logits, decode
one token as before.
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


class NgramIndex:
    """`ngram_draft` for one growing sequence in time independent of its length: every n-gram (n <= max_n) that has a
    token after it, by its latest end, indexed as the sequence grows (a 25K-token agent prompt would otherwise be
    scanned again at every step)."""

    def __init__(self, max_n: int) -> None:
        self.max_n = max_n
        self.ends: dict[tuple[int, ...], int] = {}  # n-gram -> the end (exclusive) of its latest indexed occurrence
        self.indexed = 0  # n-grams ending at positions < this are in `ends`

    def draft(self, tokens: list[int], k: int) -> list[int]:
        """`ngram_draft(tokens, max_n, k)`; `tokens` must extend the ones of the previous call."""
        length = len(tokens)
        for end in range(max(self.indexed, 1), length):  # an n-gram ending here has a token after it
            for n in range(1, min(self.max_n, end) + 1):
                self.ends[tuple(tokens[end - n : end])] = end
        self.indexed = max(self.indexed, length)
        if k <= 0:
            return []
        for n in range(min(self.max_n, length - 1), 0, -1):
            end = self.ends.get(tuple(tokens[length - n :]))
            if end is not None:
                return tokens[end : end + k]
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


class SpeculationGate:
    """Speculation only where it pays: the decode rate (tokens a second a sequence) of verify steps against plain
    decode steps, each an exponential moving average of the steps measured (`record`; the first `warmup` of each kind
    are not: they may compile kernels for new shapes). Closed while verify steps yield fewer tokens a second than
    plain ones; either way, every `probe`-th decode step runs the other kind, so that both rates stay measured as the
    context, the batch and the expert cache change. Open until both are known. A closed gate drafts nothing: the step
    is a plain decode step, at plain decoding's speed."""

    def __init__(self, probe: int = 32, weight: float = 0.25, warmup: int = 1) -> None:
        self.probe, self.weight, self.warmup = probe, weight, warmup
        self.rates: dict[bool, float | None] = {True: None, False: None}  # verify?, tokens / s a sequence
        self._seen = {True: 0, False: 0}
        self._since = 0  # decode steps of the preferred kind since it became so or since the last probe

    def verify_preferred(self) -> bool:
        verify, plain = self.rates[True], self.rates[False]
        return verify is None or plain is None or verify >= plain

    def open(self) -> bool:
        """Whether this decode step may draft."""
        return self.verify_preferred() != (self._since >= self.probe)  # a probe: the other kind, once

    def record(self, verify: bool, tokens: int, seqs: int, seconds: float) -> None:
        """A decode step of `seqs` sequences that yielded `tokens` tokens in `seconds` (verify: it had drafts)."""
        before = self.verify_preferred()
        self._seen[verify] += 1
        if seconds > 0 and seqs > 0 and self._seen[verify] > self.warmup:
            rate, old = tokens / seqs / seconds, self.rates[verify]
            self.rates[verify] = rate if old is None else old + self.weight * (rate - old)
        after = self.verify_preferred()
        self._since = 0 if after != before or verify != after else self._since + 1
