"""Streamed prefill over offloaded experts: whole layers through two areas of the slot pool, the copy of layer l+1
under the compute of layer l, with no host synchronisation between them.

Why whole layers: a prefill chunk of many tokens touches nearly every expert of every layer (512 tokens of
qwen3-30b-a3b route 4,096 pairs over 128 experts; an expert is left out with probability (1 - 8/128)^512 ~ 1e-15),
and which experts layer l+1 needs is known only once layer l has run, too late to copy them under its compute. So
the bound is every expert's bytes over PCIe once per chunk, and one copy of a layer's whole bank (its rows are side
by side in pinned memory and in the pool) reaches it. Waves of cache-sized expert sets (`OffloadedExperts`'s
fallback) copy only what misses but wait for each wave on the host and never overlap a copy with compute.

When not to stream: a chunk whose experts are mostly cached already (a short turn of an agent loop after its prompt
was prefilled, with a cache holding most of each layer). Waves copy only the M experts that miss, then compute; the
stream copies all L x E under the compute. With c an expert's copy and C the chunk's compute, waves take M c + C and
the stream max(L E c, C); C is at most about half of L E c even for the largest chunk (measured on the H200), so by
this model waves are ahead while M <= L E / 2 (`STREAM_FROM`), for any chunk; large M in waves is not measured since
the grouped GEMM, hence the conservative threshold (the figures: docs/findings.md, "Streamed prefill"). `chooses`
decides once a step, at its first MoE layer (the copy of layer l+1 starts under layer l, so a step streams all of its
layers or none): layer 0's misses counted exactly, every other layer's estimated from the experts layer 0 uses and how
many of that layer's experts are cached. One host sync a step.

Areas: slots [0, E) and [E, 2E) of the pool (a cache of at least 2E slots and fewer than all experts; other caches
keep the waves). Layer l is
copied into area l % 2 on a copy stream; the compute stream waits for that copy by an event; the copy into an area
waits for the compute that last read it (`wait_stream`). Layer l is computed with the resident path's own function
over the area's rows (`ExpertLayout.pair_outputs`: on CUDA the grouped GEMM `edgemoe.kernels.grouped_gemm`), so outputs
are bitwise those of resident experts.

The cache's bookkeeping stays true throughout: before an area is overwritten, whatever the cache held in its slots is
dropped (counted as evictions); once a layer is computed, its area is registered as holding that layer's experts (a
copy of one elsewhere in the pool is freed), counted as one layer-step of the policy for the experts the chunk used,
and in the stats as E accesses, each a miss whose bytes were copied. So after a prefill the cache holds the last two MoE
layers' experts whole, which the first decode steps read without a miss, and the rest as before (less what the
areas displaced).
"""

from __future__ import annotations

import torch

from edgemoe.moe.experts import sum_pairs
from edgemoe.offload.expert_cache import STAT_FIELDS, ExpertCache
from edgemoe.offload.layout import ExpertLayout

STREAM_FROM = 0.5  # stream a step whose expected misses exceed this share of its L x E experts (see above)


class PrefillStream:
    """Streams a prefill step's MoE layers (in order, `banks[i]` the host bank [E, row] of MoE layer i) through the
    first 2E slots of `cache`'s pool."""

    def __init__(self, cache: ExpertCache, banks: list[torch.Tensor]) -> None:
        assert self.fits(cache), "streamed prefill needs two layers' worth of slots"
        self.cache, self.banks, self.E = cache, banks, cache.num_experts
        self.cuda = cache.device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(cache.device) if self.cuda else None
        self.copied: list[torch.cuda.Event | None] = [None, None]  # per area: its copy's completion (CUDA)
        self.holds: list[int | None] = [None, None]  # per area: the layer copied into it during this step
        self.last_layer = -1  # the layer computed last: a layer at or before it starts a new step
        self.streaming = True  # what `chooses` decided for the current step
        self._experts = torch.arange(self.E, device=cache.device)
        counts = {"accesses": self.E, "misses": self.E, "bytes_copied": self.E * cache.expert_bytes}
        self._layer_stats = torch.tensor([counts.get(f, 0) for f in STAT_FIELDS], device=cache.device)  # a layer's

    @staticmethod
    def fits(cache: ExpertCache) -> bool:
        """Two layers' worth of slots, and not every expert (a cache that holds them all misses nothing to stream)."""
        E, S = cache.num_experts, cache.num_slots
        return cache.joined is not None and 2 * E <= S < cache.num_layers * E

    def chooses(self, layer: int, ids: torch.Tensor) -> bool:
        """Whether prefill streams MoE layer `layer` (ids [tokens, top_k] its routing): decided at MoE layer 0 for
        the whole step, by the misses it expects (module docstring)."""
        if layer == 0:
            self.streaming = self.expected_misses(ids) > STREAM_FROM * self.cache.num_layers * self.E
        return self.streaming

    def expected_misses(self, ids: torch.Tensor) -> float:
        """Misses a prefill step routed as `ids` at MoE layer 0 would meet in waves, over all MoE layers: layer 0's
        exactly, every later layer's as (experts layer 0 uses) x (the share of that layer's experts not cached)."""
        c, E = self.cache, self.E
        used = torch.zeros(E, dtype=torch.bool, device=ids.device).index_fill_(0, ids.reshape(-1), True)
        absent = c.slot_of[: c.num_layers * E].view(c.num_layers, E) < 0  # [L, E]
        first = (used & absent[0]).sum()
        later = used.sum() * absent[1:].sum() / E
        return float(first + later)

    def area_rows(self, area: int) -> torch.Tensor:
        return self.cache.joined[area * self.E : (area + 1) * self.E]

    def run(
        self, layer: int, layout: ExpertLayout, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, **bias
    ) -> torch.Tensor:
        """MoE layer `layer`'s routed experts for a prefill chunk (x [tokens, hidden], ids and weights
        [tokens, top_k]), as `ResidentExperts` computes them (`bias`: the pairs' expert biases, where they have
        some)."""
        if layer <= self.last_layer:  # a new step: what the areas held may have been evicted since
            self.holds = [None, None]
        self.last_layer = layer
        area = layer % 2
        self._copy(layer)
        if layer + 1 < len(self.banks):
            self._copy(layer + 1)  # under this layer's compute
        if self.cuda:
            torch.cuda.current_stream(self.cache.device).wait_event(self.copied[area])
        gate_up, down = layout.views(self.area_rows(area))
        out = sum_pairs(layout.pair_outputs(x, ids.flatten(), weights.flatten(), gate_up, down, **bias), ids.shape[1])
        self._register(layer, area, ids)
        return out

    def _copy(self, layer: int) -> None:
        area = layer % 2
        if self.holds[area] == layer:
            return
        self._drop(area, layer)
        rows, bank = self.area_rows(area), self.banks[layer]
        if self.cuda:
            # after the compute that last read this area (and the drop just queued)
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.cache.device))
            with torch.cuda.stream(self.copy_stream):
                rows.copy_(bank, non_blocking=True)
                self.copied[area] = torch.cuda.Event()
                self.copied[area].record(self.copy_stream)
        else:
            rows.copy_(bank)
        self.holds[area] = layer

    def _drop(self, area: int, layer: int) -> None:
        """Forget whatever the cache holds in the area's slots (device ops, no sync), counted as evictions of the
        layer about to be copied there."""
        c, L, E = self.cache, self.cache.num_layers, self.E
        owner = c.owner[area * E : (area + 1) * E]
        if c.collect_stats:
            c.stats[layer, STAT_FIELDS.index("evictions")] += (owner >= 0).sum()
        c.slot_of.scatter_(0, torch.where(owner >= 0, owner, L * E), -1)  # L * E: the scratch entry
        c.slot_of[L * E] = -1
        owner.fill_(-1)

    def _register(self, layer: int, area: int, ids: torch.Tensor) -> None:
        """The area holds `layer`'s experts now: mapping, policy (one layer-step of the experts `ids` used), stats."""
        c, E, S = self.cache, self.E, self.cache.num_slots
        keys = layer * E + self._experts
        slots = area * E + self._experts
        elsewhere = c.slot_of[keys]  # [E] a slot outside the area that held the expert (-1: none)
        c.owner.scatter_(0, torch.where(elsewhere >= 0, elsewhere, S), -1)  # S: the scratch slot
        c.owner[S] = -1
        c.slot_of[keys] = slots
        c.owner[slots] = keys
        c.clock += 1
        needed = torch.zeros(E, dtype=torch.bool, device=ids.device).index_fill_(0, ids.reshape(-1), True)
        c.policy.update(layer, needed, torch.where(needed, slots, S), c.clock)
        if c.collect_stats:  # accesses, hits, misses, evictions (`_drop`), bytes: every expert copied, a miss
            c.stats[layer] += self._layer_stats
