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
    """Speculation only where it pays, engine-wide and a sequence at a time.

    Engine-wide: the decode rate (tokens a second a sequence) of verify steps against plain decode steps, each an
    exponential moving average of the steps measured (`record`; the first `warmup` of each kind are not: they may
    compile kernels for new shapes). Closed while verify steps yield fewer tokens a second than plain ones; either
    way, every `probe`-th decode step runs the other kind, so that both rates stay measured as the context, the batch
    and the expert cache change. Open until both are known. A closed gate drafts nothing: the step is a plain decode
    step, at plain decoding's speed.

    A sequence at a time (`drafts`): a drafted row's cost, as a share of a plain step (`row_cost`: a verify step's
    time over a plain step's, per row more, measured from the same steps), against what the sequence's own drafts
    yield (`Acceptance`): it drafts the count with the most tokens a unit of time (`best_draft_count`), none where
    drafting would make it slower than plain decoding; a sequence turned down to none drafts again every `probe`-th of
    its steps, so that a change in what it writes (an agent turning from prose to copying a file) turns it back up."""

    def __init__(self, probe: int = 32, weight: float = 0.25, warmup: int = 1) -> None:
        self.probe, self.weight, self.warmup = probe, weight, warmup
        self.rates: dict[bool, float | None] = {True: None, False: None}  # verify?, tokens / s a sequence
        self._seen = {True: 0, False: 0}
        self._since = 0  # decode steps of the preferred kind since it became so or since the last probe
        self.plain_seconds: float | None = None  # a plain decode step's time (moving average)
        self.row_seconds: float | None = None  # what each row past the first of each sequence adds to a verify step

    def verify_preferred(self) -> bool:
        verify, plain = self.rates[True], self.rates[False]
        return verify is None or plain is None or verify >= plain

    def open(self) -> bool:
        """Whether this decode step may draft."""
        return self.verify_preferred() != (self._since >= self.probe)  # a probe: the other kind, once

    def record(self, verify: bool, tokens: int, seqs: int, seconds: float, rows: int | None = None) -> None:
        """A decode step of `seqs` sequences (`rows` rows: their next positions and drafts) that yielded `tokens`
        tokens in `seconds` (verify: it had drafts)."""
        before = self.verify_preferred()
        self._seen[verify] += 1
        if seconds > 0 and seqs > 0 and self._seen[verify] > self.warmup:
            rate, old = tokens / seqs / seconds, self.rates[verify]
            self.rates[verify] = rate if old is None else old + self.weight * (rate - old)
            if not verify:
                self.plain_seconds = self._average(self.plain_seconds, seconds)
            elif self.plain_seconds is not None and rows is not None and rows > seqs:
                extra = max(seconds - self.plain_seconds, 0.0) / (rows - seqs)
                self.row_seconds = self._average(self.row_seconds, extra)
        after = self.verify_preferred()
        self._since = 0 if after != before or verify != after else self._since + 1

    def _average(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.weight * (new - old)

    def row_cost(self) -> float | None:
        """A drafted row's time as a share of a plain step's; None until both are measured."""
        if self.plain_seconds is None or self.row_seconds is None:
            return None
        return self.row_seconds / self.plain_seconds

    def drafts(self, seq: Acceptance, most: int, at: int) -> int:
        """How many tokens a sequence whose drafts fare as `seq` says drafts at its length `at`, at most `most`: all
        of them until a row's cost is measured, else the count that yields the most tokens a unit of time; none
        where that is plain decoding, except on the sequence's probes. Asked again at the same length, the same
        answer (the MTP drafter asks before its chain and again when the step is scheduled)."""
        if seq.decided is not None and seq.decided[0] == at:
            return min(seq.decided[1], max(most, 0))
        cost = self.row_cost()
        if most <= 0 or cost is None:
            k = max(most, 0)
        else:
            k = best_draft_count(seq.rate, cost, most)
            seq.since = 0 if k else seq.since + 1
            if not k and seq.since >= self.probe:  # a probe: every draft, once
                seq.since, k = 0, most
        seq.decided = (at, k)
        return k


def expected_tokens(acceptance: float, drafts: int) -> float:
    """Tokens a verify step of `drafts` drafts yields when each is accepted with probability `acceptance` given the
    ones before were: the next token, plus each draft up to the first refused."""
    return sum(acceptance**i for i in range(drafts + 1))


def best_draft_count(acceptance: float, row_cost: float, most: int) -> int:
    """The draft count from 0 to `most` that yields the most tokens a unit of time, a verify step of k drafts taking
    1 + k * row_cost plain steps' time (the smallest count among equals; 0 is plain decoding's one token a step)."""
    best, rate = 0, 1.0
    for k in range(1, most + 1):
        r = expected_tokens(acceptance, k) / (1 + k * row_cost)
        if r > rate * (1 + 1e-9):
            best, rate = k, r
    return best


class Acceptance:
    """One sequence's drafts as they fared: the probability that a draft is accepted given the ones before it were,
    estimated from its verify steps (a step that drafted d tokens and kept m tried m + 1 drafts, or d where all were
    kept, and m were accepted; older steps count `decay` times less at each new one), starting from `prior` as if
    `weight` drafts had been tried: optimistic, so that a new sequence drafts until its own drafts say otherwise."""

    def __init__(self, prior: float = 0.8, weight: float = 1.0, decay: float = 0.8) -> None:
        self.accepted, self.tried, self.decay = prior * weight, weight, decay
        self.since = 0  # the sequence's steps since it last drafted (see `SpeculationGate.drafts`)
        self.decided: tuple[int, int] | None = None  # (the sequence's length, the drafts decided for it then)

    @property
    def rate(self) -> float:
        return self.accepted / self.tried

    def record(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        self.accepted = self.decay * self.accepted + accepted
        self.tried = self.decay * self.tried + accepted + (accepted < drafted)
