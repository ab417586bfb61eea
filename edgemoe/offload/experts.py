"""Offloaded routed experts: each MoE layer's experts run over the shared device slot pool of an `ExpertCache`,
their weights coming from host banks (`edgemoe.offload.banks`) on a miss. Also sizes the cache.

Decode (at most S distinct experts in a layer's step, which the minimum cache size guarantees) is one call into the
cache (`ExpertCache.fetch`: `ensure`, the miss copy, the CPU split's pairs) and the layout's decode, as resident
experts run it, all fixed-shape and sync-free; on CUDA the expert kernel waits for each missed expert's rows, not for
the whole copy (`edgemoe.kernels.protocol.Arrivals`). Prefill with more pairs than experts streams whole layers
through two areas of the pool where it has 2E slots (`edgemoe.offload.prefill_stream`), unless the cache holds most
of what the step needs already (`PrefillStream.chooses`); otherwise the experts it needs are made resident in waves of
at most S, each wave's pairs computed by the layout's `pair_outputs` from their slots into one buffer of pair outputs
summed at the end. Either way each pair is computed by the function resident experts run (each expert's pairs alike
in any wave), so outputs are bitwise equal to resident experts.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from edgemoe.config import ExpertCacheConfig, ModelConfig
from edgemoe.context import get_context
from edgemoe.errors import EdgeMoEError
from edgemoe.kernels.protocol import Ensured
from edgemoe.moe.experts import pair_biases, sum_pairs
from edgemoe.offload import cpu_split
from edgemoe.offload.expert_cache import ExpertCache
from edgemoe.offload.layout import ExpertLayout
from edgemoe.offload.prefill_stream import PrefillStream
from edgemoe.offload.ram_tier import RamTier, check_rows

MiB = 2**20


class OffloadedExperts(nn.Module):
    """Drop-in for `Experts`; the banks are plain host tensors (not parameters), so no `.to()` moves them."""

    def __init__(self, moe_layer: int, bank: torch.Tensor, layout: ExpertLayout) -> None:
        super().__init__()
        self.moe_layer, self.layout = moe_layer, layout
        self.bank = bank  # [E, row]: what streamed prefill copies a layer at a time, and the CPU split reads
        self.gate_up_proj, self.down_proj = layout.views(bank)  # dense: [E, 2I, H], [E, H, I] on the host
        self.banks = layout.copy_views(bank)  # what the miss copy reads
        self.num_experts = bank.shape[0]
        self.cache: ExpertCache | None = None  # set by `attach`
        self.gate_up = self.down = None  # this layer's views of the cache's slot pool
        self.tier: RamTier | None = None  # the RAM tier its experts come from instead of the banks (`--ram-budget`)
        _no_biases(self)

    def drop_banks(self) -> None:
        """The experts are in the expert store from now on (views of it were the loader's targets): no banks."""
        self.bank = self.gate_up_proj = self.down_proj = self.banks = None

    def attach(self, cache: ExpertCache | None) -> None:
        self.cache = cache
        self.gate_up, self.down = (None, None) if cache is None else self.layout.views(cache.joined)

    def use_kernels(self, device: torch.device) -> None:
        self.layout.use_kernels(device)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        # x: [tokens, hidden]; ids, weights: [tokens, top_k]
        if get_context().is_prefill:
            return self._prefill(x, ids, weights)
        got = self.cache.fetch(self.moe_layer, ids, x, self)  # decode: at most min(E, pairs) <= S experts
        if got.cpu_rows is not None:  # the CPU pairs' rows hold their biases (`host_biases`); the others get theirs
            return self.layout.decode_cpu(
                x, got.slots, weights, self.gate_up, self.down, got.cpu_rows, got.arrivals, cpu_wait=got.cpu_wait,
                **pair_biases(self, ids),
            )  # fmt: skip
        return self.layout.decode(
            x, got.slots, weights, self.gate_up, self.down, arrivals=got.arrivals, **pair_biases(self, ids)
        )

    def _prefill(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Every pair of a prefill step: the whole layer streamed through the pool's areas where the step would miss
        most experts (`PrefillStream.chooses`), else its experts made resident in waves, each wave's pairs computed
        by the layout's `pair_outputs` from their slots (the others skipped): the function resident experts run,
        each expert's pairs computed alike in any wave, so the sum is bitwise resident experts'."""
        stream, bias = self.cache.prefill_stream, pair_biases(self, ids)
        if ids.numel() > self.num_experts and stream is not None and stream.chooses(self.moe_layer, ids):
            return stream.run(self.moe_layer, self.layout, x, ids, weights, **bias)
        flat = ids.flatten()
        y = x.new_empty(flat.numel(), x.shape[1])  # [pairs, hidden]
        for wave, slots in self._waves(torch.unique(flat).tolist()):
            slot_of = torch.full((self.num_experts,), -1, dtype=torch.long, device=x.device)
            slot_of[wave] = torch.tensor(slots, device=x.device)
            self.layout.pair_outputs(x, slot_of[flat], weights.flatten(), self.gate_up, self.down, out=y, **bias)
        return sum_pairs(y, ids.shape[1])

    def host_biases(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The expert biases as the CPU expert executor reads them (gate_up [E, 2I], down [E, H], fp32 host copies,
        made once), or None where the experts have none."""
        if self.gate_up_proj_bias is None:
            return None
        if getattr(self, "_host_biases", None) is None:
            self._host_biases = tuple(b.detach().float().cpu().contiguous() for b in (self.gate_up_proj_bias,
                                                                                      self.down_proj_bias))  # fmt: skip
        return self._host_biases

    def load(self, ids: torch.Tensor) -> Ensured:
        got = self.cache.ensure(self.moe_layer, ids, self.banks)
        self.cache.copy_from(got, self.moe_layer, self)
        return got

    def _waves(self, experts: list[int]) -> Iterator[tuple[list[int], list[int]]]:
        """Make `experts` resident at most S at a time (and at most the RAM tier's rows), yielding (the wave's
        experts, their slots); each wave is used before the next may evict it (prefill: syncs)."""
        S = self.cache.num_slots if self.tier is None else min(self.cache.num_slots, self.tier.rows)
        for start in range(0, len(experts), S):
            wave = experts[start : start + S]
            got = self.load(torch.tensor(wave, device=self.cache.device)[None])
            yield wave, got.slots[0].tolist()


def _check_tier(tier: RamTier, cfg: ModelConfig, max_tokens: int, cpu_compute: str | int) -> None:
    """One line where the RAM tier cannot serve a decode step, or a CPU split was asked for beside it."""
    check_rows(tier.rows, tier.stride, cfg, max_tokens, f"{tier.rows * tier.stride / 2**30:.2f}GiB")
    if str(cpu_compute) not in ("off", "auto"):
        raise EdgeMoEError("moe_cpu_compute computes misses from experts in RAM; with ram_budget use off")


class ResidentExperts(nn.Module):
    """Every expert of a layer on the device in a layout's storage (quantized experts: GGUF blocks as stored), read in
    place by the layout's decode kernel and, on CUDA, its prefill kernel (`ExpertLayout.pair_outputs`); the plain-torch
    prefill dequantizes the experts it uses."""

    def __init__(self, num_experts: int, layout: ExpertLayout) -> None:
        super().__init__()
        self.layout, self.num_experts = layout, num_experts
        self.register_buffer("joined", torch.empty(num_experts, layout.row, dtype=layout.dtype), persistent=False)
        _no_biases(self)

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
        gate_up, down = self.layout.views(self.joined)
        bias = pair_biases(self, ids)
        if not get_context().is_prefill:
            return self.layout.decode(x, ids, weights, gate_up, down, **bias)
        # prefill: the function offloaded waves and streamed layers run (`ExpertLayout.pair_outputs`)
        pairs = self.layout.pair_outputs(x, ids.flatten(), weights.flatten(), gate_up, down, **bias)
        return sum_pairs(pairs, ids.shape[1])


def _no_biases(module: nn.Module) -> None:
    """Expert biases' places (`edgemoe.moe.experts.carry_biases` fills them where the experts have some: kept on the
    device by expert, not in the rows)."""
    module.register_parameter("gate_up_proj_bias", None)
    module.register_parameter("down_proj_bias", None)


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
    cache.tier = layers[0].tier if layers else None
    if cache.tier is not None:
        _check_tier(cache.tier, cfg, max_tokens, cpu_compute)
        cpu_compute = "off"  # auto: the CPU split reads the host banks, which the tier replaces
    elif PrefillStream.fits(cache) and layers:
        cache.prefill_stream = PrefillStream(cache, [m.bank for m in sorted(layers, key=lambda m: m.moe_layer)])
    if device.type == "cuda" and layers:
        cache.start_copy_service(max_tokens * cfg.top_k)
        if cache.tier is not None:
            a, b = layout.copy_views(layout.empty(1))
            cache.copy_service.attach_tier(cache.tier, b.data_ptr() - a.data_ptr())
    layers.sort(key=lambda m: m.moe_layer)
    cache.cpu_split = cpu_split.resolve(cpu_compute, layers, device, cfg.top_k, graphs, cpu_threads,
                                        service=cache.copy_service, max_tokens=max_tokens)  # fmt: skip
    return cache
