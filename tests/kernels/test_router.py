"""The fused router (`edgemoe.kernels.router`, Triton's interpreter on CPU) against `edgemoe.moe.router.route` and
`SparseMoE._routed`'s padding-row substitution, on fresh random inputs in float32 and bf16.

- The gate GEMV (`gate_logits`) against the float64 product, within fp32 accumulation and one rounding to the
  output dtype (`logits_error_bound`), over several expert blocks (the last one partial), one and more tokens,
  hidden sizes that need one or more steps, masked or not; every output element written.
- Routing alone (`route_logits`), on logits with distinct values: ids equal to `route`'s; weights bitwise equal to
  `kernel_order_route` (the kernel's order of operations in numpy, i.e. torch's CUDA order with the interpreter's
  exp), and within 4 ulps (float32) / 1 ulp (bf16) of `route`'s, whose CPU softmax has another exp and multiplies
  by 1 / sum.
- Ties (equal logits): the lower expert first, which torch.topk does not promise (its CPU order differs).
- The fused path: bitwise equal to `route_logits` on the logits it reports, those bitwise `gate_logits`'s; ids
  equal to `route(F.linear(x, w))`'s on logits built with clear margins.
- Padding rows: row 0's ids, their own weights and logits, bitwise."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from edgemoe.kernels.router import fused_route, gate_logits, route_logits  # noqa: E402
from edgemoe.moe.router import route  # noqa: E402
from tests.kernels import interpreter_only  # noqa: E402

pytestmark = interpreter_only

DTYPES = [torch.float32, torch.bfloat16]
ULPS = {torch.float32: 4, torch.bfloat16: 1}  # from `route` (CPU softmax); kernel_order_route: 0
GEOMETRIES = [(8, 1), (8, 2), (60, 4), (128, 8)]  # (experts, top_k)
# the weights against route(F.linear(x, w))'s, whose logits may be an ulp (bf16) or an fp32 rounding apart
WEIGHT_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=2**-7, atol=1e-6)}


def ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in units in the last place between same-dtype tensors of one sign."""
    ints = torch.int32 if a.dtype == torch.float32 else torch.int16
    return int((a.view(ints).long() - b.view(ints).long()).abs().max()) if a.numel() else 0


def logits_error_bound(x: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(x @ w.T in float64, the most logits in `dtype` computed with fp32 accumulation may differ from it).

    Accumulation: a sum whose partial sums each pass through at most d roundings (any order: in turn, a tree, a
    thread's elements then shuffles then warps) errs by at most gamma_d = d u / (1 - d u), u = 2^-24, times
    sum |x_i w_i| (Higham, Accuracy and Stability of Numerical Algorithms, 3.1); products of 16-bit floats are
    exact in fp32, fp32 products (or FMAs) add one rounding. 2^-16 covers d < 255; the kernel's depth is a few steps
    over hidden + a thread's elements of a tile (<= 64) + 5 shuffles + the warps (<= 8), numpy's pairwise sum less.
    Then one rounding of that fp32 sum s to `dtype`: half an ulp at |s|, <= eps / 2 * |s| <= eps / 2 * (|exact| +
    accumulation): relative to |s| rather than |exact|, so that a sum rounded across a power of two, where the ulp
    doubles, is covered; plus half the subnormal spacing (fp16 near 0). F.linear is no oracle: cuBLAS's bf16 GEMV
    may reduce in another precision (split-K), one bf16 ulp apart from the kernel at times."""
    exact = x.double() @ w.double().T  # float64: its own error ~H 2^-53 relative, far below the bound
    accumulation = 2**-16 * (x.double().abs() @ w.double().abs().T)
    f = torch.finfo(dtype)
    return exact, accumulation + f.eps / 2 * (exact.abs() + accumulation) + f.tiny * f.eps / 2


def assert_logits_close(logits: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    exact, bound = logits_error_bound(x, w, logits.dtype)
    err = (logits.double() - exact).abs()
    assert (err <= bound).all(), f"logits off the float64 product by up to {(err / bound).max().item():.2f}x the bound"


def kernel_order_route(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`route` in the kernel's order, float32 throughout: numpy's exp (the interpreter's), torch's CUDA warp-softmax
    sum (lanes of min(E', 32) add their elements in turn, then a butterfly; E' = next power of two), division,
    a stable descending top-k, the k weights summed in order."""
    x = logits.float().numpy()
    tokens, experts = x.shape
    width = 1 << (experts - 1).bit_length()
    lanes = min(width, 32)
    ex = np.zeros((tokens, width), np.float32)
    ex[:, :experts] = np.exp(x - x.max(1, keepdims=True))
    s = np.zeros((tokens, lanes), np.float32)
    for it in range(width // lanes):
        s = s + ex[:, it * lanes : (it + 1) * lanes]
    while s.shape[1] > 1:
        n = s.shape[1] // 2
        s = s[:, :n] + s[:, n:]
    probs = ex[:, :experts] / s
    ids = np.argsort(-probs, axis=1, kind="stable")[:, :top_k]
    weights = np.take_along_axis(probs, ids, 1)
    if normalize:
        total = np.zeros(tokens, np.float32)
        for i in range(top_k):
            total = total + weights[:, i]
        weights = weights / total[:, None]
    return torch.from_numpy(ids).long(), torch.from_numpy(weights).to(logits.dtype)


def distinct_logits(tokens: int, experts: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """Rows of distinct values, exact in bf16: a random order of a grid of 1/8 steps."""
    ranks = torch.stack([torch.randperm(experts, generator=g) for _ in range(tokens)])
    return ((ranks - experts / 2) / 8).to(dtype)


def stable_ids(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    probs = torch.softmax(logits.float(), dim=-1)
    return torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :top_k]


@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize(
    "experts, hidden, block_e",
    [
        (60, 256, None),  # the default choice: one expert a program here, hidden in one unmasked step
        (60, 200, 8),  # 8 blocks, the last of 4 experts; hidden masked
        (100, 200, 64),  # 2 blocks, the last of 36; hidden in two steps of 128, the second masked
        (48, 512, 32),  # 2 blocks, the last of 16; two unmasked steps of 256
    ],
    ids=str,
)
@pytest.mark.parametrize("dtype", [*DTYPES, torch.float16], ids=str)
def test_gate_logits_within_bound_of_float64(
    dtype: torch.dtype, experts: int, hidden: int, block_e: int | None, tokens: int
) -> None:
    g = torch.Generator().manual_seed(experts + hidden + tokens)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w = (2 * torch.randn(experts, hidden, generator=g) / hidden**0.5).to(dtype)  # logits of a few units
    out = torch.full((tokens, experts), float("nan"), dtype=dtype)
    assert gate_logits(x, w, out, block_e) is out
    assert_logits_close(out, x, w)  # no NaN left: every element written
    assert torch.equal(gate_logits(x, w, block_e=block_e), out)


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("experts, top_k", GEOMETRIES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_routing_matches_route(dtype: torch.dtype, experts: int, top_k: int, normalize: bool) -> None:
    g = torch.Generator().manual_seed(experts * 10 + top_k)
    scale = 3 if normalize else 0.5  # peaked and flat distributions
    shuffled = distinct_logits(3, experts, dtype, g)
    gaussian = (scale * torch.randn(3, experts, generator=g)).to(dtype)  # distinct for float32; bf16 may tie
    for logits in (shuffled, gaussian):
        ids, weights = route_logits(logits, top_k, normalize)
        ref_ids, ref_weights = route(logits, top_k, normalize)
        assert ids.dtype == torch.long and weights.dtype == dtype and ids.shape == weights.shape == (3, top_k)
        assert torch.equal(ids, stable_ids(logits, top_k))
        if logits is shuffled or dtype == torch.float32:
            assert torch.equal(ids, ref_ids)
        ordered_ids, ordered_weights = kernel_order_route(logits, top_k, normalize)
        assert torch.equal(ids, ordered_ids) and torch.equal(weights, ordered_weights)
        assert ulps(weights, ref_weights) <= ULPS[dtype]  # ties hold equal weights: any order compares


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_ties_take_the_lower_expert(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(5)
    logits = torch.randint(0, 3, (4, 60), generator=g).to(dtype)  # 20-odd experts share each value
    logits[1] = 1.0  # one value for all: experts 0..k-1
    logits[2, 40:] = 7.0  # a tie across the top-k boundary: the lowest of them
    for top_k, normalize in [(1, False), (4, True), (8, False)]:
        ids, weights = route_logits(logits, top_k, normalize)
        assert torch.equal(ids, stable_ids(logits, top_k))
        assert torch.equal(ids[1], torch.arange(top_k)) and torch.equal(ids[2], torch.arange(40, 40 + top_k))
        ordered = kernel_order_route(logits, top_k, normalize)
        assert torch.equal(ids, ordered[0]) and torch.equal(weights, ordered[1])
        assert ulps(weights, route(logits, top_k, normalize)[1]) <= ULPS[dtype]
    # torch.topk on the CPU returns ties in another order: the kernel is held to the stable order, not to topk's
    tied = torch.tensor([[0.1, 0.3, 0.3, 0.2, 0.3, 0.1, 0.1, 0.1]]).log()
    assert torch.equal(route_logits(tied, 4, False)[0], torch.tensor([[1, 2, 4, 3]]))


def separated_inputs(
    tokens: int, hidden: int, experts: int, dtype: torch.dtype, g: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [tokens, hidden] with orthonormal rows and w [experts, hidden] with x @ w.T = target: each row's top 9
    logits (up to 8 chosen and the next) 1/2 apart, far more than the GEMV's rounding: every top-k set and order is
    clear."""
    target = torch.rand(tokens, experts, generator=g) * 2  # [tokens, experts] in [0, 2)
    top = min(9, experts)
    for row in target:
        row[torch.randperm(experts, generator=g)[:top]] = 3 + 0.5 * torch.arange(float(top))
    q, _ = torch.linalg.qr(torch.randn(hidden, tokens, generator=g))  # [hidden, tokens] orthonormal columns
    x = q.T  # [tokens, hidden]
    return x.to(dtype), (target.T @ x).to(dtype), target


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("experts, top_k", GEOMETRIES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_matches_route_of_linear(dtype: torch.dtype, experts: int, top_k: int, normalize: bool) -> None:
    g = torch.Generator().manual_seed(100 + experts + top_k)
    hidden = 200  # not a multiple of the hidden block: a masked last step
    x, w, _ = separated_inputs(3, hidden, experts, dtype, g)
    logits = torch.empty(3, experts, dtype=dtype)
    ids, weights = fused_route(x, w, top_k, normalize, logits_out=logits)
    # the routing part on the kernel's own logits: bitwise
    same = route_logits(logits, top_k, normalize)
    assert torch.equal(ids, same[0]) and torch.equal(weights, same[1])
    assert torch.equal(logits, gate_logits(x, w))
    assert_logits_close(logits, x, w)
    ref_ids, ref_weights = route(F.linear(x, w), top_k, normalize)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, **WEIGHT_TOL[dtype])


def test_fused_even_hidden_and_one_token() -> None:
    # hidden a multiple of the block (no mask on the hidden axis), one token, strided x
    g = torch.Generator().manual_seed(7)
    x, w, target = separated_inputs(1, 256, 128, torch.bfloat16, g)
    wide = torch.zeros(1, 512, dtype=torch.bfloat16)
    wide[:, ::2] = x
    ids, weights = fused_route(wide[:, ::2], w, 8, True)
    assert torch.equal(ids, target.topk(8).indices)
    assert torch.equal(weights, route(F.linear(x, w), 8, True)[1])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mask", [[True, False, True], [True, False, False], [False, True, False]], ids=str)
def test_padding_rows_take_row_zero_experts(mask: list[bool], dtype: torch.dtype) -> None:
    """SparseMoE._routed: `torch.where(valid[:, None], ids, ids[:1])`; the weights are each row's own."""
    g = torch.Generator().manual_seed(sum(mask) + 11)
    valid = torch.tensor(mask)
    x, w, _ = separated_inputs(3, 200, 60, dtype, g)
    for normalize in (False, True):
        ids, weights = fused_route(x, w, 4, normalize)
        logits = torch.empty(3, 60, dtype=dtype)
        padded = fused_route(x, w, 4, normalize, valid, logits_out=logits)
        assert torch.equal(padded[0], torch.where(valid[:, None], ids, ids[:1]))
        assert torch.equal(padded[1], weights)
        assert torch.equal(logits, gate_logits(x, w))  # padding rows' own logits
        logits = torch.randn(3, 60, generator=g).to(dtype)
        ids, weights = route_logits(logits, 4, normalize)
        padded = route_logits(logits, 4, normalize, valid)
        assert torch.equal(padded[0], torch.where(valid[:, None], ids, ids[:1]))
        assert torch.equal(padded[1], weights)


def test_rejects_bad_arguments() -> None:
    x, w = torch.randn(2, 32), torch.randn(8, 32)
    with pytest.raises(ValueError):
        fused_route(x, w, 9, False)  # top_k > experts
    with pytest.raises(ValueError):
        fused_route(x, w.to(torch.bfloat16), 2, False)
    with pytest.raises(ValueError):
        fused_route(x, w, 2, False, torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError):
        fused_route(x, w, 2, False, logits_out=torch.empty(8, 2))  # transposed
    ids, weights = fused_route(x[:0], w, 2, False)
    assert ids.shape == weights.shape == (0, 2)
