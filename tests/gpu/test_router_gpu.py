"""The fused router (`edgemoe.kernels.router`) compiled on CUDA against `edgemoe.moe.router.route` on torch's CUDA
ops at real geometries in float32 and bf16; padding rows; no host synchronisation; replayed from a CUDA graph with
new inputs; `SparseMoE` dispatching to it in decode.

The routing part is held to `route` on the kernel's own logits: ids equal to a stable descending sort of torch's
probabilities (the kernel's ties go to the lower expert; torch.topk's tie order is unspecified), weights bitwise
equal without renormalisation (the kernel follows torch's CUDA softmax: PersistentSoftmax.cuh's summation order,
expf, IEEE division) and within top_k ulps with it (the k weights are summed in order, torch's reduction may pair them
otherwise). The GEMV (`gate_logits`) is held to the float64 product within fp32 accumulation and one rounding to the
output dtype (`logits_error_bound`), at real geometries and a large 4096 x 512 gate, over block sizes, not to cuBLAS's
F.linear (its bf16 GEMV may reduce otherwise: an ulp apart at times); ids equal to `route(F.linear(x, w))`'s on
logits built with clear margins."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from edgemoe.engine.cuda_graphs import capture_graph
from edgemoe.moe.router import route
from tests.gpu.sync_free import host_sync_forbidden
from tests.kernels.test_router import assert_logits_close

# name -> (hidden, experts, top_k)
GEOMETRIES = {
    "qwen3-30b-a3b": (2048, 128, 8),
    "qwen1.5-moe-a2.7b": (2048, 60, 4),
    "mixtral-8x7b": (4096, 8, 2),
}
LARGE = {"large-4096x512": (4096, 512, 10)}  # many expert blocks, the softmax over 512
# the weights against route(F.linear(x, w))'s, whose logits may be an ulp (bf16) or an fp32 rounding apart
WEIGHT_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=2**-7, atol=1e-6)}


def gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed)


def ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in units in the last place between same-dtype tensors of one sign."""
    ints = torch.int32 if a.dtype == torch.float32 else torch.int16
    return int((a.view(ints).long() - b.view(ints).long()).abs().max()) if a.numel() else 0


def stable_ids(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    probs = torch.softmax(logits.float(), dim=-1)
    return torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :top_k]


def random_inputs(tokens: int, hidden: int, experts: int, dtype: torch.dtype, g: torch.Generator) -> tuple:
    """Trained-router-like scales: logits of a few units, bf16 ties among them likely."""
    x = torch.randn(tokens, hidden, generator=g, device="cuda").to(dtype)
    w = (2 * torch.randn(experts, hidden, generator=g, device="cuda") / hidden**0.5).to(dtype)
    return x, w


def separated_inputs(tokens: int, hidden: int, experts: int, dtype: torch.dtype, g: torch.Generator) -> tuple:
    """x with orthonormal rows, w with x @ w.T = target whose top 9 per row are 1/2 apart: clear top-k sets."""
    target = 2 * torch.rand(tokens, experts, generator=g, device="cuda")
    top = min(9, experts)
    for row in target:
        row[torch.randperm(experts, generator=g, device="cuda")[:top]] = 3 + 0.5 * torch.arange(
            float(top), device="cuda"
        )
    q, _ = torch.linalg.qr(torch.randn(hidden, tokens, generator=g, device="cuda"))
    x = q.T.contiguous()  # [tokens, hidden]
    return x.to(dtype), (target.T @ x).to(dtype), target


def check_routing(ids: torch.Tensor, weights: torch.Tensor, logits: torch.Tensor, top_k: int, normalize: bool) -> None:
    """The kernel's routing on its own logits against torch's route on CUDA."""
    ref_ids, ref_weights = route(logits, top_k, normalize)
    assert ids.dtype == torch.long and weights.dtype == logits.dtype
    assert torch.equal(ids, stable_ids(logits, top_k))
    if normalize:
        assert ulps(weights, ref_weights) <= top_k  # each of the sum's k - 1 adds may round otherwise
    else:
        assert torch.equal(weights, ref_weights)  # torch's softmax order, expf, IEEE division


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("tokens", [1, 7, 64])
@pytest.mark.parametrize("name", [*GEOMETRIES, *LARGE])
def test_matches_route(name: str, tokens: int, dtype: torch.dtype, normalize: bool) -> None:
    from edgemoe.kernels.router import fused_route, gate_logits, route_logits

    hidden, experts, top_k = {**GEOMETRIES, **LARGE}[name]
    g = gen(tokens + 10 * normalize)
    x, w = random_inputs(tokens, hidden, experts, dtype, g)
    logits = torch.empty(tokens, experts, dtype=dtype, device="cuda")
    ids, weights = fused_route(x, w, top_k, normalize, logits_out=logits)
    same = route_logits(logits, top_k, normalize)
    assert torch.equal(ids, same[0]) and torch.equal(weights, same[1])  # one routing code path
    assert torch.equal(logits, gate_logits(x, w))
    assert_logits_close(logits, x, w)
    check_routing(ids, weights, logits, top_k, normalize)


@pytest.mark.parametrize("block_e", [None, 1, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("tokens", [1, 64])
@pytest.mark.parametrize("name", [*GEOMETRIES, *LARGE])
def test_gate_logits_within_bound_of_float64(name: str, tokens: int, dtype: torch.dtype, block_e: int | None) -> None:
    """The GEMV alone over block sizes (8: qwen1.5's 60 experts end in a partial block); every element written."""
    from edgemoe.kernels.router import gate_logits

    hidden, experts, _ = {**GEOMETRIES, **LARGE}[name]
    x, w = random_inputs(tokens, hidden, experts, dtype, gen(tokens + experts))
    out = torch.full((tokens, experts), float("nan"), dtype=dtype, device="cuda")
    assert gate_logits(x, w, out, block_e) is out
    assert_logits_close(out, x, w)  # NaN fails it


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(GEOMETRIES))
def test_ids_match_route_of_linear_with_clear_margins(name: str, dtype: torch.dtype) -> None:
    from edgemoe.kernels.router import fused_route

    hidden, experts, top_k = GEOMETRIES[name]
    x, w, target = separated_inputs(5, hidden, experts, dtype, gen(3))
    for normalize in (False, True):
        ids, weights = fused_route(x, w, top_k, normalize)
        ref_ids, ref_weights = route(F.linear(x, w), top_k, normalize)
        assert torch.equal(ids, ref_ids) and torch.equal(ids, target.topk(top_k).indices)
        torch.testing.assert_close(weights, ref_weights, **WEIGHT_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_ties_take_the_lower_expert(dtype: torch.dtype) -> None:
    from edgemoe.kernels.router import fused_route, route_logits

    logits = torch.randint(0, 3, (4, 128), generator=gen(4), device="cuda").to(dtype)
    logits[1] = 1.0
    logits[2, 40:] = 7.0
    for normalize in (False, True):
        ids, weights = route_logits(logits, 8, normalize)
        assert torch.equal(ids[1], torch.arange(8, device="cuda"))
        assert torch.equal(ids[2], torch.arange(40, 48, device="cuda"))
        check_routing(ids, weights, logits, 8, normalize)
    # through the GEMV: equal gate rows sum alike (same layout, same order), here the largest logits of both tokens
    x, w = random_inputs(2, 2048, 128, dtype, gen(5))
    w[63:] = ((x[0].float() + x[1].float()) / 16).to(dtype)
    logits = torch.empty(2, 128, dtype=dtype, device="cuda")
    ids, _ = fused_route(x, w, 8, True, logits_out=logits)
    assert (logits[:, 63:] == logits[:, 63:64]).all()
    assert torch.equal(ids, torch.arange(63, 71, device="cuda").expand(2, 8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mask", [[True, False, True, False], [True, True, True, False], [False, True, False, False]])
def test_padding_rows_take_row_zero_experts(mask: list[bool], dtype: torch.dtype) -> None:
    """`SparseMoE._routed`'s `torch.where(valid[:, None], ids, ids[:1])`; weights stay each row's own."""
    from edgemoe.kernels.router import fused_route

    hidden, experts, top_k = GEOMETRIES["qwen3-30b-a3b"]
    x, w = random_inputs(4, hidden, experts, dtype, gen(6))
    valid = torch.tensor(mask, device="cuda")
    for normalize in (False, True):
        ids, weights = fused_route(x, w, top_k, normalize)
        padded_ids, padded_weights = fused_route(x, w, top_k, normalize, valid)
        assert torch.equal(padded_ids, torch.where(valid[:, None], ids, ids[:1]))
        assert torch.equal(padded_weights, weights)


def test_no_host_sync_once_compiled() -> None:
    from edgemoe.kernels.router import fused_route, route_logits

    x, w = random_inputs(3, 2048, 128, torch.bfloat16, gen(7))
    valid = torch.tensor([True, True, False], device="cuda")
    logits = F.linear(x, w)
    fused_route(x, w, 8, True, valid)  # compiles (may sync)
    route_logits(logits, 8, True, valid)
    with torch.cuda.device(x.device), host_sync_forbidden():
        fused_route(x, w, 8, True, valid)
        fused_route(x, w, 8, True)
        route_logits(logits, 8, True, valid)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_graph_replays_new_inputs(dtype: torch.dtype) -> None:
    """Captured once over static x and valid, replayed with new hidden states and padding written into them."""
    from edgemoe.kernels.router import fused_route

    tokens, (hidden, experts, top_k) = 4, GEOMETRIES["qwen3-30b-a3b"]
    pool, w, _ = separated_inputs(16, hidden, experts, dtype, gen(8))  # 16 rows with clear margins under one w
    x = pool[:tokens].clone()
    valid = torch.ones(tokens, dtype=torch.bool, device="cuda")
    graph, (ids, weights) = capture_graph(lambda: fused_route(x, w, top_k, True, valid))
    for seed, n in [(9, 4), (10, 2), (11, 1)]:
        x.copy_(pool[torch.randperm(16, generator=gen(seed), device="cuda")[:tokens]])
        valid.copy_(torch.arange(tokens, device="cuda") < n)
        ids.fill_(-1)
        weights.fill_(float("nan"))
        graph.replay()
        eager = fused_route(x, w, top_k, True, valid)
        assert torch.equal(ids, eager[0]) and torch.equal(weights, eager[1])  # every element rewritten
        ref_ids, ref_weights = route(F.linear(x, w), top_k, True)
        assert torch.equal(ids, torch.where(valid[:, None], ref_ids, ref_ids[:1]))
        torch.testing.assert_close(weights, ref_weights, **WEIGHT_TOL[dtype])


def test_sparse_moe_decode_uses_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """`SparseMoE._routed` on CUDA: the fused route in decode, with the context's padding rows; torch in prefill."""
    import edgemoe.kernels.router as router
    from edgemoe.context import ForwardContext, set_context
    from edgemoe.layers.kernels import select_kernels
    from edgemoe.moe.layer import SparseMoE

    g = gen(12)
    layer = SparseMoE(256, 60, 4, 64, True, moe_layer=0).to(device="cuda", dtype=torch.bfloat16)
    for p in layer.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g, device="cuda") / p.shape[-1] ** 0.5)
    x = torch.randn(3, 256, generator=g, device="cuda").to(torch.bfloat16)
    valid = torch.tensor([True, True, False], device="cuda")
    calls = []
    fused = router.fused_route
    monkeypatch.setattr(router, "fused_route", lambda *a, **k: (calls.append(a), fused(*a, **k))[1])
    select_kernels(layer, torch.device("cuda"))  # picks the (counting) fused route, as the loader does
    empty = torch.empty(0, dtype=torch.long, device="cuda")
    try:
        with torch.inference_mode():
            set_context(ForwardContext(False, empty, empty, empty.view(0, 0), valid=valid))
            out = layer._routed(x)
            assert len(calls) == 1 and calls[0][4] is valid
            ids, weights = fused(x, layer.gate.weight, 4, True, valid)
            assert torch.equal(out, layer.experts(x, ids, weights))
            set_context(ForwardContext(True, empty, empty, empty.view(0, 0), query_lens=[3], context_lens_host=[3]))
            layer._routed(x)
            assert len(calls) == 1  # prefill routes in torch
    finally:
        set_context(None)
