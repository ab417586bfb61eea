"""The Gated DeltaNet layer's decode step (`GatedDeltaNet._decode`: `conv_step`, the q/k/v split, `recurrent_step`,
both states written back to their slots) in two Triton launches, reading and writing the state pools in place (no
gathered copies). References: `conv_step` and `recurrent_step` (`edgemoe.layers.linear_attention`).

- `conv_decode`, program per (sequence, block of channels): the causal depthwise convolution's update and SiLU; the
  slot's convolution state shifted by one input in place. Products of 16-bit operands are exact in fp32; their sum
  (kernel taps, in order) is rounded to the model's dtype, then SiLU's, where torch rounds.
- `delta_rule_decode`, program per (sequence, value head, block of value dims): the head's gates from the raw
  projections (`GatedDeltaNet.gates`: beta = sigmoid(b) rounded to b's dtype, the log decay g = A * softplus(a +
  dt_bias) in fp32; five launches in torch), q and k L2-normalised in fp32 (q also divided by sqrt(k_dim)), the
  state's [k_dim, block] tile decayed by exp(g), corrected along k (the delta rule) and read along q; the tile written
  back in place. Sums run over k_dim within one program in a fixed order, so a
  sequence's result does not depend on the batch it runs in.

Two launches, not one: several programs read a q/k head's channels (every value head it serves, every block of value
dims), and the convolution state is updated in place, so a program of one launch could read a state another already
shifted. With the convolution in its own launch each channel has one owner; the price is a launch and a round trip of
[seqs, channels] in the model's dtype (16 KB a sequence at Qwen3-Next's width).

Padding rows of a captured batch share the pad slot: their programs race on it as index_copy_'s threads do, and what
it holds is padding. FMA contraction is off (`enable_fp_fusion=False`): torch rounds each product and sum apart.
No host sync and only torch.empty outputs: both kernels are CUDA-graph capturable once compiled.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from edgemoe.kernels.norm_rope import _DTYPES, _round
from edgemoe.kernels.pdl import launch_args, wait_for_inputs

L2_EPS = 1e-6  # as `edgemoe.layers.linear_attention.L2_EPS` (a kernel imports no layer)
_L2_EPS = tl.constexpr(L2_EPS)  # a jitted function reads only constexpr globals
CONV_BLOCK = 256  # channels a convolution program
BLOCK_V = 32  # value dims a delta-rule program: 128 programs for one sequence at Qwen3-Next's 32 heads of 128
WARPS = 4


@triton.jit
def _conv_decode(
    x, w, state, slots, out, channels, stride_xs, stride_wc, stride_ss, stride_sc, X_TY: tl.constexpr,
    KERNEL: tl.constexpr, BLOCK: tl.constexpr, RNE_BY_HAND: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    s = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = c < channels
    slot = tl.load(slots + s).to(tl.int64)  # a step input, written by no kernel of the step
    row = state + slot * stride_ss + c * stride_sc
    wait_for_inputs(PDL)
    xf = tl.load(x + s * stride_xs + c, mask=mask, other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(KERNEL - 1):  # torch: state.to(x.dtype), then the taps in order
        prev = _round(tl.load(row + j, mask=mask, other=0.0).to(tl.float32), X_TY, RNE_BY_HAND)
        acc += tl.load(w + c * stride_wc + j, mask=mask, other=0.0).to(tl.float32) * prev
        if j > 0:  # every tap read before it is overwritten: the same thread reads (c, j) and then writes (c, j - 1)
            kept = _round(prev, state.dtype.element_ty, RNE_BY_HAND)  # torch: .to(conv_state.dtype)
            tl.store(row + j - 1, kept.to(state.dtype.element_ty), mask=mask)
    acc += tl.load(w + c * stride_wc + KERNEL - 1, mask=mask, other=0.0).to(tl.float32) * xf
    tl.store(row + KERNEL - 2, _round(xf, state.dtype.element_ty, RNE_BY_HAND).to(state.dtype.element_ty), mask=mask)
    y = _round(acc, X_TY, RNE_BY_HAND)  # conv1d's result in x's dtype
    y = _round(y / (1.0 + tl.exp(-y)), X_TY, RNE_BY_HAND)  # then SiLU's
    tl.store(out + s * channels + c, y.to(X_TY), mask=mask)


def conv_decode(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """`conv_step` of one token per sequence on the slots' states in place. x: [seqs, channels] (float32, bfloat16 or
    float16); weight: [channels, 1, kernel]; conv_state: [slots, channels, kernel - 1], any slot stride (a view of a
    state pool), unit stride over the taps; slots: [seqs] integer -> the convolved channels [seqs, channels] in x's
    dtype. conv_state[slots[i]] becomes conv_step's new state of sequence i (in
    conv_state's dtype); the other slots stay as they were. Slots are not checked (that would sync)."""
    seqs, channels = x.shape
    kernel = weight.shape[-1]
    if x.dtype not in _DTYPES or conv_state.dtype not in _DTYPES:
        raise ValueError(f"conv_decode takes float32, bfloat16 or float16, got x {x.dtype}, state {conv_state.dtype}")
    if weight.shape != (channels, 1, kernel) or kernel < 2:
        raise ValueError(f"weight must be [{channels}, 1, kernel >= 2], got {list(weight.shape)}")
    if conv_state.dim() != 3 or conv_state.shape[1:] != (channels, kernel - 1) or conv_state.stride(2) != 1:
        raise ValueError(f"conv_state must be [slots, {channels}, {kernel - 1}] with unit tap stride")
    if slots.shape != (seqs,):
        raise ValueError(f"slots {list(slots.shape)} must be [{seqs}]")
    x, weight = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, weight))
    out = torch.empty(seqs, channels, dtype=x.dtype, device=x.device)
    if seqs == 0:
        return out
    _conv_decode[(seqs, triton.cdiv(channels, CONV_BLOCK))](
        x, weight, conv_state, slots, out, channels, x.stride(0), weight.stride(0), conv_state.stride(0),
        conv_state.stride(1), _DTYPES[x.dtype], kernel, CONV_BLOCK, not x.is_cuda, num_warps=WARPS,
        enable_fp_fusion=False, **launch_args(x.device),
    )  # fmt: skip
    return out


@triton.jit
def _l2_normalized(ptr, offs, mask):
    """A q or k head [BLOCK_K] as fp32, times rsqrt(its sum of squares + L2_EPS) (padding lanes 0)."""
    t = tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return t * tl.math.rsqrt(tl.sum(t * t, axis=0) + _L2_EPS)


@triton.jit
def _gates(b_raw, a_raw, A, dt_bias, B_TY: tl.constexpr, INTERPRETED: tl.constexpr):
    """One head's beta (sigmoid(b) rounded to b's dtype, as fp32) and log decay g = A * softplus(a + dt_bias) (fp32;
    softplus as torch's: x above 20 kept, else log1p(exp(x))). On the GPU libdevice's expf and log1pf, as torch's
    CUDA ops; the interpreter has no libdevice: numpy's exp and log(1 + x)."""
    x = a_raw + dt_bias
    if INTERPRETED:
        e_b = tl.exp(-b_raw)
        soft = tl.log(1.0 + tl.exp(x))
    else:
        e_b = libdevice.exp(-b_raw)
        soft = libdevice.log1p(libdevice.exp(x))
    beta = _round(tl.math.div_rn(tl.zeros_like(e_b) + 1.0, 1.0 + e_b), B_TY, INTERPRETED)
    return beta, A * tl.where(x > 20.0, x, soft)


@triton.jit
def _delta_rule_decode(
    ch, b_raw, a_raw, A, dt_bias, slots, state, out, k_heads, v_heads, k_dim, v_dim, k_scale, stride_cs, stride_bs,
    stride_bh, stride_as, stride_ah, stride_ss, stride_sh, stride_sk, B_TY: tl.constexpr, TILED: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, RNE_BY_HAND: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    s, h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_k, mask_v = offs_k < k_dim, offs_v < v_dim
    if TILED:  # value head h reads q/k head h % k_heads; else consecutive value heads share one
        kh = h % k_heads
    else:
        kh = h // (v_heads // k_heads)
    slot = tl.load(slots + s).to(tl.int64)
    tile = state + slot * stride_ss + h * stride_sh + offs_k[:, None] * stride_sk + offs_v[None, :]
    mask = mask_k[:, None] & mask_v[None, :]
    wait_for_inputs(PDL)
    row = ch + s * stride_cs  # q heads, then k heads, then value heads
    q = _l2_normalized(row + kh * k_dim, offs_k, mask_k)
    q = tl.math.div_rn(q, tl.zeros_like(q) + k_scale)  # torch divides by sqrt(k_dim), rounding to nearest
    k = _l2_normalized(row + (k_heads + kh) * k_dim, offs_k, mask_k)
    v = tl.load(row + 2 * k_heads * k_dim + h * v_dim + offs_v, mask=mask_v, other=0.0).to(tl.float32)
    b, g = _gates(
        tl.load(b_raw + s * stride_bs + h * stride_bh).to(tl.float32),
        tl.load(a_raw + s * stride_as + h * stride_ah).to(tl.float32),
        tl.load(A + h).to(tl.float32), tl.load(dt_bias + h).to(tl.float32), B_TY, RNE_BY_HAND,
    )  # fmt: skip
    decay = tl.exp(g)
    S = tl.load(tile, mask=mask, other=0.0) * decay  # [BLOCK_K, BLOCK_V] fp32
    predicted = tl.sum(S * k[:, None], axis=0)  # k^T S
    delta = (v - predicted) * b
    S = S + k[:, None] * delta[None, :]
    tl.store(tile, S, mask=mask)
    o = tl.sum(S * q[:, None], axis=0)
    o = _round(o, out.dtype.element_ty, RNE_BY_HAND).to(out.dtype.element_ty)
    tl.store(out + (s * v_heads + h) * v_dim + offs_v, o, mask=mask_v)


def delta_rule_decode(
    channels: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    A: torch.Tensor,
    dt_bias: torch.Tensor,
    recurrent_state: torch.Tensor,
    slots: torch.Tensor,
    k_heads: int,
    tiled: bool,
) -> torch.Tensor:
    """`recurrent_step` with `GatedDeltaNet.gates(b, a)` on the convolved channels [seqs, channels] (q heads, k
    heads, value heads: `_heads`' split; unit stride over channels), b and a [seqs, v_heads] (the projections' rows,
    any float dtype and strides), A and dt_bias [v_heads], the slots' states recurrent_state [slots, v_heads, k_dim,
    v_dim] fp32 (any slot stride, unit stride over v_dim) updated in place -> out [seqs, v_heads, v_dim] in channels'
    dtype. k_dim, v_dim up to 256, any size (masked tiles)."""
    seqs = channels.shape[0]
    v_heads, k_dim, v_dim = recurrent_state.shape[1:]
    if recurrent_state.dtype != torch.float32 or recurrent_state.stride(3) != 1:
        raise ValueError(f"recurrent_state must be float32 with unit stride over v_dim, got {recurrent_state.dtype}")
    if v_heads % k_heads or channels.shape[1] != 2 * k_heads * k_dim + v_heads * v_dim or channels.stride(1) != 1:
        raise ValueError(f"channels {list(channels.shape)} do not hold {k_heads} q/k heads of the state's heads")
    if b.shape != (seqs, v_heads) or a.shape != (seqs, v_heads) or slots.shape != (seqs,):
        raise ValueError(f"b {list(b.shape)}, a {list(a.shape)} must be [{seqs}, {v_heads}], slots [{seqs}]")
    if A.shape != (v_heads,) or dt_bias.shape != (v_heads,) or b.dtype not in _DTYPES:
        raise ValueError(f"A {list(A.shape)}, dt_bias {list(dt_bias.shape)} must be [{v_heads}]; b a float tensor")
    if max(k_dim, v_dim) > 256:  # a [k_dim, BLOCK_V] tile in registers
        raise ValueError(f"delta_rule_decode holds k_dim and v_dim up to 256, got {k_dim}, {v_dim}")
    out = torch.empty(seqs, v_heads, v_dim, dtype=channels.dtype, device=channels.device)
    if seqs == 0:
        return out
    block_v = min(BLOCK_V, triton.next_power_of_2(v_dim))
    _delta_rule_decode[(seqs, v_heads, triton.cdiv(v_dim, block_v))](
        channels, b, a, A.contiguous(), dt_bias.contiguous(), slots, recurrent_state, out, k_heads, v_heads, k_dim,
        v_dim, k_dim**0.5, channels.stride(0), *b.stride(), *a.stride(), *recurrent_state.stride()[:3],
        _DTYPES[b.dtype], tiled, triton.next_power_of_2(k_dim), block_v, not channels.is_cuda, num_warps=WARPS,
        enable_fp_fusion=False, **launch_args(channels.device),
    )  # fmt: skip
    return out


def gated_delta_decode(
    mixed: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    A: torch.Tensor,
    dt_bias: torch.Tensor,
    slots: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    recurrent_state: torch.Tensor,
    k_heads: int,
    tiled: bool,
) -> torch.Tensor:
    """`GatedDeltaNet._decode` of `gates(b, a)`: mixed [seqs, channels] (in_proj_qkv's output), b and a [seqs, v_heads]
    (the gate projections' rows), A and dt_bias [v_heads], slots [seqs], the conv1d weight [channels, 1, kernel] and
    the layer's two state pools (`bind_state`'s views), updated in place at the slots -> out [seqs, v_heads, v_dim] in
    mixed's dtype. The value heads' order (`tiled`) as the layer's; shapes as `conv_decode` and `delta_rule_decode`
    take them."""
    channels = conv_decode(mixed, weight, conv_state, slots)
    return delta_rule_decode(channels, b, a, A, dt_bias, recurrent_state, slots, k_heads, tiled)
