"""Without CUDA, the Triton kernels run under Triton's interpreter (numpy): the variable must be set before
`triton.jit` decorates them, i.e. before any edgemoe.kernels module is imported."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
