"""Offloaded experts end to end on the CPU: greedy outputs token-identical to resident experts for every policy and
cache size, host banks, stats through the API and CLI, VRAM-budget sizing and its errors."""

from __future__ import annotations

import pytest
import torch

from edgemoe import LLM, EdgeMoEError, SamplingParams
from edgemoe.cli import main
from edgemoe.offload.expert_cache import copy_rows_reference
from edgemoe.offload.experts import OffloadedExperts
from edgemoe.offload.layout import split_rows
from edgemoe.tools.make_model import make_model

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """(family, layout) -> folder of a tiny random checkpoint (3 layers, 8 experts, top-2), float32."""
    cache = {}

    def get(family: str, layout: str):
        if (family, layout) not in cache:
            out = tmp_path_factory.mktemp(f"{family}-{layout}")
            cache[family, layout] = str(make_model(out, family, "tiny", layout=layout, dtype="float32"))
        return cache[family, layout]

    return get


@pytest.fixture
def wave_calls(monkeypatch):
    """Counts prefill steps whose experts went in one wave and in several, so tests can insist both ran."""
    calls = {"one": 0, "several": 0}
    original = OffloadedExperts._waves

    def spy(self, experts):
        n = 0
        for wave in original(self, experts):  # lazily: a wave is used before the next may evict it
            n += 1
            yield wave
        calls["one" if n == 1 else "several"] += 1

    monkeypatch.setattr(OffloadedExperts, "_waves", spy)
    return calls


def run(model: str | None, batches: list[list], **kwargs) -> tuple[list[list[list[int]]], LLM]:
    """Greedy token ids per batch of prompts, the batches run one after the other on one engine."""
    llm = LLM(model, progress=False, max_num_seqs=2, max_model_len=256, **kwargs)
    return [[o.token_ids for o in llm.generate(prompts, GREEDY)] for prompts in batches], llm


@pytest.mark.parametrize("layout", ["per-expert", "fused"])
@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe"])
def test_tiny_models_token_identical(tiny_models, family: str, layout: str, wave_calls) -> None:
    folder = tiny_models(family, layout)
    # two 8-token prompts prefill together (32 pairs over up to 8 experts: several waves at 4 slots); one 3-token
    # prompt has 6 pairs over at most 6 experts (one wave where the pool holds them)
    batches = [[list(range(10, 18)), list(range(40, 48))], [[7, 99, 123]]]
    expected, _ = run(folder, batches)
    for policy in ("lru", "scored"):
        for slots in (4, 9, 24):  # minimum: max_num_seqs 2 x top-2; 24: every expert of 3 layers
            kwargs = dict(moe_cache_slots=slots, moe_policy=policy, moe_collect_stats=True)
            got, llm = run(folder, batches, moe_strategy="offload", **kwargs)
            assert got == expected, (policy, slots)
            total = llm.moe_stats()["total"]
            assert total["misses"] > 0 and total["hits"] + total["misses"] == total["accesses"]
            if slots == 4:
                assert total["evictions"] > 0
    assert wave_calls["one"] > 0 and wave_calls["several"] > 0


def test_demo_model_token_identical() -> None:
    batches = [["To be, or not to be, that is the question:", "Of Man's first disobedience"]]
    want, _ = run(None, batches)
    for policy in ("lru", "scored"):
        for slots in (8, 56, 224):  # 8: the minimum at max_num_seqs 2; 224: all 7 x 32 experts
            got, llm = run(
                None, batches, moe_strategy="offload", moe_cache_slots=slots, moe_policy=policy, moe_collect_stats=True
            )
            assert got == want, (policy, slots)
            stats = llm.moe_stats()
            total = stats["total"]
            assert total["hits"] + total["misses"] == total["accesses"] > 0
            assert total["bytes_copied"] == total["misses"] * 3 * 256 * 48 * 4  # float32 experts
            assert [row["layer"] for row in stats["layers"]] == list(range(7))
            if slots < 224:
                assert total["misses"] > slots and total["evictions"] > 0
            else:
                assert total["evictions"] == 0 and total["misses"] <= 224  # each expert missed once at most


def test_host_banks_hold_the_checkpoint(tiny_models) -> None:
    for layout in ("per-expert", "fused"):
        folder = tiny_models("qwen2_moe", layout)
        resident = LLM(folder, progress=False).engine.model
        offloaded = LLM(folder, progress=False, moe_strategy="offload", moe_cache_slots=16).engine.model
        names = {n for n, _ in offloaded.named_parameters()}
        assert not any(".experts." in n for n in names), "routed experts must not be device parameters"
        for a, b in zip(resident.model.layers, offloaded.model.layers):
            assert isinstance(b.mlp.experts, OffloadedExperts)
            assert torch.equal(a.mlp.experts.gate_up_proj, b.mlp.experts.gate_up_proj)
            assert torch.equal(a.mlp.experts.down_proj, b.mlp.experts.down_proj)
            assert not b.mlp.experts.gate_up_proj.is_pinned()  # pinned only for CUDA devices
            assert_joined(b.mlp.experts.gate_up_proj, b.mlp.experts.down_proj)
        cache = offloaded.model.layers[0].mlp.experts.cache
        assert_joined(cache.pool_a, cache.pool_b)


def assert_joined(w13: torch.Tensor, w2: torch.Tensor) -> None:
    """Each expert's (or slot's) down row right after its gate_up row, and the next expert right after that: one
    run of memory an expert (`split_rows`), which the copy service copies in one piece."""
    row_a, row_b = w13[0].nbytes, w2[0].nbytes
    assert w13[0].is_contiguous() and w2[0].is_contiguous()
    for e in range(w13.shape[0]):
        assert w13[e].data_ptr() == w13.data_ptr() + e * (row_a + row_b)
        assert w2[e].data_ptr() == w13[e].data_ptr() + row_a


def test_split_rows_views_one_allocation() -> None:
    joined = torch.arange(3 * 3 * 4 * 5, dtype=torch.float32).view(5, 36)  # 5 experts, inter 3, hidden 4
    w13, w2 = split_rows(joined, 3, 4)
    assert w13.shape == (5, 6, 4) and w2.shape == (5, 4, 3)
    assert_joined(w13, w2)
    assert torch.equal(w13[2].flatten(), joined[2, :24]) and torch.equal(w2[2].flatten(), joined[2, 24:])
    pool = torch.zeros(4, 36)
    w13_pool, w2_pool = split_rows(pool, 3, 4)
    copy_rows_reference(w13_pool, w13, torch.tensor([4, 1]), torch.tensor([0, 3]))
    copy_rows_reference(w2_pool, w2, torch.tensor([4, 1]), torch.tensor([0, 3]))
    assert torch.equal(pool[0], joined[4]) and torch.equal(pool[3], joined[1]) and not pool[1:3].any()
    with pytest.raises(AssertionError):
        split_rows(torch.zeros(5, 35), 3, 4)


def test_vram_budget_sizes_the_cache(capfd) -> None:
    llm = LLM(progress=False, max_num_seqs=1, max_model_len=256, moe_strategy="offload", vram_budget="40MiB")
    cache, engine = llm.engine.expert_cache, llm.engine
    weights = sum(t.numel() * t.element_size() for t in (*engine.model.parameters(), *engine.model.buffers()))
    kv = 2 * engine.kv.k.numel() * engine.kv.k.element_size()
    per_expert = 3 * 256 * 48 * 4
    # a prefill step's activations (`prefill_activation_bytes`) at 256 tokens (the context limit), 1 sequence, float32:
    # the residual stream 2 * 256 * 256 * 4, the MoE layer (larger than attention's 1,837,056): normed input
    # 256 * 256 * 4, router 256 * 32 * 12 + 256 * 4 * 12, grouped experts 2 * 1024 * 8 + 1024 * (48 + 256) * 4
    # + 256 * 256 * 8, shared expert 256 * (3 * 256 + 256) * 4; logits 6144 * 8
    acts = 524_288 + (262_144 + 110_592 + 1_785_856 + 1_048_576) + 49_152
    assert engine.max_num_batched_tokens == 512  # 2 x 512 tokens is more than 1 sequence of 256 can prefill
    assert cache.num_slots == min(224, (40 * 2**20 - weights - acts - kv) // per_expert - 1)
    assert 4 <= cache.num_slots < 224
    err = capfd.readouterr().err
    assert f"expert cache: {cache.num_slots} of 224 experts" in err
    assert f"prefill {acts / 2**20:.1f} MiB" in err and "prefill: chunks of 512 tokens" in err


def test_vram_budget_keeps_room_for_experts() -> None:
    """A long context must not let the KV cache eat the budget: it takes at most a quarter of the room."""
    llm = LLM(progress=False, max_num_seqs=8, moe_strategy="offload", vram_budget="80MiB")
    engine = llm.engine
    weights = sum(t.numel() * t.element_size() for t in (*engine.model.parameters(), *engine.model.buffers()))
    kv = 2 * engine.kv.k.numel() * engine.kv.k.element_size()
    room = 80 * 2**20 - weights - 33 * 3 * 256 * 48 * 4
    assert kv <= room // 4 + 2 * 16 * 7 * 4 * 32 * 4 * 2  # a quarter, give or take the pad block
    assert engine.expert_cache.num_slots > 100


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(moe_strategy="offload", vram_budget="16MiB"), "the minimum is 29.5 MiB"),  # 7.5 MiB prefill
        (dict(vram_budget="16MiB"), "the minimum is"),
        (dict(moe_strategy="offload", moe_cache_slots=3), "the minimum is 32 slots"),
        (dict(moe_strategy="offload", moe_cache_slots=3, max_num_seqs=1), "the minimum is 4 slots"),
        (dict(moe_strategy="offload", moe_cache_fraction=0.1), "the minimum is 32 slots"),
        (dict(moe_strategy="offload"), "needs moe_cache_slots, moe_cache_fraction or vram_budget"),
        (dict(moe_cache_slots=40), "need moe_strategy offload"),
        (dict(moe_strategy="offload", moe_cache_slots=40, vram_budget="1GiB"), "give one of"),
        (dict(moe_strategy="swap"), "unknown moe_strategy"),
        (dict(moe_strategy="offload", moe_cache_slots=40, moe_policy="fifo"), "unknown moe_policy"),
        (dict(moe_strategy="offload", moe_cache_fraction=1.5), "moe_cache_fraction must be in (0, 1]"),
        (dict(moe_strategy="offload", vram_budget="lots"), "cannot read size"),
    ],
)
def test_errors_name_the_minimum(kwargs: dict, message: str) -> None:
    with pytest.raises(EdgeMoEError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        LLM(progress=False, **kwargs)


def test_stats_need_offload_and_collection() -> None:
    llm = LLM(progress=False, moe_strategy="offload", moe_cache_slots=64)
    with pytest.raises(EdgeMoEError, match="statistics are off"):
        llm.moe_stats()


def test_cli_prints_stats(capsys) -> None:
    argv = [
        "generate",
        "To be",
        "--max-tokens",
        "4",
        "--temperature",
        "0",
        "--moe-strategy",
        "offload",
        "--moe-cache-fraction",
        "0.25",
        "--moe-policy",
        "scored",
        "--moe-collect-stats",
    ]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "expert cache: 56 slots, policy scored" in err and "hit rate" in err
    assert "bytes_copied" in err and len([line for line in err.splitlines() if line.strip().startswith("6 ")]) == 1
    assert main(["generate", "To be", "--moe-cache-slots", "9"]) == 2
    assert "edgemoe: error: moe_cache_slots" in capsys.readouterr().err
