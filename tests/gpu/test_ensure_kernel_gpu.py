"""The fused `ensure` compiled for the GPU against `ExpertCache._ensure_torch` on the CPU (torch's CUDA cumsum is a
parallel scan, so the CPU path is the sequential oracle): bitwise, returned and state tensors, after every call;
no host synchronisation; captured in a CUDA graph and replayed."""

from __future__ import annotations

import pytest
import torch

from edgemoe.kernels.protocol import Ensured
from edgemoe.offload.expert_cache import ExpertCache
from edgemoe.offload.policies import POLICIES
from tests.gpu.sync_free import host_sync_forbidden
from tests.offload.test_expert_cache import check_invariants, random_trace


def state(cache: ExpertCache) -> dict[str, torch.Tensor]:
    tensors = {f"policy.{k}": v for k, v in vars(cache.policy).items() if isinstance(v, torch.Tensor)}
    return {"slot_of": cache.slot_of, "owner": cache.owner, "clock": cache.clock, "stats": cache.stats, **tensors}


def assert_same(want: Ensured, got: Ensured, cpu: ExpertCache, gpu: ExpertCache) -> None:
    assert not want.posted and not got.posted
    for field, x, y in zip(want._fields[:4], want[:4], got[:4], strict=True):
        assert y.is_cuda and x.dtype == y.dtype and torch.equal(x, y.cpu()), field
    gpu_state = state(gpu)
    for name, x in state(cpu).items():
        assert torch.equal(x, gpu_state[name].cpu()), name


# (layers, experts, slots, tokens, top_k, skew): 1500 slots: two blocks of the victim search
CASES = [(3, 8, 4, 2, 2, 1.0), (4, 60, 13, 3, 4, 0.0), (4, 128, 200, 8, 8, 1.0), (6, 512, 1500, 8, 8, 1.2)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "L{}-E{}-S{}-t{}-k{}-skew{}".format(*c))
@pytest.mark.parametrize("collect_stats", [True, False])
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_fused_ensure_matches_cpu(policy: str, collect_stats: bool, case: tuple) -> None:
    L, E, S, tokens, top_k, skew = case
    cpu = ExpertCache(L, E, S, policy, "cpu", 4096, collect_stats)
    gpu = ExpertCache(L, E, S, policy, "cuda", 4096, collect_stats)
    misses = 0
    for step in random_trace(20, L, E, tokens, top_k, skew, seed=E):
        for layer, ids in enumerate(step):
            want, got = cpu._ensure_torch(layer, ids), gpu.ensure(layer, ids.cuda())
            assert_same(want, got, cpu, gpu)
            misses += int(want.count)
    check_invariants(gpu)
    assert misses > S


def test_fused_ensure_does_not_synchronise() -> None:
    gpu = ExpertCache(2, 16, 8, "scored", "cuda", 10)
    trace = random_trace(3, 2, 16, 2, 4, skew=1.0, seed=1).cuda()
    gpu.ensure(0, trace[0, 0])  # compiles the kernel
    torch.cuda.synchronize()
    with host_sync_forbidden():
        for step in trace:
            for layer, ids in enumerate(step):
                gpu.ensure(layer, ids)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_fused_ensure_replays_in_a_cuda_graph(policy: str) -> None:
    """One graph per layer (`layer` is a Python int), reading ids from a static buffer refilled before each
    replay; after each replay its output tensors hold that call's results."""
    L, E, S, tokens, top_k = 3, 40, 30, 3, 4
    cpu, gpu = ExpertCache(L, E, S, policy, "cpu", 10), ExpertCache(L, E, S, policy, "cuda", 10)
    ids = torch.zeros(tokens, top_k, dtype=torch.long, device="cuda")  # static input of the graphs
    trace = random_trace(15, L, E, tokens, top_k, skew=1.0, seed=3)
    ids.copy_(trace[0, 0])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        gpu.ensure(0, ids)  # compiles the kernel outside the capture
    torch.cuda.current_stream().wait_stream(side)
    gpu.reset()  # in place: the graphs below capture these very tensors
    graphs, outputs = [], []
    for layer in range(L):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs.append(gpu.ensure(layer, ids))
        graphs.append(graph)
    assert int(gpu.clock) == 0, "capture runs nothing"
    for step in trace:
        for layer, step_ids in enumerate(step):
            ids.copy_(step_ids)
            graphs[layer].replay()
            assert_same(cpu._ensure_torch(layer, step_ids), outputs[layer], cpu, gpu)
    assert int(gpu.stats[:, 3].sum()) > 0, "the replays must evict"
