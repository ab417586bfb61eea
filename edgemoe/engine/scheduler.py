"""Decides what each step computes: prefill chunks first (admitting waiting requests), else one decode
token for every running sequence. Owns KV block allocation, state slots (models with layers that keep a state per
sequence) and preemption.

A step computes `n` not-yet-cached tokens per sequence. Prefill: several per sequence, up to a token
budget (long prompts are chunked across steps). Decode: the one token sampled last step, and with a `drafter`
(speculative decoding) the tokens it drafts after it, where free KV blocks hold them (a draft never preempts) and the
step has rows to spare (a decode step computes at most max_num_seqs tokens, a row each): such a step is a verify step
(`Batch.verify`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from edgemoe.engine.kv_cache import KVCache
from edgemoe.engine.sequence import Sequence, Status
from edgemoe.engine.state_cache import StateCache


@dataclass
class Batch:
    seqs: list[Sequence]
    num_new: list[int]  # tokens each sequence computes this step
    is_prefill: bool
    verify: bool = False  # a decode step where some sequences also compute their drafts (`Sequence.draft`): rows


class Scheduler:
    def __init__(
        self,
        kv: KVCache,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        one_prefill: bool = False,
        states: StateCache | None = None,
        drafter: Callable[[Sequence], list[int]] | None = None,
    ) -> None:
        """`one_prefill`: a prefill step holds one sequence's chunk only (batch-invariant prefill). `states`: the
        state cache (max_num_seqs slots), where the model keeps one: a running sequence holds a slot. `drafter`: a
        decoding sequence -> the tokens to draft after its next one (speculative decoding)."""
        self.kv, self.states, self.drafter = kv, states, drafter
        self.max_num_seqs, self.token_budget = max_num_seqs, max_num_batched_tokens
        self.one_prefill = one_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._prefilled_last = False

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.kv.block_size)

    def schedule(self) -> Batch | None:
        """A prefill chunk first, except right after one while sequences wait for their next token: then they decode
        first, so a long prompt (many chunks) adds at most one chunk's time to each running sequence's token gap."""
        if self._prefilled_last:
            batch = self._decode() or self._prefill()
        else:
            batch = self._prefill() or self._decode()
        self._prefilled_last = batch is not None and batch.is_prefill
        return batch

    def _prefill(self) -> Batch | None:
        budget, seqs, num_new = self.token_budget, [], []
        candidates = [s for s in self.running if s.num_uncomputed > 1]
        admitted = []
        for seq in self.waiting:
            if len(self.running) + len(admitted) >= self.max_num_seqs:
                break
            admitted.append(seq)
        for seq in candidates + admitted:
            if budget == 0 or (seqs and self.one_prefill):
                break
            if seq.status is Status.WAITING and not seq.block_table:
                self._reuse_prefix(seq)
            room = len(seq.block_table) * self.kv.block_size - seq.num_computed + self.kv.num_free * self.kv.block_size
            if seq.status is Status.WAITING and room <= seq.num_uncomputed and self.running:
                self._forget_prefix(seq)
                break  # start a request only once its whole prompt (and one token) fits beside the others
            n = min(seq.num_uncomputed, budget, room)
            if n <= 0:
                break
            self._grow(seq, seq.num_computed + n)
            if seq.status is Status.WAITING:
                self.waiting.remove(seq)
                seq.status = Status.RUNNING
                self.running.append(seq)
                if self.states is not None:
                    seq.state_slot = self.states.allocate()
                    if seq.num_cached:  # resumed after a prefix: from its snapshot
                        self.states.restore(seq.prefix_hash, seq.state_slot)
            seqs.append(seq)
            num_new.append(n)
            budget -= n
        return Batch(seqs, num_new, is_prefill=True) if seqs else None

    def _decode(self) -> Batch | None:
        seqs = []
        for seq in list(self.running):
            if seq.status is not Status.RUNNING or seq.num_uncomputed != 1:
                continue  # preempted by an earlier sequence of this loop, or still in prefill
            while len(seq.block_table) * self.kv.block_size < seq.num_computed + 1 and not self.kv.num_free:
                victim = self.running[-1]
                self.preempt(victim)
                if victim is seq:
                    break
            if seq.status is Status.RUNNING:
                self._grow(seq, seq.num_computed + 1)
                seqs.append(seq)
        num_new = [1] * len(seqs)
        rows = self.max_num_seqs - len(seqs)  # a decode step's rows are its tokens: drafts take the spare ones
        if self.drafter is not None:
            for i, seq in enumerate(seqs):
                draft = self.drafter(seq)[:rows]
                room = len(seq.block_table) * self.kv.block_size + self.kv.num_free * self.kv.block_size
                seq.draft = draft[: max(0, room - seq.num_computed - 1)]
                self._grow(seq, seq.num_computed + 1 + len(seq.draft))
                num_new[i] += len(seq.draft)
                rows -= len(seq.draft)
        verify = any(n > 1 for n in num_new)
        return Batch(seqs, num_new, is_prefill=False, verify=verify) if seqs else None

    def _reuse_prefix(self, seq: Sequence) -> None:
        """Start `seq` after the longest prefix of its tokens the prefix cache holds (whole blocks; with a state
        cache, one it keeps a snapshot of the state after)."""
        blocks = self.kv.match(seq.token_ids, None if self.states is None else self.states.has)
        if blocks:
            seq.block_table = blocks
            seq.num_computed = seq.num_cached = len(blocks) * self.kv.block_size
            seq.num_hashed, seq.prefix_hash = len(blocks), self.kv.key[blocks[-1]][0]

    def _forget_prefix(self, seq: Sequence) -> None:
        """Undo `_reuse_prefix` for a sequence that is not admitted after all."""
        self.kv.release(seq.block_table)
        seq.num_computed = seq.num_cached = seq.num_hashed = 0
        seq.prefix_hash = None

    def commit(self, seq: Sequence) -> None:
        """After a step: the sequence's newly full, computed blocks become findable by later requests; with a state
        cache, a step that ended on a block boundary leaves a snapshot of the state there."""
        seq.num_hashed, seq.prefix_hash = self.kv.commit(
            seq.token_ids, seq.block_table, seq.num_computed, seq.num_hashed, seq.prefix_hash
        )
        states, n = self.states, seq.num_computed
        if states is None or not states.num_snapshots or not n or seq.num_hashed * self.kv.block_size != n:
            return
        row = seq.snapshot_row
        if row is not None and seq.snapshot_tokens <= seq.num_prompt_tokens < n:
            states.disown(row)  # the prompt's last snapshot stays for requests that share the prompt
            row = None
        seq.snapshot_row, seq.snapshot_tokens = states.save(seq.state_slot, seq.prefix_hash, row), n

    def reserve(self, seq: Sequence, tokens: int) -> int:
        """Blocks for `seq`'s first `tokens` positions as far as free blocks allow, never preempting (what a draft
        writes ahead) -> the positions its blocks hold now."""
        need = min(self.blocks_for(tokens) - len(seq.block_table), self.kv.num_free)
        if need > 0:
            seq.block_table += self.kv.allocate(need)
        return len(seq.block_table) * self.kv.block_size

    def _grow(self, seq: Sequence, tokens: int) -> None:
        need = self.blocks_for(tokens) - len(seq.block_table)
        if need > 0:
            seq.block_table += self.kv.allocate(need)

    def preempt(self, seq: Sequence) -> None:
        """Free a sequence's KV (and state) and queue it first; it will recompute prompt + output so far."""
        self.running.remove(seq)
        self.kv.release(seq.block_table)
        self._release_state(seq)
        seq.num_computed = seq.num_cached = seq.num_hashed = 0
        seq.prefix_hash = None
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.release(seq.block_table)
        self._release_state(seq)
        seq.status = Status.FINISHED

    def _release_state(self, seq: Sequence) -> None:
        if seq.state_slot is not None:
            self.states.release(seq.state_slot)
            seq.state_slot = None
        if seq.snapshot_row is not None:
            self.states.disown(seq.snapshot_row)
            seq.snapshot_row, seq.snapshot_tokens = None, 0
