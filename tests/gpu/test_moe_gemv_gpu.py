"""The fused decode experts (`edgemoe.kernels.moe_gemv`) compiled on CUDA: against `gathered_experts` at real
geometries in float32 and bf16, without host synchronisation, and replayed from a CUDA graph with new inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from edgemoe.engine.cuda_graphs import capture_graph
from edgemoe.moe.experts import gathered_experts
from tests.gpu.sync_free import host_sync_forbidden

# name -> (hidden, inter, top_k, experts)
GEOMETRIES = {
    "qwen3-30b-a3b": (2048, 768, 8, 128),
    "qwen1.5-moe-a2.7b": (2048, 1408, 4, 60),
    "mixtral-8x7b": (4096, 14336, 2, 8),
    "demo": (256, 48, 4, 32),
}


def inputs(hidden: int, inter: int, top_k: int, experts: int, tokens: int, dtype: torch.dtype, seed: int) -> tuple:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g, device="cuda").to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g, device="cuda") / hidden**0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g, device="cuda") / inter**0.5).to(dtype)
    ids = torch.rand(tokens, experts, generator=g, device="cuda").argsort(dim=-1)[:, :top_k]  # distinct per token
    ids[-1, -1] = ids[0, 0]  # an expert shared across tokens (a no-op at one token)
    weights = torch.rand(tokens, top_k, generator=g, device="cuda").to(dtype)
    return x, ids, weights, w13, w2


def float32_reference(x, ids, weights, w13, w2) -> torch.Tensor:
    """Pair by pair in float32 (only the chosen experts are upcast)."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for t in range(ids.shape[0]):
        for k in range(ids.shape[1]):
            e = ids[t, k]
            gate, up = (w13[e].float() @ x[t].float()).chunk(2)
            out[t] += weights[t, k].float() * (w2[e].float() @ (F.silu(gate) * up))
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("tokens", [1, 4])
@pytest.mark.parametrize("name", list(GEOMETRIES))
def test_float32_matches_gathered(name: str, tokens: int) -> None:
    from edgemoe.kernels.moe_gemv import fused_experts

    x, ids, weights, w13, w2 = inputs(*GEOMETRIES[name], tokens, torch.float32, seed=tokens)
    out = fused_experts(x, ids, weights, w13, w2)
    expected = gathered_experts(x, ids, weights, w13, w2)
    assert out.dtype == torch.float32 and rel(out, expected) < 1e-5
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("tokens", [1, 4])
@pytest.mark.parametrize("name", list(GEOMETRIES))
def test_bfloat16_close_to_float32(name: str, tokens: int) -> None:
    from edgemoe.kernels.moe_gemv import fused_experts

    x, ids, weights, w13, w2 = inputs(*GEOMETRIES[name], tokens, torch.bfloat16, seed=10 + tokens)
    with torch.cuda.device(x.device), host_sync_forbidden():  # no host synchronisation once compiled
        fused_experts(x, ids, weights, w13, w2)  # compiles (may sync)
        out = fused_experts(x, ids, weights, w13, w2)
    ref = float32_reference(x, ids, weights, w13, w2)
    gathered = gathered_experts(x, ids, weights, w13, w2)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    # fp32 accumulation, h rounded once: within bf16 rounding of the truth and no worse than the reference
    assert rel(out, ref) < 1e-2 and rel(out, ref) <= 1.5 * rel(gathered, ref) + 1e-3


@pytest.mark.parametrize("dtype, name", [(torch.bfloat16, "qwen3-30b-a3b"), (torch.float32, "demo")])
def test_cuda_graph_replays_new_inputs(dtype: torch.dtype, name: str) -> None:
    """Captured once over static buffers (ids as slots of a pool, as offload decode runs it), replayed with new
    x, ids and weights written into them; every output element is rewritten on each replay."""
    from edgemoe.kernels.moe_gemv import fused_experts

    hidden, inter, top_k, experts = GEOMETRIES[name]
    tokens = 3
    x, ids, weights, w13, w2 = inputs(hidden, inter, top_k, experts, tokens, dtype, seed=0)
    pool13, pool2 = w13[: experts // 2 + 1], w2[: experts // 2 + 1]  # [S + 1, ...] slot pool views
    ids = ids % (experts // 2)
    graph, out = capture_graph(lambda: fused_experts(x, ids, weights, pool13, pool2))
    for seed in range(1, 4):
        new_x, new_ids, new_w, _, _ = inputs(hidden, inter, top_k, experts, tokens, dtype, seed=seed)
        x.copy_(new_x)
        ids.copy_(new_ids % (experts // 2))
        weights.copy_(new_w)
        out.fill_(float("nan"))
        graph.replay()
        expected = fused_experts(x, ids, weights, pool13, pool2)
        assert torch.equal(out, expected)  # deterministic: no atomics
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        assert rel(out, gathered_experts(x, ids, weights, pool13, pool2)) < tol
