"""The shared expert on its side stream: the stream is our own (never a graph's capture stream), eager, capture
and replay work with it, outputs are token-identical with overlap on and off (x graphs x policy), and the profiler
sees the side stream's kernels beside the miss copy."""

from __future__ import annotations

import pytest
import torch

from edgemoe import LLM, SamplingParams
from edgemoe.engine.streams import side_stream
from edgemoe.moe.layer import SparseMoE
from edgemoe.tools.profiler import record, summarize

PROMPTS = ["ROMEO.\n", "Of Man's first disobedience", "To be, or not to be, that is the question:"]
GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


def test_side_stream_is_ours_and_not_the_capture_stream() -> None:
    side = side_stream(torch.cuda.current_device())
    assert side is side_stream(torch.cuda.current_device()), "one per device"
    assert side.priority <= torch.cuda.Stream.priority_range()[1], "at least torch's highest priority"
    pool = [torch.cuda.Stream() for _ in range(64)]  # torch's round-robin pool, wrapped around
    assert side.cuda_stream not in {s.cuda_stream for s in pool}
    x = torch.randn(64, 64, device="cuda")
    with torch.cuda.stream(side):  # cuBLAS sets up per stream, which capture forbids: warm up first, as engines do
        x @ x
    torch.cuda.synchronize()
    graph, seen = torch.cuda.CUDAGraph(), {}
    with torch.cuda.graph(graph):
        capture = torch.cuda.current_stream()
        seen["capture"] = capture.cuda_stream
        side.wait_stream(capture)
        with torch.cuda.stream(side):
            y = x @ x
        capture.wait_stream(side)
        z = y + 1
    assert seen["capture"] != side.cuda_stream
    x.copy_(torch.randn(64, 64, device="cuda"))
    graph.replay()
    torch.testing.assert_close(z, x @ x + 1)


def generate(**kwargs) -> tuple[list[list[int]], LLM]:
    llm = LLM(device="cuda", dtype="bfloat16", progress=False, max_num_seqs=4, **kwargs)
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)], llm


@pytest.mark.parametrize("policy", ["lru", "scored"])
def test_overlap_on_off_graphs_on_off_token_identical(policy: str) -> None:
    opts = dict(moe_strategy="offload", moe_cache_slots=40, moe_policy=policy, moe_collect_stats=True)
    outs, stats = {}, {}
    for overlap in (False, True):
        for graphs in (False, True):
            outs[overlap, graphs], llm = generate(shared_expert_overlap=overlap, cuda_graphs=graphs, **opts)
            moe = [m for m in llm.engine.model.modules() if isinstance(m, SparseMoE)]
            assert all((m.side_stream is not None) == overlap for m in moe)
            stats[overlap, graphs] = llm.moe_stats()["total"]
    first = outs[False, False]
    assert all(o == first for o in outs.values())
    assert all(s == stats[False, False] for s in stats.values()) and stats[False, False]["misses"] > 0
    for overlap in (True, False):  # resident: on by default too
        resident, llm = generate(shared_expert_overlap=overlap)
        assert resident == first
        moe = [m for m in llm.engine.model.modules() if isinstance(m, SparseMoE)]
        assert all((m.side_stream is not None) == overlap for m in moe)


def test_profiler_sees_the_side_stream_beside_the_miss_copy() -> None:
    _, llm = generate(moe_strategy="offload", moe_cache_slots=20, moe_policy="lru")
    engine = llm.engine
    engine.add_request("ROMEO.\n", SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
    engine.step()  # prefill
    runner, seq = engine.runner, engine.scheduler.running[0]
    pos, bs = seq.num_computed, engine.kv.block_size
    slot = seq.block_table[pos // bs] * bs + pos % bs
    runner.decode.fill([seq.token_ids[-1]], [pos], [slot], [pos + 1], [0], [list(seq.block_table)])

    def replay() -> None:  # the same decode step again and again (it rewrites one KV slot)
        runner.graphs.replay(1)

    steps = 4
    got = summarize(record(replay, steps), steps)
    assert len(got["streams"]) >= 2, "the fork puts one branch of each layer on a stream of its own"
    layers = sum(isinstance(m, SparseMoE) for m in engine.model.modules())
    assert got["kernels"] > 20 * layers
    assert got["shared_us"] > 0 and 0 <= got["overlap"] <= 1
