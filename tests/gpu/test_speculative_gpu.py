"""Prompt-lookup speculation on CUDA: verify steps replay the decode graphs with a row per drafted position, and the
greedy tokens equal plain decoding's, resident and with offloaded experts (bf16, the demo model), drafts made and
accepted (the gate held open: no timing in the test)."""

from __future__ import annotations

import pytest
import torch

from edgemoe import LLM, SamplingParams
from tests.engine.test_speculative import Open

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)


@pytest.mark.parametrize("offload", [False, True], ids=["resident", "offloaded"])
def test_greedy_identical_with_graphs(offload: bool) -> None:
    opts = dict(device="cuda", dtype="bfloat16", progress=False, max_num_seqs=6)
    if offload:
        opts |= dict(moe_strategy="offload", moe_cache_fraction=0.3)
    base = LLM(**opts)
    spec = LLM(**opts, speculative="ngram", speculative_tokens=4)
    spec.engine.gate = Open()
    assert spec.engine.runner.graphs is not None
    tok = base.engine.tokenizer
    prompts = [tok.encode("ROMEO: But soft, what light through yonder window breaks? " * 4 + "ROMEO: But soft,"),
               tok.encode("Once upon a time")]  # fmt: skip
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in base.generate(prompts, params)]
    assert [o.token_ids for o in spec.generate(prompts, params)] == want
    stats = spec.engine.speculative
    assert stats.drafted > 0 and stats.accepted > 0
