"""The CPU split (`--moe-cpu-compute`) on CUDA: the compiled `ensure` with a split table bitwise as its CPU oracle; the
expert kernel's CPU pairs against the plain-torch `decode_cpu`, and its wait for the copy service's flag; and decoding
with the split inside replayed CUDA graphs (the captured `ensure` posts the CPU pairs with its copy list, the thread
that replays the graph computes them and hands the rows back: `edgemoe/offload/copy_service.c`) against copy-only and
against the eager split: greedy 128 tokens token-identical, at several cache sizes, dense (float32, as the contract's
token identity is stated for it) and GGUF Q4_K_M experts; the replayed steps never synchronise with the host; `auto`
measures the mailbox round trip, checks its table on replayed steps, and never keeps a split that is slower.

Logits: a CPU pair's output comes from `CpuExperts` (fp32, its own order of the dot products' sums) instead of the GPU
kernel, so logits differ from copy-only in the last bits of fp32, carried through the later layers: within
LOGITS_RTOL of each step's largest logit (the CPU test of the same split measured within 1e-4). Graph and eager
splits compute the same rows by the same executor from the same fp32 x and sum them in the same order: their tokens
are identical and their logits too, within the tolerance that graphs and eager copy-only keep."""

from __future__ import annotations

import time

import pytest
import torch

from edgemoe import LLM, SamplingParams
from edgemoe.kernels.protocol import CpuWait
from edgemoe.offload.banks import allocate_bank
from edgemoe.offload.cpu_experts import CpuExperts
from edgemoe.offload.cpu_split import CpuSplit, fit, manual_table, measure, round_trip, split_wins
from edgemoe.offload.expert_cache import ExpertCache
from edgemoe.offload.layout import ExpertLayout
from edgemoe.offload.policies import POLICIES
from edgemoe.tools.make_model import make_model
from tests.gpu.sync_free import decode_without_sync
from tests.offload.test_expert_cache import random_trace
from tests.step_logits import record_step_logits

GREEDY = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
PROMPTS = ["To be, or not to be, that is the question:", "Of Man's first disobedience"]
ID_PROMPTS = [[5, 17, 300, 41], [9, 8, 7, 6, 5, 4, 3, 2, 100, 200, 300]]  # a random GGUF's (tests/gpu/test_gguf_gpu.py)
LOGITS_RTOL = 5e-4


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
    """CPU pairs against the reference; the captured step's wait for the service's flag (set here beforehand)
    changes nothing, and its one-program twin for the reference combine returns."""
    from edgemoe.kernels.miss_copy import await_cpu_rows
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
    seq = torch.tensor(5, device="cuda")
    wait = CpuWait(cpu_out, seq + 1, seq, torch.tensor(4, device="cuda"))  # done past seq: no wait
    assert torch.equal(fused_experts(x, split, weights, w13, w2, cpu_out=cpu_out, cpu_wait=wait), out)
    await_cpu_rows(wait)
    torch.cuda.synchronize()


def generate(model: str | None, record: bool = False, **kwargs) -> tuple[list[list[int]], LLM, dict]:
    llm = LLM(model, device="cuda", dtype="float32", progress=False, max_num_seqs=2, max_model_len=512,
              moe_strategy="offload", moe_collect_stats=True, **kwargs)  # fmt: skip
    logits = record_step_logits(llm) if record else {}
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)], llm, logits


def close_logits(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key, row in got.items():
        scale = want[key].abs().max()
        assert (row - want[key]).abs().max() <= LOGITS_RTOL * scale, f"step {len(key)}"


def served_cpu_lists(llm: LLM) -> int:
    return llm.engine.expert_cache.copy_service.cpu_timings[0]


@pytest.fixture(scope="module")
def qwen3_small(tmp_path_factory) -> str:
    return str(make_model(tmp_path_factory.mktemp("qwen3"), "qwen3_moe", "small", dtype="float32"))


@pytest.mark.parametrize("which", ["demo", "qwen3-small"])
def test_graph_split_identical_to_copy_only_and_eager_split(which: str, qwen3_small: str) -> None:
    """Copy-only (graphs) against the split replayed in graphs (N = 2, and every expert on the demo) and the split
    decoded eagerly: tokens identical; logits within LOGITS_RTOL; the CPU's misses counted apart, and served by the
    copy service (so computed inside replayed steps, not eagerly)."""
    model = None if which == "demo" else qwen3_small
    want, base, want_logits = generate(model, record=True, moe_cache_slots=16)
    assert base.engine.runner.graphs is not None
    for n in (2, 32) if which == "demo" else (2,):
        got, llm, logits = generate(model, record=True, moe_cache_slots=16, moe_cpu_compute=n)
        assert llm.engine.runner.graphs is not None, "a split no longer decodes eagerly"
        assert got == want, n
        close_logits(logits, want_logits)
        total, copy_only = llm.moe_stats()["total"], base.moe_stats()["total"]
        assert total["cpu_computed"] > 0 and total["bytes_copied"] < copy_only["bytes_copied"]
        assert total["hits"] + total["misses"] == total["accesses"]
        assert served_cpu_lists(llm) > 0
        if n == 2:
            eager, eager_llm, eager_logits = generate(model, record=True, moe_cache_slots=16, moe_cpu_compute=n,
                                                      cuda_graphs=False)  # fmt: skip
            assert eager == got and served_cpu_lists(eager_llm) == 0
            close_logits(eager_logits, logits)


@pytest.mark.parametrize("slots", [8, 24])
def test_graph_split_at_other_cache_sizes(slots: int) -> None:
    """The smallest cache (max_num_seqs x top_k) and a larger one: the split in graphs gives copy-only's tokens
    (which the contract makes the same at every size)."""
    want, *_ = generate(None, moe_cache_slots=16)
    got, llm, _ = generate(None, moe_cache_slots=slots, moe_cpu_compute=3)
    assert got == want and served_cpu_lists(llm) > 0


def test_quantized_experts_split_in_graphs(tmp_path) -> None:
    """GGUF Q4_K gate/up with Q6_K down: the quantized kernels for the copied experts, reading the CPU's rows (the
    executor's K-quant paths) and waiting for them in replayed steps (`QuantExpertLayout.decode_cpu`)."""
    pytest.importorskip("gguf")
    path = str(make_model(tmp_path, "qwen3_moe", "tiny-k", dtype="float32", format="gguf", expert_dtype="q4_k_m"))
    runs = {}
    for n in ("off", 1, 2):
        llm = LLM(path, device="cuda", dtype="float32", progress=False, max_num_seqs=1, moe_strategy="offload",
                  moe_cache_slots=2, moe_collect_stats=True, moe_cpu_compute=n)  # fmt: skip
        runs[n] = [o.token_ids for o in llm.generate(ID_PROMPTS, GREEDY)]
        if n != "off":
            assert llm.moe_stats()["total"]["cpu_computed"] > 0 and served_cpu_lists(llm) > 0
    assert runs[1] == runs["off"] and runs[2] == runs["off"]


def test_graph_split_decode_does_not_synchronise() -> None:
    """The replayed steps with a split hold no host sync (torch raises on one): the CPU pairs go through the mailbox,
    not through the eager split's read of the slots."""
    llm = LLM(device="cuda", dtype="bfloat16", progress=False, max_num_seqs=2, moe_strategy="offload",
              moe_cache_slots=8, moe_collect_stats=True, moe_cpu_compute=2)  # fmt: skip
    engine = llm.engine
    for p in PROMPTS:
        engine.add_request(p, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    while engine.scheduler.waiting or any(s.num_uncomputed > 1 for s in engine.scheduler.running):
        engine.step()  # prefill may synchronise
    before, served = int(engine.expert_cache.stats[:, 5].sum()), served_cpu_lists(llm)
    steps = decode_without_sync(engine, lambda batch, due, logits: logits.argmax(-1))
    assert steps >= 14 and int(engine.expert_cache.stats[:, 5].sum()) > before and served_cpu_lists(llm) > served


def test_auto_measures_the_round_trip_and_never_keeps_a_slower_split(qwen3_small: str, capfd) -> None:
    """`auto` with graphs: its lines; a split it keeps is faster than copy-only on replayed steps that miss every
    expert, timed again here with the device table as chosen and zeroed (no recapture)."""
    llm = LLM(qwen3_small, device="cuda", progress=False, max_num_seqs=1, moe_strategy="offload", moe_cache_slots=16,
              moe_cpu_compute="auto")  # fmt: skip
    err = capfd.readouterr().err
    assert "cpu experts: measuring" in err and "ms a mailbox round trip" in err
    split, cache = llm.engine.expert_cache.cpu_split, llm.engine.expert_cache
    assert llm.engine.runner.graphs is not None
    if split is None:
        assert "none on the CPU" in err
        return
    assert isinstance(split, CpuSplit) and split.table.tolist() == sorted(split.table.tolist())
    assert "replayed steps missing every expert" in err and not split.fitted
    if not any(split.table.tolist()):
        assert "turns the split off" in err
        return
    chosen, zeros = split.table.clone(), torch.zeros_like(split.table)
    times = {"split": [], "copy-only": []}
    for _ in range(9):
        for name, table in (("split", chosen), ("copy-only", zeros)):
            split.table.copy_(table)
            cache.reset()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            llm.engine.runner.graphs.replay(1)
            torch.cuda.synchronize()
            times[name].append(time.perf_counter() - t0)
    split.table.copy_(chosen)
    median = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
    assert median["split"] <= 1.1 * median["copy-only"], median  # 10 %: two timings of the same thing on a host


def test_measure_and_fit_on_a_real_expert() -> None:
    """qwen3-30b-a3b's expert (bf16, 9.4 MB) from a pinned bank: the costs are positive, the eager fit never sends
    a miss to the CPU where the check says copying is faster, and the mailbox round trip (a copy service with the
    CPU section, as replayed steps use it) is positive and well under a millisecond's tens."""

    class Layer:  # what measure reads of an OffloadedExperts
        layer = 0
        layout = ExpertLayout(2048, 768, torch.bfloat16)
        num_experts = 16
        bank = allocate_bank((16, layout.row), torch.bfloat16, pin=True)
        banks = layout.copy_views(bank)

        @staticmethod
        def host_biases() -> None:
            return None

    Layer.bank.normal_(0, 0.02)
    device = torch.device("cuda")
    with CpuExperts() as pool:
        costs = measure(Layer, pool, device, 8)
        print(f"\ncpu experts on this machine: {costs}")
        assert costs.copy > 0 and costs.cpu > 0 and costs.overhead > 0
        table = fit(costs, 16)
        if table[8]:
            assert split_wins(Layer, pool, device, 8, table[8]), "the fit chose a split that loses"
        cache = ExpertCache(1, 16, 8, "lru", device, Layer.layout.row_bytes)
        joined = Layer.layout.empty(9, device)
        cache.attach_pool(*Layer.layout.copy_views(joined), joined)
        cache.start_copy_service(max_pairs=8)
        cache.copy_service.attach_cpu(pool, [(Layer.bank, Layer.layout, None)], 1)
        seconds = round_trip(cache.copy_service, Layer)
        graphed = measure(Layer, pool, device, 8, service=cache.copy_service)
        print(f"mailbox round trip with one CPU pair: {seconds * 1e3:.3f} ms; costs with graphs: {graphed}")
        assert 0 < seconds < 0.02 and graphed.overhead > 0
        cache.copy_service.detach_cpu()
