"""The CPU split (`--moe-cpu-compute`) on CUDA: the compiled `ensure` with a split table bitwise as its CPU oracle, the
expert kernel's CPU pairs against the plain-torch `decode_cpu`, greedy decoding of 128 tokens token-identical to
copy-only (graphs and eager; float32, as the contract's token identity is stated for it) with N = 0, 2 and every
expert, stats counting the CPU's misses apart, and `auto`'s measurement and its lines. The split decodes eagerly (it
reads each step's CPU pairs on the host), so graphs fall back to eager steps with one line."""

from __future__ import annotations

import pytest
import torch

from edgemoe import LLM, SamplingParams
from edgemoe.offload.cpu_experts import CpuExperts
from edgemoe.offload.cpu_split import CpuSplit, fit, manual_table, measure, split_wins
from edgemoe.offload.expert_cache import ExpertCache
from edgemoe.offload.layout import ExpertLayout
from edgemoe.offload.policies import POLICIES
from edgemoe.tools.make_model import make_model
from tests.offload.test_expert_cache import random_trace

GREEDY = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
PROMPTS = ["To be, or not to be, that is the question:", "Of Man's first disobedience"]


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("cap", [1, 2, 64])
def test_ensure_split_on_cuda_matches_cpu(policy: str, cap: int) -> None:
    L, E, S = 4, 64, 24
    cpu, gpu = ExpertCache(L, E, S, policy, expert_bytes=7), ExpertCache(L, E, S, policy, "cuda", expert_bytes=7)
    table = manual_table(cap, E)
    for step in random_trace(30, L, E, 2, 8, skew=1.0, seed=cap):
        for layer, ids in enumerate(step):
            a = cpu.ensure(layer, ids, cpu_take=torch.tensor(table, dtype=torch.int32))
            b = gpu.ensure(layer, ids.cuda(), cpu_take=torch.tensor(table, dtype=torch.int32, device="cuda"))
            for field in ("slots", "src", "dst", "count", "cpu", "cpu_count"):
                assert torch.equal(getattr(a, field), getattr(b, field).cpu()), field
    assert torch.equal(cpu.stats, gpu.stats.cpu()) and int(cpu.stats[:, 5].sum()) > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_cpu_pairs(dtype: torch.dtype) -> None:
    from edgemoe.kernels.moe_gemv import fused_experts

    g = torch.Generator().manual_seed(0)
    layout, T, K, N = ExpertLayout(2048, 768, dtype), 4, 8, 40
    pool = (torch.randn(N, layout.row, generator=g) * 0.03).to(dtype).cuda()
    w13, w2 = layout.views(pool)
    x = torch.randn(T, 2048, generator=g).to(dtype).cuda()
    weights = torch.rand(T, K, generator=g).cuda()
    slots = torch.stack([torch.randperm(N - 1, generator=g)[:K] for _ in range(T)]).cuda()
    cpu_out = torch.randn(T * K, 2048, generator=g).cuda()
    plain = fused_experts(x, slots, weights, w13, w2)
    assert torch.equal(fused_experts(x, slots, weights, w13, w2, cpu_out=cpu_out), plain)
    split = slots.clone()
    split[0, :3] = split[2, 5] = split[3] = -1
    out = fused_experts(x, split, weights, w13, w2, cpu_out=cpu_out)
    ref = layout._decode_cpu_reference(x.double(), split, weights.double(), w13.double(), w2.double(), cpu_out)
    err = (out.double() - ref).norm() / ref.norm()
    assert err < (1e-2 if dtype == torch.bfloat16 else 1e-5), err
    assert torch.equal(out[1], plain[1])


def generate(model: str | None, **kwargs) -> tuple[list[list[int]], LLM]:
    llm = LLM(model, device="cuda", dtype="float32", progress=False, max_num_seqs=2, max_model_len=512,
              moe_strategy="offload", moe_collect_stats=True, **kwargs)  # fmt: skip
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)], llm


@pytest.fixture(scope="module")
def qwen3_small(tmp_path_factory) -> str:
    return str(make_model(tmp_path_factory.mktemp("qwen3"), "qwen3_moe", "small", dtype="float32"))


@pytest.mark.parametrize("which", ["demo", "qwen3-small"])
def test_greedy_identical_to_copy_only(which: str, qwen3_small: str, capfd) -> None:
    model, slots, experts = (None, 16, 32) if which == "demo" else (qwen3_small, 16, 32)
    want, graphed = generate(model, moe_cache_slots=slots)
    eager_want, eager = generate(model, moe_cache_slots=slots, cuda_graphs=False)
    assert eager_want == want
    capfd.readouterr()
    for n in (0, 2, experts):
        got, llm = generate(model, moe_cache_slots=slots, moe_cpu_compute=n)  # graphs asked for: eager steps
        assert "decode runs eagerly" in capfd.readouterr().err
        assert got == want, n
        total, copy_only = llm.moe_stats()["total"], eager.moe_stats()["total"]
        if n == 0:
            assert total == copy_only
        else:
            assert total["cpu_computed"] > 0 and total["bytes_copied"] < copy_only["bytes_copied"]
            assert total["hits"] + total["misses"] == total["accesses"]


def test_auto_lines_and_measurement(qwen3_small: str, capfd) -> None:
    llm = LLM(qwen3_small, device="cuda", progress=False, max_num_seqs=1, moe_strategy="offload", moe_cache_slots=16,
              moe_cpu_compute="auto")  # fmt: skip
    assert llm.engine.expert_cache.cpu_split is None
    assert "cpu experts: off: the split runs in eager steps only" in capfd.readouterr().err
    llm = LLM(qwen3_small, device="cuda", progress=False, max_num_seqs=1, moe_strategy="offload", moe_cache_slots=16,
              moe_cpu_compute="auto", cuda_graphs=False)  # fmt: skip
    err = capfd.readouterr().err
    assert "cpu experts: measuring" in err and " ms an expert" in err and " -> " in err
    split = llm.engine.expert_cache.cpu_split
    assert split is None or isinstance(split, CpuSplit) and split.table.tolist() == sorted(split.table.tolist())


def test_measure_and_fit_on_a_real_expert() -> None:
    """qwen3-30b-a3b's expert (bf16, 9.4 MB) from a pinned bank: the costs are positive and the fit never sends a
    miss to the CPU where the check says copying is faster."""
    from edgemoe.offload.banks import allocate_bank

    class Layer:  # what measure reads of an OffloadedExperts
        layout = ExpertLayout(2048, 768, torch.bfloat16)
        num_experts = 16
        bank = allocate_bank((16, layout.row), torch.bfloat16, pin=True)

    Layer.bank.normal_(0, 0.02)
    with CpuExperts() as pool:
        costs = measure(Layer, pool, torch.device("cuda"), 8)
        print(f"\ncpu experts on this machine: {costs}")
        assert costs.copy > 0 and costs.cpu > 0 and costs.overhead > 0
        table = fit(costs, 16)
        if table[8]:
            assert split_wins(Layer, pool, torch.device("cuda"), 8, table[8]), "the fit chose a split that loses"
