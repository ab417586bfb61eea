"""Eviction policies of the expert cache: each ranks the pool's slots by a key (larger is evicted first), with its
state in device tensors of fixed shape so that `ensure` stays graph-capturable."""

from __future__ import annotations

import torch

from edgemoe.kernels.protocol import KEY_MAX, PolicyState

__all__ = ["KEY_MAX", "LRU", "POLICIES", "EvictionPolicy", "Scored"]


class EvictionPolicy:
    """Ranks slots for eviction. `keys` -> [S] float64, larger is evicted first (ties: the lower slot first)."""

    def __init__(self, num_layers: int, num_experts: int, num_slots: int, device: torch.device | str) -> None:
        self.num_layers, self.num_experts, self.num_slots = num_layers, num_experts, num_slots

    def keys(self, owner: torch.Tensor, clock: torch.Tensor, layer: int) -> torch.Tensor:
        raise NotImplementedError

    def update(self, layer: int, needed: torch.Tensor, slots: torch.Tensor, clock: torch.Tensor) -> None:
        """After `layer`'s step: `needed [E]` bool, `slots [E]` the slot of each needed expert (S elsewhere)."""
        raise NotImplementedError

    def kernel_state(self) -> PolicyState:
        """This policy's state as the fused `ensure` reads it (`edgemoe.kernels.ensure`)."""
        raise NotImplementedError(f"no fused ensure for policy {type(self).__name__}")


class LRU(EvictionPolicy):
    """Evict the slot whose last use is oldest, in layer-steps of the whole model."""

    def __init__(self, num_layers: int, num_experts: int, num_slots: int, device: torch.device | str) -> None:
        super().__init__(num_layers, num_experts, num_slots, device)
        self.last_use = torch.zeros(num_slots + 1, dtype=torch.long, device=device)

    def keys(self, owner: torch.Tensor, clock: torch.Tensor, layer: int) -> torch.Tensor:
        return (clock - self.last_use[: self.num_slots]).double()

    def update(self, layer: int, needed: torch.Tensor, slots: torch.Tensor, clock: torch.Tensor) -> None:
        self.last_use.scatter_(0, slots, clock.expand(slots.shape))

    def kernel_state(self) -> PolicyState:
        return PolicyState(False, self.last_use, self.last_use, self.last_use, self.last_use)


class Scored(EvictionPolicy):
    """Evict the slot whose expected next use is furthest away, in layer-steps.

    Per (layer, expert): `freq`, an exponential moving average of "used at this layer's step" (frequency, weight
    FREQ on the newest visit), and `last`, used at the layer's latest step (recency). Per layer: `reuse`, the
    moving average (weight REUSE) of how much more often the latest step's experts are used again than their
    frequency predicts, rho = max(0, (u - f) / (1 - f)) (u: share reused, f: their mean freq). The chance of use
    at the layer's next step is p = rho * last + (1 - rho) * freq. Layer l runs again in
    d = (l - current - 1) mod L + 1 layer-steps (the layer that just ran: L), so the expected next use is
    d + L * (1/p - 1) layer-steps away: that is the key (against LRU and Belady: docs/findings.md, "Eviction
    policies").
    """

    FREQ = 0.03
    REUSE = 0.05

    def __init__(self, num_layers: int, num_experts: int, num_slots: int, device: torch.device | str) -> None:
        super().__init__(num_layers, num_experts, num_slots, device)
        self.freq = torch.zeros(num_layers * num_experts + 1, dtype=torch.float64, device=device)
        self.last = torch.zeros_like(self.freq)  # 1.0 where used at the layer's latest step
        self.reuse = torch.zeros(num_layers, dtype=torch.float64, device=device)
        self._unread = torch.zeros(1, dtype=torch.long, device=device)  # the kernel's LRU argument, unread here

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

    def kernel_state(self) -> PolicyState:
        return PolicyState(True, self._unread, self.freq, self.last, self.reuse, self.FREQ, self.REUSE)


POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRU, "scored": Scored}  # config.MOE_POLICIES, in its order
