"""The engine on CUDA: float32 token-identical to transformers; decode steps free of host syncs;
bf16 compared with float32 (divergence reported, not hidden)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from edgemoe import LLM, SamplingParams, demo_model_path
from tests.conftest import TINY
from tests.gpu.sync_free import decode_without_sync
from tests.models.test_hf_parity import NEW_TOKENS, prompts

GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
DEMO_PROMPTS = [
    "ROMEO.\n",
    "Of Man's first disobedience",
    "To be, or not to be, that is the question:\nWhether",
    "KING.\nWhat news?",
]


@pytest.mark.parametrize("layout", ["per-expert", "fused"])
@pytest.mark.parametrize("case", list(TINY))
def test_float32_cuda_matches_transformers(tiny_checkpoint, case: str, layout: str) -> None:
    folder, hf = tiny_checkpoint(case, layout)
    hf = hf.to("cuda")
    llm = LLM(str(folder), device="cuda", dtype="float32", progress=False)
    batch = prompts(len(case))
    outs = llm.generate(batch, GREEDY)
    for prompt, out in zip(batch, outs):
        ref = hf.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=NEW_TOKENS, do_sample=False)
        assert out.token_ids == ref[0, len(prompt) :].tolist()
    hf.to("cpu")


def test_demo_float32_cuda_matches_transformers(demo_hf) -> None:
    hf, tok = demo_hf
    hf = hf.to("cuda")
    llm = LLM(device="cuda", dtype="float32", progress=False)
    outs = llm.generate(DEMO_PROMPTS, SamplingParams(max_tokens=48, temperature=0))
    for prompt, out in zip(DEMO_PROMPTS, outs):
        ids = tok(prompt, return_tensors="pt").input_ids.cuda()
        ref = hf.generate(ids, max_new_tokens=48, do_sample=False)[0, ids.shape[1] :].tolist()
        assert out.token_ids == ref
    hf.to("cpu")


@pytest.mark.parametrize("graphs", [True, False])
def test_decode_steps_do_not_synchronise(graphs: bool) -> None:
    """Only reading the sampled ids may wait for the GPU (torch raises on any other sync), replayed or eager."""
    llm = LLM(device="cuda", dtype="bfloat16", progress=False, cuda_graphs=graphs)
    assert (llm.engine.runner.graphs is not None) == graphs
    engine = llm.engine
    for p in DEMO_PROMPTS:
        engine.add_request(p, SamplingParams(max_tokens=20, temperature=0.7, seed=1, top_p=0.9, top_k=50))
    while any(s.num_uncomputed > 1 for s in engine.scheduler.waiting) or engine.scheduler.waiting:
        engine.step()  # prefill may synchronise

    def sample(batch, due: list[int], logits: torch.Tensor) -> torch.Tensor:
        seqs = [batch.seqs[i] for i in due]
        t = engine.runner.to_device
        return engine.runner.sampler(
            logits,
            t([0.7] * len(seqs), torch.float32),
            t([50] * len(seqs)),
            t([0.9] * len(seqs), torch.float32),
            t([0.0] * len(seqs), torch.float32),
            [s.generator for s in seqs],
        )

    decode_steps = decode_without_sync(engine, sample)
    assert decode_steps >= 19


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def test_bf16_against_float32_report(tiny_checkpoint) -> None:
    """bf16 greedy vs our float32 run, and batched vs one-at-a-time bf16. Rounding legitimately makes long
    greedy runs drift apart; the positions are recorded (GPU_REPORT) and only the first token must agree."""
    report = {}
    models = {"demo": (str(demo_model_path()), DEMO_PROMPTS)}
    for case in ("qwen2-gqa-shared-dense", "qwen3-head-dim", "mixtral-gqa"):
        models[case] = (str(tiny_checkpoint(case, "fused")[0]), prompts(len(case)))
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    for name, (path, batch) in models.items():
        f32 = [o.token_ids for o in LLM(path, device="cuda", dtype="float32", progress=False).generate(batch, params)]
        bf = LLM(path, device="cuda", dtype="bfloat16", progress=False)
        b16 = [o.token_ids for o in bf.generate(batch, params)]
        single = [bf.generate([p], params)[0].token_ids for p in batch]
        report[name] = {
            "bf16_vs_fp32": [first_divergence(a, b) for a, b in zip(b16, f32)],
            "batched_vs_single_bf16": [first_divergence(a, b) for a, b in zip(b16, single)],
        }
        assert all(a[0] == b[0] for a, b in zip(b16, f32)) or name != "demo"
    print(json.dumps(report, indent=1))
    if os.environ.get("GPU_REPORT"):
        Path(os.environ["GPU_REPORT"]).write_text(json.dumps(report, indent=1))
