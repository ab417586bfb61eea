"""The copy service on CUDA (`edgemoe.offload.copy_service`): captured decode steps post copy lists, and `replay` serves
them by the copy engine. Ensure + post + the wait captured in a CUDA graph and replayed against the CPU cache and
the banks' rows, bitwise, with an expert's two rows apart or side by side (one copy); eager calls keep the SM copy
and post nothing; the capture records the service, without host synchronisation; the engine's graphs run through
the service (tokens as resident, eager and graphs)"""

from __future__ import annotations

import pytest
import torch

from edgemoe import LLM, SamplingParams
from edgemoe.engine.cuda_graphs import capture_graph
from edgemoe.offload.expert_cache import ExpertCache
from edgemoe.offload.layout import split_rows
from edgemoe.offload.policies import POLICIES
from tests.gpu.sync_free import host_sync_forbidden
from tests.gpu.test_expert_offload import ensure_copy_read, pinned_bank
from tests.offload.test_expert_cache import random_trace

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def make_cache(L: int, E: int, S: int, policy: str, rows: tuple[tuple[int, int], ...], joined: bool = False):
    """`joined`: each expert's two rows side by side in its bank row and slot (`split_rows`, the engine's layout)."""
    cache = ExpertCache(L, E, S, policy, "cuda", 10)
    if joined:
        (_, hidden), (_, inter) = rows
        banks = [
            split_rows(pinned_bank((E, 3 * inter * hidden), torch.bfloat16, 10 * i), inter, hidden) for i in range(L)
        ]
        cache.attach_pool(
            *split_rows(torch.zeros(S + 1, 3 * inter * hidden, dtype=torch.bfloat16, device="cuda"), inter, hidden)
        )
    else:
        banks = [tuple(pinned_bank((E, *r), torch.bfloat16, 10 * i + k) for k, r in enumerate(rows)) for i in range(L)]
        cache.attach_pool(*(torch.zeros(S + 1, *r, dtype=torch.bfloat16, device="cuda") for r in rows))
    cache.start_copy_service()
    return cache, banks


@pytest.mark.parametrize("joined", [True, False], ids=["joined", "two-rows"])
@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("rows", [((16, 8), (8, 8)), ((1536, 2048), (2048, 768))])  # tiny; qwen3-30b-a3b's
def test_graph_replays_post_and_wait(policy: str, rows: tuple, joined: bool) -> None:
    L, E, S, tokens, top_k = 3, 12, 9, 2, 3
    gpu, banks = make_cache(L, E, S, policy, rows, joined)
    assert gpu.copy_service.joined == joined  # joined: one copy an entry
    cpu = ExpertCache(L, E, S, policy, "cpu", 10)
    ids = torch.zeros(L, tokens, top_k, dtype=torch.long, device="cuda")  # static input of the graph

    trace = random_trace(12, L, E, tokens, top_k, skew=0.8, seed=9)
    ids.copy_(trace[0])
    graph, outputs = capture_graph(lambda: ensure_copy_read(gpu, banks, ids))  # warm-up: SM copies; capture: posts
    assert graph.hooks == (gpu.copy_service,) and gpu.copy_service.served == 0
    for layer in range(L):
        cpu.ensure(layer, trace[0][layer])
    for step_ids in trace[1:]:
        ids.copy_(step_ids)
        graph.replay()  # returns once the replay has run, every posted list served
        for layer in range(L):
            want = cpu.ensure(layer, step_ids[layer])
            slots, w13, w2 = outputs[layer]
            assert torch.equal(slots.cpu(), want.slots)
            assert torch.equal(w13.view(torch.int16).cpu(), banks[layer][0][step_ids[layer]].view(torch.int16))
            assert torch.equal(w2.view(torch.int16).cpu(), banks[layer][1][step_ids[layer]].view(torch.int16))
    misses = int(gpu.stats[:, 2].sum())
    assert misses > S, "the replays must miss and copy"
    assert gpu.copy_service.served == int(gpu.copy_service.tick) > 0  # every non-empty list, and only those


def test_services_share_one_stream_per_device() -> None:
    """Every cache's service on a device copies on one stream made once (a stream per engine leaked with each)."""
    first, _ = make_cache(2, 4, 3, "lru", ((16, 8), (8, 8)))
    second, _ = make_cache(1, 6, 5, "scored", ((8, 8), (4, 8)))
    stream = first.copy_service.driver.stream
    assert stream.value and second.copy_service.driver.stream.value == stream.value
    del first, second
    third, _ = make_cache(1, 4, 2, "lru", ((16, 8), (8, 8)))
    assert third.copy_service.driver.stream.value == stream.value


def test_eager_copies_by_sms_and_capture_posts_without_sync() -> None:
    cache, banks = make_cache(1, 12, 7, "lru", ((64, 96), (96, 32)))
    service = cache.copy_service
    first = cache.ensure(0, torch.tensor([[1, 4, 7]], device="cuda"))
    cache.copy_missing(first, *banks[0])  # eager: the SM copy (compiles it)
    torch.cuda.synchronize()
    assert int(service.tick) == 0
    ids = torch.tensor([[2, 4, 9]], device="cuda")

    def step() -> None:
        got = cache.ensure(0, ids, banks[0])
        cache.copy_missing(got, *banks[0])
        cache.await_copy(got)

    graph, _ = capture_graph(step)  # the warm-up step misses 2 and 9, so the replays below all hit ...
    ids.copy_(torch.tensor([[3, 5, 9]], device="cuda"))  # ... unless the ids change
    torch.cuda.synchronize()
    with host_sync_forbidden():
        graph.replay()  # posts the list and serves it (its replay hook), polling: no host sync
    assert service.served == 1  # 3 and 5 missed: one list
    graph.replay()  # every expert hits: nothing posted
    assert service.served == 1 == int(service.tick)
    for pool, bank in zip((cache.pool_a, cache.pool_b), banks[0]):
        assert torch.equal(pool[cache.slot_table()[0, [3, 5, 9]]].cpu(), bank[[3, 5, 9]])


def test_captured_ensure_posts_its_own_list() -> None:
    """Given the banks, a captured `ensure` posts the list itself (no post kernel; `copy_missing` adds nothing), an
    eager one does not; the replay serves that post and the rows land in the chosen slots."""
    cache, banks = make_cache(1, 12, 7, "scored", ((64, 96), (96, 32)))
    service = cache.copy_service
    first = cache.ensure(0, torch.tensor([[1, 4, 7]], device="cuda"), banks[0])
    assert not first.posted  # eager: the SM copy
    cache.copy_missing(first, *banks[0])
    ids = torch.tensor([[2, 4, 9]], device="cuda")
    posted = []

    def step() -> None:
        got = cache.ensure(0, ids, banks[0])
        posted.append(got.posted)
        cache.copy_missing(got, *banks[0])
        cache.await_copy(got)

    graph, _ = capture_graph(step)
    assert posted == [False, True] and graph.hooks == (service,)  # the eager warm-up, then the capture
    ids.copy_(torch.tensor([[3, 5, 10]], device="cuda"))
    torch.cuda.synchronize()
    with host_sync_forbidden():
        graph.replay()
    assert service.served == 1 == int(service.tick)
    for pool, bank in zip((cache.pool_a, cache.pool_b), banks[0]):
        assert torch.equal(pool[cache.slot_table()[0, [3, 5, 10]]].cpu(), bank[[3, 5, 10]])


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_streamed_experts_right_after_a_posting_ensure(policy: str) -> None:
    """Offloaded decode as captured: per layer, `ensure` posts its list itself and the streamed expert GEMV follows
    it directly (`Arrivals.after_ensure`: it waits for `ensure`, then per entry). Replays with new routing must give
    bitwise the plain GEMV over the banks' own rows: a GEMV that read the slots or the list before `ensure` wrote
    them would read the last replay's."""
    from edgemoe.kernels.moe_gemv import fused_experts

    L, E, S, top_k, hidden = 3, 12, 9, 4, 2048
    gpu, banks = make_cache(L, E, S, policy, ((1536, hidden), (hidden, 768)))  # qwen3-30b-a3b's rows
    on_device = [tuple(bank.cuda() for bank in layer) for layer in banks]
    gen = torch.Generator().manual_seed(11)
    ids = torch.zeros(L, 1, top_k, dtype=torch.long, device="cuda")  # static input of the graph
    x = torch.randn(1, hidden, generator=gen).to(torch.bfloat16).cuda()
    weights = torch.rand(1, top_k, generator=gen).cuda()
    posted = []

    def step() -> list[torch.Tensor]:
        out = []
        for layer in range(L):
            got = gpu.ensure(layer, ids[layer], banks[layer])
            posted.append(got.posted)
            gpu.copy_missing(got, *banks[layer])
            out.append(fused_experts(x, got.slots, weights, gpu.pool_a, gpu.pool_b, arrivals=gpu.arrivals(got)))
        return out

    trace = random_trace(10, L, E, 1, top_k, skew=0.5, seed=12)
    ids.copy_(trace[0])
    graph, outputs = capture_graph(step)
    assert posted == [False] * L + [True] * L  # the eager warm-up copies by SMs; the capture's ensures post
    for step_ids in trace[1:]:
        ids.copy_(step_ids)
        graph.replay()
        for layer in range(L):
            want = fused_experts(x, step_ids[layer].cuda(), weights, *on_device[layer])
            assert torch.equal(outputs[layer], want), layer
    assert gpu.copy_service.served > L, "the replays must miss and copy"


def test_engine_offload_runs_through_the_service() -> None:
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    prompts = ["ROMEO.\n", "To be, or not to be, that is the question: " * 6]  # the second prefills in waves

    def run(**kwargs) -> list[list[int]]:
        llm = LLM(device="cuda", dtype="bfloat16", progress=False, max_num_seqs=2, max_model_len=256, **kwargs)
        out = [o.token_ids for o in llm.generate(prompts, greedy)]
        cache = llm.engine.expert_cache
        if cache is not None:
            served.append(cache.copy_service.served)
            assert cache.copy_service.joined  # the engine's banks and slots: one copy a miss
        return out

    served: list[int] = []
    want = run()
    assert run(moe_strategy="offload", moe_cache_slots=8) == want
    assert run(moe_strategy="offload", moe_cache_slots=8, cuda_graphs=False) == want
    assert served[0] > 0 and served[1] == 0  # graphs post (and are served); eager steps copy by SMs
