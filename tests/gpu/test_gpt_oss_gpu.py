"""gpt-oss on CUDA: sinks and windows in the decode attention kernel, experts with biases and the clamped SwiGLU in
the expert kernels (resident or offloaded, MXFP4 or float), the biased router in plain torch, under replayed CUDA
graphs: greedy tokens (float32) equal transformers' on the CPU for the tiny float checkpoint, and the engine's on the
CPU (held to transformers by tests/models/test_gpt_oss.py) for the Hub-style MXFP4 one, resident and offloaded;
bfloat16 runs too (its tokens are not compared)."""

from __future__ import annotations

import pytest
import torch

from edgemoe import LLM, SamplingParams
from tests.conftest import TINY, hf_model, save_checkpoint
from tests.models.test_gpt_oss import mxfp4_checkpoint, prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
OFFLOAD = dict(moe_strategy="offload", moe_cache_slots=6, max_num_seqs=3)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from transformers import AutoModelForCausalLM, Mxfp4Config

    root = tmp_path_factory.mktemp("gpt-oss-gpu")
    hf = hf_model("gpt_oss", **TINY["gpt-oss-yarn-window"][1])
    source = save_checkpoint(hf, root / "float", "per-expert")
    folder = mxfp4_checkpoint(source, root / "mxfp4")
    mx = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, quantization_config=Mxfp4Config(dequantize=True)
    )
    return {"float": (source, hf.eval()), "mxfp4": (folder, mx.eval())}


@pytest.mark.parametrize("options", [{}, OFFLOAD], ids=["resident", "offload"])
@pytest.mark.parametrize("kind", ["float", "mxfp4"])
def test_cuda_graphs_match_transformers(checkpoints, kind: str, options: dict) -> None:
    folder, hf = checkpoints[kind]
    llm = LLM(str(folder), progress=False, dtype="float32", device="cuda", **options)
    assert llm.engine.runner.graphs is not None, "decode should replay CUDA graphs"
    batch = prompts(11)
    if kind == "mxfp4":
        # transformers' MXFP4 dequantization moved between releases (5.17 and 5.25 tie-break token 12 of one prompt
        # apart, by 0.004): the reference is the engine on the CPU, which tests/models/test_gpt_oss.py holds to the
        # transformers CI installs
        cpu = LLM(str(folder), progress=False, dtype="float32", device="cpu", **options)
        refs = [o.token_ids for o in cpu.generate(batch, GREEDY)]
    else:
        refs = [hf.generate(torch.tensor([p]), max_new_tokens=GREEDY.max_tokens, do_sample=False)[0, len(p) :].tolist()
                for p in batch]  # fmt: skip
    for out, ref in zip(llm.generate(batch, GREEDY), refs):
        assert out.token_ids == ref


def test_bfloat16_runs(checkpoints) -> None:
    llm = LLM(str(checkpoints["mxfp4"][0]), progress=False, dtype="bfloat16", device="cuda", **OFFLOAD)
    outs = llm.generate(prompts(3), GREEDY)
    assert all(len(o.token_ids) == GREEDY.max_tokens for o in outs)
