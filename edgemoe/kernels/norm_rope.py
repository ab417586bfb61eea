"""RMSNorm and the attention prologue (per-head q/k norm + rotary + KV-cache write) as one Triton launch each on CUDA,
where torch runs ~8 and ~30 tiny kernels: decode-time cost is launches, not bytes.
References: `RMSNorm.reference` (`edgemoe.layers.norm`), `RotaryEmbedding.forward`
(`edgemoe.layers.rotary`) and `index_copy_` into the cache (`PagedAttention.forward`); the kernels round where torch
rounds:

- `rms_norm`, program per row: fp32 sum of squares times 1/dim (torch's CUDA mean), + eps, rsqrt, x * r rounded to
  x's dtype, then the product with the weight in fp32 (exact for 16-bit operands) rounded once to the promoted
  dtype. Only the order of the sum differs from torch, so results agree to an ulp or so, mostly bitwise.
- `add_rms_norm`, the residual add of a pre-norm block fused into the next norm: x + residual in fp32 rounded once
  (torch's add, bitwise), stored, then `rms_norm`'s arithmetic on it: bitwise equal to rms_norm(x + residual).
- `gated_rms_norm`, the Gated DeltaNet's output norm (`GatedRMSNorm.reference`, `edgemoe.layers.linear_attention`):
  `rms_norm`'s arithmetic per value head, then times SiLU(z) in fp32, rounded once to x's dtype (one launch for ~12).
- `attention_prologue`, program per (token, head) over q's heads, k's, then v's: `rms_norm`'s arithmetic through
  the same helpers (the norm's values at a head's rotate_half partners are recomputed, not exchanged), then rotary
  with the fp32 cos/sin row rounded to q's dtype and each product and the sum rounded as torch's separate ops do;
  k and v stored straight into their KV-cache slots in the cache's dtype: bitwise equal to rms_norm per head +
  `RotaryEmbedding` + `index_copy_`.

FMA contraction is off (`enable_fp_fusion=False`): x * cos + rh * sin fused would round once instead of twice.
No host sync and only torch.empty outputs: all are CUDA-graph capturable once compiled.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from edgemoe.kernels.pdl import launch_args, trigger_dependents, wait_for_inputs

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
def _inv_rms(xf, inv_dim, eps):
    """1 / rms of one fp32 row (padding lanes 0): torch's CUDA mean multiplies by 1/dim too."""
    return tl.math.rsqrt(tl.sum(xf * xf, axis=0) * inv_dim + eps)


@triton.jit
def _normalize(xf, wf, r, X_TY: tl.constexpr, OUT_TY: tl.constexpr, RNE_BY_HAND: tl.constexpr):
    xn = _round(xf * r, X_TY, RNE_BY_HAND)  # torch: x.to(dtype) before the weight
    return _round(wf * xn, OUT_TY, RNE_BY_HAND)  # exact fp32 product of 16-bit operands, rounded once


@triton.jit
def _rms_norm(
    x, w, out, dim, stride_x, inv_dim, eps, X_TY: tl.constexpr, BLOCK: tl.constexpr, RNE_BY_HAND: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)  # row * stride overflows int32 on long prefills
    offs = tl.arange(0, BLOCK)
    mask = offs < dim
    xf = tl.load(x + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)  # padding adds 0 to the sum
    r = _inv_rms(xf, inv_dim, eps)
    wf = tl.load(w + offs, mask=mask, other=0.0).to(tl.float32)
    o = _normalize(xf, wf, r, X_TY, out.dtype.element_ty, RNE_BY_HAND)
    tl.store(out + row * dim + offs, o.to(out.dtype.element_ty), mask=mask)


def _norm_warps(block: int) -> int:
    # shared with the prologue: the order of the sum follows the warp layout, so equal warps keep both norms alike
    return min(16, max(1, block // 512))


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
        num_warps=_norm_warps(block), enable_fp_fusion=False, **launch_args(x.device),
    )  # fmt: skip
    return out


@triton.jit
def _add_rms_norm(
    x, res, w, out, h_out, dim, stride_x, stride_r, inv_dim, eps, H_TY: tl.constexpr, BLOCK: tl.constexpr,
    RNE_BY_HAND: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)  # row * stride overflows int32 on long prefills
    offs = tl.arange(0, BLOCK)
    mask = offs < dim
    xf = tl.load(x + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    rf = tl.load(res + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
    # torch's x + residual: the fp32 sum rounded once more (fp32 has >= 2p + 2 bits of a 16-bit p: still exact RNE)
    h = _round(xf + rf, H_TY, RNE_BY_HAND)  # padding: 0 + 0, adds 0 to the sum of squares
    tl.store(h_out + row * dim + offs, h.to(H_TY), mask=mask)  # a new tensor: no program's input is overwritten
    r = _inv_rms(h, inv_dim, eps)  # then rms_norm of h, as _rms_norm computes it
    wf = tl.load(w + offs, mask=mask, other=0.0).to(tl.float32)
    o = _normalize(h, wf, r, H_TY, out.dtype.element_ty, RNE_BY_HAND)
    tl.store(out + row * dim + offs, o.to(out.dtype.element_ty), mask=mask)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """A pre-norm block's residual add fused into the next norm: x (the block's output) and residual, [..., dim] of
    one shape; weight: [dim] -> (rms_norm(h, weight, eps), h) with h = x + residual in
    torch.promote_types(x.dtype, residual.dtype), rounded as torch's add. Both new and contiguous; the inputs are
    only read. Dtypes and dim as `rms_norm`'s, whose result it matches bitwise (same arithmetic, same warps)."""
    dim = x.shape[-1]
    dtypes = (x.dtype, residual.dtype, weight.dtype)
    if any(d not in _DTYPES for d in dtypes):
        raise ValueError(f"add_rms_norm takes float32, bfloat16 or float16, got {dtypes}")
    if residual.shape != x.shape or weight.shape != (dim,):
        raise ValueError(f"x {list(x.shape)}, residual {list(residual.shape)}, weight {list(weight.shape)} differ")
    block = triton.next_power_of_2(dim)
    if block > 65536:
        raise ValueError(f"add_rms_norm holds a row in one block: dim {dim} is too large")
    h = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device)
    out = torch.empty(x.shape, dtype=torch.promote_types(h.dtype, weight.dtype), device=x.device)
    if x.numel() == 0:
        return out, h
    x2, r2 = ((t if t.stride(-1) == 1 else t.contiguous()).reshape(-1, dim) for t in (x, residual))
    weight = weight if weight.stride(0) == 1 else weight.contiguous()
    _add_rms_norm[(x2.shape[0],)](
        x2, r2, weight, out, h, dim, x2.stride(0), r2.stride(0), 1.0 / dim, eps, _DTYPES[h.dtype], block, not x.is_cuda,
        num_warps=_norm_warps(block), enable_fp_fusion=False, **launch_args(x.device),
    )  # fmt: skip
    return out, h


@triton.jit
def _gated_rms_norm(
    x, z, w, out, dim, stride_x, stride_z, inv_dim, eps, X_TY: tl.constexpr, BLOCK: tl.constexpr,
    RNE_BY_HAND: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < dim
    xf = tl.load(x + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    r = _inv_rms(xf, inv_dim, eps)
    wf = tl.load(w + offs, mask=mask, other=0.0).to(tl.float32)
    h = _normalize(xf, wf, r, X_TY, X_TY, RNE_BY_HAND)  # weight * norm(x), in x's dtype
    zf = tl.load(z + row * stride_z + offs, mask=mask, other=0.0).to(tl.float32)
    o = _round(h * (zf / (1.0 + tl.exp(-zf))), X_TY, RNE_BY_HAND)  # torch: h * silu(z.float()), then .to(dtype)
    tl.store(out + row * dim + offs, o.to(X_TY), mask=mask)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x, z: [..., dim] of one shape and dtype; weight: [dim] of x's dtype -> weight * rms_norm(x) * SiLU(z) in x's
    shape and dtype, contiguous (`GatedRMSNorm.reference`). Dtypes float32, bfloat16, float16; dim up to 65536."""
    dim = x.shape[-1]
    if x.dtype not in _DTYPES or z.dtype != x.dtype or weight.dtype != x.dtype:
        raise ValueError(f"gated_rms_norm takes x, z and weight of one float dtype, got {x.dtype}, {z.dtype}, "
                         f"{weight.dtype}")  # fmt: skip
    if z.shape != x.shape or weight.shape != (dim,):
        raise ValueError(f"x {list(x.shape)}, z {list(z.shape)}, weight {list(weight.shape)} differ")
    block = triton.next_power_of_2(dim)
    if block > 65536:
        raise ValueError(f"gated_rms_norm holds a row in one block: dim {dim} is too large")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return out
    x2, z2 = ((t if t.stride(-1) == 1 else t.contiguous()).reshape(-1, dim) for t in (x, z))
    weight = weight if weight.stride(0) == 1 else weight.contiguous()
    _gated_rms_norm[(x2.shape[0],)](
        x2, z2, weight, out, dim, x2.stride(0), z2.stride(0), 1.0 / dim, eps, _DTYPES[x.dtype], block, not x.is_cuda,
        num_warps=_norm_warps(block), enable_fp_fusion=False, **launch_args(x.device),
    )  # fmt: skip
    return out


@triton.jit
def _cos_sin(cos_sin, positions, t, stride_cs, stride_cp, offs, mask, X_TY: tl.constexpr, RNE_BY_HAND: tl.constexpr):
    """Token t's cos and sin rows, rounded to X_TY (torch: table.to(q.dtype) first), as fp32."""
    pos = tl.load(positions + t).to(tl.int64)
    row = cos_sin + pos * stride_cp + offs
    c = _round(tl.load(row, mask=mask, other=0.0), X_TY, RNE_BY_HAND)
    s = _round(tl.load(row + stride_cs, mask=mask, other=0.0), X_TY, RNE_BY_HAND)
    return c, s


@triton.jit
def _norm_rotate_row(
    src,
    stride_d,
    w,
    inv_dim,
    eps,
    c,
    s,
    offs,
    half,
    mask,
    NORM: tl.constexpr,
    X_TY: tl.constexpr,
    RNE_BY_HAND: tl.constexpr,
):
    """One head [optionally RMSNorm-ed with weight w] * cos + rotate_half(it) * sin, each product and the sum
    rounded to X_TY -> fp32 [BLOCK]. rotate_half pairs the dims below 2 * half (the rotary dims); a dim above them is
    its own partner, which its table row (cos 1, sin 0) leaves as it is."""
    partner = tl.where(offs < half, offs + half, tl.where(offs < 2 * half, offs - half, offs))  # (-x2, x1), rest
    x = tl.load(src + offs * stride_d, mask=mask, other=0.0).to(tl.float32)  # padding adds 0 to the sum
    xp = tl.load(src + partner * stride_d, mask=mask, other=0.0).to(tl.float32)
    if NORM:  # what rms_norm would have stored at offs and at the partners: one r for the row, same rounding
        r = _inv_rms(x, inv_dim, eps)
        x = _normalize(x, tl.load(w + offs, mask=mask, other=0.0).to(tl.float32), r, X_TY, X_TY, RNE_BY_HAND)
        xp = _normalize(xp, tl.load(w + partner, mask=mask, other=0.0).to(tl.float32), r, X_TY, X_TY, RNE_BY_HAND)
    rh = tl.where(offs < half, -xp, xp)
    a = _round(x * c, X_TY, RNE_BY_HAND)
    b = _round(rh * s, X_TY, RNE_BY_HAND)
    return _round(a + b, X_TY, RNE_BY_HAND)


def _check_rotary(q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor, name: str) -> None:
    tokens, _, dim = q.shape
    if q.dtype not in _DTYPES or k.dtype != q.dtype:
        raise ValueError(f"{name} takes float32, bfloat16 or float16 q and k alike, got {q.dtype}, {k.dtype}")
    if k.dim() != 3 or k.shape[0] != tokens or k.shape[2] != dim or positions.shape != (tokens,) or dim % 2:
        raise ValueError(f"shapes do not match: q {list(q.shape)}, k {list(k.shape)}, positions {positions.shape}")
    if cos_sin.dim() != 3 or cos_sin.shape[0] != 2 or cos_sin.shape[2] != dim or cos_sin.stride(2) != 1:
        raise ValueError(f"cos_sin must be [2, positions, {dim}] with a contiguous last dim, got {cos_sin.shape}")


@triton.jit
def _store_rounded(dst, o, mask, RNE_BY_HAND: tl.constexpr):
    """fp32 o into dst's dtype, rounded as torch's .to(dtype) (a no-op on values already in that dtype)."""
    tl.store(dst, _round(o, dst.dtype.element_ty, RNE_BY_HAND).to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _attention_prologue(
    q,
    k,
    v,
    q_out,
    k_cache,
    v_cache,
    q_w,
    k_w,
    cos_sin,
    positions,
    slots,
    heads,
    kv_heads,
    dim,
    inv_dim,
    eps,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_kcs,
    stride_kch,
    stride_kcd,
    stride_vcs,
    stride_vch,
    stride_vcd,
    stride_cs,
    stride_cp,
    half,
    NORM: tl.constexpr,
    X_TY: tl.constexpr,
    BLOCK: tl.constexpr,
    RNE_BY_HAND: tl.constexpr,
    PDL: tl.constexpr,
):
    # paged attention may be scheduled before this waits for qkv, so that attention's reads of step inputs and older
    # K/V rows overlap qkv, not this ~1 us kernel (docs/findings.md, "Attention")
    trigger_dependents(PDL)
    # program (t, h): h < heads: q head -> q_out; then kv_heads k heads -> k_cache; then kv_heads v heads -> v_cache
    t, h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < dim
    # Slots and positions are step inputs and cos_sin a table, none written by the step's kernels: read before
    # waiting on the previous kernel (the qkv projection), so that the position -> cos/sin round trips overlap it.
    slot = tl.load(slots + t).to(tl.int64)  # slot * stride passes int32 in a long-context cache
    if h < heads + kv_heads:
        c, s = _cos_sin(cos_sin, positions, t, stride_cs, stride_cp, offs, mask, X_TY, RNE_BY_HAND)
        wait_for_inputs(PDL)
        if h < heads:
            o = _norm_rotate_row(
                q + t * stride_qt + h * stride_qh, stride_qd, q_w, inv_dim, eps, c, s, offs, half, mask, NORM, X_TY,
                RNE_BY_HAND,
            )  # fmt: skip
            tl.store(q_out + (t * heads + h) * dim + offs, o.to(X_TY), mask=mask)
        else:
            kh = h - heads
            o = _norm_rotate_row(
                k + t * stride_kt + kh * stride_kh, stride_kd, k_w, inv_dim, eps, c, s, offs, half, mask, NORM, X_TY,
                RNE_BY_HAND,
            )  # fmt: skip
            _store_rounded(k_cache + slot * stride_kcs + kh * stride_kch + offs * stride_kcd, o, mask, RNE_BY_HAND)
    else:
        wait_for_inputs(PDL)
        vh = h - heads - kv_heads
        x = tl.load(v + t * stride_vt + vh * stride_vh + offs * stride_vd, mask=mask, other=0.0).to(tl.float32)
        _store_rounded(v_cache + slot * stride_vcs + vh * stride_vch + offs * stride_vcd, x, mask, RNE_BY_HAND)


def attention_prologue(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    rotary_dim: int | None = None,
) -> torch.Tensor:
    """Per-head q/k RMSNorm (when both weights are given), rotary on q and k, and the KV-cache write, in one launch:
    returns q_out (new, contiguous, q's dtype) and writes k_cache[slot_mapping[t]] = rotated k[t],
    v_cache[slot_mapping[t]] = v[t] in the caches' dtypes; nothing else in the caches changes.

    Equal to `rms_norm` (each head) + `RotaryEmbedding` + `index_copy_`: same shapes, dtypes and conditions as those,
    plus v: [tokens, kv_heads, head_dim] (any float dtype, strides); k_cache, v_cache: [slots, kv_heads, head_dim];
    slot_mapping: [tokens] integer; `rotary_dim`: partial rotary, the leading dims of each head that turn (None: all;
    the table's other dims hold cos 1 and sin 0, as `RotaryEmbedding.build` writes them). The norm's output dtype
    must be q's (torch.promote_types(q, weight) == q).
    Slots and positions are not checked (checking would sync); slots must be distinct, except padding tokens that
    share a pad slot (whose content is then one of theirs, as with index_copy_)."""
    _check_rotary(q, k, cos_sin, positions, "attention_prologue")
    tokens, heads, dim = q.shape
    rotary_dim = dim if rotary_dim is None else rotary_dim
    if not 0 < rotary_dim <= dim or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be even and in 1..{dim}, got {rotary_dim}")
    kv_heads = k.shape[1]
    if v.shape != k.shape or v.dtype not in _DTYPES or slot_mapping.shape != (tokens,):
        raise ValueError(f"v {list(v.shape)} {v.dtype} and slot_mapping {list(slot_mapping.shape)} must match k")
    for cache in (k_cache, v_cache):
        if cache.dim() != 3 or cache.shape[1:] != k.shape[1:] or cache.dtype not in _DTYPES:
            raise ValueError(f"caches must be [slots, {kv_heads}, {dim}] float, got {list(cache.shape)} {cache.dtype}")
    norm = q_norm_weight is not None
    if norm != (k_norm_weight is not None):
        raise ValueError("give both q_norm_weight and k_norm_weight, or neither")
    weights = (q, q)  # placeholders, never read without the norm
    if norm:
        weights = (q_norm_weight, k_norm_weight)
        for w in weights:  # a weight promoting q's dtype would promote the norm and the rotary: not fused
            if w.shape != (dim,) or w.dtype not in _DTYPES or torch.promote_types(q.dtype, w.dtype) != q.dtype:
                raise ValueError(f"norm weights must be [{dim}] and keep q's dtype {q.dtype}, got {w.shape} {w.dtype}")
        weights = tuple(w if w.stride(0) == 1 else w.contiguous() for w in weights)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if tokens == 0:
        return q_out
    block = triton.next_power_of_2(dim)
    _attention_prologue[(tokens, heads + 2 * kv_heads)](
        q, k, v, q_out, k_cache, v_cache, *weights, cos_sin, positions, slot_mapping, heads, kv_heads, dim, 1.0 / dim,
        eps, *q.stride(), *k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride(), cos_sin.stride(0),
        cos_sin.stride(1), rotary_dim // 2, norm, _DTYPES[q.dtype], block, not q.is_cuda,
        num_warps=_norm_warps(block),
        enable_fp_fusion=False, **launch_args(q.device),
    )  # fmt: skip
    return q_out
