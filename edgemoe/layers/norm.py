from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, scaled in the input dtype (as Hugging Face's Llama-style norms). Normalises the
    last dim of any shape (per-head q/k norms pass [tokens, heads, head_dim])."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from edgemoe.kernels.norm_rope import rms_norm  # CPU-only machines lack triton

            return rms_norm(x, self.weight, self.eps)  # one launch instead of ~8
        return self._forward_torch(x)

    def _forward_torch(self, x: torch.Tensor) -> torch.Tensor:
        # the reference of the kernel
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)
