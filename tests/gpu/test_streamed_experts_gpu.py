"""The expert GEMV streamed behind the miss copy (`edgemoe.kernels.miss_copy.Arrivals`) on the GPU, where the two
kernels really overlap (PDL on sm_90+): the copy fills some of the pairs' slots from pinned host banks at qwen3's
expert size (a copy list of up to 8 rows takes ~1.5 ms), the GEMV waits per pair for listed slots only. Every
result must be bitwise the plain GEMV run after the copy has finished; the slots are refilled with other values
before each round, so a read of a row before its arrival shows. Eager launches and a replayed CUDA graph."""

from __future__ import annotations

import pytest
import torch

from edgemoe.engine.cuda_graphs import capture_graph
from tests.gpu.test_miss_copy_gpu import pinned_bank

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

E, S, TOP_K = 16, 12, 8  # experts in the bank, slots of the pool (+ the scratch slot S)
H, INTER = 2048, 768  # Qwen3-30B-A3B


def setup(seed: int):
    banks = pinned_bank((E, 2 * INTER, H), torch.bfloat16, seed), pinned_bank((E, H, INTER), torch.bfloat16, seed + 1)
    pools = tuple(torch.empty(S + 1, *b.shape[1:], dtype=b.dtype, device="cuda") for b in banks)
    return banks, pools


def new_round(pools, gen: torch.Generator, misses: int, tokens: int):
    """Fresh slot contents, routing and copy list: `misses` of the pairs' slots listed (the rest padded to the
    scratch slot, as `ensure` pads them), the counters zeroed as `ensure` leaves them."""
    for pool in pools:
        pool.normal_(
            generator=torch.Generator(device="cuda").manual_seed(int(torch.randint(1 << 30, (1,), generator=gen)))
        )
    slots = torch.stack([torch.randperm(S, generator=gen)[:TOP_K] for _ in range(tokens)])
    used = torch.unique(slots.flatten())
    M = min(used.numel(), E)
    dst = torch.full((M,), S)
    dst[:misses] = used[torch.randperm(used.numel(), generator=gen)[:misses]]
    src = torch.randperm(E, generator=gen)[:M]
    x = torch.randn(tokens, H, generator=gen).to(torch.bfloat16)
    weights = torch.rand(tokens, TOP_K, generator=gen)
    cuda = [t.cuda() for t in (slots, dst, src, x, weights)]
    return (*cuda, torch.tensor(misses).cuda(), torch.zeros(M, dtype=torch.long, device="cuda"))


@pytest.mark.parametrize("tokens", [1, 2])
def test_streamed_equals_plain_eager(tokens: int) -> None:
    from edgemoe.kernels.miss_copy import chunks_per_entry, copy_rows_pair
    from edgemoe.kernels.moe_gemv import fused_experts
    from edgemoe.kernels.protocol import Arrivals

    banks, pools = setup(3)
    gen = torch.Generator().manual_seed(tokens)
    chunks = chunks_per_entry(pools)
    for misses in (0, 1, 3, 8, 8, 5):
        slots, dst, src, x, weights, count, counters = new_round(pools, gen, misses, tokens)
        torch.cuda.synchronize()
        copy_rows_pair(pools, banks, src, dst, count, counters)
        got = fused_experts(x, slots, weights, *pools, arrivals=Arrivals(dst, count, counters, chunks))
        torch.cuda.synchronize()
        assert counters[:misses].tolist() == [chunks] * misses
        want = fused_experts(x, slots, weights, *pools)
        assert torch.equal(got, want), misses


def test_streamed_equals_plain_in_a_graph() -> None:
    """Captured once (copy + streamed GEMV) over static buffers, replayed with new lists, routing and slot contents."""
    from edgemoe.kernels.miss_copy import chunks_per_entry, copy_rows_pair
    from edgemoe.kernels.moe_gemv import fused_experts
    from edgemoe.kernels.protocol import Arrivals

    banks, pools = setup(5)
    gen = torch.Generator().manual_seed(9)
    chunks = chunks_per_entry(pools)
    static = list(new_round(pools, gen, 8, 1))
    slots, dst, src, x, weights, count, counters = static

    def step() -> torch.Tensor:
        copy_rows_pair(pools, banks, src, dst, count, counters)
        return fused_experts(x, slots, weights, *pools, arrivals=Arrivals(dst, count, counters, chunks))

    graph, out = capture_graph(step)
    for misses in (8, 2, 0, 8, 6):
        fresh = new_round(pools, gen, misses, 1)
        assert fresh[1].numel() == dst.numel() == TOP_K  # one token: its top_k distinct slots, the list's capacity
        for buf, new in zip(static, fresh):
            buf.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        want = fused_experts(x, slots, weights, *pools)
        assert torch.equal(out, want), misses
