"""The dense decode GEMV (`edgemoe.kernels.dense_gemv.gemv`) against a float64 `F.linear` on fresh random inputs:
bf16 and float32, with and without bias, 1-9 tokens, shapes off the block sizes; a row the same whatever the batch;
bad inputs; and `DecodeLinear`, which on CPU must be nn.Linear exactly. Without CUDA under Triton's interpreter
(tests/conftest.py): small shapes."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("triton")

from edgemoe.kernels.dense_gemv import gemv, pick_block_n, pick_steps  # noqa: E402
from edgemoe.layers.linear import DecodeLinear  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def inputs(tokens: int, n: int, k: int, dtype: torch.dtype, bias: bool, seed: int, device: str = DEVICE) -> tuple:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, k, generator=g)
    w = torch.randn(n, k, generator=g) / k**0.5
    b = torch.randn(n, generator=g) if bias else None
    return tuple(None if t is None else t.to(device, dtype) for t in (x, w, b))


def error_bound(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, dtype: torch.dtype) -> tuple:
    """-> (exact float64 result, bound on |y - exact|) for y = x @ w.T + b with fp32 accumulation, rounded once to
    `dtype`: u |exact| + (1 + u) gamma (|x| @ |w|.T + |b|). The fp32 sum's error is at most gamma = (K + 2) u32 /
    (1 - (K + 2) u32) of the sum of |terms|, u32 = 2^-24 (the products, exact for 16-bit inputs; the K - 1 adds and
    the bias add, in any order); the rounding adds u |sum| (u = 2^-8 bf16, 2^-11 float16, 2^-24 float32). The
    float64 reference's own error, ~2^-53 of the same sum, is negligible."""
    k, u32 = x.shape[1], 2.0**-24
    u = torch.finfo(dtype).eps / 2
    gamma = (k + 2) * u32 / (1 - (k + 2) * u32)
    x64, w64, b64 = x.double(), w.double(), None if b is None else b.double()
    exact = F.linear(x64, w64, b64)
    magnitude = F.linear(x64.abs(), w64.abs(), None if b64 is None else b64.abs())
    return exact, u * exact.abs() + (1 + u) * gamma * magnitude


def assert_within_bound(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    assert y.dtype == x.dtype and y.shape == (x.shape[0], w.shape[0])
    exact, bound = error_bound(x, w, b, y.dtype)
    err = (y.double() - exact).abs()
    assert torch.isfinite(y).all() and (err <= bound).all(), f"max excess {(err - bound).max().item():.3g}"


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("tokens", [1, 2, 3, 4, 5, 9])
def test_matches_float64_off_the_blocks(tokens: int, dtype: torch.dtype, bias: bool) -> None:
    x, w, b = inputs(tokens, 37, 300, dtype, bias, seed=tokens)  # N, K not multiples of BLOCK_N, BLOCK_K
    assert_within_bound(gemv(x, w, b), x, w, b)


@pytest.mark.parametrize("dtype, tokens, bias", [(torch.bfloat16, 1, False), (torch.bfloat16, 4, True),
                                                 (torch.float32, 1, True)], ids=str)  # fmt: skip
def test_matches_float64_realistic(dtype: torch.dtype, tokens: int, bias: bool) -> None:
    x, w, b = inputs(tokens, 256, 512, dtype, bias, seed=10 + tokens)
    assert_within_bound(gemv(x, w, b), x, w, b)


def test_other_configs_float16_and_views() -> None:
    """The sweep's keywords (8 rows a program, 128-wide steps, no pipelining), float16, and row-strided views."""
    x, w, b = inputs(3, 37, 300, torch.float16, True, seed=20)
    assert_within_bound(gemv(x, w, b, block_n=8, block_k=128, warps=8, stages=1), x, w, b)
    wide_x, wide_w, _ = inputs(2, 40, 320, torch.bfloat16, False, seed=21)
    x, w = wide_x[:, :300], wide_w[:37, :300]  # rows longer than K, as slices of wider tensors
    assert_within_bound(gemv(x, w), x, w, None)
    assert pick_block_n(2048) == pick_block_n(4096) == 4 and pick_block_n(5120) == pick_block_n(6144) == 8
    assert pick_steps(2048) == pick_steps(4095) == (256, 4) and pick_steps(4096) == pick_steps(5632) == (512, 3)


def test_long_rows_take_wide_steps() -> None:
    """Rows of 4096 or more run 512-column steps (`pick_steps`), past the end of K too (4100 = 8 steps + 4)."""
    for k in (4096, 4100):
        x, w, b = inputs(1, 6, k, torch.bfloat16, True, seed=k)
        assert_within_bound(gemv(x, w, b), x, w, b)


def test_a_row_does_not_depend_on_the_batch() -> None:
    """Batch invariance: each token's row bitwise the same alone and among 2-9 tokens (one group of TOKEN_GROUP
    padded, several groups, a partial last group)."""
    x, w, b = inputs(9, 37, 300, torch.bfloat16, True, seed=40)
    alone = torch.cat([gemv(x[i : i + 1], w, b) for i in range(9)])
    for tokens in range(2, 10):
        assert torch.equal(gemv(x[:tokens], w, b), alone[:tokens]), tokens


def test_no_rows() -> None:
    x, w, _ = inputs(0, 37, 300, torch.bfloat16, False, seed=0)
    assert gemv(x, w).shape == (0, 37)


def test_bad_inputs_raise() -> None:
    x, w, b = inputs(1, 37, 300, torch.bfloat16, True, seed=30)
    bad = {
        "x [T, K]": (x[0], w, None),
        "weight [N, K]": (x, w[:, :299], None),
        "bfloat16": (x.double(), w.double(), None),
        "alike": (x, w.float(), None),
        "bias must be": (x, w, b[:36]),
        "contiguous in K": (x, w.t().contiguous().t(), None),
        "powers of two": (x, w, None, 6),
    }
    for message, (xx, ww, bb, *block_n) in bad.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            gemv(xx, ww, bb, block_n=block_n[0] if block_n else None)
    for config in ({"block_k": 0}, {"stages": 0}, {"block_n": 0}, {"warps": 0}):  # 0 is no default
        with pytest.raises(ValueError, match="powers of two"):
            gemv(x, w, b, **config)


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_decode_linear_on_cpu_is_nn_linear(dtype: torch.dtype, bias: bool) -> None:
    """Same parameters and names (checkpoints load unchanged); on CPU the same F.linear, bitwise, for any rows."""
    torch.manual_seed(0)
    ref = nn.Linear(300, 37, bias=bias).to(dtype)
    layer = DecodeLinear(300, 37, bias=bias).to(dtype)
    layer.load_state_dict(ref.state_dict())
    assert isinstance(layer, nn.Linear) and layer.state_dict().keys() == ref.state_dict().keys()
    for rows in (1, 4):
        x = torch.randn(rows, 300, generator=torch.Generator().manual_seed(rows)).to(dtype)
        assert torch.equal(layer(x), ref(x))
