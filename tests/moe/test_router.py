"""`route_grouped` against transformers' GLM-4.5 router (`Glm4MoeTopkRouter`: sigmoid scores, correction bias, group
limits, renormalisation, scaling factor) on fresh random inputs: the same experts, the same weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from edgemoe.moe.router import route_grouped


@pytest.mark.parametrize(
    "experts, top_k, n_group, topk_group, normalize, scale",
    [
        (16, 4, 4, 2, True, 2.5),
        (16, 4, 1, 1, False, 1.0),
        (32, 6, 8, 3, True, 1.0),
        (12, 2, 3, 1, False, 0.7),
        (8, 8, 2, 2, True, 1.0),  # every expert
    ],
)
def test_route_grouped_matches_transformers(experts, top_k, n_group, topk_group, normalize, scale) -> None:
    from transformers import Glm4MoeConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    hidden, tokens = 24, 37
    config = Glm4MoeConfig(hidden_size=hidden, n_routed_experts=experts, num_experts_per_tok=top_k, n_group=n_group,
                           topk_group=topk_group, norm_topk_prob=normalize, routed_scaling_factor=scale)  # fmt: skip
    router = Glm4MoeTopkRouter(config)
    g = torch.Generator().manual_seed(experts * 100 + top_k * 10 + n_group)
    with torch.no_grad():
        router.weight.copy_(torch.randn(experts, hidden, generator=g))
        router.e_score_correction_bias.copy_(0.3 * torch.randn(experts, generator=g))
    x = torch.randn(tokens, hidden, generator=g)
    _, ref_weights, ref_ids = router(x)
    ids, weights = route_grouped(
        F.linear(x, router.weight), router.e_score_correction_bias, top_k, n_group, topk_group, normalize, scale
    )
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32 and ids.shape == (tokens, top_k)
    ours, order = ids.sort(dim=-1)  # transformers' top-k is unsorted
    theirs, ref_order = ref_ids.sort(dim=-1)
    assert torch.equal(ours, theirs)
    # the renormalising sum adds the same weights in another order (transformers' top-k is unsorted): within an ulp
    torch.testing.assert_close(weights.gather(1, order), ref_weights.gather(1, ref_order), rtol=0, atol=1e-6)
    if n_group > topk_group:  # the limits changed the choice somewhere: plain top-k of the biased scores differs
        plain = (torch.sigmoid(F.linear(x, router.weight)) + router.e_score_correction_bias).topk(top_k).indices
        assert not torch.equal(plain.sort(dim=-1).values, ours)


def test_bias_chooses_but_does_not_weigh() -> None:
    """A large bias on one expert makes every token choose it, at its plain sigmoid score."""
    logits = torch.randn(9, 8, generator=torch.Generator().manual_seed(3))
    bias = torch.zeros(8)
    bias[5] = 10.0
    ids, weights = route_grouped(logits, bias, 2, 1, 1, False, 1.0)
    assert (ids == 5).any(dim=-1).all()
    torch.testing.assert_close(weights[ids == 5], torch.sigmoid(logits[:, 5]), rtol=0, atol=0)


@pytest.mark.parametrize("experts, top_k", [(32, 4), (8, 2), (128, 4)])
def test_softmax_after_top_k_matches_gpt_oss(experts: int, top_k: int) -> None:
    """gpt-oss's router (`GptOssTopKRouter`: a bias, the top k logits, a softmax over them alone): the same experts,
    the same weights, which differ from a softmax over every expert's renormalised top k only by rounding."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

    from edgemoe.moe.router import route

    hidden, tokens = 24, 37
    config = GptOssConfig(hidden_size=hidden, num_local_experts=experts, num_experts_per_tok=top_k)
    router = GptOssTopKRouter(config)
    g = torch.Generator().manual_seed(experts)
    with torch.no_grad():
        router.weight.copy_(torch.randn(experts, hidden, generator=g))
        router.bias.copy_(torch.randn(experts, generator=g))
    x = torch.randn(tokens, hidden, generator=g)
    _, scores, ref_ids = router(x)
    ids, weights = route(F.linear(x, router.weight, router.bias), top_k, False, softmax_after_top_k=True)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, scores, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(weights.sum(-1), torch.ones(tokens))
