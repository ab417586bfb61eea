"""The copy service on CUDA (`edgemoe.moe.copy_service`): the GPU posts copy lists, a host thread copies the rows by
the copy engine. Ensure + post + the per-entry wait captured in a CUDA graph and replayed against the CPU cache and
the banks' rows, bitwise; posting is one launch without host synchronisation (empty lists included); the engine's
offloaded caches run through the service, and prefill waits for its copies (tokens as resident)."""

from __future__ import annotations

import pytest
import torch

from edgemoe import LLM, SamplingParams
from edgemoe.moe.expert_cache import POLICIES, ExpertCache
from tests.gpu.sync_free import host_sync_forbidden
from tests.gpu.test_expert_offload import pinned_bank
from tests.moe.test_expert_cache import random_trace

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def make_cache(L: int, E: int, S: int, policy: str, rows: tuple[tuple[int, int], ...]):
    banks = [tuple(pinned_bank((E, *r), torch.bfloat16, 10 * i + k) for k, r in enumerate(rows)) for i in range(L)]
    cache = ExpertCache(L, E, S, policy, "cuda", 10)
    cache.attach_pool(*(torch.zeros(S + 1, *r, dtype=torch.bfloat16, device="cuda") for r in rows))
    cache.start_copy_service()
    return cache, banks


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("rows", [((16, 8), (8, 8)), ((1536, 2048), (2048, 768))])  # tiny; qwen3-30b-a3b's
def test_graph_replays_post_and_wait(policy: str, rows: tuple) -> None:
    L, E, S, tokens, top_k = 3, 12, 9, 2, 3
    gpu, banks = make_cache(L, E, S, policy, rows)
    cpu = ExpertCache(L, E, S, policy, "cpu", 10)
    ids = torch.zeros(L, tokens, top_k, dtype=torch.long, device="cuda")  # static input of the graph

    def step() -> list[tuple[torch.Tensor, ...]]:
        out = []  # per layer: slots and the rows read from them right away (a later layer may evict them)
        for layer in range(L):
            got = gpu.ensure(layer, ids[layer])
            gpu.copy_missing(got, *banks[layer])
            gpu.await_copy(got)
            out.append((got.slots, gpu.w13[got.slots], gpu.w2[got.slots]))
        return out

    trace = random_trace(12, L, E, tokens, top_k, skew=0.8, seed=9)
    ids.copy_(trace[0])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up (compiles the kernels) outside the capture
    torch.cuda.current_stream().wait_stream(side)
    for layer in range(L):
        cpu.ensure(layer, trace[0][layer])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    for step_ids in trace[1:]:
        ids.copy_(step_ids)
        graph.replay()
        torch.cuda.synchronize()  # not the blocking copies of .cpu() while the GPU waits on the service (settle)
        for layer in range(L):
            want = cpu.ensure(layer, step_ids[layer])
            slots, w13, w2 = outputs[layer]
            assert torch.equal(slots.cpu(), want.slots)
            assert torch.equal(w13.view(torch.int16).cpu(), banks[layer][0][step_ids[layer]].view(torch.int16))
            assert torch.equal(w2.view(torch.int16).cpu(), banks[layer][1][step_ids[layer]].view(torch.int16))
    misses = int(gpu.stats[:, 2].sum())
    assert misses > S, "the replays must miss and copy"
    assert gpu.copy_service.served == int(gpu.copy_service.tick) > 0  # every non-empty list, and only those
    gpu.copy_service.check()


def test_post_is_one_launch_without_sync() -> None:
    cache, banks = make_cache(1, 12, 7, "lru", ((64, 96), (96, 32)))
    first = cache.ensure(0, torch.tensor([[1, 4, 7]], device="cuda"))
    cache.copy_missing(first, *banks[0])  # compiles (may sync)
    cache.await_copy(first)
    for ids in ([[2, 4, 9]], [[2, 4, 9]]):  # misses, then every expert hits (an empty list)
        got = cache.ensure(0, torch.tensor(ids, device="cuda"))
        torch.cuda.synchronize()
        with host_sync_forbidden():
            cache.copy_missing(got, *banks[0])
            cache.await_copy(got)
        for pool, bank in zip((cache.w13, cache.w2), banks[0]):
            assert torch.equal(pool[cache.slot_table()[0, [2, 4, 9]]].cpu(), bank[[2, 4, 9]])
    assert cache.copy_service.served == 2  # the empty list was not posted


def test_engine_offload_runs_through_the_service() -> None:
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    prompts = ["ROMEO.\n", "To be, or not to be, that is the question: " * 6]  # the second prefills in waves

    def run(**kwargs) -> list[list[int]]:
        llm = LLM(device="cuda", dtype="bfloat16", progress=False, max_num_seqs=2, max_model_len=256, **kwargs)
        out = [o.token_ids for o in llm.generate(prompts, greedy)]
        cache = llm.engine.expert_cache
        if cache is not None:
            assert cache.copy_service is not None and cache.copy_service.served > 0
            cache.copy_service.check()
        return out

    want = run()
    assert run(moe_strategy="offload", moe_cache_slots=8) == want
    assert run(moe_strategy="offload", moe_cache_slots=8, cuda_graphs=False) == want
