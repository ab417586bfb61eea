"""The miss-copy protocol, in one place: what `ensure` hands to whoever copies the missed experts, how a captured
step posts that list to the copy service's mailbox, and how the expert GEMV waits for each entry.

Copy list (`Ensured`): `src [M]` experts, `dst [M]` their slots, `count []` valid entries; entries past `count`
copy expert 0 into the scratch slot S, so no step needs a host-side length. M = min(ids, experts) <= slots.
With the CPU split (`edgemoe.offload.cpu_split`) the last `cpu_count` misses in expert order are listed in `cpu [M]`
instead: no slot (their pairs' `slots` are -1), computed on the host; the expert kernels read their fp32 rows.

Mailbox (`PostTarget`): `RING` rows of pinned int64, each `[seq, n, bank_a, bank_b, src[MAX], dst[MAX]]` and a CPU
section `[layer, cpu_count, pairs, top_k, cpu[MAX], ids[MAX_PAIRS]]` (`row_width`). A posting kernel
(`edgemoe.kernels.miss_copy.post_list`, or the fused `ensure`) writes the row, fences at system scope, then stores
`seq` = tick + 1 last; the host (`copy_service.c`) reads a row once its `seq` changes, copies each entry's rows
(bank -> pool) and then sets that entry's arrival counter to `chunks`. A list is posted when it copies something or
has CPU pairs; then the kernel has also written the step's x rows, fp32, into the service's pinned `cpu_x` (the
row's ring index), and the host computes the pairs whose routed id is in `cpu[:cpu_count]` (pair p: token p // top_k)
once the copies are queued, copies their outputs into the device buffer `CpuWait.rows` at each pair's row and then
writes `seq` into the device flag `CpuWait.done` (`copy_service.c`). A step waits for each list (its arrival
counters, its flag) before it posts the next, so a ring of two rows never overflows.

Arrivals (`Arrivals`): one int64 counter per list entry, zeroed by `ensure`; an entry has arrived when its counter
reaches `chunks` (work items of the SM copy, or the copy service's single write). Readers acquire it at GPU scope.
CPU rows (`CpuWait`): a reader of pair rows whose id is -1 acquires `done` at GPU scope until it reaches the service's
tick (the sequence number of the step's own list, which was the last posted), then reads the rows at L2.

Beside the copy protocol, one argument every expert function takes, kernel or reference: a layer's expert biases
(`PairBiases`, gpt-oss), read by each pair's expert id since the bank row a pair's weights come from may be a slot.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

RING = 2  # mailbox rows
HEADER = 4  # seq, n, bank_a, bank_b
CPU_HEADER = 4  # layer, cpu_count, pairs, top_k


def row_width(max_entries: int, max_pairs: int) -> int:
    """int64 fields of a mailbox row: the header, src and dst, the CPU section's header, cpu and ids."""
    return HEADER + 2 * max_entries + CPU_HEADER + max_entries + max_pairs


class Ensured(NamedTuple):
    """`ExpertCache.ensure`'s result: the slots of the ids, and the copy list that makes them resident."""

    slots: torch.Tensor  # ids' shape: the pool slot of each (token, k)
    src: torch.Tensor  # [M] experts to copy (0 past `count`)
    dst: torch.Tensor  # [M] their slots (the scratch slot S past `count`)
    count: torch.Tensor  # [] number of valid copy-list entries (the misses copied)
    posted: bool = False  # the fused `ensure` already posted the list to the copy service
    cpu: torch.Tensor | None = None  # [M] the misses left to the CPU, in expert order (0 past `cpu_count`)
    cpu_count: torch.Tensor | None = None  # [] how many; their pairs' `slots` are -1


class PostTarget(NamedTuple):
    """A copy service's mailbox, as a kernel that posts to it takes it."""

    tick: torch.Tensor  # [] int64 on the device: lists posted so far
    mailbox: torch.Tensor  # [RING, row_width(max_entries, max_pairs)] int64, pinned host memory
    bank_a: int  # the banks' addresses (gate_up, down)
    bank_b: int
    ring: int
    max_entries: int
    max_pairs: int = 0  # routed ids a CPU section lists at most
    cpu_x: torch.Tensor | None = None  # [RING, max_tokens, hidden] fp32 pinned: a list's x rows; None: no CPU pairs

    @property
    def width(self) -> int:
        return row_width(self.max_entries, self.max_pairs)


class Arrivals(NamedTuple):
    """What a consumer of the pool needs to wait for a copy list's entries one by one."""

    dst: torch.Tensor  # [M] the list's slots (the scratch slot past `count`)
    count: torch.Tensor  # [] valid entries
    counters: torch.Tensor  # [>= M] int64: work items stored so far, per entry
    chunks: int  # work items per entry
    # the kernel just before the consumer is the `ensure` that wrote the list and posted it itself: the consumer
    # waits for that kernel (PDL) before it reads the slots; otherwise a copy kernel that waited for ensure runs in
    # between, and the consumer runs beside it without waiting
    after_ensure: bool = False


class CpuWait(NamedTuple):
    """What a reader of a captured step's CPU rows waits on (see CPU rows above)."""

    rows: torch.Tensor  # [max_pairs, hidden] fp32 on the device: each CPU pair's output at its pair's row
    done: torch.Tensor  # [] int64 on the device: the last list whose rows are in
    seq: torch.Tensor  # [] int64 on the device: the copy service's tick (this step's list, once posted)
    count: torch.Tensor  # [] this layer-step's CPU misses (`Ensured.cpu_count`): no wait without


KEY_MAX = 1e300  # eviction keys are clamped here: an infinite key marks a free slot


class PolicyState(NamedTuple):
    """An eviction policy's device state as `ensure` reads and updates it (`EvictionPolicy.kernel_state`): LRU's
    last use per slot, or the scored policy's per-expert frequency and last use and per-layer reuse with their
    moving-average weights. Tensors a policy does not have are any placeholder (unread)."""

    scored: bool
    last_use: torch.Tensor  # [S + 1] LRU's
    freq: torch.Tensor  # [L * E] scored's
    last: torch.Tensor  # [L * E]
    reuse: torch.Tensor  # [L]
    freq_rate: float = 0.0
    reuse_rate: float = 0.0


class PairBiases(NamedTuple):
    """A layer's expert biases, gate_up [E, 2I] and down [E, H], and each pair's expert id [pairs], by which they are
    read: the bank rows a pair's weights come from may be cache slots, not experts."""

    gate_up: torch.Tensor
    down: torch.Tensor
    experts: torch.Tensor
