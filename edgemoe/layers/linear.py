from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class DecodeLinear(nn.Linear):
    """nn.Linear (same parameters and names: checkpoints load unchanged) whose forward on one row on CUDA, batch-1
    decode, runs the Triton GEMV `edgemoe.kernels.dense_gemv.gemv` instead of cuBLAS's `F.linear`: 1.07-1.30x
    faster on the qkv, o and shared-expert down projections measured (`benchmarks/dense_gemv.py`). Only one row: at 4
    rows it lost to cuBLAS on qkv (0.81x), so batches, prefill and the CPU keep `F.linear`. Inference only (the GEMV
    has no backward)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and x.dim() == 2 and x.shape[0] == 1:
            from edgemoe.kernels.dense_gemv import gemv  # CPU-only machines lack triton

            return gemv(x.contiguous(), self.weight, self.bias)  # [1, out_features]
        return F.linear(x, self.weight, self.bias)
