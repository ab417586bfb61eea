from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from edgemoe.layers.linear import DecodeLinear


class GatedMLP(nn.Module):
    """SiLU-gated MLP (dense layers and the shared expert); Hugging Face parameter names."""

    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = DecodeLinear(inter, hidden, bias=False)  # gate/up stay cuBLAS: fused, they measured slower

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
