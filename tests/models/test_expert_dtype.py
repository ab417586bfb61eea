"""Quantize on load (`expert_dtype`): a safetensors checkpoint's routed experts stored as GGUF blocks, bitwise as the
`gguf` package's quantizer makes them, and decoded so that greedy output equals transformers' with every expert
replaced by gguf's dequantization of those blocks (float32, CPU); offloaded equals resident at every cache size and
policy."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from edgemoe import LLM, SamplingParams
from edgemoe.config import EXPERT_DTYPES
from edgemoe.errors import EdgeMoEError

gguf = pytest.importorskip("gguf")

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
CASES = ["qwen3-head-dim", "qwen2-gqa-shared-dense", "mixtral-gqa"]


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, 6000, (n,), generator=g).tolist() for n in (4, 17)]


def blocks(w: torch.Tensor, expert_dtype: str) -> np.ndarray:
    return gguf.quants.quantize(w.detach().float().numpy(), gguf.GGMLQuantizationType[expert_dtype.upper()])


def with_gguf_experts(hf, expert_dtype: str):
    """transformers' model with each expert weight as gguf dequantizes its quantized blocks."""
    kind = gguf.GGMLQuantizationType[expert_dtype.upper()]
    model = copy.deepcopy(hf)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".experts." in name:
                p.copy_(torch.from_numpy(gguf.quants.dequantize(blocks(p, expert_dtype), kind)).view(p.shape))
    return model


@pytest.mark.parametrize("expert_dtype", ["q8_0", "q4_0", "mxfp4", "q5_1"])
@pytest.mark.parametrize("case", CASES)
def test_quantized_experts_match_transformers_on_the_same_blocks(tiny_checkpoint, case: str, expert_dtype: str) -> None:
    folder, hf = tiny_checkpoint(case, "fused")
    llm = LLM(str(folder), progress=False, dtype="float32", expert_dtype=expert_dtype)
    model = llm.engine.model
    state = dict(hf.named_parameters())
    for i, layer in enumerate(model.model.layers):
        if not layer.is_moe:
            continue
        experts, prefix = layer.mlp.experts, f"model.layers.{i}.mlp.experts"
        for ours, theirs in ((experts.gate_up_proj, "gate_up_proj"), (experts.down_proj, "down_proj")):
            assert ours.dtype == torch.uint8
            assert np.array_equal(ours.numpy(), blocks(state[f"{prefix}.{theirs}"], expert_dtype))
    ref = with_gguf_experts(hf, expert_dtype)
    batch = prompts()
    outs = llm.generate(batch, GREEDY)
    for prompt, out in zip(batch, outs):
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=GREEDY.max_tokens, do_sample=False)
        assert out.token_ids == want[0, len(prompt) :].tolist()


@pytest.mark.parametrize("expert_dtype", ["q8_0", "mxfp4"])
def test_offloaded_quantized_experts_equal_resident(tiny_checkpoint, expert_dtype: str) -> None:
    folder, _ = tiny_checkpoint("qwen2-gqa-shared-dense", "fused")
    batch = prompts()
    resident = [
        o.token_ids for o in LLM(str(folder), progress=False, expert_dtype=expert_dtype).generate(batch, GREEDY)
    ]
    for slots, policy in ((8, "lru"), (11, "scored"), (16, "lru")):  # 8: one layer's step at most
        llm = LLM(
            str(folder), progress=False, expert_dtype=expert_dtype, moe_strategy="offload", max_num_seqs=4,
            moe_cache_slots=slots, moe_policy=policy, moe_collect_stats=True,
        )  # fmt: skip
        assert [o.token_ids for o in llm.generate(batch, GREEDY)] == resident, (slots, policy)
        stats = llm.moe_stats()
        assert stats["total"]["misses"] > 0
        assert stats["total"]["bytes_copied"] == stats["total"]["misses"] * llm.engine.expert_cache.expert_bytes


def test_rows_that_are_not_whole_blocks_are_refused() -> None:
    """In one line naming the row that does not fit and the formats that would (none for the demo model: every
    format here has 32-weight blocks, its down rows are 48 wide)."""
    for expert_dtype in EXPERT_DTYPES[1:]:
        with pytest.raises(EdgeMoEError) as err:
            LLM(progress=False, expert_dtype=expert_dtype)
        message = str(err.value)
        assert "\n" not in message and "blocks of 32 weights" in message, message
        assert "expert down rows are 48 wide (moe_intermediate_size); no expert_dtype fits this model" in message
    with pytest.raises(EdgeMoEError, match="unknown expert_dtype 'q3_k'"):
        LLM(progress=False, expert_dtype="q3_k")
