"""The prefill grouped GEMM (`edgemoe.kernels.grouped_gemm`) against a float64 per-pair loop and `prefill_reference`,
on fresh random inputs; without CUDA under Triton's interpreter (set by tests/conftest.py), hence small shapes and
small blocks (H and I off every block multiple, so ragged steps and partial column blocks run too).

Tolerances: float32 inputs agree with the float64 loop to 1e-5 (fp32 accumulation over at most 70 products of
O(1) terms); bf16/fp16 outputs are within 1e-2 relative (Frobenius) of it and no more than twice as far as the
plain-torch reference, which rounds at the same places (h and each pair's output in the inputs' dtype)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from edgemoe.context import ForwardContext, set_context  # noqa: E402
from edgemoe.kernels.grouped_gemm import Blocks, grouped_gemm, pair_outputs, pick_blocks, schedule  # noqa: E402
from edgemoe.kernels.protocol import PairBiases  # noqa: E402
from edgemoe.layers.mlp import GLUS  # noqa: E402
from edgemoe.moe.experts import Experts, pair_outputs_reference, prefill_reference  # noqa: E402
from tests.kernels.test_moe_gemv import loop_reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = Blocks(m=16, up_n=16, up_k=16, down_n=16, down_k=16, warps=4, stages=1)


def inputs(tokens: int, top_k: int, experts: int, hidden: int, inter: int, seed: int, ids: torch.Tensor | None = None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) / inter**0.5
    if ids is None:
        ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g) + 0.1
    return x.to(DEVICE), ids.to(DEVICE), weights.to(DEVICE), w13.to(DEVICE), w2.to(DEVICE)


def skewed(tokens: int, top_k: int, experts: int) -> torch.Tensor:
    """Expert 2 in every token (more than one tile of it), the others from a few; most experts get no pairs."""
    rest = torch.tensor([5, 0, 7])[torch.arange(tokens * (top_k - 1)) % 3].view(tokens, top_k - 1)
    return torch.cat([torch.full((tokens, 1), 2), rest], dim=1) if top_k > 1 else torch.full((tokens, 1), 2)


CASES = {  # id: (tokens, top_k, experts, hidden, inter, ids)
    "one-token": (1, 2, 6, 40, 24, None),
    "odd-sizes": (13, 3, 6, 40, 24, None),
    "more-pairs-than-a-tile": (23, 4, 5, 37, 21, None),
    "one-expert-takes-all": (19, 1, 4, 32, 16, torch.full((19, 1), 3)),
    "skewed-empty-experts": (17, 3, 9, 24, 20, skewed(17, 3, 9)),
}


@pytest.mark.parametrize("case", CASES)
def test_float32_matches_float64_loop_and_reference(case: str) -> None:
    tokens, top_k, experts, hidden, inter, ids = CASES[case]
    x, ids, weights, w13, w2 = inputs(tokens, top_k, experts, hidden, inter, seed=len(case), ids=ids)
    out = grouped_gemm(x, ids, weights, w13, w2, SMALL)
    assert out.dtype == x.dtype and out.shape == x.shape
    ref = loop_reference(x, ids, weights, w13, w2)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, prefill_reference(x, ids, weights, w13, w2), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_close_to_float64(dtype: torch.dtype) -> None:
    x, ids, weights, w13, w2 = inputs(21, 3, 7, 48, 40, seed=5)
    x, weights, w13, w2 = x.to(dtype), weights.to(dtype), w13.to(dtype), w2.to(dtype)  # the router's dtype
    out = grouped_gemm(x, ids, weights, w13, w2, SMALL)
    assert out.dtype == dtype
    ref = loop_reference(x, ids, weights, w13, w2)
    err = (out.double() - ref).norm() / ref.norm()
    torch_err = (prefill_reference(x, ids, weights, w13, w2).double() - ref).norm() / ref.norm()
    assert err < 1e-2 and err <= 2 * torch_err + 1e-3


def test_default_blocks() -> None:
    """The engine's blocks (64-pair tiles) on shapes smaller than one tile and one column block."""
    x, ids, weights, w13, w2 = inputs(9, 4, 8, 72, 40, seed=11)
    out = grouped_gemm(x, ids, weights, w13, w2, pick_blocks(x.dtype))
    torch.testing.assert_close(out.double(), loop_reference(x, ids, weights, w13, w2), atol=1e-5, rtol=1e-5)


def test_bitwise_the_same_run_to_run() -> None:
    x, ids, weights, w13, w2 = inputs(29, 4, 6, 40, 24, seed=3)
    x, w13, w2 = x.bfloat16(), w13.bfloat16(), w2.bfloat16()
    first = grouped_gemm(x, ids, weights, w13, w2, SMALL)
    second = grouped_gemm(x.clone(), ids.clone(), weights.clone(), w13.clone(), w2.clone(), SMALL)
    assert torch.equal(first, second)


def test_no_pairs() -> None:
    x, ids, weights, w13, w2 = inputs(3, 2, 4, 16, 16, seed=1)
    out = grouped_gemm(x[:0], ids[:0], weights[:0], w13, w2, SMALL)
    assert out.shape == (0, 16)


def test_waves_over_other_rows_are_bitwise_one_launch() -> None:
    """As offloaded prefill runs it: the experts in two waves, each read from other rows of a bigger pool (slots),
    the other wave's pairs skipped (-1) and left as they were, gives bitwise the pair outputs of one launch."""
    x, ids, weights, w13, w2 = inputs(15, 3, 6, 40, 24, seed=8)
    flat, w = ids.flatten(), weights.flatten()
    want = pair_outputs(x, flat, w, w13, w2, blocks=SMALL)
    slot_of = torch.tensor([4, 0, 6, 2, 7, 1], device=DEVICE)  # expert -> slot of a pool of 8 (3 and 5 unused)
    pool13 = torch.randn(8, *w13.shape[1:], device=DEVICE)
    pool2 = torch.randn(8, *w2.shape[1:], device=DEVICE)
    pool13[slot_of], pool2[slot_of] = w13, w2
    y = torch.full_like(want, float("nan"))
    for wave in ([0, 3, 5], [1, 2, 4]):
        in_wave = torch.isin(flat, torch.tensor(wave, device=DEVICE))
        before = y.clone()
        pair_outputs(x, torch.where(in_wave, slot_of[flat], -1), w, pool13, pool2, out=y, blocks=SMALL)
        assert torch.equal(y[~in_wave].isnan(), before[~in_wave].isnan())  # skipped rows untouched
    assert torch.equal(y, want)


@pytest.mark.parametrize("pairs, rows, block_m", [(1, 6, 16), (37, 4, 16), (64, 128, 64), (200, 3, 8)])
def test_schedule_covers_every_pair_once_within_the_bound(pairs: int, rows: int, block_m: int) -> None:
    g = torch.Generator().manual_seed(pairs)
    ids = torch.randint(0, rows, (pairs,), generator=g)
    ids[::5] = -1  # skipped
    order, starts, tile_expert, tile_first = schedule(ids, rows, block_m)
    assert tile_expert.numel() == -(-pairs // block_m) + min(rows, pairs)
    seen = []
    for tile, e in enumerate(tile_expert.tolist()):
        if e == rows:  # past the work: every later tile is too
            assert (tile_expert[tile:] == rows).all()
            break
        row0 = int(starts[e]) + (tile - int(tile_first[e])) * block_m
        run = order[row0 : min(row0 + block_m, int(starts[e + 1]))]
        assert run.numel() > 0 and (ids[run] == e).all()
        seen += run.tolist()
    assert sorted(seen) == (ids >= 0).nonzero().flatten().tolist()
    assert seen == sorted(seen, key=lambda p: int(ids[p]))  # by expert, each expert's pairs in pair order


def test_experts_prefill_takes_the_kernel_once_chosen() -> None:
    """`Experts.use_kernels` swaps prefill's reference for the grouped GEMM (here under the interpreter)."""
    x, ids, weights, w13, w2 = inputs(11, 2, 4, 16, 16, seed=2)
    experts = Experts(4, 16, 16).to(DEVICE).requires_grad_(False)
    experts.gate_up_proj.copy_(w13)
    experts.down_proj.copy_(w2)
    empty = torch.empty(0, dtype=torch.long)
    set_context(ForwardContext(True, empty, empty, empty.view(0, 0), query_lens=[11], context_lens_host=[11]))
    try:
        ref = experts(x, ids, weights)
        experts.use_kernels(torch.device(DEVICE))
        assert experts.prefill.func is grouped_gemm
        torch.testing.assert_close(experts(x, ids, weights), ref, atol=1e-5, rtol=1e-5)
    finally:
        set_context(None)


@pytest.mark.parametrize("slots", [3, 8])
def test_offloaded_prefill_is_bitwise_resident(slots: int) -> None:
    """Offloaded experts with the kernel chosen: made resident in waves of `slots` (3: three waves; 8: every expert
    at once), read from the slot pool, bitwise the resident kernel's result."""
    from edgemoe.offload.expert_cache import ExpertCache
    from edgemoe.offload.experts import OffloadedExperts
    from edgemoe.offload.layout import ExpertLayout

    E, H, inter = 8, 32, 16
    x, ids, weights, w13, w2 = inputs(10, 2, E, H, inter, seed=slots)
    layout = ExpertLayout(H, inter, torch.float32)
    layout.use_kernels(torch.device(DEVICE))
    bank = layout.empty(E)
    for view, w in zip(layout.views(bank), (w13, w2)):
        view.copy_(w)
    experts = OffloadedExperts(0, bank, layout)
    cache = ExpertCache(1, E, slots, "lru", DEVICE, layout.row_bytes, False)
    joined = layout.empty(slots + 1, DEVICE)
    cache.attach_pool(*layout.copy_views(joined), joined)
    experts.attach(cache)
    empty = torch.empty(0, dtype=torch.long)
    set_context(ForwardContext(True, empty, empty, empty.view(0, 0), query_lens=[10], context_lens_host=[10]))
    try:
        got = experts(x, ids, weights)
    finally:
        set_context(None)
    assert torch.equal(got, grouped_gemm(x, ids, weights, w13, w2))


@pytest.mark.parametrize("act", ["silu", "swiglu_oai"])
def test_expert_biases_and_gpt_oss_activation_over_slots(act: str) -> None:
    """gpt-oss's experts in prefill: each pair's biases read by its expert id while its weights come from a pool's
    slot, the clamped SwiGLU (inputs scaled past the clamp), against the reference over the same slots; two waves
    of slots give bitwise one launch's outputs."""
    x, ids, weights, w13, w2 = inputs(23, 4, 6, 37, 21, seed=41)
    x = x * 6
    g = torch.Generator().manual_seed(42)
    b13, b2 = (torch.randn(6, 2 * 21, generator=g) * 3).to(DEVICE), torch.randn(6, 37, generator=g).to(DEVICE)
    slot_of = torch.tensor([4, 0, 6, 2, 7, 1], device=DEVICE)  # expert -> slot of a pool of 8
    pool13, pool2 = torch.randn(8, *w13.shape[1:], device=DEVICE), torch.randn(8, *w2.shape[1:], device=DEVICE)
    pool13[slot_of], pool2[slot_of] = w13, w2
    flat = ids.flatten()
    bias = PairBiases(b13, b2, flat)
    y = pair_outputs(x, slot_of[flat], weights.flatten(), pool13, pool2, blocks=SMALL, bias=bias, act=act)
    ref = pair_outputs_reference(x, slot_of[flat], weights.flatten(), pool13, pool2, glu=GLUS[act], bias=bias)
    torch.testing.assert_close(y, ref, atol=1e-4, rtol=1e-5)
    plain = pair_outputs(x, slot_of[flat], weights.flatten(), pool13, pool2, blocks=SMALL, act=act)
    assert (y - plain).abs().max() > 0.1  # the biases mattered
    waves = torch.full_like(y, float("nan"))
    for wave in ([0, 3, 5], [1, 2, 4]):
        rows = torch.where(torch.isin(flat, torch.tensor(wave, device=DEVICE)), slot_of[flat], -1)
        pair_outputs(x, rows, weights.flatten(), pool13, pool2, out=waves, blocks=SMALL, bias=bias, act=act)
    assert torch.equal(waves, y)
