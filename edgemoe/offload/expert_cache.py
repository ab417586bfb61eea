"""The device expert cache: one pool of S slots shared by all MoE layers, with its bookkeeping on the device.

State (all device tensors, fixed shapes): `slot_of [L*E + 1]` ((layer, expert) -> slot, -1 absent), `owner [S + 1]`
(slot -> layer*E + expert, -1 free), the policy's state, a layer-step `clock`, and `stats [L, 5]`. Index S of
the per-slot tensors and of the pool, and index L*E of `slot_of`, are scratch entries: padded entries of a copy
list write there, so no step needs a host-side length. Invariant: `slot_of[k] == s` iff `owner[s] == k`.

`ensure` is fixed-shape and never synchronises with the host (no .item(), nonzero or boolean indexing), so a
decode step that calls it can be captured in a CUDA graph. On CUDA it is one Triton launch
(`edgemoe.kernels.ensure`), elsewhere plain torch (`_ensure_torch`, the kernel's oracle).
`edgemoe.moe.reference.EnsureReference` is the plain-Python oracle of both; `edgemoe.tools.cache_sim` replays routing
traces through this same class.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

from edgemoe.kernels.protocol import Arrivals, CpuWait, Ensured
from edgemoe.offload.layout import ExpertLayout
from edgemoe.offload.policies import KEY_MAX, POLICIES

STAT_FIELDS = ("accesses", "hits", "misses", "evictions", "bytes_copied", "cpu_computed")


class ExpertCache:
    """Bookkeeping of the shared slot pool, plus the pool itself once `attach_pool` gave it one."""

    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        num_slots: int,
        policy: str = "lru",
        device: torch.device | str = "cpu",
        expert_bytes: int = 0,
        collect_stats: bool = True,
    ) -> None:
        if num_slots < 1:
            raise ValueError("the expert cache needs at least one slot")
        self.num_layers, self.num_experts, self.num_slots = num_layers, num_experts, num_slots
        self.device, self.expert_bytes, self.collect_stats = torch.device(device), expert_bytes, collect_stats
        L, E, S = num_layers, num_experts, num_slots
        self.slot_of = torch.full((L * E + 1,), -1, dtype=torch.long, device=device)
        self.owner = torch.full((S + 1,), -1, dtype=torch.long, device=device)
        self.clock = torch.zeros((), dtype=torch.long, device=device)
        self.stats = torch.zeros(L, len(STAT_FIELDS), dtype=torch.long, device=device)
        self.policy = POLICIES[policy](L, E, S, device)
        self.policy_name = policy
        self._experts = torch.arange(E, device=device)
        # the fused CUDA `ensure`'s scratch: keys [S], clock marks [E], the miss copy's arrival counters [E];
        # here, so graph capture never allocates
        self.ensure_scratch = (
            torch.zeros(S + 2 * E, dtype=torch.long, device=device) if self.device.type == "cuda" else None
        )
        self.joined: torch.Tensor | None = None  # [S + 1, row]: the pool, one expert's row a slot
        self.pool_a: torch.Tensor | None = None  # [S + 1, ...] its first part (dense: gate_up) the miss copy moves
        self.pool_b: torch.Tensor | None = None  # [S + 1, ...] the rest
        self.copy_service = None  # a CopyService once `start_copy_service` ran (CUDA)
        self.prefill_stream = None  # an `edgemoe.offload.prefill_stream.PrefillStream` where the pool has 2E slots
        self.cpu_split = None  # a CpuSplit (edgemoe.offload.cpu_split) when decode computes some misses on the CPU
        self.tier = None  # the RAM tier (edgemoe.offload.ram_tier) the misses come from, where there is one
        self.drafts: RefusedDrafts | None = None  # what refused drafts cost (speculative decoding with stats)
        # the implementation, chosen once for the device: one Triton launch on CUDA, plain torch elsewhere
        if self.device.type == "cuda":
            from edgemoe.kernels.ensure import ensure_fused
            from edgemoe.kernels.miss_copy import copy_rows_pair

            self._ensure_impl, self._copy_rows = ensure_fused, copy_rows_pair
        else:
            self._ensure_impl, self._copy_rows = None, None

    @property
    def pool_bytes(self) -> int:
        """Device bytes of the slot pool (the scratch slot included)."""
        parts = [self.joined] if self.joined is not None else [t for t in (self.pool_a, self.pool_b) if t is not None]
        return sum(t.numel() * t.element_size() for t in parts)

    def attach_pool(self, pool_a: torch.Tensor, pool_b: torch.Tensor, joined: torch.Tensor | None = None) -> None:
        """The slot pool: (pool_a, pool_b) the two parts of each slot the miss copy moves (as the mailbox's bank_a
        and bank_b), views of `joined` [S + 1, row] (the storage the layers view in their own layout) where there is
        one."""
        assert pool_a.shape[0] == pool_b.shape[0] == self.num_slots + 1, "the pool has S slots plus one scratch slot"
        self.pool_a, self.pool_b, self.joined = pool_a, pool_b, joined

    def start_copy_service(self, max_pairs: int = 0) -> None:
        """Hand the miss copy to the copy engine (`edgemoe.offload.copy_service`): CUDA pools, pinned banks.
        `max_pairs`: routed ids of a decode step at most (room for the CPU split's lists)."""
        from edgemoe.kernels.miss_copy import chunks_per_entry
        from edgemoe.offload import copy_service

        pools = (self.pool_a, self.pool_b)
        counters, chunks = self.arrival_counters, chunks_per_entry(pools)
        self.copy_service = copy_service.CopyService(pools, counters, chunks, self.num_experts, max_pairs=max_pairs)

    def reset(self) -> None:
        """Empty the cache in place: tensor addresses stay, so CUDA graphs captured over them remain valid.
        Every policy starts from all-zero state tensors."""
        self.slot_of.fill_(-1)
        self.owner.fill_(-1)
        self.clock.zero_()
        self.stats.zero_()
        if self.drafts is not None:
            self.drafts.reset()
        for state in vars(self.policy).values():
            if isinstance(state, torch.Tensor):
                state.zero_()
        if self.ensure_scratch is not None:
            self.ensure_scratch.zero_()  # its clock marks must stay below the clock
        if self.tier is not None:
            self.tier.reset()

    def slot_table(self) -> torch.Tensor:
        """[L, E] view: slot of each (layer, expert), -1 where absent."""
        return self.slot_of[:-1].view(self.num_layers, self.num_experts)

    def ensure(
        self,
        layer: int,
        ids: torch.Tensor,
        banks: tuple[torch.Tensor, torch.Tensor] | None = None,
        cpu_take: torch.Tensor | None = None,
        x: torch.Tensor | None = None,
    ) -> Ensured:
        """Make every expert in `ids` (any shape, of MoE layer `layer`) resident, choosing victims by the policy.

        At most S distinct experts (callers split larger sets into waves). Updates mapping, policy state and
        stats; the copy list it returns must be applied (`copy_missing`) before the slots are read. `banks` (gate_up,
        down): where the copies come from (None: bookkeeping only, as the cache simulator). `cpu_take` [>= M + 1]:
        of m misses, the last `cpu_take[m]` in expert order are left to the CPU (see `_ensure_torch`). CUDA: the fused
        Triton kernel (one launch), which in a captured step posts the list to the copy service itself as soon as its
        victims are chosen (`copy_missing` then has nothing left to do), with the CPU's misses and the step's input
        `x` [tokens, hidden] for the service to compute them (`cpu_wait`); elsewhere `_ensure_torch`."""
        if self._ensure_impl is None:
            return self._ensure_torch(layer, ids, cpu_take)
        post, posts = None, self._posts()
        if posts and self.tier is not None:
            post = self.copy_service.tier_target(layer)
        elif posts and banks is not None:
            post = self.copy_service.target(banks)
        return self._ensure_impl(self, layer, ids, post=post, cpu_take=cpu_take, x=x)

    def _ensure_torch(self, layer: int, ids: torch.Tensor, cpu_take: torch.Tensor | None = None) -> Ensured:
        """`ensure` in plain torch: the CPU path, and the oracle of `edgemoe.kernels.ensure` (bitwise, state too).

        Make every expert in `ids` (any shape, of MoE layer `layer`) resident, choosing victims by the policy.
        At most S distinct experts (callers split larger sets into waves). Updates mapping, policy state and
        stats; the copy list it returns must be applied (`copy_missing`) before the slots are read.

        The CPU split (`cpu_take`, a table on the device: no host sync): of the m misses in expert order, the first
        m - n are copied and the last n = cpu_take[m] are computed on the CPU. Those get no slot (their `slots` are
        -1), evict nothing, and are listed in `cpu` / `cpu_count`; the policy counts them as used (the scored
        policy's frequency and recency are of the routing, so an expert that keeps missing still ranks hot once it
        is copied; LRU keeps recency per slot, so they leave no trace there); stats count them among the misses and
        apart (`cpu_computed`), not among the bytes copied."""
        L, E, S = self.num_layers, self.num_experts, self.num_slots
        flat = ids.reshape(-1)
        M = min(flat.numel(), E)  # the most misses this call can have
        assert M <= S, "more distinct experts than slots: split them into waves"
        self.clock += 1
        needed = torch.zeros(E, dtype=torch.bool, device=flat.device).index_fill_(0, flat, True)  # [E]
        row = self.slot_of[layer * E : (layer + 1) * E]  # [E] view
        hit, miss = needed & (row >= 0), needed & (row < 0)
        protected = torch.zeros(S + 1, dtype=torch.bool, device=flat.device)
        protected.scatter_(0, torch.where(hit, row, S), True)
        owner = self.owner[:S]
        keys = self.policy.keys(owner, self.clock, layer).clamp(max=KEY_MAX)  # [S]; free slots alone rank first
        keys = keys.masked_fill(owner < 0, float("inf")).masked_fill(protected[:S], float("-inf"))
        victims = torch.sort(keys, descending=True, stable=True).indices[:M]  # [M]
        misses = miss.sum()
        on_cpu = torch.zeros_like(misses) if cpu_take is None else cpu_take[misses].to(misses.dtype)
        count = misses - on_cpu  # the copy list's length
        rank = miss.cumsum(0) - 1  # [E] position of each miss among the misses
        src = torch.zeros(M + 1, dtype=torch.long, device=flat.device)
        src.scatter_(0, torch.where(miss, rank, M), self._experts)
        positions = torch.arange(M, device=flat.device)
        valid = positions < count
        cpu = torch.where(positions < on_cpu, src[(count + positions).clamp(max=M)], 0)
        src = torch.where(valid, src[:M], 0)
        dst = torch.where(valid, victims, S)
        old = self.owner[dst]  # [M] evicted (layer, expert) keys, -1 for free or scratch
        evicted = old >= 0
        new = layer * E + src
        self.slot_of.scatter_(0, torch.where(evicted, old, L * E), -1)
        self.slot_of.scatter_(0, torch.where(valid, new, L * E), dst)
        self.owner.scatter_(0, dst, torch.where(valid, new, -1))
        self.policy.update(layer, needed, torch.where(needed & (row >= 0), row, S), self.clock)
        if self.collect_stats:
            counts = [needed.sum(), hit.sum(), misses, evicted.sum(), count * self.expert_bytes, on_cpu]
            self.stats[layer] += torch.stack(counts)
        return Ensured(row[flat].view(ids.shape), src, dst, count, cpu=cpu, cpu_count=on_cpu)

    @property
    def arrival_counters(self) -> torch.Tensor | None:
        """[E] the miss copy's per-entry counters (`edgemoe.kernels.protocol.Arrivals`), zeroed by the fused
        `ensure` (part of its scratch); None before a CPU cache's first fused `ensure`."""
        if self.ensure_scratch is None:
            return None
        return self.ensure_scratch[self.num_slots + self.num_experts :]

    def arrivals(self, copy: Ensured) -> Arrivals | None:
        """With kernels: what the expert GEMV needs to wait for `copy`'s entries one by one instead of the whole copy
        (`edgemoe.kernels.protocol.Arrivals`); None elsewhere, where the copy is done when `copy_missing` returns."""
        if self._copy_rows is None:
            return None
        from edgemoe.kernels.miss_copy import chunks_per_entry

        counters, chunks = self.arrival_counters, chunks_per_entry((self.pool_a, self.pool_b))
        return Arrivals(copy.dst, copy.count, counters, chunks, after_ensure=copy.posted)

    def copy_missing(self, copy: Ensured, bank_a: torch.Tensor, bank_b: torch.Tensor) -> None:
        """Copy the listed experts' rows, bank -> pool. A list `ensure` posted to the copy service (captured steps:
        `copy.posted`) is left to the service, which `edgemoe.engine.cuda_graphs.ServedGraph` serves at replay.
        Otherwise on CUDA one Triton launch for both banks, counting each entry's arrival (sync-free,
        graph-capturable; the banks must be pinned); elsewhere `copy_rows_reference`."""
        if copy.posted:
            return
        if self._copy_rows is not None:
            counters = self.arrival_counters
            self._copy_rows((self.pool_a, self.pool_b), (bank_a, bank_b), copy.src, copy.dst, copy.count, counters)
        else:
            copy_rows_reference(self.pool_a, bank_a, copy.src, copy.dst)
            copy_rows_reference(self.pool_b, bank_b, copy.src, copy.dst)

    def copy_from(self, copy: Ensured, layer: int, source: ExpertSource) -> None:
        """`copy_missing` from MoE layer `layer`'s banks (`source.banks`), or from the RAM tier where there is one
        (`edgemoe.offload.ram_tier.RamTier.copy_missing`: the list read on the host, a sync)."""
        if copy.posted:
            return
        if self.tier is None:
            self.copy_missing(copy, *source.banks)
            return
        counters = None
        if self._copy_rows is not None:  # the expert kernels wait on each entry's counter
            from edgemoe.kernels.miss_copy import chunks_per_entry

            counters = (self.arrival_counters, chunks_per_entry((self.pool_a, self.pool_b)))
        self.tier.copy_missing(copy, layer, self.joined, counters)

    def cpu_wait(self, copy: Ensured) -> CpuWait | None:
        """Where a posted step's CPU pairs' rows arrive and what to wait on before reading them (the copy service
        computes them: `edgemoe.kernels.protocol.CpuWait`); None for an eager step, whose rows are computed on the
        spot (`edgemoe.offload.cpu_split.CpuSplit.pairs`)."""
        if not copy.posted or copy.cpu_count is None:
            return None
        return self.copy_service.cpu_wait(copy.cpu_count)

    def await_copy(self, copy: Ensured) -> None:
        """Order the stream after `copy`'s rows arrived, for captured readers that do not wait entry by entry. Only
        posted copies run off the stream."""
        if copy.posted:
            self.copy_service.wait(copy.count)

    def fetch(self, layer: int, ids: torch.Tensor, x: torch.Tensor, source: ExpertSource) -> Fetched:
        """Decode's one call: `ids`' experts of MoE layer `layer` made readable for `source`'s decode (`x` [tokens,
        hidden]: the MoE input, which the CPU split computes its pairs from). `ensure`, then the miss copy (posted to
        the copy service in a captured step), and with the CPU split its pairs: an eager step reads them on the host
        (a sync, before the copy starts) and computes them while the GPU copies; a captured step leaves them to the
        copy service and returns the wait for their rows. A plain-torch decode (a family whose activation the
        kernels lack) reads every slot at once: the stream waits for the whole copy here."""
        split = self.cpu_split
        if self.drafts is not None:  # before `ensure` changes what the layer holds
            E = self.num_experts
            self.drafts.note(layer, ids, self.slot_of[layer * E : (layer + 1) * E])
        got = self.ensure(layer, ids, source.banks, cpu_take=None if split is None else split.table, x=x)
        wait = None if split is None else self.cpu_wait(got)
        on_cpu = split.pairs(ids, got.slots, x) if split is not None and wait is None else None
        self.copy_from(got, layer, source)
        if not source.layout.decode_waits:
            self.await_copy(got)
        rows = None
        if wait is not None:
            rows = wait.rows[: ids.numel()]
        elif on_cpu is not None:  # computed while the GPU copies
            rows = split.compute(source.bank, source.layout, on_cpu, ids.numel(), x.device, source.host_biases())
        return Fetched(got.slots, self.arrivals(got), rows, wait)

    def _posts(self) -> bool:
        """Whether copies go to the copy service: only in a graph capture (see `edgemoe.offload.copy_service`)."""
        return self.copy_service is not None and torch.cuda.is_current_stream_capturing()

    def stats_dict(self, layer_ids: list[int] | None = None) -> dict:
        """Per-layer counters (`layer`: the decoder layer index when `layer_ids` maps MoE layers to them)."""
        rows = self.stats.tolist()
        layer_ids = layer_ids or list(range(self.num_layers))
        per_layer = [{"layer": i, **dict(zip(STAT_FIELDS, r))} for i, r in zip(layer_ids, rows)]
        total = {f: sum(r[j] for r in rows) for j, f in enumerate(STAT_FIELDS)}
        total["hit_rate"] = total["hits"] / total["accesses"] if total["accesses"] else 0.0
        if self.drafts is not None:
            refused = self.drafts.bytes.tolist()
            for row, b in zip(per_layer, refused):
                row["refused_draft_bytes"] = b
            total["refused_draft_bytes"] = sum(refused)
        got = {"slots": self.num_slots, "policy": self.policy_name, "layers": per_layer, "total": total}
        return got if self.tier is None else got | {"ram_tier": self.tier.stats()}


class RefusedDrafts:
    """What drafted rows that the model then refused cost the expert cache (speculative decoding, with stats): the
    bytes of the experts a decode step missed (copied, or computed on the CPU) that only refused rows routed to, per
    MoE layer. Each decode step's routed ids and the experts each layer lacked before its `ensure` are kept on the
    device in fixed shapes (`note`: a captured step records them too); after a verify step, `count` takes which rows
    were kept and which refused (rows in neither, as a graph's padding, count for nothing)."""

    def __init__(self, layers: int, experts: int, rows: int, top_k: int, expert_bytes: int, device) -> None:
        self.experts, self.expert_bytes = experts, expert_bytes
        self.ids = torch.full((layers, rows, top_k), experts, dtype=torch.long, device=device)  # `experts`: none
        self.absent = torch.zeros(layers, experts + 1, dtype=torch.bool, device=device)
        self.bytes = torch.zeros(layers, dtype=torch.long, device=device)

    def note(self, layer: int, ids: torch.Tensor, slot_of: torch.Tensor) -> None:
        """A decode step's MoE layer `layer`: its routed `ids` [rows, top_k] and `slot_of` [E] before `ensure`."""
        self.ids[layer, : ids.shape[0]].copy_(ids)
        self.absent[layer, : self.experts].copy_(slot_of < 0)

    def clear(self) -> None:
        """Before a verify step: no row routed anywhere, so that a layer the step does not run (an MTP head's) or a
        row it does not have counts for nothing."""
        self.ids.fill_(self.experts)

    def count(self, kept: torch.Tensor, refused: torch.Tensor) -> None:
        """After a verify step: `kept`, `refused` [rows] bool, the step's rows in order (the rest in neither)."""
        self.bytes += self.refused(kept, refused)

    def refused(self, kept: torch.Tensor, refused: torch.Tensor) -> torch.Tensor:
        """[L] what `count` would add for these rows (a benchmark weighs several outcomes of one step)."""
        only = self._routed(refused) & ~self._routed(kept) & self.absent
        return only[:, : self.experts].sum(1) * self.expert_bytes

    def _routed(self, rows: torch.Tensor) -> torch.Tensor:
        """[L, E + 1] bool: the experts `rows` routed to, by layer (column E: none)."""
        ids = torch.where(rows[None, :, None], self.ids, self.experts).flatten(1)
        return torch.zeros_like(self.absent).scatter_(1, ids, True)

    def reset(self) -> None:
        self.bytes.zero_()


class ExpertSource(Protocol):
    """What `fetch` reads of an offloaded MoE layer (`edgemoe.offload.experts.OffloadedExperts`)."""

    bank: torch.Tensor | None  # [E, row] host bank (the CPU split computes from it); None: in the RAM tier
    banks: tuple[torch.Tensor, torch.Tensor] | None  # its halves as the miss copy moves them
    layout: ExpertLayout


class Fetched(NamedTuple):
    """A decode step's routed experts, readable: what the layout's decode takes."""

    slots: torch.Tensor  # [tokens, top_k] each pair's slot (-1: computed on the CPU)
    arrivals: Arrivals | None  # the miss copy's entries to wait for one by one (kernels)
    cpu_rows: torch.Tensor | None  # [pairs, hidden] fp32: the CPU pairs' outputs (None: no CPU split this step)
    cpu_wait: CpuWait | None  # a captured step's wait for those rows


def copy_rows_reference(pool: torch.Tensor, bank: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Plain-torch miss copy: pool[dst] = bank[src] for every copy-list entry (padded ones land in the scratch
    slot), so no host-side length is needed. The CPU path, and the CUDA kernel's oracle (there it reads the copy
    list on the host)."""
    pool.index_copy_(0, dst, bank[src.to(bank.device)].to(pool.device, non_blocking=True))
