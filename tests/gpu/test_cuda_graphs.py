"""Decode CUDA graphs: token-identical to eager decode for resident and offloaded experts, every policy,
batch sizes 1-4 (3 pads to 4); the expert-cache counters agree between replay and eager."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from edgemoe import LLM, SamplingParams
from edgemoe.engine.cuda_graphs import capture_graph

PROMPTS = ["ROMEO.\n", "Of Man's first disobedience", "To be, or not to be, that is the question:", "KING."]
GREEDY = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)


def run(graphs: bool, n: int, **kwargs) -> tuple[list[list[int]], LLM]:
    llm = LLM(device="cuda", progress=False, cuda_graphs=graphs, max_num_seqs=4, **kwargs)
    g = llm.engine.runner.graphs
    assert (g is not None) == graphs
    replays = []
    if g is not None:
        original = g.replay
        g.replay = lambda *a: (replays.append(1), original(*a))[1]
    out = [o.token_ids for o in llm.generate(PROMPTS[:n], GREEDY)]
    assert len(replays) >= (GREEDY.max_tokens - 1 if graphs else 0)  # every decode step replayed
    return out, llm


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_resident_graphs_match_eager(dtype, n) -> None:
    eager, _ = run(False, n, dtype=dtype)
    replayed, llm = run(True, n, dtype=dtype)
    assert replayed == eager
    assert sorted(llm.engine.runner.graphs.graphs) == [1, 2, 4]


@pytest.mark.parametrize("policy", ["lru", "scored"])
def test_offloaded_graphs_match_eager_and_count_the_same(policy) -> None:
    opts = dict(dtype="bfloat16", moe_strategy="offload", moe_cache_slots=40, moe_policy=policy, moe_collect_stats=True)
    eager, a = run(False, 3, **opts)
    replayed, b = run(True, 3, **opts)
    assert replayed == eager
    resident, _ = run(True, 3, dtype="bfloat16")
    assert replayed == resident
    sa, sb = a.moe_stats()["total"], b.moe_stats()["total"]
    assert sa == sb and sa["misses"] > 0


def test_capture_collects_garbage_before_and_never_during() -> None:
    """A dead graph in a reference cycle is freed before a capture begins, and the collector cannot run during one:
    a graph destroyed mid-capture invalidates the capture (the engines of this file, whose `replay` wrappers make
    cycles, once broke a later engine's capture that way)."""
    x = torch.randn(256, device="cuda")
    dead = {"graph": capture_graph(lambda: x * 2)[0]}
    dead["self"] = dead
    graph_ref = weakref.ref(dead["graph"])
    del dead
    enabled = []
    graph, y = capture_graph(lambda: (enabled.append(gc.isenabled()), x * 3)[1])
    assert graph_ref() is None, "the dead graph was not collected before the capture"
    assert enabled == [True, False] and gc.isenabled()  # on for the eager warm-up, off while captured, on again
    x.copy_(torch.randn(256, device="cuda"))
    graph.replay()
    torch.testing.assert_close(y, x * 3)


def test_routing_is_recorded_with_graphs_on(tmp_path) -> None:
    """`--record-routing` keeps CUDA graphs on (the routing seam writes each layer's ids into a buffer the graphs
    captured) and records exactly what eager decode records."""
    import numpy as np

    traces = {}
    for graphs in (False, True):
        path = tmp_path / f"graphs-{graphs}.npy"
        llm = LLM(device="cuda", dtype="float32", progress=False, cuda_graphs=graphs, record_routing=str(path))
        assert (llm.engine.runner.graphs is not None) == graphs
        llm.generate(PROMPTS[:2], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
        traces[graphs] = np.load(path)
    assert traces[True].shape == (11, 7, 4) and np.array_equal(traces[True], traces[False])
    assert len(np.unique(traces[True])) > 4 and traces[True].max() < 32  # real routing, not an unwritten buffer
