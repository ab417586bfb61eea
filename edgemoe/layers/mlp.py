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
SWIGLU_OAI = "swiglu_oai"  # gpt-oss's experts (llama.cpp's name for it)
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0


def swiglu_oai(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU: the gate clamped above and up on both sides at 7, gate * sigmoid(1.702 gate) times
    (up + 1), in transformers' order of operations."""
    gate, up = gate.clamp(max=SWIGLU_LIMIT), up.clamp(-SWIGLU_LIMIT, SWIGLU_LIMIT)
    return (up + 1) * (gate * torch.sigmoid(gate * SWIGLU_ALPHA))


def _gated(act: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    return lambda gate, up: act(gate) * up


# routed experts' gated activations: (gate, up) -> the down projection's input; every `ACTIVATIONS` name as act(gate)
# * up, plus gpt-oss's
GLUS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    **{name: _gated(act) for name, act in ACTIVATIONS.items()},
    SWIGLU_OAI: swiglu_oai,
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
