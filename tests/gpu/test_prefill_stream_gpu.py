"""Streamed prefill on CUDA (`edgemoe.offload.prefill_stream`): the copy stream and its events give every prefill and
decode step's logits bitwise equal to resident experts (bf16, graphs on), over chunks, requests one after another
and together, for qwen3_moe and qwen2_moe checkpoints of the `small` preset (32 experts a layer, 6 layers)."""

from __future__ import annotations

import pytest
import torch

from edgemoe.tools.make_model import make_model
from tests.offload.test_prefill_stream import assert_streamed_is_resident

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_streamed_prefill_is_bitwise_resident_on_cuda(tmp_path, family: str, monkeypatch) -> None:
    folder = str(make_model(tmp_path, family, "small", dtype="bfloat16", seed=5))
    assert_streamed_is_resident(folder, monkeypatch, 80, device="cuda")  # 2 x 32 <= 80 < 6 x 32 slots
