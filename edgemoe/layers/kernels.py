"""Kernels chosen once: when a model is built for a device, every layer that has a Triton fast path picks it or
keeps its plain-torch reference, so no forward tests the device.

A layer with a fast path defines `use_kernels(device)`, which swaps its reference functions for the kernels (imported
there: CPU-only machines without triton never import them). `select_kernels` calls it on every such module.
"""

from __future__ import annotations

import torch
from torch import nn


def select_kernels(model: nn.Module, device: torch.device) -> bool:
    """Give every layer of `model` its Triton kernels on a CUDA device (else they keep their references). -> whether
    kernels were chosen."""
    if device.type != "cuda":
        return False
    for module in model.modules():
        use = getattr(module, "use_kernels", None)
        if use is not None:
            use(device)
    return True
