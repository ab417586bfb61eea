"""GGUF blocks dequantized on the device, bitwise as `edgemoe.quant.dequantize` computes them (its float32
operations in its order, no FMA contraction), then rounded to the output's dtype: what prefill multiplies on the
tensor cores. A few rows' worth of a quantized weight is written out dense at a time (a wave of experts, one
projection), so that prefill's matrix products run at bf16 GEMM speed (`edgemoe.kernels.grouped_gemm`, cuBLAS) while
the weights stay quantized everywhere else (`QuantExpertLayout.pair_outputs`, `QuantLinear`). Decode never
dequantizes: its GEMVs read the blocks in place (`edgemoe.kernels.quant_gemv`).

One program per (BR rows of one matrix, 256 weights of each): the matrices are `idx`'s rows of a bank
[N, R, row_bytes] (experts, or one dense weight as [1, R, row_bytes]); each block's weights are decoded as the
reference decodes them and stored at their positions in the row (a nibble byte's two weights to their two places), so
no value moves between lanes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from edgemoe.kernels.protocol import PairBiases
from edgemoe.kernels.quant_decode import _e2m1_doubled, _f16, _word
from edgemoe.quant import QuantLike, quant_type, row_bytes

BR = 16  # rows a program
STEP = 256  # weights of each row a program


@triton.jit
def _put(out_rows, r_ok, pos, vals, n):
    """vals [BR, G, L] to columns pos [G, L] of rows `out_rows` [BR] (element pointers); columns past n skipped."""
    ok = r_ok[:, None, None] & (pos < n)[None, :, :]
    tl.store(out_rows[:, None, None] + pos[None, :, :], vals.to(out_rows.dtype.element_ty), mask=ok)


@triton.jit
def _nibbles32(rows, out_rows, r_ok, b0, n, nblk, FIVE: tl.constexpr, MIN: tl.constexpr, MX: tl.constexpr,
               BITS: tl.constexpr, NB: tl.constexpr):  # fmt: skip
    blk = b0 + tl.arange(0, NB)
    b = tl.minimum(blk, nblk - 1)
    head = 1 if MX else 2 + 2 * MIN + 4 * FIVE
    base = rows[:, None] + (b * (head + 16))[None, :]  # [BR, NB]
    j = tl.arange(0, 16)
    q = tl.load(base[:, :, None] + head + j[None, None, :]).to(tl.int32)  # [BR, NB, 16]
    lo, hi = q & 15, q >> 4
    pos = blk[:, None] * 32 + j[None, :]  # [NB, 16]
    if MX:
        e = tl.load(base).to(tl.int32)
        d = tl.where(e < 2, 0x00200000 << tl.minimum(e, 1), (e - 1) << 23).to(tl.float32, bitcast=True)[:, :, None]
        _put(out_rows, r_ok, pos, d * _e2m1_doubled(lo), n)
        _put(out_rows, r_ok, pos + 16, d * _e2m1_doubled(hi), n)
    else:
        d = _f16(base, "")[:, :, None]
        if FIVE:
            bits = tl.load((base + head - 4).to(tl.pointer_type(tl.uint16))).to(tl.int32) | (
                tl.load((base + head - 2).to(tl.pointer_type(tl.uint16))).to(tl.int32) << 16
            )
            lo |= ((bits[:, :, None] >> j[None, None, :]) & 1) << 4
            hi |= ((bits[:, :, None] >> (j + 16)[None, None, :]) & 1) << 4
        if MIN:  # d q + m, two roundings
            m = _f16(base + 2, "")[:, :, None]
            _put(out_rows, r_ok, pos, d * lo.to(tl.float32) + m, n)
            _put(out_rows, r_ok, pos + 16, d * hi.to(tl.float32) + m, n)
        else:  # d (q - 2^(BITS - 1))
            _put(out_rows, r_ok, pos, d * (lo - (1 << (BITS - 1))).to(tl.float32), n)
            _put(out_rows, r_ok, pos + 16, d * (hi - (1 << (BITS - 1))).to(tl.float32), n)


@triton.jit
def _q8_0(rows, out_rows, r_ok, b0, n, nblk, NB: tl.constexpr):
    blk = b0 + tl.arange(0, NB)
    base = rows[:, None] + (tl.minimum(blk, nblk - 1) * 34)[None, :]
    j = tl.arange(0, 32)
    q = tl.load((base[:, :, None] + 2 + j[None, None, :]).to(tl.pointer_type(tl.int8))).to(tl.float32)
    _put(out_rows, r_ok, blk[:, None] * 32 + j[None, :], _f16(base, "")[:, :, None] * q, n)


@triton.jit
def _k_scale_min(w1, w2, w3, j):
    """6-bit scales and mins of sub-blocks j [G] from the scale bytes' three words [BR] -> [BR, G] float32 each."""
    shift = (8 * (j % 4))[None, :]
    a, b, c = (w1[:, None] >> shift) & 255, (w2[:, None] >> shift) & 255, (w3[:, None] >> shift) & 255
    low = (j < 4)[None, :]
    sc = tl.where(low, a & 63, (c & 15) | ((a >> 6) << 4))
    m = tl.where(low, b & 63, (c >> 4) | ((b >> 6) << 4))
    return sc.to(tl.float32), m.to(tl.float32)


@triton.jit
def _q45_k(rows, out_rows, r_ok, blk, n, FIVE: tl.constexpr):
    """Sub-block j = 2 g + h of byte group g: weights 64 g + 32 h + l, w = (d sc_j) q - (dmin m_j)."""
    base = rows + blk * (176 if FIVE else 144)  # [BR]
    head = _word(base, "")
    d = (head & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)[:, None]
    dmin = (head >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)[:, None]
    w1, w2, w3 = _word(base + 4, ""), _word(base + 8, ""), _word(base + 12, "")
    g, lane = tl.arange(0, 4), tl.arange(0, 32)
    q = tl.load(base[:, None, None] + ((48 if FIVE else 16) + 32 * g[:, None] + lane[None, :])[None, :, :])
    q = q.to(tl.int32)  # [BR, 4, 32]
    pos = blk * 256 + 64 * g[:, None] + lane[None, :]  # [4, 32]: the low nibbles' weights
    if FIVE:
        qh = tl.load(base[:, None, None] + 16 + lane[None, None, :]).to(tl.int32)  # [BR, 1, 32]
    for h in tl.static_range(2):
        nib = (q >> (4 * h)) & 15
        if FIVE:
            nib |= ((qh >> (2 * g + h)[None, :, None]) & 1) << 4
        sc, m = _k_scale_min(w1, w2, w3, 2 * g + h)  # [BR, 4]
        ds, dm = (d * sc)[:, :, None], (dmin * m)[:, :, None]
        _put(out_rows, r_ok, pos + 32 * h, ds * nib.to(tl.float32) - dm, n)


@triton.jit
def _q6_k(rows, out_rows, r_ok, blk, n):
    """Weight 128 h + 32 c + l (as `quant._q6_k`): w = (d sc) (q - 32), a scale per 16 weights."""
    base = rows + blk * 210  # [BR]
    h, lane = tl.arange(0, 2), tl.arange(0, 32)
    hl = (64 * h[:, None] + lane[None, :])[None, :, :]  # [1, 2, 32]: low-bit byte of (h, c = 0, l)
    ptr = base[:, None, None]
    ql0, ql1 = tl.load(ptr + hl).to(tl.int32), tl.load(ptr + hl + 32).to(tl.int32)  # c = 0, 2 / c = 1, 3
    qh = tl.load(ptr + 128 + (32 * h[:, None] + lane[None, :])[None, :, :]).to(tl.int32)
    d = _f16(base + 208, "")[:, None, None]
    for c in tl.static_range(4):
        ql = ql0 if c % 2 == 0 else ql1
        q = ((ql & 15) if c < 2 else (ql >> 4)) | (((qh >> (2 * c)) & 3) << 4)  # [BR, 2, 32]
        s_at = 192 + 8 * h[:, None] + 2 * c + lane[None, :] // 16  # [2, 32]: the weight's 16-weight scale
        sc = tl.load((base[:, None, None] + s_at[None, :, :]).to(tl.pointer_type(tl.int8))).to(tl.float32)
        pos = blk * 256 + 128 * h[:, None] + 32 * c + lane[None, :]
        _put(out_rows, r_ok, pos, (d * sc) * (q - 32).to(tl.float32), n)


@triton.jit
def _dequant(
    bank, idx, out, R, n, nblk, stride_e, stride_r, QTYPE: tl.constexpr, UNIT: tl.constexpr, BR: tl.constexpr,
    NB32: tl.constexpr,
):  # fmt: skip
    tiles = tl.cdiv(R, BR)
    j, tile = tl.program_id(0) // tiles, tl.program_id(0) % tiles
    e = tl.load(idx + j).to(tl.int64)
    r = tile * BR + tl.arange(0, BR)
    r_ok = r < R
    r = tl.minimum(r, R - 1).to(tl.int64)
    rows = bank + (e * stride_e + r * stride_r) * UNIT  # [BR] byte pointers
    out_rows = out + (j.to(tl.int64) * R + r) * n  # [BR] element pointers (out: [G, R, n] contiguous)
    step = tl.program_id(1)
    if QTYPE == 12:
        _q45_k(rows, out_rows, r_ok, step, n, False)
    elif QTYPE == 13:
        _q45_k(rows, out_rows, r_ok, step, n, True)
    elif QTYPE == 14:
        _q6_k(rows, out_rows, r_ok, step, n)
    elif QTYPE == 8:
        _q8_0(rows, out_rows, r_ok, step * NB32, n, nblk, NB32)
    elif QTYPE == 2:
        _nibbles32(rows, out_rows, r_ok, step * NB32, n, nblk, False, False, False, 4, NB32)
    elif QTYPE == 3:
        _nibbles32(rows, out_rows, r_ok, step * NB32, n, nblk, False, True, False, 4, NB32)
    elif QTYPE == 6:
        _nibbles32(rows, out_rows, r_ok, step * NB32, n, nblk, True, False, False, 5, NB32)
    elif QTYPE == 7:
        _nibbles32(rows, out_rows, r_ok, step * NB32, n, nblk, True, True, False, 5, NB32)
    else:
        tl.static_assert(QTYPE == 39, "unsupported block format")
        _nibbles32(rows, out_rows, r_ok, step * NB32, n, nblk, False, False, True, 1, NB32)


def _unit(w: torch.Tensor, align: int) -> tuple[int, int, int]:
    """(expert stride, row stride, unit): strides in the largest power of two up to 16 dividing them and the
    address, so that the compiler sees the rows' alignment (the K formats' scales load as words)."""
    unit = 16
    while w.data_ptr() % unit or w.stride(0) % unit or w.stride(1) % unit:
        unit //= 2
    if unit < align:
        raise ValueError(f"rows must start {align}-byte aligned for their format's scales")
    return w.stride(0) // unit, w.stride(1) // unit, unit


def dequantize_rows(
    bank: torch.Tensor, idx: torch.Tensor, qtype: QuantLike, n: int, out: torch.Tensor | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:  # fmt: skip
    """bank: uint8 [N, R, row_bytes(qtype, n)] (any strides, rows contiguous), idx: [G] int64 rows of bank's first
    dimension on its device -> [G, R, n] in `dtype` (or into `out`, contiguous): bank[idx] dequantized, bitwise
    `quant.dequantize` rounded to the dtype."""
    from edgemoe.kernels.quant_decode import ALIGN

    q = quant_type(qtype)
    N, R, rb = bank.shape
    assert bank.dtype == torch.uint8 and rb == row_bytes(q, n) and bank.stride(2) == 1
    G = idx.numel()
    out = torch.empty(G, R, n, dtype=dtype, device=bank.device) if out is None else out
    assert out.shape == (G, R, n) and out.is_contiguous()
    if G == 0 or R == 0:
        return out
    se, sr, unit = _unit(bank, ALIGN[q.name])
    nblk = n // q.block_weights
    grid = (G * triton.cdiv(R, BR), triton.cdiv(n, STEP))
    _dequant[grid](bank, idx, out, R, n, nblk, se, sr, q.ggml_type, unit, BR, STEP // 32, enable_fp_fusion=False)
    return out


SCRATCH_BYTES = 256 << 20  # prefill's dequantized experts at a time (a wave): qwen3-30b-a3b's 27 of 9.4 MiB in bf16


def wave_experts(inter: int, hidden: int, dtype: torch.dtype) -> int:
    """Experts dequantized at a time in prefill: as many as SCRATCH_BYTES holds, at least one."""
    return max(1, SCRATCH_BYTES // (3 * inter * hidden * dtype.itemsize))


def quant_pair_outputs(
    x: torch.Tensor,
    rows: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    q13: QuantLike,
    q2: QuantLike,
    out: torch.Tensor | None = None,
    wave: int | None = None,
    bias: PairBiases | None = None,
    act: str = "silu",
) -> torch.Tensor:
    """`grouped_gemm.pair_outputs` over quantized banks (x [T, H], rows [T * K] bank rows, -1 skipped; w13 uint8
    [N, 2I, row_bytes(q13, H)], w2 uint8 [N, H, row_bytes(q2, I)]): the experts the pairs use are dequantized in
    waves of `wave` (default `wave_experts`) into a scratch bank, and each wave's pairs are computed by the bf16
    grouped GEMM over it (the other pairs skipped). Every expert's pairs form the tiles they form in one launch, so
    the result is bitwise the same whatever the waves and whichever bank rows hold the experts (resident, a slot
    pool, a streamed area). One host sync (the used rows). `bias`, `act`: as `pair_outputs`'."""
    from edgemoe.kernels.grouped_gemm import pair_outputs, pick_blocks, schedule

    H, inter, N = x.shape[1], w13.shape[1] // 2, w13.shape[0]
    out = torch.empty(rows.numel(), H, dtype=x.dtype, device=x.device) if out is None else out
    if rows.numel() == 0:
        return out
    used = torch.unique(rows[rows >= 0])  # sorted bank rows (the host sync)
    wave = wave or wave_experts(inter, H, x.dtype)
    plan = schedule(rows.flatten(), N, pick_blocks(x.dtype).m)  # one schedule for every wave
    bank_of = torch.full((N,), -1, dtype=torch.long, device=x.device)
    size = min(wave, used.numel())  # one scratch for every wave (a new one a wave would briefly hold two)
    s13 = torch.empty(size, 2 * inter, H, dtype=x.dtype, device=x.device)
    s2 = torch.empty(size, H, inter, dtype=x.dtype, device=x.device)
    for start in range(0, used.numel(), wave):
        these = used[start : start + wave]
        d13 = dequantize_rows(w13, these, q13, H, out=s13[: these.numel()], dtype=x.dtype)  # [G, 2I, H]
        d2 = dequantize_rows(w2, these, q2, inter, out=s2[: these.numel()], dtype=x.dtype)  # [G, H, I]
        bank_of.fill_(-1)
        bank_of[these] = torch.arange(these.numel(), device=x.device)
        pair_outputs(x, rows, weights, d13, d2, out=out, plan=plan, bank_of=bank_of, bias=bias, act=act)
    return out


def dequantize_weight(raw: torch.Tensor, qtype: QuantLike, n: int, dtype: torch.dtype) -> torch.Tensor:
    """A dense quantized weight uint8 [R, row_bytes] -> [R, n] in `dtype` (prefill's projections)."""
    idx = torch.zeros(1, dtype=torch.long, device=raw.device)
    return dequantize_rows(raw[None], idx, qtype, n, dtype=dtype)[0]
