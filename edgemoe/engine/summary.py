"""The start-up line: what is running where, printed once the engine has started by `edgemoe generate` and `edgemoe
serve` alike (stderr), e.g.

    edgemoe: Qwen3-30B-A3B (qwen3_moe) on cuda:0, bfloat16 (auto: the checkpoint's): 30.5 B parameters (1.9 B dense
    on the GPU, 28.6 B in experts: host RAM, 1,200 of 6,144 cached on the GPU), context 40,960 tokens (40,960 in the
    KV cache), loaded in 12.3 s

Each part is one small function of the engine, so that a part (where the memory went, say) is one more function.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from edgemoe.offload.layout import QuantExpertLayout

if TYPE_CHECKING:
    from edgemoe.engine.engine import LLMEngine


def startup_line(engine: LLMEngine) -> str:
    parts = (_model(engine), _compute(engine), _parameters(engine), _context(engine))
    return f"edgemoe: {parts[0]} {parts[1]}: {parts[2]}, {parts[3]}, loaded in {engine.load_seconds:.1f} s"


def _model(engine: LLMEngine) -> str:
    return f"{engine.model_name} ({engine.model_config.model_type})"


def _compute(engine: LLMEngine) -> str:
    dtype = str(engine.dtype).removeprefix("torch.")
    where = _device(engine.device)
    if engine.parallel is not None:  # rank 0's device, and the others'
        world = engine.parallel.world
        where = f"{world} ranks (cuda:0-{world - 1})" if engine.device.type == "cuda" else f"{world} CPU ranks"
    return f"on {where}, {dtype} ({engine.dtype_reason})"


def _device(device: torch.device) -> str:
    if device.type == "cuda" and device.index is None:
        return f"cuda:{torch.cuda.current_device()}"
    return str(device)


def _parameters(engine: LLMEngine) -> str:
    """The parameters, dense apart from the routed experts, and where each lives."""
    cfg, cache, total = engine.model_config, engine.expert_cache, count(engine.num_params)
    experts = engine.num_expert_params  # the whole model's (a tensor-parallel rank's config holds its share)
    dense = count(engine.num_params - experts)
    stored = _expert_formats(engine)
    in_experts = f"{count(experts)} in {stored + ' ' if stored else ''}experts"
    if cache is None:
        return f"{total} parameters ({dense} dense, {in_experts}), all {_memory(engine.device)}"
    slots = f"{cache.num_slots:,} of {cfg.num_experts * sum(cfg.moe_layers):,}"
    if cache.tier is not None:
        tier, where = cache.tier, "in cache slots" if engine.device.type == "cpu" else "cached on the GPU"
        size = tier.rows * tier.stride
        ram = (
            f"{tier.rows:,} in RAM ({size / 2**30:.1f} GiB)"
            if size >= 2**30
            else f"{tier.rows:,} in RAM ({size / 2**20:.1f} MiB)"
        )
        disk = f"all on disk ({tier.source.where})"
        return f"{total} parameters ({dense} dense, {in_experts}: {disk}, {ram}, {slots} {where})"
    if engine.device.type == "cpu":
        return f"{total} parameters ({dense} dense, {in_experts}: host banks, {slots} in cache slots), all in RAM"
    return f"{total} parameters ({dense} dense on the GPU, {in_experts}: host RAM, {slots} cached on the GPU)"


def _context(engine: LLMEngine) -> str:
    """The longest sequence a request may reach (the model's own unless max_model_len is lower) and the tokens the KV
    cache was given room for: all sequences together (fewer than max_num_seqs x the context where memory is short)."""
    reserved = engine.kv.num_blocks * engine.kv.block_size
    return f"context {engine.max_model_len:,} tokens ({reserved:,} in the KV cache)"


def _memory(device: torch.device) -> str:
    return "in RAM" if device.type == "cpu" else "on the GPU"


def _expert_formats(engine: LLMEngine) -> str:
    """The GGUF block formats routed experts are stored in ("Q4_K/Q6_K": gate/up, down); "": the compute dtype."""
    names = set()
    for module in engine.model.modules():
        layout = getattr(module, "layout", None)
        if isinstance(layout, QuantExpertLayout):
            gu, down = layout.q_gate_up.name, layout.q_down.name
            names.add(gu if gu == down else f"{gu}/{down}")
    return ", ".join(sorted(names))


def count(n: int) -> str:
    """12649472 -> "12.6 M"."""
    for size, unit in ((10**9, "B"), (10**6, "M"), (10**3, "K")):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return str(n)
