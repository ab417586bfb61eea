"""Host banks: routed-expert weights in host memory, one contiguous bank per MoE layer, each expert's row laid out by
its `ExpertLayout` (`edgemoe.offload.layout`: a miss is one copy), pinned when the device
is CUDA, so that copies to the GPU run at full PCIe speed and a kernel can read them through unified addressing.
The loader fills them straight from safetensors, one checkpoint tensor at a time, so peak host memory stays about
the model's size.

With a RAM budget smaller than the experts (`--ram-budget`), once loaded the layers read their experts through the RAM
tier (`edgemoe.offload.ram_tier`) instead, from one of two sources (`plan_tier`): the checkpoint's own files, where the
loader found every offloaded layer's experts there as the rows hold them (`edgemoe.offload.in_place`: the banks it
fills are then on the meta device and it reads no expert), else the expert store on disk
(`edgemoe.offload.expert_store`), which the banks it fills are views of. `--expert-store DIR` asks for the store
whatever the checkpoint (a copy on a faster disk than the checkpoint's).
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from edgemoe.errors import EdgeMoEError
from edgemoe.moe.experts import carry_biases
from edgemoe.offload.expert_store import CACHE_DIR, ExpertStore, GiB
from edgemoe.offload.experts import OffloadedExperts
from edgemoe.offload.in_place import CheckpointSpans, InPlaceExperts
from edgemoe.offload.layout import ExpertLayout
from edgemoe.offload.ram_tier import RamTier, TierSource, check_rows, pin_in_place, row_stride


@dataclass(frozen=True)
class TierOptions:
    """`--ram-budget` (bytes, or a fraction of the experts) and `--expert-store` (None: the checkpoint's files read in
    place where they can be, else a store beside the checkpoint, else under `CACHE_DIR`; a folder: a store there)."""

    budget: int | float
    folder: Path | None = None
    max_seqs: int = 1  # a decode step's sequences: its experts of one layer must fit the rows


@dataclass
class TierPlan:
    """What the RAM tier will read (the expert store the loader fills, or the checkpoint's files in place) and its
    rows."""

    source: ExpertStore | InPlaceExperts
    rows: int


def allocate_bank(shape: tuple[int, ...], dtype: torch.dtype, pin: bool, what: str = "an expert bank") -> torch.Tensor:
    """An uninitialised bank (of `what`, for the error), page-locked in place when `pin` (cudaHostRegister, exact
    size: torch's pinned allocator rounds each allocation up to a power of two, which would cost up to twice the
    experts' size)."""
    bank = torch.empty(shape, dtype=dtype)
    if pin and bank.numel():
        pin_in_place(bank, what)
    return bank


def available_memory() -> int | None:
    """The host memory available to a new allocation (MemAvailable), None where the system does not say."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def ram_rows(budget: int | float, total: int, stride: int) -> int:
    """RAM rows of `stride` bytes that a budget (bytes, or a fraction of the `total` experts) holds."""
    return round(budget * total) if isinstance(budget, float) else budget // stride


def plan_tier(
    model: nn.Module, dtype: torch.dtype, layouts: dict[int, ExpertLayout], tier: TierOptions, near: Path | None,
    identity: object, in_place: CheckpointSpans | None = None,
) -> TierPlan | None:  # fmt: skip
    """The RAM tier's source and rows for `tier`, or None where every expert fits the budget (host banks as without
    one): the checkpoint's files where `in_place` says where they hold every offloaded layer's experts as stored (the
    loader's call), else an expert store. `near`: the checkpoint's folder (None: random weights), `identity`: the
    checkpoint's (`source_identity`). A budget the machine's available memory cannot hold, or one below a decode
    step's experts, is one line, before any loading."""
    cfg = model.config
    dense = ExpertLayout(cfg.hidden_size, cfg.moe_intermediate_size, dtype, cfg.hidden_act)
    moe = [i for i, layer in enumerate(model.model.layers) if layer.is_moe]
    chosen = [layouts.get(i, dense) for i in moe]
    folders = [tier.folder] if tier.folder is not None else [p for p in (near, CACHE_DIR) if p is not None]
    total = len(moe) * cfg.num_experts
    row = max(layout.row_bytes for layout in chosen)
    stride = row_stride(row)
    rows = ram_rows(tier.budget, total, stride)
    if rows >= total:
        return None
    check_rows(rows, stride, cfg, tier.max_seqs, tier.budget)  # `attach_expert_cache` checks its own batch again
    free = available_memory()
    if free is not None and rows * stride > free:
        raise EdgeMoEError(
            f"ram_budget {tier.budget} is {rows * stride / GiB:.1f} GiB of experts; this machine has "
            f"{free / GiB:.1f} GiB available"
        )
    if in_place is not None and tier.folder is None:
        return TierPlan(InPlaceExperts(in_place, cfg.num_experts, chosen), rows)
    return TierPlan(ExpertStore(folders, cfg.num_experts, chosen, identity), rows)


def attach_ram_tier(model: nn.Module, plan: TierPlan, pin: bool) -> RamTier:
    """The loader is done: the store it filled is finished (nothing to do in place), and the offloaded layers read
    their experts through a RAM tier of `plan.rows` rows over the source (their banks, views of the store's mapping or
    meta tensors, dropped)."""
    layers = [m for m in model.modules() if isinstance(m, OffloadedExperts)]
    for m in layers:
        m.drop_banks()
    plan.source.finish()
    tier = RamTier(plan.source, plan.rows, pin)
    for m in layers:
        m.tier = tier
    return tier


def replace_ram_tier(model: nn.Module, budget: int | float, pin: bool) -> RamTier:
    """A new RAM tier of `budget` over the source the model's experts are read from (a benchmark's sweep of
    budgets)."""
    layers = [m for m in model.modules() if isinstance(m, OffloadedExperts)]
    old = layers[0].tier
    rows = ram_rows(budget, old.layers * old.experts, old.stride)
    if not 1 <= rows < old.layers * old.experts:
        raise EdgeMoEError(f"ram_budget {budget} holds {rows} of {old.layers * old.experts} experts: a tier needs "
                           "fewer than all of them and at least one")  # fmt: skip
    source: TierSource = old.source
    for m in layers:
        m.tier = None
    del old
    gc.collect()  # the old rows go first (an expert cache over them must be gone too)
    tier = RamTier(source, rows, pin)
    for m in layers:
        m.tier = tier
    return tier


def offload_experts(
    model: nn.Module,
    dtype: torch.dtype,
    pin: bool,
    progress: bool = True,
    layouts: dict[int, ExpertLayout] | None = None,
    source: ExpertStore | InPlaceExperts | None = None,
) -> dict[str, torch.Tensor]:
    """Swap every MoE layer's `Experts` (still on the meta device) for `OffloadedExperts` over new host banks, each
    laid out by `layouts[decoder layer]` (default: dense experts in `dtype`); with a RAM tier's `source`, its banks
    (`banks`: views of the store, or meta tensors: not pinned, the RAM tier's rows are).

    Returns the banks by Hugging Face-style parameter name (`model.layers.N.mlp.experts.gate_up_proj`), the
    loader's targets for them; the swapped modules hold no parameters, so `to_empty` puts nothing of theirs on
    the device."""
    cfg = model.config
    targets, index = {}, 0
    layers = [(i, layer) for i, layer in enumerate(model.model.layers) if layer.is_moe]
    desc = "allocating pinned expert banks" if pin and source is None else "allocating expert banks"
    dense = ExpertLayout(cfg.hidden_size, cfg.moe_intermediate_size, dtype, cfg.hidden_act)
    for i, layer in tqdm(layers, desc=desc, unit="layer", disable=not progress or None, leave=False):
        layout = (layouts or {}).get(i, dense)
        if source is None:
            bank = allocate_bank((cfg.num_experts, layout.row), layout.dtype, pin)
        else:
            bank = source.banks(layout, index)
        experts = OffloadedExperts(index, bank, layout)
        carry_biases(layer.mlp.experts, experts)  # on the meta device, then the device: biases stay resident
        layer.mlp.experts = experts
        targets[f"model.layers.{i}.mlp.experts.gate_up_proj"] = experts.gate_up_proj
        targets[f"model.layers.{i}.mlp.experts.down_proj"] = experts.down_proj
        index += 1
    return targets
