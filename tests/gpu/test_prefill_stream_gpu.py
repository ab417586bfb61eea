"""Streamed prefill on CUDA (`edgemoe.offload.prefill_stream`): the copy stream and its events give every prefill and
decode step's logits bitwise equal to resident experts (bf16, graphs on), over chunks, requests one after another
and together, for qwen3_moe and qwen2_moe checkpoints of the `small` preset (32 experts a layer, 6 layers)."""

from __future__ import annotations

import pytest
import torch

from edgemoe import LLM
from edgemoe.offload.prefill_stream import PrefillStream
from edgemoe.tools.make_model import make_model
from tests.offload.test_prefill_stream import PROMPTS, step_logits

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_streamed_prefill_is_bitwise_resident_on_cuda(tmp_path, family: str, monkeypatch) -> None:
    folder = str(make_model(tmp_path, family, "small", dtype="bfloat16", seed=5))
    calls = []
    original = PrefillStream.run

    def spy(self, layer, *args):  # noqa: ANN001, ANN202
        calls.append(layer)
        return original(self, layer, *args)

    monkeypatch.setattr(PrefillStream, "run", spy)
    common = dict(device="cuda", progress=False, max_num_seqs=2, max_model_len=256, max_num_batched_tokens=16)
    want = step_logits(LLM(folder, **common), PROMPTS)
    llm = LLM(folder, moe_strategy="offload", moe_cache_slots=80, **common)  # 2 x 32 <= 80 < 6 x 32
    assert llm.engine.expert_cache.prefill_stream is not None
    got = step_logits(llm, PROMPTS)
    assert calls, "prefill did not stream"
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), f"logits differ at {len(key)} tokens"
