"""The CPU split (`--moe-cpu-compute`, edgemoe/offload/cpu_split.py) on the CPU device, where a manual N runs the whole
eager path: `ensure`'s split against the plain-Python reference (copies, CPU list, slots, mapping; stats), the fitted
table against a brute-force reference, the layout's `decode_cpu` against `decode`, and greedy decoding of 128 tokens
token-identical to copy-only on the demo model and a tiny model of every family.

Why greedy is identical and logits nearly so: a CPU pair's output comes from `CpuExperts` (fp32, its own order of the
dot products' sums) instead of torch's matmul, so logits differ in the last bits of fp32 (measured here within 1e-4 of
their scale); the weighted sum over k runs in the same order as copy-only. A greedy step could flip only at a near-tie
of the top two logits, which these models do not reach in 128 tokens (the test would say where).
"""

from __future__ import annotations

import pytest
import torch

from edgemoe import LLM, EdgeMoEError, SamplingParams
from edgemoe.cli import main
from edgemoe.moe.reference import EnsureReference
from edgemoe.offload.cpu_split import Costs, fit, manual_table
from edgemoe.offload.expert_cache import ExpertCache
from edgemoe.offload.layout import ExpertLayout
from edgemoe.offload.policies import POLICIES, Scored
from edgemoe.tools.make_model import make_model
from tests.models.test_gemma4 import CASES as GEMMA_CASES
from tests.models.test_gemma4 import gemma_model, save
from tests.offload.test_expert_cache import check_invariants, random_trace

GREEDY = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
FAMILIES = ["qwen2_moe", "qwen3_moe", "mixtral", "olmoe"]  # and Gemma-4: its own test


# ---------------------------------------------------------------------------------------------- ensure's split


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("cap", [0, 1, 2, 8])
def test_ensure_split_matches_reference(policy: str, cap: int) -> None:
    L, E, S, tokens, top_k = 3, 8, 5, 2, 2
    table = manual_table(cap, E)
    cache = ExpertCache(L, E, S, policy, expert_bytes=100)
    ref = EnsureReference(L, E, S, policy, Scored.FREQ, Scored.REUSE)
    on_cpu = copied = 0
    for step in random_trace(40, L, E, tokens, top_k, skew=1.0, seed=cap):
        for layer, ids in enumerate(step):
            got = cache.ensure(layer, ids, cpu_take=torch.tensor(table, dtype=torch.int32))
            want = ref.ensure(layer, ids.flatten().tolist(), table)
            n, c = int(got.count), int(got.cpu_count)
            assert c == len(want["cpu"]) == min(cap, len(want["misses"]))
            assert got.cpu[:c].tolist() == want["cpu"] and got.cpu[c:].eq(0).all()
            assert got.src[:n].tolist() == [e for e, _, _ in want["copies"]]
            assert got.dst[:n].tolist() == [s for _, s, _ in want["copies"]]
            assert got.dst[n:].eq(S).all() and got.src[n:].eq(0).all()
            assert got.slots.flatten().tolist() == want["slots"]
            on_cpu, copied = on_cpu + c, copied + n
        check_invariants(cache)
        table_now = cache.slot_table().tolist()
        assert {(lay, e): s for lay, row in enumerate(table_now) for e, s in enumerate(row) if s >= 0} == ref.slot_of
    total = cache.stats_dict()["total"]
    assert total["cpu_computed"] == on_cpu and total["misses"] == on_cpu + copied
    assert total["bytes_copied"] == 100 * copied and total["hits"] + total["misses"] == total["accesses"]
    assert (on_cpu > 0) == (cap > 0)


def test_ensure_without_a_table_is_unchanged() -> None:
    """No table (prefill waves, the cache simulator) and an all-zero table decide alike, state and stats too."""
    L, E, S = 2, 16, 9
    a, b = (ExpertCache(L, E, S, "scored", expert_bytes=3) for _ in range(2))
    zeros = torch.zeros(E + 1, dtype=torch.int32)
    for step in random_trace(20, L, E, 2, 3, skew=0.8, seed=4):
        for layer, ids in enumerate(step):
            x, y = a.ensure(layer, ids), b.ensure(layer, ids, cpu_take=zeros)
            assert all(torch.equal(u, v) for u, v in zip(x[:4], y[:4]))
            assert int(x.cpu_count) == int(y.cpu_count) == 0
    assert torch.equal(a.stats, b.stats) and torch.equal(a.policy.freq, b.policy.freq)


# ---------------------------------------------------------------------------------------------- the fit


def fit_reference(costs: Costs, max_misses: int, cap: int | None) -> list[int]:
    """Every split of every m timed; the fastest, the fewest on the CPU among equals; none unless faster."""
    table = []
    for m in range(max_misses + 1):
        options = range(min(m, max_misses if cap is None else cap) + 1)
        times = {n: costs.copy * m if n == 0 else max(costs.copy * (m - n), costs.overhead + costs.cpu * n)
                 for n in options}  # fmt: skip
        best = min(times.values())
        table.append(min(n for n, t in times.items() if t == best))
    return table


@pytest.mark.parametrize(
    "costs",
    [
        Costs(copy=0.17e-3, cpu=0.9e-3, overhead=0.05e-3),  # CPU slower than the copy: a split wins from 6 misses on
        Costs(copy=1e-3, cpu=1e-3, overhead=0.0),  # even: half and half
        Costs(copy=1e-3, cpu=0.5e-3, overhead=2e-3),
        Costs(copy=1e-3, cpu=50e-3, overhead=0.0),  # CPU far slower: one, from 51 misses on
        Costs(copy=1e-3, cpu=1e-3, overhead=1.0),  # overhead beyond any copy: none
    ],
)
@pytest.mark.parametrize("cap", [None, 2])
def test_fit_matches_reference_and_never_loses(costs: Costs, cap: int | None) -> None:
    table = fit(costs, 128, cap)
    assert table == fit_reference(costs, 128, cap)
    for m, n in enumerate(table):
        assert n <= m and (cap is None or n <= cap)
        if n:
            assert max(costs.copy * (m - n), costs.overhead + costs.cpu * n) < costs.copy * m
    assert table == sorted(table), "more misses never send fewer to the CPU"


def test_fit_extremes() -> None:
    assert not any(fit(Costs(copy=1e-3, cpu=50e-3, overhead=0.0), 50))  # from 51 misses on, one would win
    assert not any(fit(Costs(copy=1e-3, cpu=1e-3, overhead=1.0), 128))
    even = fit(Costs(copy=1e-3, cpu=1e-3, overhead=0.0), 8)
    assert even == [0, 0, 1, 1, 2, 2, 3, 3, 4]  # ceil-free halves: ties keep the fewer on the CPU
    assert manual_table(3, 6) == [0, 1, 2, 3, 3, 3, 3]


# ---------------------------------------------------------------------------------------------- decode_cpu


def test_decode_cpu_reference_matches_decode() -> None:
    """No CPU pair: `decode` bitwise. CPU pairs given `decode`'s own per-pair outputs: `decode` bitwise again, so the
    CPU rows enter the weighted sum where the copied pairs' would."""
    g = torch.Generator().manual_seed(0)
    layout, T, K, S = ExpertLayout(24, 10, torch.float32), 3, 2, 6
    pool = torch.randn(S + 1, layout.row, generator=g)
    w13, w2 = layout.views(pool)
    x, weights = torch.randn(T, 24, generator=g), torch.rand(T, K, generator=g)
    slots = torch.tensor([[0, 3], [5, 1], [2, 4]])
    want = layout.decode(x, slots, weights, w13, w2)
    got = layout.decode_cpu(x, slots, weights, w13, w2, torch.full((T * K, 24), float("nan")))
    assert torch.equal(got, want)
    per_pair = layout.decode(x.repeat_interleave(K, 0), slots.view(-1, 1), torch.ones(T * K, 1), w13, w2)
    on_cpu = torch.tensor([[-1, 3], [5, -1], [-1, -1]])
    cpu_out = torch.where(on_cpu.view(-1, 1) < 0, per_pair, float("nan"))
    assert torch.equal(layout.decode_cpu(x, on_cpu, weights, w13, w2, cpu_out), want)


# ---------------------------------------------------------------------------------------------- end to end


def run(model: str | None, prompts: list, **kwargs) -> tuple[list[list[int]], LLM]:
    llm = LLM(model, progress=False, max_num_seqs=2, max_model_len=256, moe_strategy="offload",
              moe_collect_stats=True, **kwargs)  # fmt: skip
    return [o.token_ids for o in llm.generate(prompts, GREEDY)], llm


def check_split(model: str | None, prompts: list, slots: int, splits: tuple[int, ...], **kwargs) -> None:
    """Copy-only against N in `splits`: the same tokens; N = 0 the same stats too."""
    want, base = run(model, prompts, moe_cache_slots=slots, **kwargs)
    for n in splits:
        got, llm = run(model, prompts, moe_cache_slots=slots, moe_cpu_compute=n, **kwargs)
        assert got == want, f"moe_cpu_compute {n}: first difference at token " + str(
            next(i for a, b in zip(got, want) for i, (u, v) in enumerate(zip(a, b)) if u != v)
        )
        total, copy_only = llm.moe_stats()["total"], base.moe_stats()["total"]
        if n == 0:
            assert total == copy_only
        else:
            assert total["cpu_computed"] > 0 and total["hits"] + total["misses"] == total["accesses"]
            assert total["bytes_copied"] < copy_only["bytes_copied"]


def test_demo_model_token_identical() -> None:
    prompts = ["To be, or not to be, that is the question:", "Of Man's first disobedience"]
    check_split(None, prompts, 16, (1, 32))  # 32: every expert of a layer may go to the CPU


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    def get(family: str, **kwargs) -> str:
        return str(make_model(tmp_path_factory.mktemp(family), family, "tiny", dtype="float32", **kwargs))

    return get


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_models_token_identical(tiny, family: str) -> None:
    splits = (0, 1, 8) if family == "qwen3_moe" else (1, 8)  # 0: one family is enough (the stats equal too)
    check_split(tiny(family), [list(range(10, 18)), [7, 99, 123]], 5, splits)


def test_gemma4_token_identical(tmp_path) -> None:
    """GELU-tanh experts beside a dense MLP, per-layer embeddings, KV-shared layers (tests/models/test_gemma4.py)."""
    folder = save(gemma_model(**GEMMA_CASES["moe-ple-kvshared"]), tmp_path / "gemma4", "fused")
    check_split(str(folder), [list(range(10, 18)), [7, 99, 123]], 5, (1, 8))


def test_quantized_experts_token_identical(tiny) -> None:
    """Q8_0 experts (a safetensors checkpoint quantized at load): the executor reads the same blocks."""
    check_split(tiny("qwen3_moe"), [list(range(10, 18)), [7, 99, 123]], 5, (8,), expert_dtype="q8_0")


def test_settings_and_lines(capfd) -> None:
    with pytest.raises(EdgeMoEError, match="off, auto or a number"):
        LLM(progress=False, moe_strategy="offload", moe_cache_slots=16, moe_cpu_compute="some")
    with pytest.raises(EdgeMoEError, match="off, auto or a number"):
        LLM(progress=False, moe_strategy="offload", moe_cache_slots=16, moe_cpu_compute=-1)
    with pytest.raises(EdgeMoEError, match="needs moe_strategy offload"):
        LLM(progress=False, moe_cpu_compute=2)
    with pytest.raises(EdgeMoEError, match="moe_cpu_threads must be an integer >= 1, got 0"):
        LLM(progress=False, moe_strategy="offload", moe_cache_slots=16, moe_cpu_compute=2, moe_cpu_threads=0)
    llm = LLM(progress=False, max_num_seqs=2, moe_strategy="offload", moe_cache_slots=16, moe_cpu_compute=2,
              moe_cpu_threads=2)  # fmt: skip
    assert llm.engine.expert_cache.cpu_split.pool.threads == 2
    assert "2 threads" in capfd.readouterr().err
    assert main(["generate", "hi", "--moe-strategy", "offload", "--moe-cache-slots", "16", "--moe-cpu-compute",
                 "lots"]) == 2  # fmt: skip
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "moe_cpu_compute must be off, auto or a number" in err[0]
    llm = LLM(progress=False, max_num_seqs=2, moe_strategy="offload", moe_cache_slots=16)  # auto, the default
    assert llm.engine.config.moe.moe_cpu_compute == "auto" and llm.engine.expert_cache.cpu_split is None
    assert "cpu experts" not in capfd.readouterr().err  # the CPU device copies nothing to weigh the CPU against


# ---------------------------------------------------------------------------------------------- the replayed check


@pytest.mark.parametrize(
    ("miss_ms", "hit_ms", "keep"),
    [(20.0, 10.0, True), (60.0, 10.0, False), (20.0, 30.0, False), (20.0, 20.1, True), (49.5, 20.0, False)],
)
def test_check_replayed_keeps_a_split_only_if_faster(
    monkeypatch: pytest.MonkeyPatch, miss_ms: float, hit_ms: float, keep: bool, capfd
) -> None:
    """`CpuSplit.check_replayed` times a step with the table as fitted and zeroed, missing every expert (the cache
    emptied first) and hitting every one (the same step again after copy-only's), here a stand-in whose duration
    follows the table and whether the cache is empty (copy-only: 50 ms missing, 20 ms hitting). It keeps the table
    only if the split is at least 2 % faster missing (49.5 ms against 50 is noise: off) and at most 5 % slower hitting;
    otherwise the device table ends all zero.
    The stand-in advances a clock of its own instead of sleeping, so that a busy machine's late wake-ups cannot
    decide: 20.1 ms hitting against copy-only's 20.0 sits 0.9 ms inside the tolerance."""
    from types import SimpleNamespace

    from edgemoe.offload import cpu_split
    from edgemoe.offload.cpu_split import CpuSplit

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    clock = [0.0]
    monkeypatch.setattr(cpu_split, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    fitted = [0, 0, 1, 1, 2]
    split = CpuSplit(fitted, None, torch.device("cpu"), fitted=True)
    state = {"empty": False}
    resets = []

    def reset() -> None:
        resets.append(1)
        state["empty"] = True

    def step() -> None:
        on = bool(split.table.any())
        ms = (miss_ms if on else 50.0) if state["empty"] else (hit_ms if on else 20.0)
        clock[0] += ms / 1e3
        state["empty"] = False  # a step makes its experts resident

    got = split.check_replayed(step, reset, rounds=3)
    assert got == keep and len(resets) == 6 and not split.fitted
    assert split.table.tolist() == (fitted if keep else [0] * 5)
    assert ("keeps the split" if keep else "turns the split off") in capfd.readouterr().err
