"""RMSNorm and rotary embedding as one Triton launch each on CUDA, where torch runs ~8 and ~15 tiny kernels (the
decode-time cost is launches, not bytes). References: `RMSNorm._forward_torch` (`edgemoe.layers.norm`) and
`RotaryEmbedding._forward_torch` (`edgemoe.layers.rotary`); both kernels round where torch rounds:

- `rms_norm`, program per row: fp32 sum of squares times 1/dim (torch's CUDA mean), + eps, rsqrt, x * r rounded to
  x's dtype, then the product with the weight in fp32 (exact for 16-bit operands) rounded once to the promoted
  dtype. Only the order of the sum differs from torch, so results agree to an ulp or so, mostly bitwise.
- `apply_rotary`, program per (token, head) over q's heads then k's: the fp32 cos/sin row is rounded to q's dtype,
  each product and the sum rounded to q's dtype as torch's separate bf16 ops do: bitwise equal.

FMA contraction is off (`enable_fp_fusion=False`): x * cos + rh * sin fused would round once instead of twice.
No host sync and only torch.empty outputs: both are CUDA-graph capturable once compiled.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _round(x, TY: tl.constexpr, RNE_BY_HAND: tl.constexpr):
    """fp32 x rounded to nearest-even in TY, returned as fp32: where torch rounds each op's result."""
    y = x.to(TY).to(tl.float32)
    if RNE_BY_HAND:  # Triton's interpreter truncates fp32 -> bf16 casts; the GPU rounds to nearest even
        if TY == tl.bfloat16:
            b = x.to(tl.uint32, bitcast=True)
            y = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16 << 16).to(tl.float32, bitcast=True)  # finite x only
    return y


@triton.jit
def _rms_norm(
    x, w, out, dim, stride_x, inv_dim, eps, X_TY: tl.constexpr, BLOCK: tl.constexpr, RNE_BY_HAND: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)  # row * stride overflows int32 on long prefills
    offs = tl.arange(0, BLOCK)
    mask = offs < dim
    xf = tl.load(x + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)  # padding adds 0 to the sum
    r = tl.math.rsqrt(tl.sum(xf * xf, axis=0) * inv_dim + eps)  # torch's CUDA mean multiplies by 1/dim too
    xn = _round(xf * r, X_TY, RNE_BY_HAND)  # torch: x.to(dtype) before the weight
    wf = tl.load(w + offs, mask=mask, other=0.0).to(tl.float32)
    o = _round(wf * xn, out.dtype.element_ty, RNE_BY_HAND)  # exact fp32 product of 16-bit operands, rounded once
    tl.store(out + row * dim + offs, o.to(out.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., dim]; weight: [dim] -> x's shape in torch.promote_types(x.dtype, weight.dtype) (x's dtype in the
    engine), contiguous. Dtypes float32, bfloat16, float16; dim at most 65536 (one block per row)."""
    dim = x.shape[-1]
    if x.dtype not in _DTYPES or weight.dtype not in _DTYPES:
        raise ValueError(f"rms_norm takes float32, bfloat16 or float16, got x {x.dtype}, weight {weight.dtype}")
    if weight.shape != (dim,):
        raise ValueError(f"weight {list(weight.shape)} does not match x {list(x.shape)}")
    block = triton.next_power_of_2(dim)
    if block > 65536:
        raise ValueError(f"rms_norm holds a row in one block: dim {dim} is too large")
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if x.numel() == 0:
        return out
    x2 = (x if x.stride(-1) == 1 else x.contiguous()).reshape(-1, dim)  # a view unless the rows do not flatten
    weight = weight if weight.stride(0) == 1 else weight.contiguous()
    _rms_norm[(x2.shape[0],)](
        x2, weight, out, dim, x2.stride(0), 1.0 / dim, eps, _DTYPES[x.dtype], block, not x.is_cuda,
        num_warps=min(16, max(1, block // 512)), enable_fp_fusion=False,
    )  # fmt: skip
    return out


@triton.jit
def _rotate_row(src, dst, c, s, offs, half, mask, stride_d, X_TY: tl.constexpr, RNE_BY_HAND: tl.constexpr):
    """dst = src * cos + rotate_half(src) * sin over one head, each product and the sum rounded to X_TY."""
    x = tl.load(src + offs * stride_d, mask=mask, other=0.0).to(tl.float32)
    partner = tl.where(offs < half, offs + half, offs - half)  # rotate_half: (-x2, x1)
    xp = tl.load(src + partner * stride_d, mask=mask, other=0.0).to(tl.float32)
    rh = tl.where(offs < half, -xp, xp)
    a = _round(x * c, X_TY, RNE_BY_HAND)
    b = _round(rh * s, X_TY, RNE_BY_HAND)
    tl.store(dst + offs, _round(a + b, X_TY, RNE_BY_HAND).to(X_TY), mask=mask)


@triton.jit
def _rotary(
    q,
    k,
    q_out,
    k_out,
    cos_sin,
    positions,
    heads,
    dim,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_cs,
    stride_cp,
    X_TY: tl.constexpr,
    BLOCK: tl.constexpr,
    RNE_BY_HAND: tl.constexpr,
):
    t, h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < dim
    pos = tl.load(positions + t).to(tl.int64)
    row = cos_sin + pos * stride_cp + offs
    c = _round(tl.load(row, mask=mask, other=0.0), X_TY, RNE_BY_HAND)  # torch: table.to(q.dtype) first
    s = _round(tl.load(row + stride_cs, mask=mask, other=0.0), X_TY, RNE_BY_HAND)
    half = dim // 2
    if h < heads:
        src = q + t * stride_qt + h * stride_qh
        _rotate_row(src, q_out + (t * heads + h) * dim, c, s, offs, half, mask, stride_qd, X_TY, RNE_BY_HAND)
    else:
        kv_heads = tl.num_programs(1) - heads
        kh = h - heads
        src = k + t * stride_kt + kh * stride_kh
        _rotate_row(src, k_out + (t * kv_heads + kh) * dim, c, s, offs, half, mask, stride_kd, X_TY, RNE_BY_HAND)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [tokens, heads, head_dim], k: [tokens, kv_heads, head_dim] (any strides, same dtype); cos_sin: [2,
    max_positions, head_dim] float32; positions: [tokens] integer, on the device and within the table (unchecked:
    checking would sync) -> new contiguous (q_out, k_out) in q's dtype. head_dim even."""
    tokens, heads, dim = q.shape
    if q.dtype not in _DTYPES or k.dtype != q.dtype:
        raise ValueError(f"apply_rotary takes float32, bfloat16 or float16 q and k alike, got {q.dtype}, {k.dtype}")
    if k.shape[0] != tokens or k.shape[2] != dim or positions.shape != (tokens,) or dim % 2:
        raise ValueError(f"shapes do not match: q {list(q.shape)}, k {list(k.shape)}, positions {positions.shape}")
    if cos_sin.dim() != 3 or cos_sin.shape[0] != 2 or cos_sin.shape[2] != dim or cos_sin.stride(2) != 1:
        raise ValueError(f"cos_sin must be [2, positions, {dim}] with a contiguous last dim, got {cos_sin.shape}")
    kv_heads = k.shape[1]
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=q.dtype, device=q.device)
    if tokens == 0:
        return q_out, k_out
    block = triton.next_power_of_2(dim)
    _rotary[(tokens, heads + kv_heads)](
        q, k, q_out, k_out, cos_sin, positions, heads, dim,
        *q.stride(), *k.stride(), cos_sin.stride(0), cos_sin.stride(1),
        _DTYPES[q.dtype], block, not q.is_cuda, num_warps=max(1, min(4, block // 256)), enable_fp_fusion=False,
    )  # fmt: skip
    return q_out, k_out
