"""The two-bank miss copy (`copy_rows_pair`, `edgemoe.kernels.miss_copy`) compiled on CUDA, from pinned host banks:
against `copy_rows_reference` on each bank at real and odd geometries, as the one kernel `ExpertCache.copy_missing`
launches, past 65535 chunks per entry, without host synchronisation, and captured in a CUDA graph and replayed with
new copy lists written into its static buffers."""

from __future__ import annotations

import pytest
import torch

from edgemoe.engine.cuda_graphs import capture_graph
from edgemoe.offload.banks import allocate_bank
from edgemoe.offload.expert_cache import ExpertCache, copy_rows_reference
from edgemoe.tools.profiler import MISS_COPY, record
from tests.gpu.sync_free import host_sync_forbidden

S, M = 7, 5


def pinned_bank(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    bank = allocate_bank(shape, dtype, pin=True)
    bank.copy_(torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype))
    assert bank.is_pinned()
    return bank


def random_list(experts: int, count: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A device copy list of capacity M; entries past `count` padded as `ensure` pads them (expert 0 -> slot S)."""
    src, dst = torch.randperm(experts, generator=gen)[:M], torch.randperm(S, generator=gen)[:M]
    valid = torch.arange(M) < count
    return torch.where(valid, src, 0).cuda(), torch.where(valid, dst, S).cuda(), torch.tensor(count).cuda()


def expected(pools: tuple[torch.Tensor, ...], banks: tuple[torch.Tensor, ...], src, dst) -> list[torch.Tensor]:
    out = [p.clone() for p in pools]
    for pool, bank in zip(out, banks):
        copy_rows_reference(pool, bank, src, dst)
    return out


# (experts, gate_up row, down row): Qwen3-30B-A3B's experts (H 2048, I 768), odd rows, Qwen1.5-MoE's (H 2048, I 1408)
SHAPES = [(12, (1536, 2048), (2048, 768)), (9, (3, 5), (5, 3)), (6, (2816, 2048), (2048, 1408))]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_pair_matches_reference(shape: tuple, dtype: torch.dtype) -> None:
    from edgemoe.kernels.miss_copy import copy_rows_pair

    E, w13_row, w2_row = shape
    banks = pinned_bank((E, *w13_row), dtype, 0), pinned_bank((E, *w2_row), dtype, 1)
    gen = torch.Generator().manual_seed(E)
    for count in (0, 2, M):
        pools = tuple(torch.randn(S + 1, *b.shape[1:], generator=gen).to(dtype).cuda() for b in banks)
        src, dst, n = random_list(E, count, gen)
        want = expected(pools, banks, src, dst)
        copy_rows_pair(pools, banks, src, dst, n)
        for pool, w in zip(pools, want):
            assert torch.equal(pool[:S], w[:S]), count  # the scratch slot S: only the reference writes it


def test_more_chunks_than_grid_axis_one_holds() -> None:
    """40000 + 30000 chunks of 256 per entry: more than 65535, which fits axis 0 only."""
    from edgemoe.kernels.miss_copy import copy_rows_pair

    banks = pinned_bank((M, 40000, 256), torch.bfloat16, 2), pinned_bank((M, 30000, 256), torch.bfloat16, 3)
    pools = tuple(torch.zeros(S + 1, *b.shape[1:], dtype=b.dtype, device="cuda") for b in banks)
    src, dst, n = random_list(M, 2, torch.Generator().manual_seed(4))
    want = expected(pools, banks, src, dst)
    copy_rows_pair(pools, banks, src, dst, n, block=256)
    for pool, w in zip(pools, want):
        assert torch.equal(pool[:S], w[:S])


def make_cache(E: int = 12) -> tuple[ExpertCache, tuple[torch.Tensor, torch.Tensor]]:
    cache = ExpertCache(1, E, S, "lru", "cuda", 10)
    cache.attach_pool(
        torch.zeros(S + 1, 64, 96, dtype=torch.bfloat16, device="cuda"),
        torch.zeros(S + 1, 96, 32, dtype=torch.bfloat16, device="cuda"),
    )
    return cache, (pinned_bank((E, 64, 96), torch.bfloat16, 5), pinned_bank((E, 96, 32), torch.bfloat16, 6))


def test_copy_missing_is_one_launch_without_sync() -> None:
    cache, banks = make_cache()
    ids = torch.tensor([[1, 4, 7]], device="cuda")
    cache.copy_missing(cache.ensure(0, ids), *banks)  # compiles (may sync)
    got = cache.ensure(0, torch.tensor([[2, 4, 9]], device="cuda"))
    torch.cuda.synchronize()
    ops = record(lambda: cache.copy_missing(got, *banks), steps=1)
    assert len(ops) == 1 and ops[0].kernel and MISS_COPY in ops[0].name, ops  # the profiler still finds it
    torch.cuda.synchronize()
    with host_sync_forbidden():
        cache.copy_missing(got, *banks)
    for pool, bank in zip((cache.pool_a, cache.pool_b), banks):
        assert torch.equal(pool[cache.slot_table()[0, [2, 4, 9]]].cpu(), bank[[2, 4, 9]])


def test_cuda_graph_replays_new_copy_lists() -> None:
    """Captured once over a static copy list; each replay copies the list written into it (count 0 included)."""
    from edgemoe.kernels.miss_copy import copy_rows_pair

    E = 12
    banks = pinned_bank((E, 1536, 2048), torch.bfloat16, 7), pinned_bank((E, 2048, 768), torch.bfloat16, 8)
    pools = tuple(torch.zeros(S + 1, *b.shape[1:], dtype=b.dtype, device="cuda") for b in banks)
    gen = torch.Generator().manual_seed(10)
    src, dst, n = random_list(E, M, gen)  # static buffers of the graph
    graph, _ = capture_graph(lambda: copy_rows_pair(pools, banks, src, dst, n))
    for count in (3, 0, M, 1):
        for pool in pools:
            pool.normal_(generator=torch.Generator(device="cuda").manual_seed(count))
        new_src, new_dst, new_n = random_list(E, count, gen)
        for static, new in ((src, new_src), (dst, new_dst), (n, new_n)):
            static.copy_(new)
        want = expected(pools, banks, src, dst)
        graph.replay()
        for pool, w in zip(pools, want):
            assert torch.equal(pool[:S], w[:S]), count
