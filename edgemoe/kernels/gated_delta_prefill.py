"""The Gated DeltaNet layer's prefill delta rule (`chunked_delta_rule` for every sequence of a prefill batch, each
from and back to its slot of the state pool) in two Triton launches. Reference: `chunked_delta_rule`
(`edgemoe.layers.linear_attention`), whose docstring derives the chunked form used here; the convolution before it
stays torch's conv1d (`causal_conv`, one cuDNN call a sequence: it moves [tokens, channels] once, a small share of
the prefill).

Per chunk of CHUNK tokens (a sequence's last one ragged, masked), with G the decay summed from the chunk's start, S0
the state before the chunk and A[t, s] = beta_t e^(G_t - G_s) k_t . k_s for s < t:

- `_chunk_inverse`, program per (chunk, sequence, value head): T = (I + A)^-1, written to an fp32 workspace
  [tokens, v_heads, CHUNK]. A is nilpotent lower-triangular, so the inverse doubles: from the inverses of its
  diagonal blocks of size b, those of size 2b cost two [CHUNK, CHUNK] products: log2(CHUNK) - 1 steps, ten
  products (tensor-core work) where substitution takes 64 dependent row steps. (On nearly parallel keys, the hard
  case, it stayed as close to a float64 recurrence as the reference's triangular solve.)
- `_chunk_scan`, program per (sequence, value head, block of value dims): the slot's fp32 state tile [k_dim, block]
  in registers, walked over the sequence's chunks in order: the corrections d = T beta (v - e^G K S0) (T applied
  here to one [CHUNK, block] operand instead of to beta v and to beta e^G K apart: one workspace of CHUNK floats a
  token and head, not k_dim + v_dim), out = (q e^G) S0 + (causal e^(G_t - G_s) q_t . k_s) d, and
  S = e^(G_last) S0 + (e^(G_last - G) K)^T d; the tile written back in place at the end.

q and k are L2-normalised in fp32 (q also multiplied by k_dim^-0.5, as `_prepare` does) where each kernel loads them;
grouped or tiled value heads as `delta_rule_decode` maps them. Several sequences run in one launch: `cu_seqlens`
[seqs + 1] on the device delimits their tokens in the batch, and the inverse's grid covers `max_len` (a host int) for
each, its programs past a sequence's end doing nothing. Dot products take fp32 operands; on the GPU as IEEE fp32
for fp32 models, as TF32 (10-bit mantissas) for 16-bit ones, whose outputs round to 8 bits anyway. FMA contraction
stays on: no result here is meant to match torch's rounding bit for bit. No host sync and only torch.empty outputs:
both launches are CUDA-graph capturable once compiled.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from edgemoe.kernels.norm_rope import _DTYPES, _round
from edgemoe.kernels.pdl import launch_args, wait_for_inputs

L2_EPS = 1e-6  # as `edgemoe.layers.linear_attention.L2_EPS` (a kernel imports no layer)
_L2_EPS = tl.constexpr(L2_EPS)
CHUNK = 64  # as `edgemoe.layers.linear_attention.CHUNK`
_LEVELS = tl.constexpr(CHUNK.bit_length() - 1)  # log2(CHUNK): the inverse's doublings
BLOCK_V = 32  # value dims a scan program: 128 programs for one sequence at Qwen3-Next's 32 heads of 128
WARPS = 4


@triton.jit
def _rows_l2_normalized(ptrs, mask):
    """Rows of q or k heads [CHUNK, BLOCK_K] as fp32, each times rsqrt(its sum of squares + L2_EPS) (padding 0)."""
    t = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    return t * tl.math.rsqrt(tl.sum(t * t, axis=1) + _L2_EPS)[:, None]


@triton.jit
def _qk_head(h, k_heads, v_heads, TILED: tl.constexpr):
    """The q/k head that value head h reads: h % k_heads (tiled) or h // (v_heads // k_heads) (grouped)."""
    if TILED:
        kh = h % k_heads
    else:
        kh = h // (v_heads // k_heads)
    return kh


@triton.jit
def _chunk_inverse(
    ch, beta, g, cu_seqlens, inv, k_heads, v_heads, k_dim, stride_cs, stride_bs, stride_bh, stride_gs, stride_gh,
    TILED: tl.constexpr, BLOCK_K: tl.constexpr, CHUNK: tl.constexpr, DOT: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    c, s, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = tl.load(cu_seqlens + s).to(tl.int64) + c * CHUNK
    end = tl.load(cu_seqlens + s + 1).to(tl.int64)
    if start < end:  # else a chunk past the sequence's end: nothing to do
        r = tl.arange(0, CHUNK)
        rows, offs_k = start + r, tl.arange(0, BLOCK_K)
        mask_r = rows < end
        kh = _qk_head(h, k_heads, v_heads, TILED)
        wait_for_inputs(PDL)
        k_ptrs = ch + rows[:, None] * stride_cs + (k_heads + kh) * k_dim + offs_k[None, :]
        k = _rows_l2_normalized(k_ptrs, mask_r[:, None] & (offs_k < k_dim)[None, :])  # [CHUNK, BLOCK_K]
        b = tl.load(beta + rows * stride_bs + h * stride_bh, mask=mask_r, other=0.0).to(tl.float32)
        G = tl.cumsum(tl.load(g + rows * stride_gs + h * stride_gh, mask=mask_r, other=0.0).to(tl.float32), axis=0)
        earlier = r[:, None] > r[None, :]  # s < t
        decay = tl.exp(tl.where(earlier, G[:, None] - G[None, :], 0.0))
        A = tl.where(earlier, tl.dot(k * b[:, None], tl.trans(k), input_precision=DOT) * decay, 0.0)
        # T = (I + A)^-1 by doubling: the inverse of A's diagonal blocks of size b (T_b) gives those of size 2b as
        # T_b - T_b L T_b, with L the lower off-diagonal b-blocks of A's 2b-blocks; for b = 1, T_b = I
        T = tl.where(r[:, None] == r[None, :], 1.0, 0.0) - tl.where(r[:, None] // 2 == r[None, :] // 2, A, 0.0)
        for level in tl.static_range(1, _LEVELS):
            b = 1 << level  # a constexpr: the loop is unrolled
            pair = (r[:, None] // (2 * b) == r[None, :] // (2 * b)) & (r[:, None] // b != r[None, :] // b)
            L = tl.where(pair, A, 0.0)
            T = T - tl.dot(tl.dot(T, L, input_precision=DOT), T, input_precision=DOT)
        ptrs = inv + (rows[:, None] * v_heads + h) * CHUNK + r[None, :]
        tl.store(ptrs, T, mask=mask_r[:, None])


@triton.jit
def _chunk_scan(
    ch, beta, g, cu_seqlens, slots, inv, state, out, k_heads, v_heads, k_dim, v_dim, q_scale, stride_cs, stride_bs,
    stride_bh, stride_gs, stride_gh, stride_ss, stride_sh, stride_sk, TILED: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr, CHUNK: tl.constexpr, DOT: tl.constexpr, RNE_BY_HAND: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    s, h = tl.program_id(0), tl.program_id(1)
    r, offs_k = tl.arange(0, CHUNK), tl.arange(0, BLOCK_K)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_k, mask_v = offs_k < k_dim, offs_v < v_dim
    kh = _qk_head(h, k_heads, v_heads, TILED)
    start = tl.load(cu_seqlens + s).to(tl.int64)  # step inputs, written by no kernel of the step
    end = tl.load(cu_seqlens + s + 1).to(tl.int64)
    slot = tl.load(slots + s).to(tl.int64)
    tile = state + slot * stride_ss + h * stride_sh + offs_k[:, None] * stride_sk + offs_v[None, :]
    mask_s = mask_k[:, None] & mask_v[None, :]
    wait_for_inputs(PDL)
    S = tl.load(tile, mask=mask_s, other=0.0)  # [BLOCK_K, BLOCK_V] fp32
    causal = r[:, None] >= r[None, :]  # s <= t
    last = r == CHUNK - 1
    for t0 in tl.range(start, end, CHUNK, num_stages=1):  # no loads in flight across chunks: shared memory
        rows = t0 + r
        mask_r = rows < end
        mask_qk = mask_r[:, None] & mask_k[None, :]
        row = ch + rows[:, None] * stride_cs + offs_k[None, :]  # q heads, then k heads, then value heads
        k = _rows_l2_normalized(row + (k_heads + kh) * k_dim, mask_qk)  # [CHUNK, BLOCK_K]
        b = tl.load(beta + rows * stride_bs + h * stride_bh, mask=mask_r, other=0.0).to(tl.float32)
        G = tl.cumsum(tl.load(g + rows * stride_gs + h * stride_gh, mask=mask_r, other=0.0).to(tl.float32), axis=0)
        G_last = tl.sum(tl.where(last, G, 0.0), axis=0)  # padding rows add 0: the last token's
        v_ptrs = ch + rows[:, None] * stride_cs + 2 * k_heads * k_dim + h * v_dim + offs_v[None, :]
        v = tl.load(v_ptrs, mask=mask_r[:, None] & mask_v[None, :], other=0.0).to(tl.float32)  # [CHUNK, BLOCK_V]
        # the corrections d = T beta (v - e^G K S0)
        x = b[:, None] * (v - tl.exp(G)[:, None] * tl.dot(k, S, input_precision=DOT))
        T = tl.load(inv + (rows[:, None] * v_heads + h) * CHUNK + r[None, :], mask=mask_r[:, None], other=0.0)
        d = tl.dot(T, x, input_precision=DOT)  # [CHUNK, BLOCK_V]
        q = _rows_l2_normalized(row + kh * k_dim, mask_qk) * q_scale
        decay = tl.exp(tl.where(causal, G[:, None] - G[None, :], 0.0))
        attn = tl.where(causal, tl.dot(q, tl.trans(k), input_precision=DOT) * decay, 0.0)  # [CHUNK, CHUNK]
        o = tl.dot(q * tl.exp(G)[:, None], S, input_precision=DOT) + tl.dot(attn, d, input_precision=DOT)
        o = _round(o, out.dtype.element_ty, RNE_BY_HAND).to(out.dtype.element_ty)
        tl.store(out + (rows[:, None] * v_heads + h) * v_dim + offs_v[None, :], o, mask=mask_r[:, None] & mask_v)
        k_to_end = k * tl.exp(G_last - G)[:, None]
        S = S * tl.exp(G_last) + tl.dot(tl.trans(k_to_end), d, input_precision=DOT)
    tl.store(tile, S, mask=mask_s)


def delta_rule_prefill(
    channels: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor,
    recurrent_state: torch.Tensor,
    slots: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_len: int,
    k_heads: int,
    tiled: bool,
) -> torch.Tensor:
    """`chunked_delta_rule` for each sequence of a batch on the convolved channels [tokens, channels] (q heads, k
    heads, value heads: `_heads`' split; unit stride over channels), beta and g [tokens, v_heads] (any float dtype;
    g the log decay); sequence i's tokens are cu_seqlens[i] .. cu_seqlens[i + 1] (integer, on the device), at most
    `max_len` of them, its state recurrent_state[slots[i]] ([slots, v_heads, k_dim, v_dim] fp32, any slot stride,
    unit stride over v_dim), read and updated in place -> out [tokens, v_heads, v_dim] in channels' dtype. k_dim,
    v_dim up to 256, any size (masked tiles). Neither the slots nor the lengths are checked (that would sync)."""
    tokens, seqs = channels.shape[0], slots.shape[0]
    v_heads, k_dim, v_dim = recurrent_state.shape[1:]
    if recurrent_state.dtype != torch.float32 or recurrent_state.stride(3) != 1:
        raise ValueError(f"recurrent_state must be float32 with unit stride over v_dim, got {recurrent_state.dtype}")
    if channels.dtype not in _DTYPES:
        raise ValueError(f"delta_rule_prefill takes float32, bfloat16 or float16 channels, got {channels.dtype}")
    if v_heads % k_heads or channels.shape[1] != 2 * k_heads * k_dim + v_heads * v_dim or channels.stride(1) != 1:
        raise ValueError(f"channels {list(channels.shape)} do not hold {k_heads} q/k heads of the state's heads")
    if beta.shape != (tokens, v_heads) or g.shape != (tokens, v_heads) or cu_seqlens.shape != (seqs + 1,):
        shapes = f"beta {list(beta.shape)}, g {list(g.shape)}, cu_seqlens {list(cu_seqlens.shape)}"
        raise ValueError(f"{shapes} must be [{tokens}, {v_heads}], [{tokens}, {v_heads}], [{seqs + 1}]")
    if max(k_dim, v_dim) > 256:  # a [k_dim, BLOCK_V] tile and [CHUNK, k_dim] q and k in registers
        raise ValueError(f"delta_rule_prefill holds k_dim and v_dim up to 256, got {k_dim}, {v_dim}")
    out = torch.empty(tokens, v_heads, v_dim, dtype=channels.dtype, device=channels.device)
    if tokens == 0 or seqs == 0:
        return out
    inverse = torch.empty(tokens, v_heads, CHUNK, dtype=torch.float32, device=channels.device)
    block_k = max(16, triton.next_power_of_2(k_dim))  # tl.dot takes dims of 16 and more
    block_v = max(16, min(BLOCK_V, triton.next_power_of_2(v_dim)))
    dot = "ieee" if channels.dtype == torch.float32 else "tf32"
    common = (k_heads, v_heads, k_dim)
    strides = (channels.stride(0), *beta.stride(), *g.stride())
    pdl = launch_args(channels.device)
    _chunk_inverse[(triton.cdiv(max_len, CHUNK), seqs, v_heads)](
        channels, beta, g, cu_seqlens, inverse, *common, *strides, tiled, block_k, CHUNK, dot, num_warps=WARPS, **pdl,
    )  # fmt: skip
    _chunk_scan[(seqs, v_heads, triton.cdiv(v_dim, block_v))](
        channels, beta, g, cu_seqlens, slots, inverse, recurrent_state, out, *common, v_dim, k_dim**-0.5, *strides,
        *recurrent_state.stride()[:3], tiled, block_k, block_v, CHUNK, dot, not channels.is_cuda, num_warps=WARPS,
        **pdl,
    )  # fmt: skip
    return out
