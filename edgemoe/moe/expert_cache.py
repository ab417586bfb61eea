"""The device expert cache: one pool of S slots shared by all MoE layers, with its bookkeeping on the device.

State (all device tensors, fixed shapes): `slot_of [L*E + 1]` ((layer, expert) -> slot, -1 absent), `owner [S + 1]`
(slot -> layer*E + expert, -1 free), the policy's state, a layer-step `clock`, and `stats [L, 5]`. Index S of
the per-slot tensors and of the pool, and index L*E of `slot_of`, are scratch entries: padded entries of a copy
list write there, so no step needs a host-side length. Invariant: `slot_of[k] == s` iff `owner[s] == k`.

`ensure` is fixed-shape and never synchronises with the host (no .item(), nonzero or boolean indexing), so a
decode step that calls it can be captured in a CUDA graph. `edgemoe.moe.reference.EnsureReference` is its
plain-Python oracle; `edgemoe.moe.cache_sim` replays routing traces through this same class.
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
    """Evict the slot whose expected next use is furthest away.

    `usage[l, e]`, an exponential moving average (weight ALPHA on the newest) of "layer l's step used e", is a
    recency-weighted frequency: the chance e is used at l's next step. Layer l runs again in
    d = (l - current - 1) mod L + 1 layer-steps (the layer that just ran: L), so with chance p per visit the
    expected next use is d + L * (1/p - 1) layer-steps away; that is the key.
    """

    ALPHA = 0.25

    def __init__(self, num_layers: int, num_experts: int, num_slots: int, device: torch.device | str) -> None:
        super().__init__(num_layers, num_experts, num_slots, device)
        self.usage = torch.zeros(num_layers * num_experts + 1, dtype=torch.float64, device=device)

    def keys(self, owner: torch.Tensor, clock: torch.Tensor, layer: int) -> torch.Tensor:
        L = self.num_layers
        owner = owner.clamp_min(0)  # free slots: any value, the cache ranks them first anyway
        distance = (owner // self.num_experts - layer - 1) % L + 1
        return L * (1 / self.usage[owner] - 1) + distance

    def update(self, layer: int, needed: torch.Tensor, slots: torch.Tensor, clock: torch.Tensor) -> None:
        E = self.num_experts
        row = self.usage[layer * E : (layer + 1) * E]
        row.mul_(1 - self.ALPHA).add_(needed.double() * self.ALPHA)


POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRU, "scored": Scored}


class Ensured(NamedTuple):
    slots: torch.Tensor  # ids' shape: the pool slot of each (token, k)
    src: torch.Tensor  # [M] experts to copy (0 past `count`)
    dst: torch.Tensor  # [M] their slots (the scratch slot S past `count`)
    count: torch.Tensor  # [] number of valid copy-list entries (the misses)


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
        self.w13: torch.Tensor | None = None  # [S + 1, 2 * inter, hidden]
        self.w2: torch.Tensor | None = None  # [S + 1, hidden, inter]

    def attach_pool(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        assert w13.shape[0] == w2.shape[0] == self.num_slots + 1, "the pool has S slots plus one scratch slot"
        self.w13, self.w2 = w13, w2

    def slot_table(self) -> torch.Tensor:
        """[L, E] view: slot of each (layer, expert), -1 where absent."""
        return self.slot_of[:-1].view(self.num_layers, self.num_experts)

    def ensure(self, layer: int, ids: torch.Tensor) -> Ensured:
        """Make every expert in `ids` (any shape, of MoE layer `layer`) resident, choosing victims by the policy.

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

    def copy_missing(self, copy: Ensured, w13_bank: torch.Tensor, w2_bank: torch.Tensor) -> None:
        """Plain-torch miss copy: every copy-list row, bank -> pool (padded rows land in the scratch slot).

        Used on the CPU, and as the oracle of the CUDA kernel; on CUDA it reads the copy list on the host."""
        src, dst = copy.src, copy.dst
        if w13_bank.device != self.w13.device:
            src = src.to(w13_bank.device)
        self.w13.index_copy_(0, dst, w13_bank[src].to(self.w13.device, non_blocking=True))
        self.w2.index_copy_(0, dst, w2_bank[src].to(self.w2.device, non_blocking=True))

    def stats_dict(self, layer_ids: list[int] | None = None) -> dict:
        """Per-layer counters (`layer`: the decoder layer index when `layer_ids` maps MoE layers to them)."""
        rows = self.stats.tolist()
        layer_ids = layer_ids or list(range(self.num_layers))
        per_layer = [{"layer": i, **dict(zip(STAT_FIELDS, r))} for i, r in zip(layer_ids, rows)]
        total = {f: sum(r[j] for r in rows) for j, f in enumerate(STAT_FIELDS)}
        total["hit_rate"] = total["hits"] / total["accesses"] if total["accesses"] else 0.0
        return {"slots": self.num_slots, "policy": self.policy_name, "layers": per_layer, "total": total}
