"""The residual add and RMSNorm fused into the router's gate GEMV (`edgemoe.kernels.router.norm_route`) compiled on
CUDA, at real geometries in bf16 and float32, against the two launches it replaces (`add_rms_norm`, then
`fused_route`): h bitwise torch's add; xn `add_rms_norm`'s up to the order of the sum of squares (the reference's own
bound against torch, tests/kernels/test_add_rms_norm.py); logits within fp32 accumulation of the float64 product
with xn; the routing bitwise `route_logits` on those logits. No host synchronisation once compiled; replays of a CUDA
graph with new inputs equal eager runs bitwise; `SparseMoE.add_norm_forward` (what `DecoderLayer` runs in decode)
equals the separate norm, then the block."""

from __future__ import annotations

import pytest
import torch

from edgemoe.engine.cuda_graphs import capture_graph
from tests.gpu.sync_free import host_sync_forbidden
from tests.kernels.test_add_rms_norm import assert_close_to_reference
from tests.kernels.test_router import assert_logits_close

EPS = 1e-6
GEOMETRIES = {"qwen3-30b-a3b": (2048, 128, 8), "qwen1.5-moe-a2.7b": (2048, 60, 4), "mixtral-8x7b": (4096, 8, 2)}


def inputs(tokens: int, hidden: int, experts: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = 0.5 * torch.randn(tokens, hidden, generator=g, device="cuda")
    residual = 3 * torch.randn(tokens, hidden, generator=g, device="cuda")
    norm_weight = 1 + 0.5 * torch.randn(hidden, generator=g, device="cuda")
    gate = torch.randn(experts, hidden, generator=g, device="cuda") / hidden**0.5
    return tuple(t.to(dtype) for t in (x, residual, norm_weight, gate))


@pytest.mark.parametrize("tokens", [1, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("name", list(GEOMETRIES))
def test_matches_add_rms_norm_then_router(name: str, dtype: torch.dtype, tokens: int) -> None:
    from edgemoe.kernels.norm_rope import add_rms_norm
    from edgemoe.kernels.router import norm_route, route_logits

    hidden, experts, top_k = GEOMETRIES[name]
    x, residual, norm_weight, gate = inputs(tokens, hidden, experts, dtype, seed=tokens)
    valid = torch.arange(tokens, device="cuda") < max(1, tokens - 1)  # a padding row at 4 tokens
    logits = torch.empty(tokens, experts, dtype=dtype, device="cuda")
    xn, h, ids, weights = norm_route(x, residual, norm_weight, EPS, gate, top_k, True, valid, logits_out=logits)
    ref_xn, ref_h = add_rms_norm(x, residual, norm_weight, EPS)
    assert torch.equal(h, ref_h)
    assert_close_to_reference(xn, ref_xn, dtype)
    assert_logits_close(logits, xn, gate)
    ref_ids, ref_weights = route_logits(logits, top_k, True, valid)
    assert torch.equal(ids, ref_ids) and torch.equal(weights, ref_weights)


def test_no_host_sync_and_graph_replays() -> None:
    from edgemoe.kernels.router import norm_route

    hidden, experts, top_k = GEOMETRIES["qwen3-30b-a3b"]
    x, residual, norm_weight, gate = inputs(1, hidden, experts, torch.bfloat16, seed=9)
    valid = torch.ones(1, dtype=torch.bool, device="cuda")
    norm_route(x, residual, norm_weight, EPS, gate, top_k, True, valid)  # compiles (may sync)
    with torch.cuda.device(x.device), host_sync_forbidden():
        norm_route(x, residual, norm_weight, EPS, gate, top_k, True, valid)
    graph, outs = capture_graph(lambda: norm_route(x, residual, norm_weight, EPS, gate, top_k, True, valid))
    for seed in (10, 11):
        new = inputs(1, hidden, experts, torch.bfloat16, seed=seed)
        x.copy_(new[0])
        residual.copy_(new[1])
        for t in outs:
            t.fill_(-1)
        graph.replay()
        eager = norm_route(x, residual, norm_weight, EPS, gate, top_k, True, valid)
        assert all(torch.equal(a, b) for a, b in zip(outs, eager))


def test_sparse_moe_fuses_the_norm_in_decode_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """`SparseMoE.add_norm_forward` on CUDA runs `norm_route` and the block on its outputs, bitwise; its norm is the
    separate add + norm's up to the order of the sum; `fuses_norm` (DecoderLayer's test) holds in decode only, for
    one dtype only."""
    import edgemoe.kernels.router as router
    from edgemoe.config import ModelConfig
    from edgemoe.context import ForwardContext, set_context
    from edgemoe.layers.kernels import select_kernels
    from edgemoe.layers.rotary import RotaryEmbedding
    from edgemoe.models.qwen3_moe import Qwen3MoeDecoderLayer

    cfg = ModelConfig(
        model_type="qwen3_moe", vocab_size=64, hidden_size=256, num_layers=1, num_heads=4, num_kv_heads=4,
        head_dim=64, intermediate_size=512, num_experts=60, top_k=4, moe_intermediate_size=64, moe_layers=(True,),
        norm_topk_prob=True,
    )  # fmt: skip
    layer = Qwen3MoeDecoderLayer(cfg, 0, RotaryEmbedding(64, 128, 10000.0)).to(device="cuda", dtype=torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(12)
    for p in layer.parameters():  # every weight from the seed (the experts' are allocated uninitialised)
        p.data.copy_(torch.randn(p.shape, generator=g, device="cuda") / p.shape[-1] ** 0.5)
    x = torch.randn(1, 256, generator=g, device="cuda").to(torch.bfloat16)
    residual = torch.randn(1, 256, generator=g, device="cuda").to(torch.bfloat16)
    calls = []
    fused = router.norm_route
    monkeypatch.setattr(router, "norm_route", lambda *a, **k: (calls.append(a), fused(*a, **k))[1])
    select_kernels(layer, torch.device("cuda"))  # after the patch: the layer takes the counting kernel
    moe, norm, empty = layer.mlp, layer.post_attention_layernorm, torch.empty(0, dtype=torch.long, device="cuda")
    try:
        with torch.inference_mode():
            valid = torch.ones(1, dtype=torch.bool, device="cuda")
            set_context(ForwardContext(False, empty, empty, empty.view(0, 0), valid=valid))
            assert moe.fuses_norm(x, norm) and not moe.fuses_norm(x.float(), norm)  # not where dtypes differ
            out, h = moe.add_norm_forward(x, residual, norm)
            assert len(calls) == 1
            xn, h_k, ids, weights = fused(x, residual, norm.weight, norm.eps, moe.gate.weight, 4, True, valid)
            assert torch.equal(h, h_k) and torch.equal(out, moe(xn, (ids, weights)))  # the kernel's, wired through
            ref_xn, ref_h = norm(x, residual)  # the separate add + norm
            assert torch.equal(h, ref_h)
            assert_close_to_reference(xn, ref_xn, torch.bfloat16)
            set_context(ForwardContext(True, empty, empty, empty.view(0, 0), query_lens=[1], context_lens_host=[1]))
            assert not moe.fuses_norm(x, norm)
    finally:
        set_context(None)
