"""Per-sequence state beside the paged KV cache, for layers that remember the past in a fixed-size state instead of
K/V (the Gated DeltaNet layers of the hybrid families: a convolution's last inputs and a matrix per head).

A module keeps state when it has `state_shapes(dtype) -> [(shape, dtype), ...]` (one sequence's tensors) and
`bind_state(*tensors)`. The cache gives every such module, in order, views [slots + 1, *shape] of one pool: a slot is
one row of bytes holding every layer's state of one sequence, so that clearing or copying a sequence's whole state
is one operation. A running sequence holds one slot (`allocate` clears it); the row after the slots is the pad slot,
which padding rows of a captured decode batch and the warm-up prefills write and read, as the KV cache's pad block.

Snapshots (with the prefix cache): a state cannot be rebuilt from KV blocks, so the rows after the pad slot keep copies
of states taken at block boundaries, each known by the prefix hash of the block that ends there (the KV cache's
key). A running sequence owns at most one, its latest boundary's, overwritten as it crosses the next one (the
scheduler copies after the step that reached it); when the sequence ends it stays, findable, until a row is needed
(least recently used first). A later request whose prompt starts with that prefix resumes from the snapshot and the
prefix's KV blocks instead of its first token.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import torch
from torch import nn

ALIGN = 16  # bytes: each state starts aligned within a slot's row


def stateful_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if callable(getattr(m, "state_shapes", None))]


def _layout(modules: list[nn.Module], dtype: torch.dtype) -> tuple[list[list[tuple]], int]:
    """Per module, its states' (offset, shape, dtype) in a slot's row, and the row's bytes."""
    layout, offset = [], 0
    for m in modules:
        own = []
        for shape, dt in m.state_shapes(dtype):
            own.append((offset, shape, dt))
            offset += -(-math.prod(shape) * dt.itemsize // ALIGN) * ALIGN
        layout.append(own)
    return layout, offset


def bytes_per_slot(model: nn.Module, dtype: torch.dtype) -> int:
    """One sequence's state in every layer that keeps one (0: a model without such layers)."""
    return _layout(stateful_modules(model), dtype)[1]


class StateCache:
    def __init__(
        self,
        model: nn.Module,
        slots: int,
        dtype: torch.dtype,
        device: torch.device,
        snapshots: int = 0,
        stashes: int = 0,
    ) -> None:
        """`stashes`: rows that keep a slot's state while a verify step may have to be undone (`stash`)."""
        modules = stateful_modules(model)
        layout, self.row_bytes = _layout(modules, dtype)
        self.pool = torch.zeros(slots + 1 + snapshots + stashes, self.row_bytes, dtype=torch.uint8, device=device)
        self.stash_row = slots + 1 + snapshots  # the first stash row
        for module, own in zip(modules, layout):
            module.bind_state(*(self._view(offset, shape, dt) for offset, shape, dt in own))
        self.num_slots, self.pad_slot, self.num_snapshots = slots, slots, snapshots
        self.free: list[int] = list(range(slots - 1, -1, -1))  # a stack: pop() gives low slots first
        self.free_rows: list[int] = list(range(slots + snapshots, slots, -1))  # snapshot rows holding nothing
        self.row_at: dict[int, int] = {}  # prefix hash -> the snapshot row of the state after that prefix
        self.key: dict[int, int] = {}  # snapshot row -> its prefix hash
        self.unowned: OrderedDict[int, None] = OrderedDict()  # snapshot rows no sequence owns, least recent first
        self.saved = self.restored = 0  # snapshots taken, and resumed from
        # tensor parallelism: rank 0 notes what it does to its rows here, for the other ranks to do to theirs before
        # the next forward (`edgemoe.engine.model_runner.ModelRunner.prepare` sends it, `apply` replays it)
        self.journal: list[tuple[int, int]] | None = None

    def _view(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Every slot's copy of one state: [slots + 1, *shape], rows `row_bytes` apart."""
        n = math.prod(shape) * dtype.itemsize
        rows = self.pool[:, offset : offset + n]
        return rows.view(dtype).view(self.pool.shape[0], *shape)

    @property
    def num_bytes(self) -> int:
        return self.pool.numel()

    def allocate(self) -> int:
        """A slot for a sequence that starts from its first token: cleared (a state of zeros)."""
        if not self.free:
            raise RuntimeError("no free state slot (the scheduler admits at most max_num_seqs sequences)")
        slot = self.free.pop()
        self._copy(-1, slot)
        return slot

    def release(self, slot: int) -> None:
        self.free.append(slot)

    def stash(self, slot: int, i: int) -> None:
        """Keep `slot`'s state in stash row i (speculative decoding: before a verify step that may be undone)."""
        self._copy(slot, self.stash_row + i)

    def unstash(self, i: int, slot: int) -> None:
        """Put stash row i's state back into `slot`: the verify step after `stash` is undone."""
        self._copy(self.stash_row + i, slot)

    def _copy(self, src: int, dst: int) -> None:
        """Row `src` into row `dst` (src -1: zeros), noted in the journal where one is kept."""
        if src < 0:
            self.pool[dst].zero_()
        else:
            self.pool[dst].copy_(self.pool[src])
        if self.journal is not None:
            self.journal.append((src, dst))

    def take_journal(self) -> list[tuple[int, int]]:
        """What was done to the rows since the last call (rank 0 of a tensor-parallel engine)."""
        ops, self.journal = self.journal, []
        return ops

    def apply(self, ops: list[tuple[int, int]]) -> None:
        """Another rank's journal, done to these rows (each rank's rows hold its share of every state)."""
        for src, dst in ops:
            self._copy(src, dst)

    def has(self, key: int) -> bool:
        """Whether a snapshot of the state after the prefix whose hash is `key` is kept."""
        return key in self.row_at

    def save(self, slot: int, key: int, row: int | None) -> int | None:
        """Copy `slot`'s state into a snapshot known by `key`: into `row` (the sequence's own, re-keyed), else a free
        row or the least recently used one no sequence owns. -> the row, now the sequence's, or None if no row can
        be had (no snapshot rows)."""
        if row is None:
            row = self._take()
            if row is None:
                return None
        else:
            self._unkey(row)
        if key in self.row_at:  # another row holds the same prefix's state (the same tokens): ours replaces it
            other = self.row_at.pop(key)
            del self.key[other]
            if self.unowned.pop(other, 0) is None:
                self.free_rows.append(other)
        self._copy(slot, row)
        self.row_at[key], self.key[row] = row, key
        self.saved += 1
        return row

    def restore(self, key: int, slot: int) -> None:
        """Start `slot` from the snapshot known by `key` (which `has`)."""
        row = self.row_at[key]
        self._copy(row, slot)
        if row in self.unowned:
            self.unowned.move_to_end(row)
        self.restored += 1

    def disown(self, row: int) -> None:
        """A sequence's snapshot row outlives it, findable until its row is needed."""
        if row in self.key:
            self.unowned[row] = None
        else:
            self.free_rows.append(row)

    def _take(self) -> int | None:
        if self.free_rows:
            return self.free_rows.pop()
        if not self.unowned:
            return None
        row, _ = self.unowned.popitem(last=False)
        self._unkey(row)
        return row

    def _unkey(self, row: int) -> None:
        key = self.key.pop(row, None)
        if key is not None:
            del self.row_at[key]
