"""The miss-copy protocol, in one place: what `ensure` hands to whoever copies the missed experts, how a captured
step posts that list to the copy service's mailbox, and how the expert GEMV waits for each entry.

Copy list (`Ensured`): `src [M]` experts, `dst [M]` their slots, `count []` valid entries; entries past `count`
copy expert 0 into the scratch slot S, so no step needs a host-side length. M = min(ids, experts) <= slots.
With the CPU split (`edgemoe.offload.cpu_split`) the last `cpu_count` misses in expert order are listed in `cpu [M]`
instead: no slot (their pairs' `slots` are -1), computed on the host; the expert kernels read their fp32 rows. Eager
steps only for now: nothing of them is posted to the mailbox.

Mailbox (`PostTarget`): `RING` rows of pinned int64, each `[seq, n, bank_a, bank_b, src[MAX], dst[MAX]]`. A posting
kernel (`edgemoe.kernels.miss_copy.post_list`) writes the row, fences at system scope, then stores `seq` = tick + 1
last; the host (`copy_service.c`) reads a row once its `seq` changes, copies each entry's rows (bank -> pool) and
then sets that entry's arrival counter to `chunks`. Empty lists are never posted, and a step waits for each list
before it posts the next, so a ring of two rows never overflows.

Arrivals (`Arrivals`): one int64 counter per list entry, zeroed by `ensure`; an entry has arrived when its counter
reaches `chunks` (work items of the SM copy, or the copy service's single write). Readers acquire it at GPU scope.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

RING = 2  # mailbox rows
HEADER = 4  # seq, n, bank_a, bank_b


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
    mailbox: torch.Tensor  # [RING, HEADER + 2 * max_entries] int64, pinned host memory
    bank_a: int  # the banks' addresses (gate_up, down)
    bank_b: int
    ring: int
    max_entries: int


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
