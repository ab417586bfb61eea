"""Prefill's activation memory, estimated from the model config, and the default prefill chunk chosen from it.

Why the chunk depends on where experts live: with resident experts a chunk costs time in proportion to its tokens, so
short chunks (`PREFILL_CHUNK`) keep a running stream's token gap short at no cost in throughput. With offloaded
experts every chunk streams nearly every expert of every layer over PCIe once (`edgemoe.offload.prefill_stream`),
about the same time whatever its length: a 16K-token prompt costs 32 such copies in 512-token chunks and one in a
16K chunk, and the token gap of a running stream is one chunk's time either way. So offloaded, the default chunk is
the largest power of two up to `OFFLOAD_CHUNK_CAP` whose activations fit a share of the device memory.
"""

from __future__ import annotations

import torch

from edgemoe.config import ModelConfig

PREFILL_CHUNK = 512  # the default chunk with resident experts
OFFLOAD_CHUNK_CAP = 16384  # the largest default chunk with offloaded experts
ACTIVATION_SHARE = 8  # offloaded: the default chunk's activations take at most 1/8 of the room they are given
_INDEX, _FLOAT32 = 8, 4  # bytes of an int64 index, of a float32


def prefill_activation_bytes(cfg: ModelConfig, tokens: int, seqs: int, context: int, dtype: torch.dtype) -> int:
    """Peak device bytes of the activations of one prefill step: `tokens` tokens of at most `seqs` sequences, none
    longer than `context` tokens, in `dtype` (T tokens, H hidden, d head_dim, q / kv heads, E experts, k top_k, I the
    expert width, S the shared expert's, V the vocabulary).

    Derived from the prefill path on CUDA, where layers run one after another and each frees its temporaries before
    the next starts, so the peak is what lives between layers plus the largest layer's temporaries plus the logits:
    - between layers: the block output and the residual, 2 [T, H];
    - attention: the normed input [T, H], qkv [T, (q + 2 kv) d], the rotated q [T, q d], the per-sequence outputs
      and their concatenation 2 [T, q d]; one sequence's K and V gathered from the cache 2 [context, kv d] with their
      slot indices [context] int64 (flash attention keeps no scores);
    - MoE: the normed input [T, H], the router's logits [T, E], their float32 copy and softmax 2 [T, E], top-k
      [T, k]; the grouped GEMM's sort keys and order 2 [T k] int64, h [T k, I] and the pair outputs [T k, H], their
      float32 sum and its rounding [T, H] each; a shared expert beside them (its side stream) gate, up and their
      product 3 [T, S] and its output [T, H]; a dense MLP layer 3 [T, I_mlp] + [T, H] instead;
    - logits: the due sequences' last rows only, [seqs, V] in dtype and in float32.
    Not counted: allocator rounding and the CPU path's own temporaries; a family that narrows the attention
    (Gemma-4's sliding window) also builds a [T, context] mask and repeats K/V per query head in its chunks after
    the first. qwen3-30b-a3b in bf16 (8 sequences, a 40,960-token context): 110 MiB at 512 tokens (80 of them the
    gathered K/V), 1.1 GiB at 16,384."""
    b, H, d, T = dtype.itemsize, cfg.hidden_size, cfg.head_dim, tokens
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    attention = T * (H + q + 2 * kv + 3 * q) * b + 2 * context * kv * b + context * _INDEX
    mlp = 0
    if any(cfg.moe_layers):
        pairs, shared = T * cfg.top_k, cfg.shared_expert_intermediate_size
        router = T * cfg.num_experts * (b + 2 * _FLOAT32) + T * cfg.top_k * (_FLOAT32 + _INDEX)
        experts = 2 * pairs * _INDEX + pairs * (cfg.moe_intermediate_size + H) * b + T * H * (_FLOAT32 + b)
        mlp = T * H * b + router + experts + (T * (3 * shared + H) * b if shared else 0)
    if not all(cfg.moe_layers):
        mlp = max(mlp, T * (H + 3 * cfg.intermediate_size + H) * b)
    logits = seqs * cfg.vocab_size * (b + _FLOAT32)
    return 2 * T * H * b + max(attention, mlp) + logits


def offload_prefill_chunk(
    cfg: ModelConfig, dtype: torch.dtype, max_num_seqs: int, max_model_len: int, room: int | None
) -> int:
    """The default chunk with offloaded experts: the largest power of two from `PREFILL_CHUNK` up to
    `OFFLOAD_CHUNK_CAP` (and no longer than `max_num_seqs` prompts of `max_model_len` tokens) whose activations take
    at most 1/`ACTIVATION_SHARE` of `room` bytes (None: no limit); `PREFILL_CHUNK` where even that does not fit."""
    most = min(OFFLOAD_CHUNK_CAP, max_num_seqs * max_model_len)
    chunk = PREFILL_CHUNK
    while 2 * chunk <= most and (
        room is None
        or prefill_activation_bytes(cfg, 2 * chunk, max_num_seqs, max_model_len, dtype) * ACTIVATION_SHARE <= room
    ):
        chunk *= 2
    return chunk


def dequant_scratch_bytes(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Device bytes prefill adds for weights kept as GGUF blocks where kernels run (CUDA): a wave of a layer's
    experts dequantized for the grouped GEMM (`edgemoe.kernels.dequant.quant_pair_outputs`), or the largest dense
    projection dequantized for a step (`QuantLinear`), whichever is larger (they never coexist)."""
    from edgemoe.layers.quant_linear import QuantLinear
    from edgemoe.offload.layout import QuantExpertLayout

    most = 0
    for m in model.modules():
        layout = getattr(m, "layout", None)
        if isinstance(layout, QuantExpertLayout) and layout.pair_outputs is not None:
            from edgemoe.kernels.dequant import wave_experts

            per = 3 * layout.inter * layout.hidden * dtype.itemsize
            experts = getattr(m, "num_experts", 1)
            most = max(most, min(experts, wave_experts(layout.inter, layout.hidden, dtype)) * per)
        elif isinstance(m, QuantLinear):
            most = max(most, m.prefill_scratch_bytes(dtype))
    return most
