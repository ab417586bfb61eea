"""A GGUF checkpoint with experts in Q4_K (gate/up) and Q6_K (down), on the GPU: the quantized expert kernels in
resident and offloaded decode, eager and replayed from CUDA graphs (the copy service moving raw blocks), give the same
greedy tokens as each other and as the CPU's plain-torch path (float32)."""

from __future__ import annotations

import pytest
import torch

from edgemoe import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
gguf = pytest.importorskip("gguf")

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
PROMPTS = [[5, 17, 300, 41], [9, 8, 7, 6, 5, 4, 3, 2, 100, 200, 300]]


def test_quantized_experts_on_cuda_every_path(tmp_path) -> None:
    from edgemoe.tools.make_model import make_model

    path = str(make_model(tmp_path, "qwen3_moe", "tiny-k", dtype="float32", format="gguf", expert_dtype="q4_k_m"))
    cpu = [o.token_ids for o in LLM(path, progress=False, max_num_seqs=2).generate(PROMPTS, GREEDY)]
    runs = {}
    for graphs in (False, True):
        for offload in (None, 4, 6):
            opts = {} if offload is None else dict(moe_strategy="offload", moe_cache_slots=offload)
            llm = LLM(path, device="cuda", dtype="float32", progress=False, max_num_seqs=2, cuda_graphs=graphs, **opts)
            assert (llm.engine.runner.graphs is not None) == graphs
            runs[graphs, offload] = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    first = runs[False, None]
    assert all(r == first for r in runs.values()), runs
    assert first == cpu
