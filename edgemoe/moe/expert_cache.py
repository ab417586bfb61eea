"""The device expert cache: one pool of S slots shared by all MoE layers, with its bookkeeping on the device.

State (all device tensors, fixed shapes): `slot_of [L*E + 1]` ((layer, expert) -> slot, -1 absent), `owner [S + 1]`
(slot -> layer*E + expert, -1 free), the policy's state, a layer-step `clock`, and `stats [L, 5]`. Index S of
the per-slot tensors and of the pool, and index L*E of `slot_of`, are scratch entries: padded entries of a copy
list write there, so no step needs a host-side length. Invariant: `slot_of[k] == s` iff `owner[s] == k`.

`ensure` is fixed-shape and never synchronises with the host (no .item(), nonzero or boolean indexing), so a
decode step that calls it can be captured in a CUDA graph. On CUDA it is one Triton launch
(`edgemoe.kernels.ensure`), elsewhere plain torch (`_ensure_torch`, the kernel's oracle).
`edgemoe.moe.reference.EnsureReference` is the plain-Python oracle of both; `edgemoe.moe.cache_sim` replays routing
traces through this same class.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

STAT_FIELDS = ("accesses", "hits", "misses", "evictions", "bytes_copied")
KEY_MAX = 1e300


class EvictionPolicy:
    """Ranks slots for eviction. `keys` -> [S] float64, larger is evicted first (ties: the lower slot first)."""

    def __init__(self, num_layers: int, num_experts: int, num_slots: int, device: torch.device | str) -> None:
        self.num_layers, self.num_experts, self.num_slots = num_layers, num_experts, num_slots

    def keys(self, owner: torch.Tensor, clock: torch.Tensor, layer: int) -> torch.Tensor:
        raise NotImplementedError

    def update(self, layer: int, needed: torch.Tensor, slots: torch.Tensor, clock: torch.Tensor) -> None:
        """After `layer`'s step: `needed [E]` bool, `slots [E]` the slot of each needed expert (S elsewhere)."""
        raise NotImplementedError


class LRU(EvictionPolicy):
    """Evict the slot whose last use is oldest, in layer-steps of the whole model."""

    def __init__(self, num_layers: int, num_experts: int, num_slots: int, device: torch.device | str) -> None:
        super().__init__(num_layers, num_experts, num_slots, device)
        self.last_use = torch.zeros(num_slots + 1, dtype=torch.long, device=device)

    def keys(self, owner: torch.Tensor, clock: torch.Tensor, layer: int) -> torch.Tensor:
        return (clock - self.last_use[: self.num_slots]).double()

    def update(self, layer: int, needed: torch.Tensor, slots: torch.Tensor, clock: torch.Tensor) -> None:
        self.last_use.scatter_(0, slots, clock.expand(slots.shape))


class Scored(EvictionPolicy):
    """Evict the slot whose expected next use is furthest away, in layer-steps.

    Per (layer, expert): `freq`, an exponential moving average of "used at this layer's step" (frequency, weight
    FREQ on the newest visit), and `last`, used at the layer's latest step (recency). Per layer: `reuse`, the
    moving average (weight REUSE) of how much more often the latest step's experts are used again than their
    frequency predicts, rho = max(0, (u - f) / (1 - f)) (u: share reused, f: their mean freq). The chance of use
    at the layer's next step is p = rho * last + (1 - rho) * freq. Layer l runs again in
    d = (l - current - 1) mod L + 1 layer-steps (the layer that just ran: L), so the expected next use is
    d + L * (1/p - 1) layer-steps away: that is the key. Measured against LRU and Belady in benchmarks/RESULTS.md.
    """

    FREQ = 0.03
    REUSE = 0.05

    def __init__(self, num_layers: int, num_experts: int, num_slots: int, device: torch.device | str) -> None:
        super().__init__(num_layers, num_experts, num_slots, device)
        self.freq = torch.zeros(num_layers * num_experts + 1, dtype=torch.float64, device=device)
        self.last = torch.zeros_like(self.freq)  # 1.0 where used at the layer's latest step
        self.reuse = torch.zeros(num_layers, dtype=torch.float64, device=device)

    def keys(self, owner: torch.Tensor, clock: torch.Tensor, layer: int) -> torch.Tensor:
        L = self.num_layers
        owner = owner.clamp_min(0)  # free slots: any value, the cache ranks them first anyway
        owner_layer = owner // self.num_experts
        rho = self.reuse[owner_layer]
        p = rho * self.last[owner] + (1 - rho) * self.freq[owner]
        return L * (1 / p - 1) + ((owner_layer - layer - 1) % L + 1)

    def update(self, layer: int, needed: torch.Tensor, slots: torch.Tensor, clock: torch.Tensor) -> None:
        E = self.num_experts
        used = needed.double()
        last, freq = self.last[layer * E : (layer + 1) * E], self.freq[layer * E : (layer + 1) * E]
        seen = last.sum().clamp_min(1)  # counts: exact in float64
        reused = (used * last).sum() / seen
        chance = (last * freq).cumsum(0)[-1] / seen  # cumsum: a sequential sum, as the reference's
        rho = ((reused - chance) / (1 - chance).clamp_min(1e-12)).clamp_min(0)
        self.reuse[layer : layer + 1].mul_(1 - self.REUSE).add_(rho * self.REUSE)
        freq.mul_(1 - self.FREQ).add_(used * self.FREQ)
        last.copy_(used)


POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRU, "scored": Scored}


class Ensured(NamedTuple):
    slots: torch.Tensor  # ids' shape: the pool slot of each (token, k)
    src: torch.Tensor  # [M] experts to copy (0 past `count`)
    dst: torch.Tensor  # [M] their slots (the scratch slot S past `count`)
    count: torch.Tensor  # [] number of valid copy-list entries (the misses)
    posted: bool = False  # the fused `ensure` already posted the list to the copy service (`ensure`'s banks)


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
        self.w13: torch.Tensor | None = None  # [S + 1, 2 * inter, hidden]
        self.w2: torch.Tensor | None = None  # [S + 1, hidden, inter]
        self.copy_service = None  # a CopyService once `start_copy_service` ran (CUDA)

    def attach_pool(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        assert w13.shape[0] == w2.shape[0] == self.num_slots + 1, "the pool has S slots plus one scratch slot"
        self.w13, self.w2 = w13, w2

    def start_copy_service(self) -> None:
        """Hand the miss copy to the copy engine (`edgemoe.moe.copy_service`): CUDA pools, pinned banks."""
        from edgemoe.kernels.miss_copy import chunks_per_entry
        from edgemoe.moe import copy_service

        pools, group = (self.w13, self.w2), copy_service.BATCH_GROUP
        counters, chunks = self.arrival_counters, chunks_per_entry(pools)
        self.copy_service = copy_service.CopyService(pools, counters, chunks, self.num_experts, group)

    def reset(self) -> None:
        """Empty the cache in place: tensor addresses stay, so CUDA graphs captured over them remain valid.
        Every policy starts from all-zero state tensors."""
        self.slot_of.fill_(-1)
        self.owner.fill_(-1)
        self.clock.zero_()
        self.stats.zero_()
        for state in vars(self.policy).values():
            if isinstance(state, torch.Tensor):
                state.zero_()
        if self.ensure_scratch is not None:
            self.ensure_scratch.zero_()  # its clock marks must stay below the clock

    def slot_table(self) -> torch.Tensor:
        """[L, E] view: slot of each (layer, expert), -1 where absent."""
        return self.slot_of[:-1].view(self.num_layers, self.num_experts)

    def ensure(self, layer: int, ids: torch.Tensor, banks: tuple[torch.Tensor, torch.Tensor] | None = None) -> Ensured:
        """Make every expert in `ids` (any shape, of MoE layer `layer`) resident, choosing victims by the policy.

        At most S distinct experts (callers split larger sets into waves). Updates mapping, policy state and
        stats; the copy list it returns must be applied (`copy_missing`) before the slots are read. CUDA: the fused
        Triton kernel (one launch); CPU: `_ensure_torch`. `banks` (w13, w2 banks: where the copies come from): in a
        step that posts to the copy service, the kernel posts the list itself as soon as its victims are chosen
        (`edgemoe.kernels.ensure.FUSED_POST`), and `copy_missing` has nothing left to do."""
        if self.slot_of.is_cuda:
            from edgemoe.kernels import ensure

            posts = banks is not None and ensure.FUSED_POST and self._posts()
            return ensure.ensure_fused(self, layer, ids, post=self.copy_service.target(banks) if posts else None)
        return self._ensure_torch(layer, ids)

    def _ensure_torch(self, layer: int, ids: torch.Tensor) -> Ensured:
        """`ensure` in plain torch: the CPU path, and the oracle of `edgemoe.kernels.ensure` (bitwise, state too).

        Make every expert in `ids` (any shape, of MoE layer `layer`) resident, choosing victims by the policy.
        At most S distinct experts (callers split larger sets into waves). Updates mapping, policy state and
        stats; the copy list it returns must be applied (`copy_missing`) before the slots are read."""
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
        count = miss.sum()
        rank = miss.cumsum(0) - 1  # [E] position of each miss in the copy list
        src = torch.zeros(M + 1, dtype=torch.long, device=flat.device)
        src.scatter_(0, torch.where(miss, rank, M), self._experts)
        valid = torch.arange(M, device=flat.device) < count
        src = torch.where(valid, src[:M], 0)
        dst = torch.where(valid, victims, S)
        old = self.owner[dst]  # [M] evicted (layer, expert) keys, -1 for free or scratch
        evicted = old >= 0
        new = layer * E + src
        self.slot_of.scatter_(0, torch.where(evicted, old, L * E), -1)
        self.slot_of.scatter_(0, torch.where(valid, new, L * E), dst)
        self.owner.scatter_(0, dst, torch.where(valid, new, -1))
        self.policy.update(layer, needed, torch.where(needed, row, S), self.clock)
        if self.collect_stats:
            counts = torch.stack([needed.sum(), hit.sum(), count, evicted.sum(), count * self.expert_bytes])
            self.stats[layer] += counts
        return Ensured(row[flat].view(ids.shape), src, dst, count)

    @property
    def arrival_counters(self) -> torch.Tensor | None:
        """[E] the miss copy's per-entry counters (`edgemoe.kernels.miss_copy.Arrivals`), zeroed by the fused
        `ensure` (part of its scratch); None before a CPU cache's first fused `ensure`."""
        if self.ensure_scratch is None:
            return None
        return self.ensure_scratch[self.num_slots + self.num_experts :]

    def arrivals(self, copy: Ensured):
        """CUDA: what the expert GEMV needs to wait for `copy`'s entries one by one instead of the whole copy
        (`edgemoe.kernels.miss_copy.Arrivals`); None elsewhere, where the copy is done when `copy_missing` returns."""
        if not self.w13.is_cuda:
            return None
        from edgemoe.kernels.miss_copy import Arrivals, chunks_per_entry

        counters, chunks = self.arrival_counters, chunks_per_entry((self.w13, self.w2))
        return Arrivals(copy.dst, copy.count, counters, chunks, after_ensure=copy.posted)

    def copy_missing(self, copy: Ensured, w13_bank: torch.Tensor, w2_bank: torch.Tensor) -> None:
        """Copy the listed experts' rows, bank -> pool, counting each entry's arrival (CUDA). Captured with a copy
        service: one post of the list to it (`edgemoe.engine.cuda_graphs.ServedGraph` serves its replays), which must
        be waited for (per entry by the expert GEMV's `arrivals`, or by `await_copy`) before the next post;
        otherwise on CUDA one Triton launch for both banks (sync-free, graph-capturable; the banks must be pinned);
        CPU: `copy_rows_reference`. A list `ensure` posted itself (`copy.posted`) is left to the service."""
        if copy.posted:
            return
        if self._posts():
            self.copy_service.post(copy.src, copy.dst, copy.count, (w13_bank, w2_bank))
        elif self.w13.is_cuda:
            from edgemoe.kernels.miss_copy import copy_rows_pair

            counters = self.arrival_counters
            copy_rows_pair((self.w13, self.w2), (w13_bank, w2_bank), copy.src, copy.dst, copy.count, counters)
        else:
            copy_rows_reference(self.w13, w13_bank, copy.src, copy.dst)
            copy_rows_reference(self.w2, w2_bank, copy.src, copy.dst)

    def await_copy(self, copy: Ensured) -> None:
        """Order the stream after `copy`'s rows arrived, for captured readers that do not wait entry by entry. Only
        posted copies run off the stream."""
        if self._posts():
            self.copy_service.wait(copy.count)

    def _posts(self) -> bool:
        """Whether copies go to the copy service: only in a graph capture (see `edgemoe.moe.copy_service`)."""
        return self.copy_service is not None and torch.cuda.is_current_stream_capturing()

    def stats_dict(self, layer_ids: list[int] | None = None) -> dict:
        """Per-layer counters (`layer`: the decoder layer index when `layer_ids` maps MoE layers to them)."""
        rows = self.stats.tolist()
        layer_ids = layer_ids or list(range(self.num_layers))
        per_layer = [{"layer": i, **dict(zip(STAT_FIELDS, r))} for i, r in zip(layer_ids, rows)]
        total = {f: sum(r[j] for r in rows) for j, f in enumerate(STAT_FIELDS)}
        total["hit_rate"] = total["hits"] / total["accesses"] if total["accesses"] else 0.0
        return {"slots": self.num_slots, "policy": self.policy_name, "layers": per_layer, "total": total}


def copy_rows_reference(pool: torch.Tensor, bank: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Plain-torch miss copy: pool[dst] = bank[src] for every copy-list entry (padded ones land in the scratch
    slot), so no host-side length is needed. The CPU path, and the CUDA kernel's oracle (there it reads the copy
    list on the host)."""
    pool.index_copy_(0, dst, bank[src.to(bank.device)].to(pool.device, non_blocking=True))
