"""The residual add and RMSNorm fused into the router's gate GEMV (`edgemoe.kernels.router.norm_route`, Triton's
interpreter on CPU) against the two launches it replaces, on fresh random inputs in float32 and bf16:

- (xn, h) bitwise `add_rms_norm`'s (the same arithmetic), the inputs only read;
- the logits within fp32 accumulation and one rounding of the float64 product of xn with the gate
  (`logits_error_bound`), and the routing bitwise `route_logits` on those logits;
- padding rows (`valid`): row 0's ids, their own weights, as `fused_route`;
- hidden sizes off powers of two, one and more tokens, strided views; bad arguments rejected."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from edgemoe.kernels.norm_rope import add_rms_norm  # noqa: E402
from edgemoe.kernels.router import MAX_NORM_HIDDEN, norm_route, route_logits  # noqa: E402
from tests.kernels import interpreter_only  # noqa: E402
from tests.kernels.test_router import assert_logits_close  # noqa: E402

pytestmark = interpreter_only

EPS = 1e-6
DTYPES = [torch.float32, torch.bfloat16]


def inputs(tokens: int, hidden: int, experts: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = 0.5 * torch.randn(tokens, hidden, generator=g)  # an attention output
    residual = 3 * torch.randn(tokens, hidden, generator=g)
    norm_weight = 1 + 0.5 * torch.randn(hidden, generator=g)  # around one, as trained norms are, but not ones
    gate = torch.randn(experts, hidden, generator=g) / hidden**0.5
    return tuple(t.to(dtype) for t in (x, residual, norm_weight, gate))


def check(x, residual, norm_weight, gate, top_k: int, normalize: bool, valid=None) -> None:
    before = [t.clone() for t in (x, residual, norm_weight, gate)]
    logits = torch.empty(x.shape[0], gate.shape[0], dtype=x.dtype)
    xn, h, ids, weights = norm_route(x, residual, norm_weight, EPS, gate, top_k, normalize, valid, logits_out=logits)
    assert all(torch.equal(a, b) for a, b in zip(before, (x, residual, norm_weight, gate)))  # inputs only read
    ref_xn, ref_h = add_rms_norm(x, residual, norm_weight, EPS)
    assert torch.equal(h, ref_h) and torch.equal(xn, ref_xn)
    assert_logits_close(logits, xn, gate)
    ref_ids, ref_weights = route_logits(logits, top_k, normalize, valid)
    assert torch.equal(ids, ref_ids) and torch.equal(weights, ref_weights)


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("tokens, hidden, experts, top_k", [(1, 256, 64, 8), (3, 200, 60, 4), (2, 1000, 16, 2)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_add_rms_norm_then_router(
    dtype: torch.dtype, tokens: int, hidden: int, experts: int, top_k: int, normalize: bool
) -> None:
    x, residual, norm_weight, gate = inputs(tokens, hidden, experts, dtype, seed=hidden + tokens)
    check(x, residual, norm_weight, gate, top_k, normalize)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_padding_rows_and_strided_views(dtype: torch.dtype) -> None:
    x, residual, norm_weight, gate = inputs(3, 200, 60, dtype, seed=5)
    wide_x, wide_r = torch.zeros(3, 400, dtype=dtype), torch.zeros(3, 400, dtype=dtype)
    wide_x[:, ::2], wide_r[:, 1::2] = x, residual
    check(wide_x[:, ::2], wide_r[:, 1::2], norm_weight, gate, 4, True, torch.tensor([True, False, True]))


def test_rejects_bad_arguments() -> None:
    x, residual, norm_weight, gate = inputs(2, 64, 8, torch.float32, seed=0)
    with pytest.raises(ValueError, match="one dtype"):
        norm_route(x, residual, norm_weight.bfloat16(), EPS, gate, 2, False)
    with pytest.raises(ValueError, match="do not fit"):
        norm_route(x, residual[:, :32], norm_weight, EPS, gate, 2, False)
    with pytest.raises(ValueError, match="one tile"):
        wide = torch.zeros(1, MAX_NORM_HIDDEN + 1)
        norm_route(wide, wide, wide[0], EPS, torch.zeros(8, MAX_NORM_HIDDEN + 1), 2, False)
    with pytest.raises(ValueError):
        norm_route(x, residual, norm_weight, EPS, gate, 9, False)  # top_k > experts
    xn, h, ids, weights = norm_route(x[:0], residual[:0], norm_weight, EPS, gate, 2, False)
    assert xn.shape == h.shape == (0, 64) and ids.shape == weights.shape == (0, 2)
