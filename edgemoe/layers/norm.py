from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, scaled in the input dtype (as Hugging Face's Llama-style norms). Normalises the
    last dim of any shape (per-head q/k norms pass [tokens, heads, head_dim]).

    With a `residual`, the pre-norm block's residual add comes first, in the same launch on CUDA:
    `norm(x, residual)` -> (norm(x + residual), x + residual)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if x.is_cuda:
            from edgemoe.kernels.norm_rope import add_rms_norm, rms_norm  # CPU-only machines lack triton

            if residual is None:
                return rms_norm(x, self.weight, self.eps)  # one launch instead of ~8
            return add_rms_norm(x, residual, self.weight, self.eps)  # and the add: one instead of ~9
        return self._forward_torch(x, residual)

    def _forward_torch(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        # the reference of the kernels (rms_norm; add_rms_norm with a residual)
        if residual is not None:
            x = residual = x + residual
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * h.to(dtype)
        return out if residual is None else (out, residual)
