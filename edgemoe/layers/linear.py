from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class DecodeLinear(nn.Linear):
    """nn.Linear (same parameters and names: checkpoints load unchanged) whose forward on one row, batch-1 decode, runs
    the Triton GEMV `edgemoe.kernels.dense_gemv.gemv` where kernels are chosen (faster than cuBLAS at one token;
    at 4 rows it lost, so batches and prefill keep `F.linear`: docs/findings.md, "Dense GEMV"). Inference only."""

    _gemv = None  # the one-row kernel, once `use_kernels` chose it

    def use_kernels(self, device: torch.device) -> None:
        from edgemoe.kernels.dense_gemv import gemv

        self._gemv = gemv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._gemv is not None and x.dim() == 2 and x.shape[0] == 1:
            return self._gemv(x.contiguous(), self.weight, self.bias)  # [1, out_features]
        return F.linear(x, self.weight, self.bias)
