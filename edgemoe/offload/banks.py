"""Host banks: routed-expert weights in host memory, one contiguous bank per MoE layer, each expert's row laid out by
its `ExpertLayout` (`edgemoe.offload.layout`: a miss is one copy), pinned when the device
is CUDA, so that copies to the GPU run at full PCIe speed and a kernel can read them through unified addressing.
The loader fills them straight from safetensors, one checkpoint tensor at a time, so peak host memory stays about
the model's size.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from tqdm import tqdm

from edgemoe.errors import EdgeMoEError
from edgemoe.moe.experts import carry_biases
from edgemoe.offload.experts import OffloadedExperts
from edgemoe.offload.layout import ExpertLayout


def allocate_bank(shape: tuple[int, ...], dtype: torch.dtype, pin: bool, what: str = "an expert bank") -> torch.Tensor:
    """An uninitialised bank (of `what`, for the error), page-locked in place when `pin` (cudaHostRegister, exact
    size: torch's pinned allocator rounds each allocation up to a power of two, which would cost up to twice the
    experts' size)."""
    bank = torch.empty(shape, dtype=dtype)
    if pin and bank.numel():
        cudart = torch.cuda.cudart()
        ptr, size = bank.data_ptr(), bank.numel() * bank.element_size()
        err = cudart.cudaHostRegister(ptr, size, 3)  # portable | mapped: any GPU reads it through unified addressing
        if int(err) != 0:
            raise EdgeMoEError(f"cannot pin {size / 2**30:.2f} GiB of host memory for {what} (CUDA error {int(err)})")
        weakref.finalize(bank, cudart.cudaHostUnregister, ptr)
    return bank


def offload_experts(
    model: nn.Module,
    dtype: torch.dtype,
    pin: bool,
    progress: bool = True,
    layouts: dict[int, ExpertLayout] | None = None,
) -> dict[str, torch.Tensor]:
    """Swap every MoE layer's `Experts` (still on the meta device) for `OffloadedExperts` over new host banks, each
    laid out by `layouts[decoder layer]` (default: dense experts in `dtype`).

    Returns the banks by Hugging Face-style parameter name (`model.layers.N.mlp.experts.gate_up_proj`), the
    loader's targets for them; the swapped modules hold no parameters, so `to_empty` puts nothing of theirs on
    the device."""
    cfg = model.config
    targets, index = {}, 0
    layers = [(i, layer) for i, layer in enumerate(model.model.layers) if layer.is_moe]
    desc = "allocating pinned expert banks" if pin else "allocating expert banks"
    dense = ExpertLayout(cfg.hidden_size, cfg.moe_intermediate_size, dtype, cfg.hidden_act)
    for i, layer in tqdm(layers, desc=desc, unit="layer", disable=not progress or None, leave=False):
        layout = (layouts or {}).get(i, dense)
        bank = allocate_bank((cfg.num_experts, layout.row), layout.dtype, pin)
        experts = OffloadedExperts(index, bank, layout)
        carry_biases(layer.mlp.experts, experts)  # on the meta device, then the device: biases stay resident
        layer.mlp.experts = experts
        targets[f"model.layers.{i}.mlp.experts.gate_up_proj"] = experts.gate_up_proj
        targets[f"model.layers.{i}.mlp.experts.down_proj"] = experts.down_proj
        index += 1
    return targets
