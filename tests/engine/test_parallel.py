"""Tensor parallelism (`--tensor-parallel N`, `edgemoe/engine/parallel.py`) on the CPU: two processes over gloo, each
holding half of every attention layer's heads and half of every expert's intermediate axis, resident or offloaded.
Greedy tokens equal one process's (which tests/models/test_hf_parity.py holds equal to transformers') for every family
it splits, a seeded sampled request beside them draws the same tokens, each rank's KV cache holds its heads and its
experts their half (quantized experts whole blocks of it, unevenly where the blocks are odd: GGUF files, gpt-oss's
MXFP4), what it does not split is refused in one line before anything is spawned, and a rank that dies ends the
engine's next step with one line."""

from __future__ import annotations

import pytest
import torch

from edgemoe import LLM, SamplingParams
from edgemoe.engine.parallel import shares
from edgemoe.engine.summary import startup_line
from edgemoe.errors import EdgeMoEError
from tests.conftest import TINY, hf_model, save_checkpoint
from tests.engine.test_speculative import Open, generate, oracle_drafter

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
FLOAT32 = dict(progress=False, dtype="float32")


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, 400, (n,), generator=g).tolist() for n in (21, 9, 33)]


OFFLOAD = dict(moe_strategy="offload", moe_cache_fraction=0.5, moe_collect_stats=True)


@pytest.mark.parametrize(
    ("case", "layout", "options"),
    [
        ("qwen2-gqa-shared-dense", "per-expert", {}),
        ("qwen3-head-dim", "per-expert", {}),
        ("qwen3-head-dim", "fused", OFFLOAD),
        ("mixtral-gqa", "per-expert", OFFLOAD),
        ("glm-groups-qknorm-mtp", "per-expert", {}),
        ("glm-air-dense2", "fused", OFFLOAD),
        ("gpt-oss-yarn-window", "per-expert", {}),
        ("gpt-oss-yarn-window", "per-expert", OFFLOAD),
        ("olmoe-mha-clip", "per-expert", {}),
        ("olmoe-mha-clip", "fused", OFFLOAD),
        ("qwen3next-dense", "per-expert", {}),
        ("qwen3next-dense", "per-expert", OFFLOAD),
        ("qwen35-tied-mha", "per-expert", {}),
    ],
    ids=lambda v: "offloaded" if v == OFFLOAD else "resident" if v == {} else v,
)
def test_two_ranks_decode_as_one(tiny_checkpoint, case: str, layout: str, options: dict) -> None:
    """Each rank loads its share of every tensor (per-expert and stacked checkpoints); offloaded, each rank's expert
    cache holds its share of every expert and decides as the others do."""
    folder, _ = tiny_checkpoint(case, layout)
    params = [GREEDY, SamplingParams(max_tokens=12, temperature=0.8, seed=3), GREEDY]
    base = LLM(str(folder), **FLOAT32, **options)
    want = generate(base, prompts(), params)
    llm = LLM(str(folder), **FLOAT32, **options, tensor_parallel=2)
    try:
        assert generate(llm, prompts(), params) == want
        one, two = startup_line(base.engine).split(": ", 2), startup_line(llm.engine).split(": ", 2)
        assert " on 2 CPU ranks, " in two[1] and one[2].split(", context")[0] == two[2].split(", context")[0]
        attn = next(layer.self_attn for layer in llm.engine.model.model.layers if hasattr(layer.self_attn, "nq"))
        cfg = llm.engine.model_config  # the rank's share of the heads, which its KV cache holds
        assert (attn.nq, attn.nkv) == (cfg.num_heads, cfg.num_kv_heads)
        assert attn.attn.k_cache.shape[1:] == (cfg.num_kv_heads, cfg.head_dim)
        moe = next(layer.mlp.inner for layer in llm.engine.model.model.layers if layer.is_moe)
        assert moe.experts.down_proj.shape[-1] == cfg.moe_intermediate_size  # its half of each expert
        if options:
            assert llm.engine.moe_stats()["total"]["misses"] > 0  # its cache missed, and copied its share of experts
    finally:
        llm.engine.close()


@pytest.mark.parametrize(
    ("case", "options", "message"),
    [
        ("qwen3-head-dim", dict(moe_strategy="offload", ram_budget=0.5), "a RAM budget .the disk tier. is not split"),
        ("glm-groups-qknorm-mtp", dict(speculative="mtp"), "the MTP head is not split yet"),
        ("qwen3-head-dim", dict(expert_dtype="q8_0"), "moe_intermediate_size 32 is 1 blocks of 32 weights, fewer than"),
        ("qwen3-mqa-tied", {}, "num_key_value_heads 1 does not split into 2 equal parts"),
    ],
)
def test_what_is_not_split_is_refused(tiny_checkpoint, case: str, options: dict, message: str) -> None:
    folder, _ = tiny_checkpoint(case, "per-expert")
    with pytest.raises(EdgeMoEError, match=message) as info:
        LLM(str(folder), **FLOAT32, tensor_parallel=2, **options)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("expert_dtype", ["q8_0", "q4_0"])
def test_experts_quantized_on_load_by_each_rank(tmp_path, expert_dtype: str) -> None:
    """Each rank quantizes its share of every expert (its down rows are whole blocks: 64 / 2 = 32 weights, one q8_0 or
    q4_0 block), resident and offloaded: tokens as one process's with the same expert_dtype."""
    folder = save_checkpoint(hf_model("qwen3_moe", num_key_value_heads=2, moe_intermediate_size=64), tmp_path, "fused")
    for options in ({}, OFFLOAD):
        opts = FLOAT32 | options | dict(expert_dtype=expert_dtype)
        want = generate(LLM(str(folder), **opts), prompts(), GREEDY)
        llm = LLM(str(folder), **opts, tensor_parallel=2)
        try:
            assert generate(llm, prompts(), GREEDY) == want
            moe = next(layer.mlp.inner for layer in llm.engine.model.model.layers if layer.is_moe)
            assert moe.experts.down_proj.dtype == torch.uint8  # blocks, as stored
        finally:
            llm.engine.close()


@pytest.mark.parametrize("options", [{}, OFFLOAD], ids=["resident", "offloaded"])
def test_a_gguf_files_experts_split_in_whole_blocks(tmp_path, options: dict) -> None:
    """A Q8_0 file that llama.cpp's converter wrote, experts 96 wide (three blocks of 32 in each down row): the ranks
    take 64 and 32 of every expert's intermediate axis (uneven, whole blocks: `parallel.shares`), as stored, dense
    weights dequantized: tokens as one process's."""
    pytest.importorskip("gguf")
    from tests.models.llama_converter import convert

    model = hf_model("qwen3_moe", **dict(TINY["qwen3-head-dim"][1], mlp_only_layers=[], moe_intermediate_size=96))
    file = convert(save_checkpoint(model, tmp_path / "hf", "per-expert"), tmp_path / "experts.gguf", "q8_0")
    base = LLM(str(file), **FLOAT32, **options)
    want = generate(base, prompts(), GREEDY)
    llm = LLM(str(file), **FLOAT32, **options, tensor_parallel=2)
    try:
        assert generate(llm, prompts(), GREEDY) == want
        assert llm.engine.model_config.moe_intermediate_size == 64  # rank 0's two blocks (rank 1: one)
        # the start-up line counts the whole model's parameters, not the rank's share times the ranks
        one, two = startup_line(base.engine).split(": ", 2), startup_line(llm.engine).split(": ", 2)
        assert one[2].split(", context")[0] == two[2].split(", context")[0], (one, two)
        moe = next(layer.mlp.inner for layer in llm.engine.model.model.layers if layer.is_moe)
        assert moe.experts.down_proj.dtype == torch.uint8  # blocks, as stored
    finally:
        llm.engine.close()


@pytest.mark.parametrize("options", [{}, OFFLOAD], ids=["resident", "offloaded"])
def test_gpt_oss_mxfp4_experts_split_in_whole_blocks(tiny_checkpoint, tmp_path, options: dict) -> None:
    """gpt-oss as the Hub ships it, MXFP4 experts kept as stored: each rank takes whole 32-weight blocks of every down
    row (the repacked rows' bytes: 17 a block) and its rows of gate/up, its heads' sinks, and adds the expert and
    o_proj biases on rank 0 alone: tokens as one process's."""
    from tests.models.test_gpt_oss import mxfp4_checkpoint

    source, _ = tiny_checkpoint("gpt-oss-yarn-window", "per-expert")
    folder = mxfp4_checkpoint(source, tmp_path / "mxfp4")
    want = generate(LLM(str(folder), **FLOAT32, **options), prompts(), GREEDY)
    llm = LLM(str(folder), **FLOAT32, **options, tensor_parallel=2)
    try:
        assert generate(llm, prompts(), GREEDY) == want
        layer = llm.engine.model.model.layers[0]
        assert layer.mlp.inner.experts.down_proj.dtype == torch.uint8  # blocks, as stored
        assert layer.self_attn.attn.sinks.shape == (llm.engine.model_config.num_heads,)  # its heads' sinks
    finally:
        llm.engine.close()


def test_hybrid_states_follow_rank_0s(tiny_checkpoint) -> None:
    """A hybrid's per-sequence states live on every rank (each its heads' share), but rank 0 alone schedules: what it
    does to its state rows (a slot cleared for a new sequence, a snapshot saved and later resumed from, a verify
    step's state stashed and put back) reaches the other ranks with the next forward. Requests one after another (each
    reusing the slot before it, dirty), one that resumes from the first one's snapshot, prompt lookup's drafts: tokens
    as one process's."""
    folder, _ = tiny_checkpoint("qwen3next-dense", "per-expert")
    first = (prompts()[2] * 2)[:64]  # 4 whole blocks: the snapshot after its prompt stays for requests sharing it
    batch = [first, first + [7, 8, 9], prompts()[0]]
    base = LLM(str(folder), **FLOAT32)
    want = [generate(base, [p], GREEDY)[0] for p in batch]
    llm = LLM(str(folder), **FLOAT32, tensor_parallel=2, max_num_seqs=6, speculative="ngram")
    llm.engine.gate = Open()  # drafts right up to a varying position (an oracle): kept and undone verify steps
    llm.engine.scheduler.drafter = oracle_drafter(llm.engine, {tuple(b): w for b, w in zip(batch, want)})
    try:
        assert [generate(llm, [p], GREEDY)[0] for p in batch] == want
        assert llm.engine.states.restored > 0
        stats = llm.engine.speculative
        assert stats.accepted > 0 and stats.drafted > stats.accepted, stats
    finally:
        llm.engine.close()


def test_shares_are_whole_units_as_even_as_they_go() -> None:
    assert shares(768, 2, 256) == [(0, 512), (512, 256)]
    assert shares(96, 2, 32) == [(0, 64), (64, 32)] and shares(64, 2) == [(0, 32), (32, 32)]
    assert shares(1408, 4, 32) == [(0, 352), (352, 352), (704, 352), (1056, 352)]
    assert shares(1280, 3, 256) == [(0, 512), (512, 512), (1024, 256)]


def test_prompt_lookup_verify_steps_on_two_ranks(tiny_checkpoint) -> None:
    """Verify steps are eager steps whose rows every rank computes: drafts accepted, tokens as one process's."""
    folder, _ = tiny_checkpoint("qwen3-head-dim", "per-expert")
    batch = [[5, 6, 7, 8, 9] * 6, prompts()[0]]  # a pattern that prompt lookup drafts, and random tokens
    want = generate(LLM(str(folder), **FLOAT32), batch, GREEDY)
    llm = LLM(str(folder), **FLOAT32, tensor_parallel=2, speculative="ngram", max_num_seqs=6)
    llm.engine.gate = Open()
    try:
        assert generate(llm, batch, GREEDY) == want
        assert llm.engine.speculative.drafted > 0
    finally:
        llm.engine.close()


def test_a_rank_that_dies_ends_the_next_step_in_one_line(tiny_checkpoint) -> None:
    folder, _ = tiny_checkpoint("qwen3-head-dim", "per-expert")
    llm = LLM(str(folder), **FLOAT32, tensor_parallel=2)
    try:
        assert len(llm.generate(prompts()[:1], GREEDY)[0].token_ids) == GREEDY.max_tokens
        worker = llm.engine.parallel.workers[0]
        worker.kill()
        worker.join(timeout=30)
        with pytest.raises(EdgeMoEError, match=r"rank 1 \(exit code -9\) ended") as info:
            llm.generate(prompts()[:1], GREEDY)
        assert "\n" not in str(info.value)
    finally:
        llm.engine.close()
    again = LLM(str(folder), **FLOAT32, tensor_parallel=2)  # the group was given up: a new engine starts one
    try:
        assert len(again.generate(prompts()[:1], GREEDY)[0].token_ids) == GREEDY.max_tokens
    finally:
        again.engine.close()


def test_an_engine_that_fails_after_spawning_leaves_no_group_behind(tiny_checkpoint) -> None:
    """A start-up error after the ranks are up and loaded (here a KV cache too small for a block): one line, the
    workers gone (they wait in a collective), and the next engine starts its own group."""
    folder, _ = tiny_checkpoint("qwen3-head-dim", "per-expert")
    with pytest.raises(EdgeMoEError, match="kv_cache_memory 1B holds no KV block") as info:
        LLM(str(folder), **FLOAT32, tensor_parallel=2, kv_cache_memory="1B")
    assert "\n" not in str(info.value)
    llm = LLM(str(folder), **FLOAT32, tensor_parallel=2)
    try:
        assert len(llm.generate(prompts()[:1], GREEDY)[0].token_ids) == GREEDY.max_tokens
    finally:
        llm.engine.close()
