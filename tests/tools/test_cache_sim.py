"""The cache simulator: lru against an independent LRU, Belady's MIN against brute force and as every policy's bound,
routing traces recorded by the engine, and the `edgemoe cache-sim` command."""

from __future__ import annotations

import functools
import itertools
import json

import numpy as np
import pytest

from edgemoe import LLM, SamplingParams
from edgemoe.cli import main
from edgemoe.tools.cache_sim import POLICIES, belady, min_slots, simulate, synthetic_trace
from tests.engine.test_speculative import Open


def tiny_lru(trace: np.ndarray, slots: int) -> int:
    """Hits of a plain LRU over slots: evict the slot with the oldest last use (then the lowest slot); each layer-step
    touches its distinct experts at one time."""
    where: dict[tuple[int, int], int] = {}  # (layer, expert) -> slot
    owner, last = [None] * slots, [0] * slots
    hits, now = 0, 0
    for step in trace:
        for layer, ids in enumerate(step):
            now += 1
            needed = sorted(set(ids.tolist()))
            busy = {where[layer, e] for e in needed if (layer, e) in where}
            hits += len(busy)
            for e in needed:
                if (layer, e) not in where:
                    free = [s for s in range(slots) if owner[s] is None]
                    s = free[0] if free else min((s for s in range(slots) if s not in busy), key=lambda s: (last[s], s))
                    if owner[s] is not None:
                        del where[owner[s]]
                    owner[s], where[layer, e] = (layer, e), s
                    busy.add(s)
            for e in needed:
                last[where[layer, e]] = now
    return hits


def optimal_hits(trace: np.ndarray, slots: int) -> int:
    """Most hits of any eviction choice (exhaustive search, tiny traces only)."""
    steps = [(layer, frozenset(step[layer].tolist())) for step in trace for layer in range(trace.shape[1])]

    @functools.cache
    def best(t: int, resident: frozenset) -> int:
        if t == len(steps):
            return 0
        layer, needed = steps[t]
        keys = {(layer, e) for e in needed}
        hits, missing = len(keys & resident), keys - resident
        evictable = sorted(resident - keys)
        n_evict = max(0, len(resident) + len(missing) - slots)
        return hits + max(
            best(t + 1, (resident - set(out)) | keys) for out in itertools.combinations(evictable, n_evict)
        )

    return best(0, frozenset())


@pytest.mark.parametrize("slots", [2, 3, 5, 9])
def test_lru_matches_an_independent_lru(slots: int) -> None:
    for trace in (synthetic_trace(60, 3, 6, 2, skew=1.0, seed=slots), synthetic_trace(60, 4, 5, 1, seed=slots)):
        assert simulate(trace, slots, "lru")["hits"] == tiny_lru(trace, slots)


def test_belady_is_optimal_on_tiny_traces() -> None:
    for seed in range(4):
        trace = synthetic_trace(7, 2, 4, 1 + seed % 2, skew=0.5, repeat=0.2, seed=seed)
        for slots in range(min_slots(trace), 5):
            hits, _ = belady(trace, slots)
            assert hits == optimal_hits(trace, slots), (seed, slots)


@pytest.mark.parametrize("skew, repeat", [(0.0, 0.0), (1.0, 0.3), (0.6, 0.7)])
def test_belady_bounds_every_policy(skew: float, repeat: float) -> None:
    trace = synthetic_trace(120, 6, 32, 4, skew=skew, repeat=repeat, seed=7)
    for slots in (8, 48, 96, 150):
        bound = simulate(trace, slots, "belady")
        assert bound["hits"] + bound["misses"] == sum(len(set(ids.tolist())) for step in trace for ids in step)
        for policy in POLICIES:
            r = simulate(trace, slots, policy)
            assert r["hits"] <= bound["hits"] and r["hits"] + r["misses"] == bound["hits"] + bound["misses"]
        if slots < 150:
            assert bound["misses"] > len({(layer, e) for step in trace for layer, ids in enumerate(step) for e in ids})


def test_recorded_trace_replays(tmp_path, capsys) -> None:
    paths = {}
    for strategy, extra in (("resident", {}), ("offload", dict(moe_cache_slots=20))):
        paths[strategy] = tmp_path / f"{strategy}.npy"
        llm = LLM(progress=False, max_num_seqs=2, moe_strategy=strategy, record_routing=str(paths[strategy]), **extra)
        llm.generate(["To be, or not", "Of Man's first"], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    trace = np.load(paths["resident"])
    assert trace.dtype == np.int32 and trace.shape == (9, 7, 4)  # 10 tokens: the first comes from prefill
    assert trace.min() >= 0 and trace.max() < 32 and min_slots(trace) == 4
    assert np.array_equal(trace, np.load(paths["offload"])), "offload routes exactly as resident"
    # with prompt lookup, a verify step's accepted rows are recorded a token each: the same trace
    spec = tmp_path / "spec.npy"
    llm = LLM(progress=False, max_num_seqs=6, record_routing=str(spec), speculative="ngram")
    llm.engine.gate = Open()
    llm.generate(["To be, or not to be, or not to be, or not"], SamplingParams(max_tokens=12, temperature=0,
                                                                              ignore_eos=True))  # fmt: skip
    plain = tmp_path / "plain.npy"
    LLM(progress=False, max_num_seqs=6, record_routing=str(plain)).generate(
        ["To be, or not to be, or not to be, or not"], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    )
    assert llm.engine.speculative.accepted > 0 and np.array_equal(np.load(spec), np.load(plain))

    assert main(["cache-sim", str(paths["resident"]), "--slots", "56", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert list(out) == ["lru", "scored", "belady"]
    for r in out.values():
        assert r["hits"] + r["misses"] == sum(len(set(ids)) for step in trace.tolist() for ids in step)
        assert r["hit_rate"] == pytest.approx(r["hits"] / (r["hits"] + r["misses"]))
    assert out["belady"]["hits"] >= max(out["lru"]["hits"], out["scored"]["hits"])
    assert main(["cache-sim", str(paths["resident"]), "--slots", "56", "--policy", "belady"]) == 0
    assert "belady: hit rate" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--slots", "3"], "--slots 3 is too small: one layer-step of this trace needs 4"),
        (["--slots", "9", "--policy", "lru,fifo"], "unknown policy fifo"),
    ],
)
def test_cache_sim_errors(tmp_path, capsys, argv: list[str], message: str) -> None:
    path = tmp_path / "t.npy"
    np.save(path, synthetic_trace(5, 2, 8, 4, seed=0))
    assert main(["cache-sim", str(path), *argv]) == 2
    assert f"edgemoe: error: {message}" in capsys.readouterr().err
    np.save(path, np.zeros((3, 4)))
    assert main(["cache-sim", str(path), "--slots", "9"]) == 2
    assert "is not a routing trace" in capsys.readouterr().err
    assert main(["cache-sim", str(tmp_path / "missing.npy"), "--slots", "9"]) == 2
    assert "does not exist" in capsys.readouterr().err
