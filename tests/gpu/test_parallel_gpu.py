"""Tensor parallelism on CUDA (`--tensor-parallel 2`, NCCL, one GPU a rank): greedy tokens equal one process's on one
GPU, experts resident and offloaded, float32 (tests/engine/test_parallel.py holds the same on two CPU ranks over
gloo). Needs two CUDA devices: skipped on the single-GPU kinds."""

from __future__ import annotations

import pytest
import torch

from edgemoe import LLM
from tests.engine.test_parallel import GREEDY, OFFLOAD, prompts
from tests.engine.test_speculative import generate

if torch.cuda.device_count() < 2:
    pytest.skip("needs two CUDA devices", allow_module_level=True)

CUDA = dict(device="cuda", dtype="float32", progress=False)


@pytest.mark.parametrize("options", [{}, OFFLOAD], ids=["resident", "offloaded"])
@pytest.mark.parametrize("case", ["qwen3-head-dim", "glm-groups-qknorm-mtp"])
def test_two_gpus_decode_as_one(tiny_checkpoint, case: str, options: dict) -> None:
    folder, _ = tiny_checkpoint(case, "per-expert")
    want = generate(LLM(str(folder), **CUDA, **options), prompts(), GREEDY)
    llm = LLM(str(folder), **CUDA, **options, tensor_parallel=2)
    try:
        assert llm.engine.device == torch.device("cuda", 0)
        assert generate(llm, prompts(), GREEDY) == want
    finally:
        llm.engine.close()
