"""The start-up warm-up (`LLMEngine._warm_up`, run on CUDA; called here on the CPU) changes nothing a request sees:
greedy tokens identical, no KV block taken or cached, the expert cache's counters as if it never ran."""

from __future__ import annotations

import pytest

from edgemoe import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPTS = ["To be, or not to be, that is the question:", "Of Man's first disobedience"]


@pytest.mark.parametrize("moe", [{}, {"moe_strategy": "offload", "moe_cache_slots": 8, "moe_collect_stats": True}])
def test_warm_up_changes_no_output_and_no_kv_block(moe: dict) -> None:
    def run(warm: bool) -> tuple[list[list[int]], dict | None]:
        llm = LLM(progress=False, max_num_seqs=2, max_model_len=256, **moe)
        engine, kv = llm.engine, llm.engine.kv
        before = (list(kv.free), list(kv.refs), dict(kv.known), list(kv.key))
        if warm:
            engine._warm_up()
            assert (list(kv.free), list(kv.refs), dict(kv.known), list(kv.key)) == before
        tokens = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
        return tokens, engine.moe_stats() if moe else None

    assert run(True) == run(False)


def test_warm_up_lengths() -> None:
    """A whole chunk, then 17, 16 and 1 tokens (Triton's integer specialisations); with resident experts also each
    power of two below the chunk down to 32 (the dense GEMMs' kernels by size)."""
    from edgemoe.engine.model_runner import warmup_lengths

    assert warmup_lengths(512) == [512, 17, 16, 1]
    assert warmup_lengths(512, every_size=True) == [512, 256, 128, 64, 32, 17, 16, 1]
    assert warmup_lengths(40, every_size=True) == [40, 17, 16, 1] and warmup_lengths(16) == [16, 1]
