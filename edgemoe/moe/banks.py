"""Host banks: routed-expert weights in host memory, one contiguous bank per MoE layer, each expert's gate_up and
down weights side by side in its row (`edgemoe.moe.offload.split_rows`: a miss is one copy), pinned when the device
is CUDA, so that copies to the GPU run at full PCIe speed and a kernel can read them through unified addressing.
The loader fills them straight from safetensors, one checkpoint tensor at a time, so peak host memory stays about
the model's size.
"""

from __future__ import annotations

import weakref

import torch
from tqdm import tqdm

from edgemoe.errors import EdgeMoEError
from edgemoe.models.decoder import MoEForCausalLM
from edgemoe.moe.offload import OffloadedExperts, split_rows


def allocate_bank(shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """An uninitialised bank, page-locked in place when `pin` (cudaHostRegister, exact size: torch's pinned
    allocator rounds each allocation up to a power of two, which would cost up to twice the experts' size)."""
    bank = torch.empty(shape, dtype=dtype)
    if pin and bank.numel():
        cudart = torch.cuda.cudart()
        ptr, size = bank.data_ptr(), bank.numel() * bank.element_size()
        err = cudart.cudaHostRegister(ptr, size, 3)  # portable | mapped: any GPU reads it through unified addressing
        if int(err) != 0:
            raise EdgeMoEError(
                f"cannot pin {size / 2**30:.2f} GiB of host memory for an expert bank (CUDA error {int(err)})"
            )
        weakref.finalize(bank, cudart.cudaHostUnregister, ptr)
    return bank


def offload_experts(
    model: MoEForCausalLM, dtype: torch.dtype, pin: bool, progress: bool = True
) -> dict[str, torch.Tensor]:
    """Swap every MoE layer's `Experts` (still on the meta device) for `OffloadedExperts` over new host banks.

    Returns the banks by Hugging Face-style parameter name (`model.layers.N.mlp.experts.gate_up_proj`), the
    loader's targets for them; the swapped modules hold no parameters, so `to_empty` puts nothing of theirs on
    the device."""
    cfg = model.config
    targets, index = {}, 0
    layers = [(i, layer) for i, layer in enumerate(model.model.layers) if layer.is_moe]
    desc = "allocating pinned expert banks" if pin else "allocating expert banks"
    for i, layer in tqdm(layers, desc=desc, unit="layer", disable=not progress or None, leave=False):
        E, H, inter = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        w13, w2 = split_rows(allocate_bank((E, 3 * inter * H), dtype, pin), inter, H)
        layer.mlp.experts = OffloadedExperts(index, w13, w2)
        targets[f"model.layers.{i}.mlp.experts.gate_up_proj"] = w13
        targets[f"model.layers.{i}.mlp.experts.down_proj"] = w2
        index += 1
    return targets
