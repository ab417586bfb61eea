"""Routed-expert compute paths against the plain per-token reference, on fresh random inputs."""

from __future__ import annotations

import pytest
import torch

from edgemoe.moe.experts import gathered_experts, grouped_experts
from edgemoe.moe.reference import moe_reference
from edgemoe.moe.router import route


@pytest.mark.parametrize("tokens, experts, top_k, normalize", [(1, 8, 2, False), (5, 16, 4, True), (37, 8, 3, False)])
def test_experts_match_reference(tokens, experts, top_k, normalize) -> None:
    g = torch.Generator().manual_seed(tokens * 100 + experts)
    hidden, inter = 24, 10
    x = torch.randn(tokens, hidden, generator=g, dtype=torch.float64)
    gate = torch.randn(experts, hidden, generator=g, dtype=torch.float64)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g, dtype=torch.float64) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=g, dtype=torch.float64) / inter**0.5
    ids, weights = route(x @ gate.T, top_k, normalize)
    ref = moe_reference(x, gate, w13, w2, top_k, normalize)
    for path in (gathered_experts, grouped_experts):
        # the router softmax runs in float32 (as in transformers), hence float32-level agreement
        torch.testing.assert_close(path(x, ids, weights, w13, w2), ref, atol=1e-5, rtol=1e-5)


def test_router_normalisation() -> None:
    logits = torch.randn(6, 10, generator=torch.Generator().manual_seed(1))
    ids, w = route(logits, 3, True)
    torch.testing.assert_close(w.sum(-1), torch.ones(6))
    ids2, w2 = route(logits, 3, False)
    assert torch.equal(ids, ids2) and (w2.sum(-1) < 1).all()
    assert torch.equal(ids, logits.topk(3).indices)
