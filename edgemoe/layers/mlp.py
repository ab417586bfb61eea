from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from edgemoe.layers.linear import DecodeLinear

# Hugging Face's `hidden_act` names -> the exact function transformers uses for each (its `ACT2FN`)
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
}


class GatedMLP(nn.Module):
    """Gated MLP (dense layers and the shared expert), SiLU unless `act` names another of `ACTIVATIONS`; Hugging Face
    parameter names."""

    def __init__(self, hidden: int, inter: int, act: str = "silu") -> None:
        super().__init__()
        self.gate_proj = DecodeLinear(hidden, inter, bias=False)
        self.up_proj = DecodeLinear(hidden, inter, bias=False)
        self.down_proj = DecodeLinear(inter, hidden, bias=False)
        self.act = ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
