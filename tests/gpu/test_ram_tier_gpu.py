"""The RAM tier on CUDA (`--ram-budget`): the demo model's greedy tokens with experts in an expert store behind a few
RAM rows equal resident experts', token for token, with replayed CUDA graphs (the copy service fetches each posted
list from the tier before queueing its copies) and eagerly (the step reads its list on the host and copies the rows,
marking the arrival counters the expert kernels wait on); the tier really read from disk; and a store truncated under
a running engine fails the step with one line naming the RAM tier instead of decoding from a bad read."""

from __future__ import annotations

import os

import pytest

from edgemoe import LLM, EdgeMoEError, SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
PROMPTS = ["ROMEO.\n", "Of Man's first disobedience", "To be, or not to be, that is the question:", "KING.\n"]


def tokens(llm: LLM) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def resident() -> list[list[int]]:
    return tokens(LLM(device="cuda", dtype="bfloat16", progress=False, max_num_seqs=4, max_model_len=256))


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("budget", ["0.25", "0.5"])
def test_ram_tier_token_identical_on_cuda(resident, tmp_path, graphs: bool, budget: str) -> None:
    llm = LLM(
        device="cuda", dtype="bfloat16", progress=False, max_num_seqs=4, max_model_len=256, moe_strategy="offload",
        moe_cache_slots=16, ram_budget=budget, expert_store=str(tmp_path), moe_collect_stats=True, cuda_graphs=graphs,
    )  # fmt: skip
    assert tokens(llm) == resident
    tier = llm.engine.moe_stats()["ram_tier"]
    assert tier["reads"] > 0 and tier["error"] == 0


def test_truncated_store_fails_the_step(tmp_path) -> None:
    llm = LLM(
        device="cuda", dtype="bfloat16", progress=False, max_num_seqs=4, max_model_len=256, moe_strategy="offload",
        moe_cache_slots=16, ram_budget="0.25", expert_store=str(tmp_path),
    )  # fmt: skip
    store = next(tmp_path.glob("edgemoe-experts-*.bin"))
    os.truncate(store, store.stat().st_size // 2)
    with pytest.raises(EdgeMoEError, match="RAM tier"):
        tokens(llm)
