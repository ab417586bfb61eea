"""Every family, both checkpoint layouts, several shapes: greedy tokens identical to transformers'
`generate` (three prompts of different lengths batched together, 32 tokens each), and logits at every
prompt and decode position within 1e-4 (float32, CPU)."""

from __future__ import annotations

import pytest
import torch

from edgemoe import LLM, SamplingParams
from tests.conftest import TINY

NEW_TOKENS = 32
# The hybrid families' reference logits come from one forward over the whole sequence (the chunked delta rule);
# decode runs its recurrent form, equal in exact arithmetic: transformers' own incremental decode of these tiny models
# differs from its whole forward by up to 5.4e-5 over 30 positions (attention-only models: 4e-6), and the gap grows
# with the steps.
ATOL = {"qwen3next-dense": 5e-4, "qwen35-tied-mha": 5e-4}


def prompts(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 6000, (n,), generator=g).tolist() for n in (5, 19, 43)]


def hf_greedy(model, prompt: list[int]) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("layout", ["per-expert", "fused"])
@pytest.mark.parametrize("case", list(TINY))
def test_greedy_matches_transformers(tiny_checkpoint, case: str, layout: str) -> None:
    folder, hf = tiny_checkpoint(case, layout)
    llm = LLM(str(folder), progress=False, dtype="float32")
    batch = prompts(len(case))
    outs = llm.generate(batch, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
    for prompt, out in zip(batch, outs):
        assert out.token_ids == hf_greedy(hf, prompt)
        assert out.finish_reason == "length"
    distinct = {t for out in outs for t in out.token_ids}
    assert len(distinct) > 8, "degenerate model: the comparison would prove little"


@pytest.mark.parametrize("case", list(TINY))
def test_logits_match_transformers(tiny_checkpoint, case: str) -> None:
    """Teacher-forced: feed transformers' greedy continuation through our prefill and batched decode."""
    folder, hf = tiny_checkpoint(case, "per-expert")
    engine = LLM(str(folder), progress=False, dtype="float32", max_num_batched_tokens=16).engine  # chunked prefill too
    batch = prompts(len(case) + 1)
    full = [p + hf_greedy(hf, p) for p in batch]
    with torch.no_grad():
        ref = [hf(torch.tensor([ids])).logits[0] for ids in full]  # [len, vocab]
    seqs = [engine.add_request(p, SamplingParams(max_tokens=NEW_TOKENS, temperature=0)) for p in batch]
    checked = 0
    while engine.scheduler.has_work():
        step = engine.scheduler.schedule()
        due, logits = engine.runner.compute_logits(step)
        for seq, n in zip(step.seqs, step.num_new):
            seq.num_computed += n
        for row, i in enumerate(due):
            seq = step.seqs[i]
            k = seqs.index(seq)
            pos = len(seq.token_ids) - 1
            torch.testing.assert_close(logits[row], ref[k][pos], atol=ATOL.get(case, 1e-4), rtol=0)
            checked += 1
            if pos + 1 < len(full[k]):
                seq.token_ids.append(full[k][pos + 1])
            else:
                engine.scheduler.finish(seq)
    assert checked == len(batch) * (NEW_TOKENS + 1)  # the prompt's last position, then each decode step
