"""Offloaded routed experts: each MoE layer's experts run over the shared device slot pool of an `ExpertCache`,
their weights coming from host banks (`edgemoe.offload.banks`) on a miss. Also sizes the cache.

Decode (at most S distinct experts in a layer's step, which the minimum cache size guarantees) is one `ensure`,
one miss copy and the same expert kernel as resident experts, all fixed-shape and sync-free; on CUDA the expert
kernel waits for each missed expert's rows, not for the whole copy (`edgemoe.kernels.protocol.Arrivals`).
Prefill with more pairs than experts streams whole layers through two areas of the pool where it has 2E slots
(`edgemoe.offload.prefill_stream`), unless the cache holds most of what the step needs already (`PrefillStream.
chooses`); otherwise, or with fewer pairs, the experts it needs are made resident in waves of at most S, in expert
order. Either way each pair is computed exactly as the resident path would (same functions,
same order), so outputs are bitwise equal to resident experts. With the prefill kernel (dense SiLU experts on CUDA)
every wave is one grouped GEMM over its experts' pairs, read from their slots, into one buffer of pair outputs summed
at the end, as resident experts sum it (`edgemoe.kernels.grouped_gemm`).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from edgemoe.config import ExpertCacheConfig, ModelConfig
from edgemoe.context import get_context
from edgemoe.errors import EdgeMoEError
from edgemoe.kernels.protocol import Ensured
from edgemoe.offload import cpu_split
from edgemoe.offload.expert_cache import ExpertCache
from edgemoe.offload.layout import ExpertLayout
from edgemoe.offload.prefill_stream import PrefillStream

MiB = 2**20


class OffloadedExperts(nn.Module):
    """Drop-in for `Experts`; the banks are plain host tensors (not parameters), so no `.to()` moves them."""

    def __init__(self, layer: int, bank: torch.Tensor, layout: ExpertLayout) -> None:
        super().__init__()
        self.layer, self.layout = layer, layout  # layer: index among MoE layers
        self.bank = bank  # [E, row]: what streamed prefill copies a layer at a time, and the CPU split reads
        self.gate_up_proj, self.down_proj = layout.views(bank)  # dense: [E, 2I, H], [E, H, I] on the host
        self.banks = layout.copy_views(bank)  # what the miss copy reads
        self.num_experts = bank.shape[0]
        self.cache: ExpertCache | None = None  # set by `attach`
        self.w13 = self.w2 = None  # this layer's views of the cache's slot pool

    def attach(self, cache: ExpertCache | None) -> None:
        self.cache = cache
        self.w13, self.w2 = (None, None) if cache is None else self.layout.views(cache.joined)

    def use_kernels(self, device: torch.device) -> None:
        self.layout.use_kernels(device)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        # x: [tokens, hidden]; ids, weights: [tokens, top_k]; the same kernel choice as `Experts.forward`
        pairs, E, S = ids.numel(), self.num_experts, self.cache.num_slots
        stream = self.cache.prefill_stream
        if get_context().is_prefill and pairs > E and stream is not None and stream.chooses(self.layer, ids):
            return stream.run(self.layer, self.layout, x, ids, weights)
        if get_context().is_prefill and self.layout.pair_outputs is not None:
            return self._kernel_waves(x, ids, weights)
        gathered = pairs <= E or not get_context().is_prefill  # decode: at most min(E, pairs) <= S experts
        if gathered and (pairs <= S or E <= S):
            if get_context().is_prefill:  # bitwise as resident
                return self.layout.gathered(x, self.load(ids).slots, weights, self.w13, self.w2)
            split = self.cache.cpu_split
            take = None if split is None else split.table
            got = self.cache.ensure(self.layer, ids, self.banks, cpu_take=take, x=x)
            wait = None if split is None else self.cache.cpu_wait(got)  # captured: the copy service computes them
            eager = split is not None and wait is None
            on_cpu = split.pairs(ids, got.slots, x) if eager else None  # a sync, before the copy starts
            self.cache.copy_missing(got, *self.banks)
            if not self.layout.decode_waits:  # a plain-torch decode (a non-SiLU family on CUDA) reads every slot at
                self.cache.await_copy(got)  # once: in a captured step, after the copy service's copy
            arrivals = self.cache.arrivals(got)
            if wait is not None:
                rows = wait.rows[:pairs]
                return self.layout.decode_cpu(x, got.slots, weights, self.w13, self.w2, rows, arrivals, cpu_wait=wait)
            if on_cpu is not None:  # computed while the GPU copies
                cpu_out = split.compute(self.bank, self.layout, on_cpu, pairs, x.device)
                return self.layout.decode_cpu(x, got.slots, weights, self.w13, self.w2, cpu_out, arrivals=arrivals)
            return self.layout.decode(x, got.slots, weights, self.w13, self.w2, arrivals=arrivals)
        if pairs <= E:
            return self._gathered_waves(x, ids, weights)
        return self._grouped_waves(x, ids, weights)

    def load(self, ids: torch.Tensor) -> Ensured:
        got = self.cache.ensure(self.layer, ids, self.banks)
        self.cache.copy_missing(got, *self.banks)
        return got

    def _waves(self, experts: list[int]) -> Iterator[tuple[list[int], list[int]]]:
        """Make `experts` resident at most S at a time, yielding (the wave's experts, their slots); each wave is
        used before the next may evict it (prefill: syncs)."""
        S = self.cache.num_slots
        for start in range(0, len(experts), S):
            wave = experts[start : start + S]
            got = self.load(torch.tensor(wave, device=self.cache.device)[None])
            yield wave, got.slots[0].tolist()

    def _kernel_waves(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The grouped GEMM wave by wave: each wave computes the pairs of its experts (the others' rows are -1,
        skipped); each expert's pairs form the tiles they form resident, so the sum is bitwise resident experts'."""
        flat = ids.flatten()
        y = x.new_empty(flat.numel(), x.shape[1])  # [pairs, hidden]
        for wave, slots in self._waves(torch.unique(flat).tolist()):
            slot_of = torch.full((self.num_experts,), -1, dtype=torch.long, device=x.device)
            slot_of[wave] = torch.tensor(slots, device=x.device)
            self.layout.pair_outputs(x, slot_of[flat], weights.flatten(), self.w13, self.w2, out=y)
        return y.view(*ids.shape, -1).sum(dim=1, dtype=torch.float32).to(x.dtype)  # as `grouped_gemm` sums

    def _gathered_waves(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """`gathered_experts`, wave by wave. Batched matmuls are not batch-size invariant, so every wave runs them
        over all pairs (those of other waves read some resident slot) and keeps its own pairs' rows."""
        tokens, top_k = ids.shape
        flat = ids.flatten()
        xs = x.repeat_interleave(top_k, dim=0)[:, :, None]  # [pairs, hidden, 1]
        out = x.new_empty(flat.numel(), x.shape[1])  # [pairs, hidden]
        for wave, slots in self._waves(torch.unique(flat).tolist()):
            slot_of = torch.full((self.num_experts,), slots[0], dtype=torch.long, device=x.device)
            slot_of[wave] = torch.tensor(slots, device=x.device)
            in_wave = torch.zeros(self.num_experts, dtype=torch.bool, device=x.device)
            in_wave[wave] = True
            slot = slot_of[flat]  # [pairs]
            w13, w2 = self.layout.dense_gate_up(self.w13[slot]), self.layout.dense_down(self.w2[slot])
            gate, up = torch.bmm(w13, xs)[:, :, 0].chunk(2, dim=-1)
            h = (self.layout.act(gate) * up)[:, :, None]
            out = torch.where(in_wave[flat][:, None], torch.bmm(w2, h)[:, :, 0], out)
        return (out.view(tokens, top_k, -1) * weights[:, :, None]).sum(dim=1)

    def _grouped_waves(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """`grouped_experts`, the experts made resident wave by wave (same pair order, same accumulation)."""
        top_k = ids.shape[1]
        order = ids.flatten().argsort(stable=True)
        counts = torch.bincount(ids.flatten(), minlength=self.num_experts).tolist()
        starts = [sum(counts[:e]) for e in range(self.num_experts)]
        token_of_pair = order // top_k
        out = torch.zeros_like(x)
        for wave, slots in self._waves([e for e, n in enumerate(counts) if n]):
            for expert, slot in zip(wave, slots):
                pairs = order[starts[expert] : starts[expert] + counts[expert]]
                tok = token_of_pair[starts[expert] : starts[expert] + counts[expert]]
                w13, w2 = self.layout.dense_gate_up(self.w13[slot]), self.layout.dense_down(self.w2[slot])
                gate, up = F.linear(x[tok], w13).chunk(2, dim=-1)
                y = F.linear(self.layout.act(gate) * up, w2) * weights.flatten()[pairs, None]
                out.index_add_(0, tok, y)
        return out


class ResidentExperts(nn.Module):
    """Every expert of a layer on the device in a layout's storage (quantized experts: GGUF blocks as stored), read in
    place by the layout's decode kernel and, on CUDA, its prefill kernel (`ExpertLayout.pair_outputs`); the plain-torch
    prefill dequantizes the experts it uses."""

    def __init__(self, num_experts: int, layout: ExpertLayout) -> None:
        super().__init__()
        self.layout, self.num_experts = layout, num_experts
        self.register_buffer("joined", torch.empty(num_experts, layout.row, dtype=layout.dtype), persistent=False)

    def use_kernels(self, device: torch.device) -> None:
        self.layout.use_kernels(device)

    @property
    def gate_up_proj(self) -> torch.Tensor:
        return self.layout.views(self.joined)[0]

    @property
    def down_proj(self) -> torch.Tensor:
        return self.layout.views(self.joined)[1]

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        # x: [tokens, hidden]; ids, weights: [tokens, top_k]
        w13, w2 = self.layout.views(self.joined)
        if not get_context().is_prefill:
            return self.layout.decode(x, ids, weights, w13, w2)
        if self.layout.pair_outputs is not None:  # the prefill kernel, as offloaded waves and streamed layers run it
            from edgemoe.kernels.grouped_gemm import sum_pairs

            return sum_pairs(self.layout.pair_outputs(x, ids.flatten(), weights.flatten(), w13, w2), ids.shape[1])
        if ids.numel() <= self.num_experts:
            return self.layout.gathered(x, ids, weights, w13, w2)
        return self.layout.grouped(x, ids, weights, w13, w2)


def expert_bytes(model: nn.Module, dtype: torch.dtype) -> int:
    """Bytes of one expert's storage row (a slot): its layout's where the experts are offloaded, else dense."""
    layout = next((m.layout for m in model.modules() if hasattr(m, "layout")), None)
    return layout.row_bytes if layout is not None else model.config.expert_params * dtype.itemsize


def min_cache_slots(cfg: ModelConfig, max_num_seqs: int) -> int:
    """The most distinct experts one layer can need in one decode step."""
    return min(cfg.num_experts, max_num_seqs * cfg.top_k)


def cache_slots(moe: ExpertCacheConfig, cfg: ModelConfig, max_num_seqs: int, per: int, room: int | None) -> int:
    """Slots from `moe_cache_slots`, `moe_cache_fraction` of all experts, or what `room` bytes of device memory
    hold (one scratch slot aside, `per` bytes a slot); capped at all experts."""
    total = cfg.num_experts * sum(cfg.moe_layers)
    minimum = min_cache_slots(cfg, max_num_seqs)
    why = (
        f"the minimum is {minimum} slots ({minimum * per / MiB:.1f} MiB): one decode step of a layer needs "
        f"min(experts {cfg.num_experts}, max_num_seqs {max_num_seqs} x top_k {cfg.top_k})"
    )
    if moe.moe_cache_slots is not None:
        slots = moe.moe_cache_slots
        if slots < minimum:
            raise EdgeMoEError(f"moe_cache_slots {slots} is too small; {why}")
    elif moe.moe_cache_fraction is not None:
        slots = round(moe.moe_cache_fraction * total)
        if slots < minimum:
            raise EdgeMoEError(f"moe_cache_fraction {moe.moe_cache_fraction} gives {slots} of {total} experts; {why}")
    else:
        slots = room // per - 1
        if slots < minimum:
            raise EdgeMoEError(
                f"the device memory left for the expert cache ({max(room, 0) / MiB:.1f} MiB) holds "
                f"{max(slots, 0)} experts; {why}"
            )
    return min(slots, total)


def attach_expert_cache(
    model: nn.Module,
    slots: int,
    policy: str,
    collect_stats: bool,
    device: torch.device,
    dtype: torch.dtype,
    cpu_compute: str | int = "off",
    graphs: bool = False,
    max_tokens: int = 1,
    cpu_threads: int | None = None,
) -> ExpertCache:
    """One cache and slot pool (S slots + a scratch slot, each an expert's row in the layers' `ExpertLayout`) for all
    of `model`'s offloaded MoE layers; `cpu_compute`: `--moe-cpu-compute`, `graphs`: whether decode would replay CUDA
    graphs (`edgemoe.offload.cpu_split.resolve`), `max_tokens`: a decode step's tokens at most (the copy service's
    room for the split's pairs), `cpu_threads`: the CPU pool's (None: every core)."""
    cfg = model.config
    layers = [m for m in model.modules() if isinstance(m, OffloadedExperts)]
    dense = ExpertLayout(cfg.hidden_size, cfg.moe_intermediate_size, dtype, cfg.hidden_act)
    layout = layers[0].layout if layers else dense
    cache = ExpertCache(len(layers), cfg.num_experts, slots, policy, device, layout.row_bytes, collect_stats)
    joined = layout.empty(slots + 1, device)
    cache.attach_pool(*layout.copy_views(joined), joined)
    for m in layers:
        m.attach(cache)
    if PrefillStream.fits(cache) and layers:
        cache.prefill_stream = PrefillStream(cache, [m.bank for m in sorted(layers, key=lambda m: m.layer)])
    if device.type == "cuda" and layers:
        cache.start_copy_service(max_tokens * cfg.top_k)
    layers.sort(key=lambda m: m.layer)
    cache.cpu_split = cpu_split.resolve(cpu_compute, layers, device, cfg.top_k, graphs, cpu_threads,
                                        service=cache.copy_service, max_tokens=max_tokens)  # fmt: skip
    return cache
