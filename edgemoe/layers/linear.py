from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from edgemoe.context import get_context


class DecodeLinear(nn.Linear):
    """nn.Linear (same parameters and names: checkpoints load unchanged) whose forward in a decode step runs the Triton
    GEMV `edgemoe.kernels.dense_gemv.gemv` where kernels are chosen: each token's row is computed the same way
    whatever the batch (batch invariance; cuBLAS picks its kernel by the row count). Faster than cuBLAS at one
    token, 0.8x at four (docs/findings.md, "Dense GEMV"); prefill keeps `F.linear`. Inference only."""

    _gemv = None  # the decode kernel, once `use_kernels` chose it

    def use_kernels(self, device: torch.device) -> None:
        from edgemoe.kernels.dense_gemv import gemv

        self._gemv = gemv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._gemv is not None and x.dim() == 2 and (x.shape[0] == 1 or not get_context().is_prefill):
            return self._gemv(x.contiguous(), self.weight, self.bias)  # [tokens, out_features]
        return F.linear(x, self.weight, self.bias)
