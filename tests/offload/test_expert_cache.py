"""ExpertCache.ensure against its plain-Python reference, invariants, the plain-torch miss copy, and stats."""

from __future__ import annotations

import pytest
import torch

from edgemoe.moe.reference import EnsureReference
from edgemoe.offload.expert_cache import ExpertCache
from edgemoe.offload.policies import POLICIES, Scored


def random_trace(steps: int, layers: int, experts: int, tokens: int, top_k: int, skew: float, seed: int):
    """[steps, layers, tokens, top_k] expert ids, distinct per token; skew > 0 favours low ids (Zipf-like)."""
    gen = torch.Generator().manual_seed(seed)
    weights = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64) ** skew
    out = torch.empty(steps, layers, tokens, top_k, dtype=torch.long)
    for s in range(steps):
        for layer in range(layers):
            perm = torch.randperm(experts, generator=gen)  # a different favourite set per layer
            for t in range(tokens):
                out[s, layer, t] = perm[torch.multinomial(weights, top_k, generator=gen)]
    return out


def check_invariants(cache: ExpertCache) -> None:
    L, E, S = cache.num_layers, cache.num_experts, cache.num_slots
    slot_of, owner = cache.slot_of[:-1], cache.owner[:-1]
    assert cache.owner[S] == -1, "the scratch slot never gets an owner"
    for key in range(L * E):
        s = int(slot_of[key])
        assert s == -1 or int(owner[s]) == key
    for s in range(S):
        k = int(owner[s])
        assert k == -1 or int(slot_of[k]) == s


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("slots", [4, 7, 13, 24])  # 4: the minimum (2 tokens x top-2); 24: every expert
def test_ensure_matches_reference(policy: str, slots: int) -> None:
    L, E, tokens, top_k = 3, 8, 2, 2
    trace = random_trace(40, L, E, tokens, top_k, skew=1.0, seed=slots)
    cache = ExpertCache(L, E, slots, policy, expert_bytes=100)
    ref = EnsureReference(L, E, slots, policy, Scored.FREQ, Scored.REUSE)
    misses = 0
    for step in trace:
        for layer, ids in enumerate(step):
            before = cache.owner.clone()
            got = cache.ensure(layer, ids)
            want = ref.ensure(layer, ids.flatten().tolist())
            n = int(got.count)
            misses += n
            assert n == len(want["misses"])
            assert got.src[:n].tolist() == [e for e, _, _ in want["copies"]]
            assert got.dst[:n].tolist() == [s for _, s, _ in want["copies"]]
            evicted = [-1 if old is None else old[0] * E + old[1] for _, _, old in want["copies"]]
            assert before[got.dst[:n]].tolist() == evicted
            assert got.dst[n:].eq(slots).all() and got.src[n:].eq(0).all(), "padding: scratch slot, expert 0"
            assert got.slots.flatten().tolist() == want["slots"]
            # each token's experts are now in the slots it reads
            assert (cache.owner[got.slots] == layer * E + ids).all()
        check_invariants(cache)
        table = cache.slot_table().tolist()
        assert {(lay, e): s for lay, row in enumerate(table) for e, s in enumerate(row) if s >= 0} == ref.slot_of
    if slots < L * E:
        assert misses > slots and int(cache.stats[:, 3].sum()) > 0, "small caches must miss and evict"


def test_stats_invariants() -> None:
    L, E = 4, 16
    trace = random_trace(30, L, E, 1, 4, skew=1.2, seed=1)
    cache = ExpertCache(L, E, 20, "scored", expert_bytes=1234)
    for step in trace:
        for layer, ids in enumerate(step):
            cache.ensure(layer, ids)
    stats = cache.stats_dict()
    total = stats["total"]
    assert total["hits"] + total["misses"] == total["accesses"] > 0
    assert total["bytes_copied"] == 1234 * total["misses"]
    assert 0 < total["hits"] and total["evictions"] == total["misses"] - 20  # the pool filled once, then evicted
    for row in stats["layers"]:
        assert row["hits"] + row["misses"] == row["accesses"]


def test_never_evicts_what_the_layer_needs() -> None:
    cache = ExpertCache(2, 8, 4, "lru")
    cache.ensure(0, torch.tensor([[0, 1]]))
    cache.ensure(1, torch.tensor([[2, 3]]))
    got = cache.ensure(0, torch.tensor([[0, 1], [4, 5]]))  # 0 and 1 are oldest but needed: 2, 3 go
    assert sorted(got.dst[: int(got.count)].tolist()) == [2, 3]
    assert cache.slot_table()[1].eq(-1).all()


def test_copy_missing_moves_the_listed_rows() -> None:
    L, E, S, inter, hidden = 2, 6, 5, 3, 4
    banks = [(torch.randn(E, 2 * inter, hidden), torch.randn(E, hidden, inter)) for _ in range(L)]
    cache = ExpertCache(L, E, S, "lru")
    cache.attach_pool(torch.zeros(S + 1, 2 * inter, hidden), torch.zeros(S + 1, hidden, inter))
    trace = random_trace(10, L, E, 2, 2, skew=0.5, seed=3)
    for step in trace:
        for layer, ids in enumerate(step):
            got = cache.ensure(layer, ids)
            cache.copy_missing(got, *banks[layer])
            assert torch.equal(cache.pool_a[got.slots], banks[layer][0][ids])
            assert torch.equal(cache.pool_b[got.slots], banks[layer][1][ids])


def test_the_configured_policies_are_the_cache_s() -> None:
    """config.MOE_POLICIES (what moe_policy accepts, without importing the cache) names exactly its policies."""
    from edgemoe.config import MOE_POLICIES
    from edgemoe.offload.policies import POLICIES

    assert MOE_POLICIES == tuple(POLICIES)
