from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, scaled in the input dtype (as Hugging Face's Llama-style norms). Normalises the
    last dim of any shape (per-head q/k norms pass [tokens, heads, head_dim]).

    With a `residual`, the pre-norm block's residual add comes first, in the same launch with kernels:
    `norm(x, residual)` -> (norm(x + residual), x + residual)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self._norm, self._add_norm = rms_norm_reference, add_rms_norm_reference

    def use_kernels(self, device: torch.device) -> None:
        from edgemoe.kernels.norm_rope import add_rms_norm, rms_norm

        self._norm, self._add_norm = rms_norm, add_rms_norm  # one launch instead of ~8 (~9 with the add)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self._norm(x, self.weight, self.eps)
        return self._add_norm(x, residual, self.weight, self.eps)

    def reference(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """`forward` in plain torch, whatever kernels were chosen: the kernels' oracle."""
        if residual is None:
            return rms_norm_reference(x, self.weight, self.eps)
        return add_rms_norm_reference(x, residual, self.weight, self.eps)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The reference of `edgemoe.kernels.norm_rope.rms_norm`."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference of `edgemoe.kernels.norm_rope.add_rms_norm`: (norm(x + residual), x + residual)."""
    h = x + residual
    return rms_norm_reference(h, weight, eps), h
