"""The residual add and RMSNorm fused into the dense GEMV after them (`edgemoe.kernels.dense_gemv.norm_gemv`,
decode's qkv projection; Triton's interpreter on CPU) against the two launches it replaces, on fresh random inputs
in float32 and bf16: h bitwise `add_rms_norm`'s; y bitwise `gemv` of `add_rms_norm`'s normalised row (the same
arithmetic, at add_rms_norm's warps) and within fp32 accumulation of the float64 product; bias or none, hidden
sizes off powers of two, strided views; the inputs only read; bad arguments rejected with the reason."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from edgemoe.kernels.dense_gemv import MAX_NORM_HIDDEN, gemv, norm_gemv, norm_warps  # noqa: E402
from edgemoe.kernels.norm_rope import add_rms_norm  # noqa: E402
from tests.kernels import interpreter_only  # noqa: E402
from tests.kernels.test_dense_gemv import assert_within_bound  # noqa: E402

pytestmark = interpreter_only

EPS = 1e-6
DTYPES = [torch.float32, torch.bfloat16]


def inputs(hidden: int, n: int, dtype: torch.dtype, bias: bool, seed: int) -> tuple:
    g = torch.Generator().manual_seed(seed)
    x = 0.5 * torch.randn(1, hidden, generator=g)  # the last block's output
    residual = 3 * torch.randn(1, hidden, generator=g)
    norm_weight = 1 + 0.5 * torch.randn(hidden, generator=g)  # around one, as trained norms are, but not ones
    weight = torch.randn(n, hidden, generator=g) / hidden**0.5
    b = torch.randn(n, generator=g) if bias else None
    return tuple(None if t is None else t.to(dtype) for t in (x, residual, norm_weight, weight, b))


def check(x, residual, norm_weight, weight, bias) -> None:
    before = [t.clone() for t in (x, residual, norm_weight, weight)]
    y, h = norm_gemv(x, residual, norm_weight, EPS, weight, bias)
    assert all(torch.equal(a, b) for a, b in zip(before, (x, residual, norm_weight, weight)))  # inputs only read
    xn, ref_h = add_rms_norm(x, residual, norm_weight, EPS)
    assert h.dtype == ref_h.dtype and torch.equal(h, ref_h)
    assert torch.equal(y, gemv(xn, weight, bias, warps=norm_warps(x.shape[1])))
    assert_within_bound(y, xn, weight, bias)


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
# off the block sizes; 200: 1 warp; 4100: a long row, which both kernels must step through alike (`pick_steps`)
@pytest.mark.parametrize("hidden, n", [(2048, 40), (1500, 37), (200, 24), (4100, 12)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_add_rms_norm_then_gemv(dtype: torch.dtype, hidden: int, n: int, bias: bool) -> None:
    check(*inputs(hidden, n, dtype, bias, seed=hidden + n + bias))


def test_strided_views() -> None:
    x, residual, norm_weight, weight, bias = inputs(1500, 37, torch.bfloat16, True, seed=3)
    wide_x, wide_r = torch.zeros(1, 3000, dtype=x.dtype), torch.zeros(1, 3000, dtype=x.dtype)
    wide_x[:, ::2], wide_r[:, 1::2] = x, residual
    wide_w = torch.zeros(37, 1600, dtype=x.dtype)
    wide_w[:, :1500] = weight
    check(wide_x[:, ::2], wide_r[:, 1::2], norm_weight, wide_w[:, :1500], bias)


def test_warps_are_add_rms_norms() -> None:
    assert norm_warps(2048) == 4 and norm_warps(200) == 1 and norm_warps(4096) == 8 and norm_warps(8192) == 16


def test_rejects_bad_arguments() -> None:
    x, residual, norm_weight, weight, bias = inputs(1500, 37, torch.float32, True, seed=4)
    bad = {
        "one token": (torch.cat([x, x]), torch.cat([residual, residual]), norm_weight, weight, None),
        "norm weight [K]": (x, residual, norm_weight[:-1], weight, None),
        "needs weight [N, 1500]": (x, residual, norm_weight, weight[:, :-1], None),
        "one float dtype": (x, residual, norm_weight.bfloat16(), weight, None),
        "bias must be [37]": (x, residual, norm_weight, weight, bias[:-1]),
    }
    for message, args in bad.items():
        with pytest.raises(ValueError, match=message.replace("[", r"\[")):
            norm_gemv(*args[:3], EPS, *args[3:])
    wide = torch.zeros(1, MAX_NORM_HIDDEN + 1)
    with pytest.raises(ValueError, match="in registers"):
        norm_gemv(wide, wide, wide[0], EPS, torch.zeros(8, MAX_NORM_HIDDEN + 1))
