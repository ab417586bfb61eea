"""Expert offload on CUDA: the miss-copy kernel against its plain-torch reference, ensure on the GPU against the CPU,
no host synchronisation in offloaded decode steps, greedy token identity resident vs offload, and ensure + miss
copy captured in a CUDA graph and replayed."""

from __future__ import annotations

import pytest
import torch

from edgemoe import LLM, SamplingParams
from edgemoe.offload.banks import allocate_bank
from edgemoe.offload.expert_cache import ExpertCache, copy_rows_reference
from edgemoe.offload.policies import POLICIES
from tests.gpu.sync_free import decode_without_sync
from tests.offload.test_expert_cache import random_trace

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
PROMPTS = ["ROMEO.\n", "Of Man's first disobedience", "To be, or not to be, that is the question:", "KING.\n"]


def pinned_bank(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    bank = allocate_bank(shape, dtype, pin=True)
    bank.copy_(torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype))
    assert bank.is_pinned()
    return bank


def ensure_copy_read(cache: ExpertCache, banks: list, ids: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
    """Per layer of ids [L, tokens, k]: ensure, copy, then the slots and the rows read from them right away (a later
    layer may evict them). Posted copies (a capture with a copy service: posted by ensure itself) are waited for
    first."""
    out = []
    for layer in range(ids.shape[0]):
        got = cache.ensure(layer, ids[layer], banks[layer])
        cache.copy_missing(got, *banks[layer])
        cache.await_copy(got)
        out.append((got.slots, cache.pool_a[got.slots], cache.pool_b[got.slots]))
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(16, 96, 64), (9, 3, 5), (12, 1536, 2048)])
def test_copy_kernel_matches_reference(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    from edgemoe.kernels.miss_copy import copy_rows

    E, S, M = shape[0], 7, 5
    bank = pinned_bank(shape, dtype, seed=E)
    gen = torch.Generator().manual_seed(1)
    for count in (0, 2, M):
        pool = torch.randn(S + 1, *shape[1:], generator=gen).to(dtype).cuda()
        expected = pool.clone()
        src, dst = torch.randperm(E, generator=gen)[:M], torch.randperm(S, generator=gen)[:M]
        valid = torch.arange(M) < count
        copy_rows_reference(expected, bank, torch.where(valid, src, 0).cuda(), torch.where(valid, dst, S).cuda())
        copy_rows(pool, bank, src.cuda(), dst.cuda(), torch.tensor(count).cuda())
        assert torch.equal(pool[:S], expected[:S]), count


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_ensure_on_cuda_matches_cpu(policy: str) -> None:
    L, E, S = 4, 16, 11
    cpu, gpu = ExpertCache(L, E, S, policy, "cpu", 10), ExpertCache(L, E, S, policy, "cuda", 10)
    for step in random_trace(30, L, E, 2, 4, skew=1.0, seed=5):
        for layer, ids in enumerate(step):
            a, b = cpu.ensure(layer, ids), gpu.ensure(layer, ids.cuda())
            assert not a.posted and not b.posted  # eager: nothing goes to a copy service
            for x, y in zip(a[:4], b[:4], strict=True):
                assert torch.equal(x, y.cpu())
    assert torch.equal(cpu.slot_of, gpu.slot_of.cpu()) and torch.equal(cpu.stats, gpu.stats.cpu())


def test_offloaded_decode_does_not_synchronise() -> None:
    """As tests/gpu/test_cuda_engine.py, with experts offloaded to a small cache: ensure and miss copy stay on
    the device (torch raises on any host sync)."""
    llm = LLM(
        device="cuda",
        dtype="bfloat16",
        progress=False,
        max_num_seqs=4,
        moe_strategy="offload",
        moe_cache_slots=24,
        moe_policy="scored",
        moe_collect_stats=True,
    )
    engine = llm.engine
    for p in PROMPTS:
        engine.add_request(p, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    while engine.scheduler.waiting or any(s.num_uncomputed > 1 for s in engine.scheduler.running):
        engine.step()  # prefill may synchronise
    before = engine.expert_cache.stats[:, 2].sum().item()
    steps = decode_without_sync(engine, lambda batch, due, logits: logits.argmax(-1))
    assert steps >= 14 and engine.expert_cache.stats[:, 2].sum().item() > before, "decode must miss"


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_offload_token_identical_on_cuda(policy: str, dtype: str) -> None:
    def run(**kwargs) -> list[list[int]]:
        llm = LLM(device="cuda", dtype=dtype, progress=False, max_num_seqs=4, max_model_len=256, **kwargs)
        return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]

    want = run()
    for slots in (16, 56, 224):  # 16: the minimum at max_num_seqs 4 x top-4; 224: every expert
        assert run(moe_strategy="offload", moe_cache_slots=slots, moe_policy=policy) == want, slots


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_ensure_and_copy_replay_in_a_cuda_graph(policy: str) -> None:
    L, E, S, tokens, top_k = 3, 12, 9, 2, 3
    banks = [
        (pinned_bank((E, 16, 8), torch.bfloat16, 2 * i), pinned_bank((E, 8, 8), torch.bfloat16, 2 * i + 1))
        for i in range(L)
    ]
    gpu = ExpertCache(L, E, S, policy, "cuda", 10)
    gpu.attach_pool(
        torch.zeros(S + 1, 16, 8, dtype=torch.bfloat16, device="cuda"),
        torch.zeros(S + 1, 8, 8, dtype=torch.bfloat16, device="cuda"),
    )
    cpu = ExpertCache(L, E, S, policy, "cpu", 10)
    ids = torch.zeros(L, tokens, top_k, dtype=torch.long, device="cuda")  # static input of the graph

    def step() -> list[tuple[torch.Tensor, ...]]:
        return ensure_copy_read(gpu, banks, ids)

    trace = random_trace(12, L, E, tokens, top_k, skew=0.8, seed=9)
    ids.copy_(trace[0])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up (compiles the kernel) outside the capture
    torch.cuda.current_stream().wait_stream(side)
    for layer in range(L):
        cpu.ensure(layer, trace[0][layer])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    for step_ids in trace[1:]:
        ids.copy_(step_ids)
        graph.replay()
        for layer in range(L):
            want = cpu.ensure(layer, step_ids[layer])
            slots, w13, w2 = outputs[layer]
            assert torch.equal(slots.cpu(), want.slots)
            assert torch.equal(w13.cpu(), banks[layer][0][step_ids[layer]])
            assert torch.equal(w2.cpu(), banks[layer][1][step_ids[layer]])
    assert torch.equal(gpu.slot_of.cpu(), cpu.slot_of) and torch.equal(gpu.owner.cpu(), cpu.owner)
    assert int(gpu.stats[:, 2].sum()) > S, "the replays must miss and copy"
