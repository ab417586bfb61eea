"""Plain references, tests only: a sparse MoE block (one token, one expert at a time) and the expert cache's
`ensure` (dicts and lists), the oracles of `SparseMoE` and `ExpertCache`."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def moe_reference(
    x: torch.Tensor, gate: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int, normalize: bool
) -> torch.Tensor:
    """x: [tokens, hidden], gate: [experts, hidden], banks as in `Experts` -> [tokens, hidden]."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax((gate @ x[t]).double(), dim=-1)
        top = sorted(range(len(probs)), key=lambda e: -probs[e].item())[:top_k]
        total = sum(probs[e].item() for e in top) if normalize else 1.0
        for e in top:
            gate_h, up_h = (w13[e] @ x[t]).chunk(2)
            out[t] += (probs[e].item() / total) * (w2[e] @ (F.silu(gate_h) * up_h))
    return out


class EnsureReference:
    """`ExpertCache.ensure` in plain Python: same policies and tie-breaking (free slots first, then by the policy's
    key, larger first, then the lower slot; misses take victims in expert order), same float64 arithmetic."""

    def __init__(
        self, num_layers: int, num_experts: int, num_slots: int, policy: str, freq_weight: float, reuse_weight: float
    ) -> None:
        self.L, self.E, self.S, self.policy = num_layers, num_experts, num_slots, policy
        self.freq_weight, self.reuse_weight = freq_weight, reuse_weight
        self.slot_of: dict[tuple[int, int], int] = {}
        self.owner: list[tuple[int, int] | None] = [None] * num_slots
        self.last_use = [0] * num_slots
        self.freq: dict[tuple[int, int], float] = {}
        self.last: dict[tuple[int, int], float] = {}
        self.reuse = [0.0] * num_layers
        self.clock = 0

    def _key(self, s: int, layer: int) -> float:
        if self.policy == "lru":
            return float(self.clock - self.last_use[s])
        owner_layer, expert = self.owner[s]
        rho = self.reuse[owner_layer]
        p = rho * self.last.get((owner_layer, expert), 0.0) + (1 - rho) * self.freq.get((owner_layer, expert), 0.0)
        distance = (owner_layer - layer - 1) % self.L + 1
        return (self.L * (1 / p - 1) if p else math.inf) + distance

    def _update_scored(self, layer: int, needed: list[int]) -> None:
        last = [self.last.get((layer, e), 0.0) for e in range(self.E)]
        freq = [self.freq.get((layer, e), 0.0) for e in range(self.E)]
        seen = max(sum(last), 1.0)
        reused = sum(last[e] for e in needed) / seen
        acc = 0.0
        for e in range(self.E):
            acc += last[e] * freq[e]
        chance = acc / seen
        rho = max((reused - chance) / max(1 - chance, 1e-12), 0.0)
        self.reuse[layer] = self.reuse[layer] * (1 - self.reuse_weight) + rho * self.reuse_weight
        for e in range(self.E):
            used = 1.0 if e in needed else 0.0
            self.freq[layer, e] = freq[e] * (1 - self.freq_weight) + used * self.freq_weight
            self.last[layer, e] = used

    def ensure(self, layer: int, ids: list[int], cpu_take: list[int] | None = None) -> dict:
        """-> {"hits", "misses": sorted expert lists, "copies": [(expert, slot, evicted (layer, expert) | None)],
        "cpu": the misses computed on the CPU (the last cpu_take[len(misses)], no slot), "slots": the slot of each id
        (-1: on the CPU)}. CPU experts count as used by the scored policy, and LRU has no slot to mark."""
        self.clock += 1
        needed = sorted(set(ids))
        hits = [e for e in needed if (layer, e) in self.slot_of]
        misses = [e for e in needed if (layer, e) not in self.slot_of]
        n_cpu = cpu_take[len(misses)] if cpu_take else 0
        copied, cpu = misses[: len(misses) - n_cpu], misses[len(misses) - n_cpu :]
        protected = {self.slot_of[layer, e] for e in hits}

        def rank(s: int) -> tuple:
            if self.owner[s] is None:
                return (0, 0.0, s)
            return (2, 0.0, s) if s in protected else (1, -min(self._key(s, layer), 1e300), s)

        victims = sorted(range(self.S), key=rank)
        copies = []
        for e, s in zip(copied, victims):
            old = self.owner[s]
            if old is not None:
                del self.slot_of[old]
            self.slot_of[layer, e] = s
            self.owner[s] = (layer, e)
            copies.append((e, s, old))
        for e in needed:
            if e not in cpu:
                self.last_use[self.slot_of[layer, e]] = self.clock
        self._update_scored(layer, needed)
        slots = [-1 if e in cpu else self.slot_of[layer, e] for e in ids]
        return {"hits": hits, "misses": misses, "copies": copies, "cpu": cpu, "slots": slots}
