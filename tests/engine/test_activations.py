"""The prefill chunk: 512 with resident experts; offloaded, the largest power of two whose activations fit; the
user's `max_num_batched_tokens` always; greedy output the same whatever the chunk."""

from __future__ import annotations

import torch

from edgemoe import LLM, SamplingParams
from edgemoe.engine.activations import (
    ACTIVATION_SHARE,
    OFFLOAD_CHUNK_CAP,
    PREFILL_CHUNK,
    offload_prefill_chunk,
    prefill_activation_bytes,
)

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def test_resident_experts_keep_the_short_chunk(capfd) -> None:
    engine = LLM(progress=False).engine
    assert engine.max_num_batched_tokens == engine.scheduler.token_budget == PREFILL_CHUNK == 512
    assert "prefill: chunks of 512 tokens" in capfd.readouterr().err


def test_offloaded_experts_take_the_longest_chunk_a_step_can_use(capfd) -> None:
    """On the CPU nothing limits the activations but what a step can hold: max_num_seqs prompts of max_model_len."""
    engine = LLM(progress=False, moe_strategy="offload", moe_cache_slots=64).engine  # 8 x 2048 tokens
    assert engine.max_num_batched_tokens == engine.scheduler.token_budget == OFFLOAD_CHUNK_CAP
    assert "prefill: chunks of 16384 tokens" in capfd.readouterr().err
    engine = LLM(progress=False, moe_strategy="offload", moe_cache_slots=64, max_num_seqs=4, max_model_len=1000).engine
    assert engine.max_num_batched_tokens == 2048  # the largest power of two <= 4 x 1000


def test_a_budget_bounds_the_offloaded_chunk() -> None:
    """Under a VRAM budget the default chunk's activations take at most an eighth of what the dense weights and the
    smallest expert cache leave, and twice the chunk would not."""
    engine = LLM(progress=False, moe_strategy="offload", vram_budget="200MiB").engine
    cfg, chunk = engine.model_config, engine.max_num_batched_tokens
    weights = sum(t.numel() * t.element_size() for t in (*engine.model.parameters(), *engine.model.buffers()))
    room = 200 * 2**20 - weights - 33 * 3 * 256 * 48 * 4  # 33: the smallest cache (8 x top-4) and a scratch slot
    acts = [prefill_activation_bytes(cfg, n, 8, 2048, torch.float32) for n in (chunk, 2 * chunk)]
    assert PREFILL_CHUNK < chunk < OFFLOAD_CHUNK_CAP
    assert acts[0] * ACTIVATION_SHARE <= room < acts[1] * ACTIVATION_SHARE
    assert chunk == offload_prefill_chunk(cfg, torch.float32, 8, 2048, room)


def test_the_users_chunk_wins() -> None:
    offloaded = LLM(progress=False, moe_strategy="offload", moe_cache_slots=64, max_num_batched_tokens=96).engine
    assert offloaded.max_num_batched_tokens == offloaded.scheduler.token_budget == 96
    resident = LLM(progress=False, max_num_batched_tokens=2048).engine
    assert resident.max_num_batched_tokens == resident.scheduler.token_budget == 2048


def test_chunks_grow_with_the_step_and_stop_at_the_cap() -> None:
    engine = LLM(progress=False).engine
    cfg = engine.model_config
    sizes = [prefill_activation_bytes(cfg, n, 8, 2048, torch.float32) for n in (512, 1024, 2048)]
    assert sizes[0] < sizes[1] < sizes[2]
    assert offload_prefill_chunk(cfg, torch.float32, 8, 2048, None) == OFFLOAD_CHUNK_CAP
    assert offload_prefill_chunk(cfg, torch.float32, 8, 2048, 0) == PREFILL_CHUNK  # nothing fits: the old default
    assert offload_prefill_chunk(cfg, torch.float32, 1, 300, None) == PREFILL_CHUNK


def test_greedy_output_is_the_same_whatever_the_chunk() -> None:
    """A 700-token prompt: one chunk offloaded by default, two resident at 512, seven at 100."""
    prompt = [1 + (7 * i) % 6000 for i in range(700)]
    runs = [
        dict(moe_strategy="offload", moe_cache_slots=64),
        dict(),
        dict(moe_strategy="offload", moe_cache_slots=64, max_num_batched_tokens=100),
    ]
    outs = [LLM(progress=False, max_num_seqs=2, max_model_len=1024, **kw).generate([prompt], GREEDY)[0] for kw in runs]
    assert outs[0].token_ids == outs[1].token_ids == outs[2].token_ids
