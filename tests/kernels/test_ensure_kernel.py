"""The Triton kernels against their plain-torch oracles, on the CPU under Triton's interpreter (see conftest.py):
the fused `ensure` against `ExpertCache._ensure_torch` (every returned and every state tensor, after every call;
it also zeroes the miss copy's arrival counters), and the miss copy against `copy_rows_reference`."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from edgemoe.kernels.ensure import ensure_fused  # noqa: E402
from edgemoe.kernels.miss_copy import copy_rows  # noqa: E402
from edgemoe.offload.cpu_split import Costs, fit, manual_table  # noqa: E402
from edgemoe.offload.expert_cache import ExpertCache, copy_rows_reference  # noqa: E402
from edgemoe.offload.policies import POLICIES  # noqa: E402
from tests.kernels import interpreter_only  # noqa: E402
from tests.offload.test_expert_cache import check_invariants, random_trace  # noqa: E402

# Scored keys divide by a zero chance of use on purpose (-> inf, clamped); numpy warns about it
pytestmark = [interpreter_only, pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")]


def state(cache: ExpertCache) -> dict[str, torch.Tensor]:
    tensors = {f"policy.{k}": v for k, v in vars(cache.policy).items() if isinstance(v, torch.Tensor)}
    return {"slot_of": cache.slot_of, "owner": cache.owner, "clock": cache.clock, "stats": cache.stats, **tensors}


def compare(
    want: ExpertCache, got: ExpertCache, trace: torch.Tensor, block_s: int, cpu_take: torch.Tensor | None = None
) -> int:
    """Feed `trace` [steps, layers, tokens, top_k] to both caches (with the CPU split's table `cpu_take`); -> the
    number of misses."""
    misses = 0
    for step in trace:
        for layer, ids in enumerate(step):
            if got.arrival_counters is not None:
                got.arrival_counters.fill_(-3)  # what the last miss copy left
            a = want._ensure_torch(layer, ids, cpu_take)
            b = ensure_fused(got, layer, ids, block_s=block_s, cpu_take=cpu_take)
            assert (got.arrival_counters[: b.src.numel()] == 0).all()  # zeroed for the copy that follows
            assert not a.posted and not b.posted  # no copy service here
            for field in ("slots", "src", "dst", "count", "cpu", "cpu_count"):
                x, y = getattr(a, field), getattr(b, field)
                assert x.dtype == y.dtype and torch.equal(x, y), (field, x, y)
            for name, x in state(want).items():
                assert torch.equal(x, state(got)[name]), (name, layer, x, state(got)[name])
            misses += int(a.count) + int(a.cpu_count)
    check_invariants(got)
    return misses


# (layers, experts, slots, tokens, top_k, skew, block_s): slots from the minimum (tokens x top_k) to every
# expert; 60 experts: not a power of two; block_s below slots: the victim search over several blocks
CASES = [
    (3, 8, 4, 2, 2, 1.0, 1024),
    (3, 8, 24, 2, 2, 1.0, 1024),
    (3, 8, 7, 1, 2, 0.0, 1024),
    (2, 60, 12, 3, 4, 1.0, 4),
    (2, 60, 50, 3, 4, 0.0, 16),
    (4, 16, 20, 1, 4, 1.5, 8),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "L{}-E{}-S{}-t{}-k{}-skew{}-b{}".format(*c))
@pytest.mark.parametrize("collect_stats", [True, False])
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_fused_ensure_matches_torch(policy: str, collect_stats: bool, case: tuple) -> None:
    L, E, S, tokens, top_k, skew, block_s = case
    trace = random_trace(8, L, E, tokens, top_k, skew, seed=S + int(collect_stats))
    want, got = (ExpertCache(L, E, S, policy, expert_bytes=1000, collect_stats=collect_stats) for _ in range(2))
    misses = compare(want, got, trace, block_s)
    if S < L * E:
        assert misses > S, "small caches must evict"


@pytest.mark.parametrize("case", [CASES[0], CASES[3], CASES[5]], ids=["E8-S4", "E60-S12-blocks", "E16-S20-blocks"])
@pytest.mark.parametrize("split", ["cap1", "cap2", "all", "fitted"])
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_fused_ensure_cpu_split_matches_torch(policy: str, split: str, case: tuple) -> None:
    """The CPU split's table: the last misses to the CPU (no slot, no eviction), stats counting them apart."""
    L, E, S, tokens, top_k, skew, block_s = case
    table = {"cap1": manual_table(1, E), "cap2": manual_table(2, E), "all": manual_table(E, E),
             "fitted": fit(Costs(copy=1.0, cpu=0.8, overhead=1.5), E)}[split]  # fmt: skip
    trace = random_trace(8, L, E, tokens, top_k, skew, seed=S)
    want, got = (ExpertCache(L, E, S, policy, expert_bytes=1000) for _ in range(2))
    compare(want, got, trace, block_s, torch.tensor(table, dtype=torch.int32))
    assert int(got.stats[:, 5].sum()) > 0, "some misses were computed on the CPU"


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_fused_ensure_many_ids_and_reset(policy: str) -> None:
    """More ids than one block of them (prefill-like, every expert fits), then both caches reset and go on."""
    L, E, S = 2, 16, 16
    want, got = (ExpertCache(L, E, S, policy, expert_bytes=3) for _ in range(2))
    compare(want, got, random_trace(3, L, E, 40, 8, skew=1.0, seed=7), block_s=8)  # 320 ids a call
    for cache in (want, got):
        cache.reset()
    compare(want, got, random_trace(4, L, E, 2, 3, skew=0.5, seed=8), block_s=8)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_fused_ensure_more_seeds(policy: str) -> None:
    L, E, S = 3, 12, 9
    for seed in range(3):
        want, got = (ExpertCache(L, E, S, policy, expert_bytes=5) for _ in range(2))
        compare(want, got, random_trace(6, L, E, 2, 3, skew=0.8, seed=seed), block_s=4)


@pytest.mark.parametrize("block_s", [1, 4])
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_fused_ensure_passes_over_hits_ranked_first(policy: str, block_s: int) -> None:
    """A hit in the slot the policy would evict first: the victim search (keys computed before the call's ids are
    known) must pass over it. LRU: three experts fill three slots in one call, so their keys tie and the lowest
    slot, expert 0's, ranks first; the next call needs expert 0 again and a new one. One block of keys (4) and a
    block a slot (1)."""
    want, got = (ExpertCache(1, 6, 3, policy, expert_bytes=7) for _ in range(2))
    trace = torch.tensor([[[[0, 1, 2]]], [[[3, 0, 0]]], [[[4, 5, 3]]]])  # [steps, layers, tokens, top_k]
    compare(want, got, trace[:2], block_s)
    if policy == "lru":
        assert int(got.slot_of[3]) == 1 and int(got.slot_of[0]) == 0  # slot 0 kept its hit, slot 1 taken
    compare(want, got, trace[2:], block_s)


@pytest.mark.parametrize("shape", [(9, 3, 5), (16, 8, 8)])
def test_copy_rows_matches_reference(shape: tuple[int, ...]) -> None:
    E, S, M = shape[0], 7, 5
    gen = torch.Generator().manual_seed(E)
    bank = torch.randn(shape, generator=gen)
    for count in (0, 2, M):
        pool = torch.randn(S + 1, *shape[1:], generator=gen)
        expected = pool.clone()
        src, dst = torch.randperm(E, generator=gen)[:M], torch.randperm(S, generator=gen)[:M]
        valid = torch.arange(M) < count
        copy_rows_reference(expected, bank, torch.where(valid, src, 0), torch.where(valid, dst, S))
        copy_rows(pool, bank, src, dst, torch.tensor(count), block=8)  # 8: rows of several blocks, a partial one
        assert torch.equal(pool[:S], expected[:S]), count
