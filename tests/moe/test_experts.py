"""Routed-expert compute paths against the plain per-token reference, on fresh random inputs; `SparseMoE` with routing
handed to it."""

from __future__ import annotations

import pytest
import torch

from edgemoe.moe.experts import gathered_experts, pair_outputs_reference, prefill_reference
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
    for path in (gathered_experts, prefill_reference):
        # the router softmax runs in float32 (as in transformers), hence float32-level agreement
        torch.testing.assert_close(path(x, ids, weights, w13, w2), ref, atol=1e-5, rtol=1e-5)


def test_pair_outputs_skip_rows_and_do_not_depend_on_the_others() -> None:
    """Rows -1 leave their pairs' outputs untouched; an expert's pairs come out bitwise the same computed alone or
    with every other expert's (how offloaded prefill in waves equals one resident call)."""
    g = torch.Generator().manual_seed(3)
    x, w13 = torch.randn(9, 12, generator=g), torch.randn(4, 10, 12, generator=g)
    w2 = torch.randn(4, 12, 5, generator=g)
    rows, weights = torch.randint(0, 4, (18,), generator=g), torch.rand(18, generator=g)
    whole = pair_outputs_reference(x, rows, weights, w13, w2)
    mine = rows == int(rows[0])
    alone = pair_outputs_reference(x, torch.where(mine, rows, -1), weights, w13, w2, out=torch.full_like(whole, 7.0))
    assert torch.equal(alone[mine], whole[mine]) and (alone[~mine] == 7.0).all()


def test_router_normalisation() -> None:
    logits = torch.randn(6, 10, generator=torch.Generator().manual_seed(1))
    ids, w = route(logits, 3, True)
    torch.testing.assert_close(w.sum(-1), torch.ones(6))
    ids2, w2 = route(logits, 3, False)
    assert torch.equal(ids, ids2) and (w2.sum(-1) < 1).all()
    assert torch.equal(ids, logits.topk(3).indices)


def test_sparse_moe_takes_given_routing() -> None:
    """`SparseMoE(x, routing)` (decode's fused norm + router hands its ids and weights over) runs the experts on those
    ids, not the router's: here the router's least likely experts, so that ignoring them would show; the shared
    expert is added either way. On the CPU the norm is never fused."""
    from edgemoe.context import ForwardContext, set_context
    from edgemoe.moe.layer import SparseMoE

    g = torch.Generator().manual_seed(3)
    moe = SparseMoE(32, 8, 2, 16, False, moe_layer=0, shared=24).requires_grad_(False)
    for p in moe.parameters():
        p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    x = torch.randn(3, 32, generator=g)
    probs = torch.softmax(moe.gate(x), dim=-1)
    weights, ids = probs.topk(2, dim=-1, largest=False)
    shared = moe._shared(x)
    empty = torch.empty(0, dtype=torch.long)
    set_context(ForwardContext(False, empty, empty, empty.view(0, 0)))  # decode, no padding rows
    try:
        assert torch.equal(moe(x, (ids, weights)), moe.experts(x, ids, weights) + shared)
        routed_ids, routed_weights = route(moe.gate(x), 2, False)
        assert torch.equal(moe(x), moe.experts(x, routed_ids, routed_weights) + shared)
        assert not torch.allclose(moe(x, (ids, weights)), moe(x))
        assert not moe.fuses_norm(x, torch.nn.Module())  # CPU: never fused (the norm is not even looked at)
    finally:
        set_context(None)


@pytest.mark.parametrize("tokens, top_k", [(1, 4), (13, 2)])
def test_clamped_swiglu_with_biases_matches_gpt_oss(tokens: int, top_k: int) -> None:
    """`Experts` with gpt-oss's activation and biases, decode and prefill references, against transformers'
    `GptOssExperts` on the same weights (theirs transposed, gate and up interleaved): inputs large enough that the clamp
    at 7 bites on both sides."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    from edgemoe.moe.experts import Experts, pair_biases

    E, H, inter = 8, 32, 16
    theirs = GptOssExperts(GptOssConfig(hidden_size=H, intermediate_size=inter, num_local_experts=E))
    g = torch.Generator().manual_seed(tokens)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    ours = Experts(E, H, inter, "swiglu_oai", bias=True)
    with torch.no_grad():
        w13, b13 = theirs.gate_up_proj.transpose(1, 2), theirs.gate_up_proj_bias  # [E, 2I, H], [E, 2I]
        ours.gate_up_proj.copy_(torch.cat((w13[:, 0::2], w13[:, 1::2]), 1))
        ours.gate_up_proj_bias.copy_(torch.cat((b13[:, 0::2], b13[:, 1::2]), 1))
        ours.down_proj.copy_(theirs.down_proj.transpose(1, 2))
        ours.down_proj_bias.copy_(theirs.down_proj_bias)
    x = torch.randn(tokens, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, top_k, generator=g), -1)
    with torch.no_grad():
        ref = theirs(x, ids, weights)
        gate_up = torch.einsum("th,ehi->tei", x, theirs.gate_up_proj)
        assert (gate_up[..., 0::2] > 7).any() and (gate_up[..., 1::2] < -7).any()  # the clamp bites
        for path in (ours.decode, ours.prefill):
            out = path(x, ids, weights, ours.gate_up_proj, ours.down_proj, **pair_biases(ours, ids))
            torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-5)
