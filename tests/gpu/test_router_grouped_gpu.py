"""GLM-4.5's grouped sigmoid router (`edgemoe.kernels.router.grouped_route`) compiled on CUDA against
`edgemoe.moe.router.route_grouped` on torch's CUDA ops, at GLM-4.5-Air's and GLM-4.5's geometries and DeepSeek-style
group limits: ids equal on the kernel's own logits, weights within an fp32 ulp or two before their cast (libdevice
expf and IEEE division as torch's sigmoid; the k scores summed in order); padding rows; no host sync; replayed from a
CUDA graph with new inputs, bitwise the eager call."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from edgemoe.engine.cuda_graphs import capture_graph
from edgemoe.kernels.router import grouped_route
from edgemoe.moe.router import route_grouped
from tests.gpu.sync_free import host_sync_forbidden

# name -> (hidden, experts, top_k, n_group, topk_group)
GEOMETRIES = {
    "glm-4.5-air": (4096, 128, 8, 1, 1),
    "glm-4.5": (5120, 160, 8, 1, 1),
    "deepseek-groups": (2048, 256, 8, 8, 4),
}


def inputs(tokens: int, hidden: int, experts: int, dtype: torch.dtype, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g, device="cuda").to(dtype)
    gate = torch.randn(experts, hidden, generator=g, device="cuda") / hidden**0.5
    bias = 0.1 * torch.randn(experts, generator=g, device="cuda")
    return x, gate, bias


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("tokens", [1, 8])
@pytest.mark.parametrize("name", GEOMETRIES)
def test_matches_route_grouped(name: str, tokens: int, dtype: torch.dtype, normalize: bool) -> None:
    hidden, experts, top_k, n_group, topk_group = GEOMETRIES[name]
    x, gate, bias = inputs(tokens, hidden, experts, dtype, seed=tokens + experts)
    logits = torch.empty(tokens, experts, device="cuda")
    ids, weights = grouped_route(x, gate, bias, top_k, n_group, topk_group, normalize, 2.5, logits_out=logits)
    torch.testing.assert_close(logits, F.linear(x.float(), gate), rtol=1e-5, atol=1e-5)
    ref_ids, ref_weights = route_grouped(logits, bias, top_k, n_group, topk_group, normalize, 2.5)
    assert torch.equal(ids, ref_ids)
    tol = dict(rtol=2.5e-7, atol=1e-7) if dtype == torch.float32 else dict(rtol=2**-8, atol=1e-7)
    torch.testing.assert_close(weights.float(), ref_weights.to(dtype).float(), **tol)


def test_padding_rows_and_no_host_sync() -> None:
    x, gate, bias = inputs(4, 4096, 128, torch.bfloat16, seed=3)
    valid = torch.tensor([True, False, True, False], device="cuda")
    ids, weights = grouped_route(x, gate, bias, 8, 1, 1, True, 1.0)
    padded = grouped_route(x, gate, bias, 8, 1, 1, True, 1.0, valid)
    assert torch.equal(padded[0], torch.where(valid[:, None], ids, ids[:1])) and torch.equal(padded[1], weights)
    with torch.cuda.device(x.device), host_sync_forbidden():
        grouped_route(x, gate, bias, 8, 1, 1, True, 1.0, valid)


def test_cuda_graph_replays_new_inputs() -> None:
    x, gate, bias = inputs(4, 4096, 256, torch.bfloat16, seed=5)
    valid = torch.ones(4, dtype=torch.bool, device="cuda")

    def step():
        return grouped_route(x, gate, bias, 8, 8, 4, True, 2.5, valid)

    graph, (ids, weights) = capture_graph(step)
    for seed in (1, 2):
        x.copy_(inputs(4, 4096, 256, torch.bfloat16, seed=seed)[0])
        valid.copy_(torch.tensor([True, True, seed == 1, False], device="cuda"))
        graph.replay()
        eager = step()
        assert torch.equal(ids, eager[0]) and torch.equal(weights, eager[1])
