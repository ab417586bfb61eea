import pytest
import torch

# A file of Triton-interpreter tests: its kernels take CPU tensors, which only the interpreter (set up when there is
# no CUDA, tests/conftest.py) accepts. On a CUDA machine tests/gpu runs those kernels, at real shapes.
interpreter_only = pytest.mark.skipif(
    torch.cuda.is_available(), reason="Triton-interpreter tests (CPU tensors); on CUDA see tests/gpu"
)
