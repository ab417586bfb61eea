"""GLM-4.5's grouped sigmoid router as kernels (`edgemoe.kernels.router.grouped_route`, Triton's interpreter on CPU)
against `edgemoe.moe.router.route_grouped` of `F.linear(x.float(), gate)` and `Glm4MoeMoE.route`'s padding rows, on
fresh random inputs: GLM-4.5-Air's one group of 128, GLM-4.5's 160 experts (not a power of two), DeepSeek-style group
limits (8 groups, 4 kept), with and without renormalisation, bf16 and fp32 activations, an fp32 gate and bias.

The ids are held equal to the reference's on the kernel's own logits (the GEMV sums in its own order, so on other
logits a near tie could flip); the logits within fp32 rounding of the float64 product; the weights within an fp32
ulp or two before their cast (bitwise where the cast to bf16 absorbs it, nearly always). Ties go to the lower group
and expert."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from edgemoe.kernels.router import grouped_route  # noqa: E402
from edgemoe.moe.router import route_grouped  # noqa: E402
from tests.kernels import interpreter_only  # noqa: E402

pytestmark = interpreter_only

# (experts, top_k, n_group, topk_group)
GEOMETRIES = {"glm-4.5-air": (128, 8, 1, 1), "glm-4.5": (160, 8, 1, 1), "groups": (64, 6, 8, 4), "two": (16, 2, 4, 2)}


def inputs(tokens: int, hidden: int, experts: int, dtype: torch.dtype, g: torch.Generator):
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    gate = torch.randn(experts, hidden, generator=g) / hidden**0.5  # fp32, as the family keeps it
    bias = 0.1 * torch.randn(experts, generator=g)  # some negative: biased scores below zero
    return x, gate, bias


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("geometry", GEOMETRIES.values(), ids=GEOMETRIES.keys())
def test_matches_route_grouped(geometry, dtype: torch.dtype, normalize: bool) -> None:
    experts, top_k, n_group, topk_group = geometry
    g = torch.Generator().manual_seed(experts + top_k + n_group)
    x, gate, bias = inputs(5, 200, experts, dtype, g)
    logits = torch.empty(5, experts)
    ids, weights = grouped_route(x, gate, bias, top_k, n_group, topk_group, normalize, 2.5, logits_out=logits)
    exact = F.linear(x.double(), gate.double())
    torch.testing.assert_close(logits.double(), exact, rtol=1e-5, atol=1e-5)
    ref_ids, ref_weights = route_grouped(logits, bias, top_k, n_group, topk_group, normalize, 2.5)
    assert ids.dtype == torch.long and weights.dtype == dtype
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights.float(), ref_weights.to(dtype).float(), rtol=2.5e-7 if dtype == torch.float32
                               else 2**-8, atol=1e-7)  # fmt: skip
    # the group limit is honoured: every chosen expert in one of the topk_group best groups of the biased scores
    if topk_group < n_group:
        choice = (torch.sigmoid(logits) + bias).view(5, n_group, -1)
        best = choice.topk(2, dim=-1).values.sum(-1).topk(topk_group, dim=-1).indices
        assert all(set((row // (experts // n_group)).tolist()) <= set(b.tolist()) for row, b in zip(ids, best))


def test_ties_take_the_lower_group_and_expert() -> None:
    """Equal biased scores: the lower expert first; equal group worths: the lower group."""
    x = torch.zeros(1, 32)  # every logit 0: every score 0.5
    gate = torch.zeros(16, 32)
    bias = torch.zeros(16)
    bias[[5, 9, 13]] = 0.25  # groups of 4: 1, 2 and 3 hold one each and tie; group 0 holds none
    ids, weights = grouped_route(x, gate, bias, 2, 4, 2, False, 1.0)
    assert ids.tolist() == [[5, 9]]  # groups 1 and 2 kept (tied with 3), their best experts
    ids, _ = grouped_route(x, gate, torch.zeros(16), 3, 1, 1, False, 1.0)
    assert ids.tolist() == [[0, 1, 2]]
    assert torch.equal(weights, torch.full((1, 2), 0.5))


@pytest.mark.parametrize("mask", [[True, False, True], [False, True, True]], ids=str)
def test_padding_rows_take_row_zero_experts_and_keep_their_weights(mask: list[bool]) -> None:
    """`Glm4MoeMoE.route`: `torch.where(valid[:, None], ids, ids[:1])`; each row's weights are its own choice's."""
    g = torch.Generator().manual_seed(sum(mask))
    x, gate, bias = inputs(3, 64, 64, torch.bfloat16, g)
    valid = torch.tensor(mask)
    ids, weights = grouped_route(x, gate, bias, 6, 8, 4, True, 1.0)
    padded = grouped_route(x, gate, bias, 6, 8, 4, True, 1.0, valid)
    assert torch.equal(padded[0], torch.where(valid[:, None], ids, ids[:1]))
    assert torch.equal(padded[1], weights)


def test_rejects_bad_arguments() -> None:
    x, gate, bias = torch.randn(2, 32), torch.randn(16, 32), torch.randn(16)
    with pytest.raises(ValueError, match="fp32 gate"):
        grouped_route(x, gate.bfloat16(), bias, 2, 1, 1, True, 1.0)
    with pytest.raises(ValueError, match="groups"):
        grouped_route(x, gate, bias, 2, 3, 1, True, 1.0)  # 3 does not divide 16
    with pytest.raises(ValueError, match="kept groups"):
        grouped_route(x, gate, bias, 5, 4, 1, True, 1.0)  # 5 of the 4 experts of one kept group
    ids, weights = grouped_route(x[:0], gate, bias, 2, 1, 1, True, 1.0)
    assert ids.shape == (0, 2) and weights.shape == (0, 2)


@pytest.mark.parametrize("name", ["glm-groups-qknorm-mtp", "glm-air-dense2"])
def test_engine_decodes_on_the_kernel_as_transformers(tiny_checkpoint, name: str) -> None:
    """A tiny GLM through the engine with its MoE layers' decode routing on the kernel (under the interpreter; only
    the routers swapped, as `select_kernels` swaps them on CUDA): greedy tokens identical to transformers', batched."""
    from edgemoe import LLM, SamplingParams
    from edgemoe.models.glm4_moe import Glm4MoeMoE

    folder, hf = tiny_checkpoint(name, "per-expert")
    llm = LLM(str(folder), progress=False, dtype="float32")
    routers = [m for m in llm.engine.runner.model.modules() if isinstance(m, Glm4MoeMoE)]
    for m in routers:
        m.use_kernels(torch.device("cuda"))
    assert routers and all(m._grouped_route is grouped_route for m in routers)
    g = torch.Generator().manual_seed(3)
    batch = [torch.randint(3, 6000, (n,), generator=g).tolist() for n in (5, 11)]
    outs = llm.generate(batch, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    for prompt, out in zip(batch, outs):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt) :].tolist()
        assert out.token_ids == ref
