"""The decode-graph runner's own logic on the CPU: static buffers, padding to the captured batch size, padding
rows routed to row 0's experts. Capture is swapped for an eager call of the same static-buffer forward (graphs
themselves are CUDA-only: tests/gpu/test_cuda_graphs.py replays real ones)."""

from __future__ import annotations

import pytest

from edgemoe import LLM, SamplingParams
from edgemoe.engine.cuda_graphs import DecodeGraphs, default_batch_sizes

PROMPTS = ["ROMEO.\n", "Of Man's first disobedience", "To be, or not to be, that is the question:", "KING."]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


class EagerGraph:
    def __init__(self, fn) -> None:
        self.fn = fn

    def replay(self) -> None:
        self.fn()


def emulate_capture(graphs: DecodeGraphs, forward) -> None:
    """`DecodeGraphs.capture` with each graph an eager call of the same static-buffer forward."""
    for b in graphs.sizes:
        graphs.logits[b] = forward(b).clone()
        graphs.graphs[b] = EagerGraph(lambda b=b: graphs.logits[b].copy_(forward(b)))


def with_graphs(llm: LLM) -> list[int]:
    engine = llm.engine
    graphs = DecodeGraphs(default_batch_sizes(4))
    emulate_capture(graphs, engine.runner.forward_static)
    if engine.expert_cache is not None:
        engine.expert_cache.reset()
    engine.runner.graphs = graphs
    used = []
    original = graphs.replay
    graphs.replay = lambda b: (used.append(b), original(b))[1]
    return used


def test_default_batch_sizes() -> None:
    assert (
        default_batch_sizes(1) == [1] and default_batch_sizes(4) == [1, 2, 4] and default_batch_sizes(6) == [1, 2, 4, 6]
    )


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("offload", [False, True])
def test_padded_replay_matches_eager(n, offload) -> None:
    opts = dict(progress=False, max_num_seqs=4)
    if offload:
        opts.update(moe_strategy="offload", moe_cache_slots=40, moe_collect_stats=True)
    eager = LLM(**opts)
    graphed = LLM(**opts)
    used = with_graphs(graphed)
    a = [o.token_ids for o in eager.generate(PROMPTS[:n], GREEDY)]
    b = [o.token_ids for o in graphed.generate(PROMPTS[:n], GREEDY)]
    assert a == b
    assert len(used) == GREEDY.max_tokens - 1 and set(used) == {1 if n == 1 else 4}
    if offload:  # padding rows fetch and count nothing
        assert eager.moe_stats()["total"] == graphed.moe_stats()["total"]
