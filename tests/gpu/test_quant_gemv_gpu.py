"""The quantized decode experts (`edgemoe.kernels.quant_gemv`) compiled on CUDA at qwen3-30b-a3b's expert shape, on
fresh random blocks of every format (and Q4_K_M's Q4_K + Q6_K): against `quant_experts_reference` in float32 and
bf16 without host synchronisation, replayed from a CUDA graph with new inputs, and streamed behind the miss copy
from pinned host banks (bitwise the plain kernel). Tolerances as in tests/kernels/test_quant_gemv.py, whose sums
ran over 256 products; here over 2048 (~3x the float32 rounding), still well inside 1e-5 relative."""

from __future__ import annotations

import functools

import pytest
import torch

from edgemoe.engine.cuda_graphs import capture_graph
from edgemoe.quant import QUANT_TYPES, random_blocks, row_bytes
from tests.gpu.sync_free import host_sync_forbidden

H, INTER, TOP_K, E = 2048, 768, 8, 16  # qwen3-30b-a3b's expert shape and top_k; 16 of its 128 experts
PAIRS = [(name, name) for name in QUANT_TYPES] + [("Q4_K", "Q6_K")]
IDS = [a if a == b else f"{a}+{b}" for a, b in PAIRS]


@functools.cache
def host_banks(q13: str, q2: str, seed: int = 0) -> torch.Tensor:
    """One joined row per expert (gate_up's blocks, then down's), pinned: [E, a + b] uint8."""
    g = torch.Generator().manual_seed(seed)
    w13 = random_blocks((E, 2 * INTER, H), q13, g, std=H**-0.5)
    w2 = random_blocks((E, H, INTER), q2, g, std=INTER**-0.5)
    return torch.cat([w13.flatten(1), w2.flatten(1)], dim=1).pin_memory()


def split(joined: torch.Tensor, q13: str, q2: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The banks as views of the joined rows: w13 [N, 2I, rb13], w2 [N, H, rb2]."""
    a = 2 * INTER * row_bytes(q13, H)
    return joined[:, :a].view(-1, 2 * INTER, row_bytes(q13, H)), joined[:, a:].view(-1, H, row_bytes(q2, INTER))


def routing(tokens: int, dtype: torch.dtype, seed: int, experts: int = E):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, H, generator=g, device="cuda").to(dtype)
    ids = torch.rand(tokens, experts, generator=g, device="cuda").argsort(dim=-1)[:, :TOP_K]  # distinct per token
    ids[-1, -1] = ids[0, 0]
    weights = torch.rand(tokens, TOP_K, generator=g, device="cuda")
    return x, ids, weights


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("tokens", [1, 4])
@pytest.mark.parametrize("q13, q2", PAIRS, ids=IDS)
def test_matches_reference(q13: str, q2: str, tokens: int) -> None:
    from edgemoe.kernels.quant_gemv import quant_experts_reference, quant_fused_experts

    w13, w2 = split(host_banks(q13, q2).cuda(), q13, q2)
    x, ids, weights = routing(tokens, torch.float32, seed=tokens)
    out = quant_fused_experts(x, ids, weights, w13, w2, q13, q2, INTER, H)
    truth = quant_experts_reference(x, ids, weights, w13, w2, q13, q2, INTER, H)  # float32 (h unrounded)
    assert out.dtype == torch.float32 and rel(out, truth) < 1e-5
    torch.testing.assert_close(out, truth, rtol=1e-4, atol=1e-5 * truth.abs().max().item())

    xb = x.to(torch.bfloat16)
    with torch.cuda.device(x.device), host_sync_forbidden():  # no host synchronisation once compiled
        quant_fused_experts(xb, ids, weights, w13, w2, q13, q2, INTER, H)  # compiles (may sync)
        out = quant_fused_experts(xb, ids, weights, w13, w2, q13, q2, INTER, H)
    ref = quant_experts_reference(xb, ids, weights, w13, w2, q13, q2, INTER, H)
    truth = quant_experts_reference(xb.float(), ids, weights, w13, w2, q13, q2, INTER, H)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    # fp32 accumulation, h rounded once: within bf16 rounding of the truth and no worse than the reference
    assert rel(out, ref) < 1e-2 and rel(out, truth) <= 1.5 * rel(ref, truth) + 1e-3
    assert (out.float() - ref.float()).abs().max() <= 2e-2 * ref.float().abs().max()


@pytest.mark.parametrize("q13, q2", [("Q4_K", "Q6_K"), ("Q8_0", "Q8_0")], ids=["Q4_K+Q6_K", "Q8_0"])
def test_cuda_graph_replays_new_inputs(q13: str, q2: str) -> None:
    """Captured once over static buffers (ids as slots of a pool of views), replayed with new x, ids and weights
    written into them; every output element is rewritten on each replay."""
    from edgemoe.kernels.quant_gemv import quant_experts_reference, quant_fused_experts

    slots = E // 2
    w13, w2 = split(host_banks(q13, q2)[: slots + 1].cuda(), q13, q2)  # [S + 1, ...] slot pool views
    tokens = 3
    x, ids, weights = routing(tokens, torch.bfloat16, seed=0, experts=slots)
    graph, out = capture_graph(lambda: quant_fused_experts(x, ids, weights, w13, w2, q13, q2, INTER, H))
    for seed in range(1, 4):
        new_x, new_ids, new_w = routing(tokens, torch.bfloat16, seed=seed, experts=slots)
        x.copy_(new_x)
        ids.copy_(new_ids)
        weights.copy_(new_w)
        out.fill_(float("nan"))
        graph.replay()
        assert torch.equal(out, quant_fused_experts(x, ids, weights, w13, w2, q13, q2, INTER, H))  # no atomics
        assert rel(out, quant_experts_reference(x, ids, weights, w13, w2, q13, q2, INTER, H)) < 1e-2


def test_streamed_behind_the_miss_copy_equals_plain() -> None:
    """Q4_K_M rows copied from pinned host banks into slots by the miss copy, the GEMV behind it (PDL) waiting per
    pair for listed slots: bitwise the plain GEMV after the copy, slots refilled with other blocks every round."""
    from edgemoe.kernels.miss_copy import chunks_per_entry, copy_rows_pair
    from edgemoe.kernels.protocol import Arrivals
    from edgemoe.kernels.quant_gemv import quant_fused_experts

    q13, q2, slots = "Q4_K", "Q6_K", 12
    banks = split(host_banks(q13, q2), q13, q2)
    pool = torch.empty(slots + 1, host_banks(q13, q2).shape[1], dtype=torch.uint8, device="cuda")
    pools = split(pool, q13, q2)
    chunks = chunks_per_entry(pools)
    gen = torch.Generator().manual_seed(0)
    for misses in (0, 1, 3, 8, 5):
        pool.copy_(host_banks(q13, q2, seed=1)[torch.randint(0, E, (slots + 1,), generator=gen)])  # other values
        x, ids, weights = routing(2, torch.bfloat16, seed=misses, experts=slots)
        used = torch.unique(ids.flatten()).cpu()
        M = used.numel()
        dst = torch.full((M,), slots)  # the scratch slot past `count`, as `ensure` pads the list
        dst[:misses] = used[torch.randperm(M, generator=gen)[:misses]]
        src = torch.randperm(E, generator=gen)[:M]
        dst, src, count = dst.cuda(), src.cuda(), torch.tensor(misses).cuda()
        counters = torch.zeros(M, dtype=torch.long, device="cuda")
        torch.cuda.synchronize()
        copy_rows_pair(pools, banks, src, dst, count, counters)
        arrivals = Arrivals(dst, count, counters, chunks)
        got = quant_fused_experts(x, ids, weights, *pools, q13, q2, INTER, H, arrivals=arrivals)
        torch.cuda.synchronize()
        assert counters[:misses].tolist() == [chunks] * misses
        assert torch.equal(got, quant_fused_experts(x, ids, weights, *pools, q13, q2, INTER, H))
