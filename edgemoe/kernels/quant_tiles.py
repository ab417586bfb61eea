"""One reduction step of the quantized matrix kernels (`edgemoe.kernels.quant_gemm`): a unit of a quantized weight
matrix's columns (one super-block of 256 for the K formats, NB blocks of 32 for the others) dequantized in registers
for BLOCK_N rows at once and multiplied by the matching columns of an activation tile on the tensor cores.

`w_rows` [BN] points at each weight row's first byte; `a_rows` [BM, 1] at each activation row's first element, `a_ok`
[BM, 1] says which are real. Weights whose positions inside a block are not contiguous (a nibble format's byte holds
weight j and j + 16, or j and j + 32) are dequantized as sub-tiles whose columns are contiguous runs of a block, and
the activations are loaded at the same positions, so no weight is ever moved to another lane: each sub-tile is one
`tl.dot` of [BM, Kp] by [Kp, BN] (or, `W_IS_A`, of the weights [BN, Kp] by the activations' transpose: decode's
orientation, where the few tokens are the narrow side).

Quants become floats without integer-to-float conversions (`quant_decode._unit`: q's bits ORed under the exponent of
1.0) and the block's affine map is one FMA, as in the decode GEMVs; the dequantized tile is rounded to the activations'
dtype for the dot (bf16 or fp16; fp32 activations keep fp32 weights, dotted in IEEE fp32). Byte layouts and the
reference: `edgemoe.layers.quant`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from edgemoe.kernels.quant_decode import _e2m1_doubled, _f16, _unit, _word

# Every sub-tile is 64 weights of each row wide (a [BN, 64] fp32 tile: 32 registers a thread at BN 64 over 4 warps;
# 128 wide spilled). A reduction unit of the matrix kernels (`units`) is a super-block of the K formats, NB32 blocks
# of the nibble formats (each byte two weights: 64 and 64), NB8 blocks of Q8_0.
NB32, NB8 = tl.constexpr(4), tl.constexpr(2)
UNIT_WEIGHTS: dict[str, int] = {"Q4_K": 256, "Q5_K": 256, "Q6_K": 256, "Q8_0": 32 * NB8.value} | {
    name: 32 * NB32.value for name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "MXFP4")
}


def units(name: str, n: int) -> tuple[int, bool]:
    """(reduction units of a row of n weights, whether they cover it exactly)."""
    w = UNIT_WEIGHTS[name]
    return triton.cdiv(n, w), n % w == 0


@triton.jit
def _dot(acc, a, w, W_IS_A: tl.constexpr, PRECISION: tl.constexpr):
    """acc + a [BM, Kp] @ w [BN, Kp]^T -> [BM, BN], or with W_IS_A acc + w @ a^T -> [BN, BM]."""
    w = w.to(a.dtype)
    if W_IS_A:
        acc = tl.dot(w, tl.trans(a), acc, input_precision=PRECISION)
    else:
        acc = tl.dot(a, tl.trans(w), acc, input_precision=PRECISION)
    return acc


@triton.jit
def _cols(a_rows, a_ok, pos, K, EVEN: tl.constexpr):
    """The activations' columns `pos` [Kp] of rows `a_rows` [BM, 1] -> [BM, Kp] (rows not ok, columns past K: 0)."""
    if EVEN:
        return tl.load(a_rows + pos[None, :], mask=a_ok, other=0.0)
    return tl.load(a_rows + pos[None, :], mask=a_ok & (pos < K)[None, :], other=0.0)


@triton.jit
def _affine(scale, offset, f, BITS: tl.constexpr):
    """scale q + offset for f = _unit(q, BITS), one FMA; scale, offset [BN, G], f [BN, G, L]."""
    s = scale * (1 << BITS)
    return f * s[:, :, None] + (offset - s)[:, :, None]


@triton.jit
def _flat(t, BN: tl.constexpr, KP: tl.constexpr):
    return tl.reshape(t, [BN, KP])


@triton.jit
def _nibbles32(
    acc, a_rows, a_ok, w_rows, u, nblk, K, FIVE: tl.constexpr, MIN: tl.constexpr, MX: tl.constexpr,
    BITS: tl.constexpr, NB: tl.constexpr, EVEN: tl.constexpr, W_IS_A: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Q4_0, Q4_1, Q5_0, Q5_1 and MXFP4: NB blocks of 32 weights, byte j holding weights j (low nibble) and j + 16."""
    BN: tl.constexpr = w_rows.shape[0]
    blk = u * NB + tl.arange(0, NB)
    b = blk if EVEN else tl.minimum(blk, nblk - 1)  # past the row: its last block again, met by zeros of a
    HEAD: tl.constexpr = 1 if MX else 2 + 2 * MIN + 4 * FIVE
    base = w_rows[:, None] + (b * (HEAD + 16))[None, :]  # [BN, NB]
    j = tl.arange(0, 16)
    q = tl.load(base[:, :, None] + HEAD + j[None, None, :]).to(tl.int32)  # [BN, NB, 16]
    lo, hi = q & 15, q >> 4
    pos = blk[:, None] * 32 + j[None, :]  # [NB, 16]
    if MX:  # 2^(e - 128) (e < 2: a subnormal), times the doubled E2M1 values
        e = tl.load(base).to(tl.int32)
        d = tl.where(e < 2, 0x00200000 << tl.minimum(e, 1), (e - 1) << 23).to(tl.float32, bitcast=True)
        w_lo, w_hi = d[:, :, None] * _e2m1_doubled(lo), d[:, :, None] * _e2m1_doubled(hi)
    else:
        d = _f16(base, "")
        if FIVE:  # bit j of the little-endian word after the header: weight j's fifth bit
            bits = tl.load((base + HEAD - 4).to(tl.pointer_type(tl.uint16))).to(tl.int32) | (
                tl.load((base + HEAD - 2).to(tl.pointer_type(tl.uint16))).to(tl.int32) << 16
            )
            lo |= ((bits[:, :, None] >> j[None, None, :]) & 1) << 4
            hi |= ((bits[:, :, None] >> (j + 16)[None, None, :]) & 1) << 4
        m = _f16(base + 2, "") if MIN else -(1 << (BITS - 1)) * d
        w_lo, w_hi = _affine(d, m, _unit(lo, BITS), BITS), _affine(d, m, _unit(hi, BITS), BITS)
    KP: tl.constexpr = NB * 16
    acc = _dot(acc, _cols(a_rows, a_ok, tl.reshape(pos, [KP]), K, EVEN), _flat(w_lo, BN, KP), W_IS_A, PRECISION)
    return _dot(acc, _cols(a_rows, a_ok, tl.reshape(pos + 16, [KP]), K, EVEN), _flat(w_hi, BN, KP), W_IS_A, PRECISION)


@triton.jit
def _q8_0(acc, a_rows, a_ok, w_rows, u, nblk, K, NB: tl.constexpr, EVEN: tl.constexpr, W_IS_A: tl.constexpr,
          PRECISION: tl.constexpr):  # fmt: skip
    BN: tl.constexpr = w_rows.shape[0]
    blk = u * NB + tl.arange(0, NB)
    b = blk if EVEN else tl.minimum(blk, nblk - 1)
    base = w_rows[:, None] + (b * 34)[None, :]  # [BN, NB]
    j = tl.arange(0, 32)
    q = tl.load(base[:, :, None] + 2 + j[None, None, :]).to(tl.int32) ^ 0x80  # the int8 q + 128
    d = _f16(base, "")
    w = _affine(d, -128 * d, _unit(q, 8), 8)  # [BN, NB, 32]
    KP: tl.constexpr = NB * 32
    pos = tl.reshape(blk[:, None] * 32 + j[None, :], [KP])
    return _dot(acc, _cols(a_rows, a_ok, pos, K, EVEN), _flat(w, BN, KP), W_IS_A, PRECISION)


@triton.jit
def _k_scale_min(w1, w2, w3, j):
    """6-bit scales and mins of sub-blocks j [G] of Q4_K/Q5_K super-blocks from their scale bytes' three words
    [BN] -> [BN, G] float32 each (`layers/quant._k_scales`)."""
    shift = (8 * (j % 4))[None, :]
    a, b, c = (w1[:, None] >> shift) & 255, (w2[:, None] >> shift) & 255, (w3[:, None] >> shift) & 255
    low = (j < 4)[None, :]
    sc = tl.where(low, a & 63, (c & 15) | ((a >> 6) << 4))
    m = tl.where(low, b & 63, (c >> 4) | ((b >> 6) << 4))
    return sc.to(tl.float32), m.to(tl.float32)


@triton.jit
def _q45_k(acc, a_rows, a_ok, w_rows, u, K, FIVE: tl.constexpr, BITS: tl.constexpr, W_IS_A: tl.constexpr,
           PRECISION: tl.constexpr):  # fmt: skip
    """Q4_K (and with FIVE Q5_K): byte 32 g + l of the nibbles holds weights 64 g + l (low) and 64 g + 32 + l."""
    BN: tl.constexpr = w_rows.shape[0]
    base = w_rows + u * (176 if FIVE else 144)  # [BN]
    head = _word(base, "")
    d = (head & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)[:, None]
    dmin = (head >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)[:, None]
    w1, w2, w3 = _word(base + 4, ""), _word(base + 8, ""), _word(base + 12, "")
    lane = tl.arange(0, 32)
    if FIVE:  # bit j of byte l: the fifth bit of weight l of sub-block j
        qh = tl.load(base[:, None, None] + 16 + lane[None, None, :]).to(tl.int32)  # [BN, 1, 32]
    for half in tl.static_range(2):  # byte groups g = 2 half, 2 half + 1: sub-blocks 4 half .. 4 half + 3
        g = 2 * half + tl.arange(0, 2)
        q = tl.load(base[:, None, None] + ((48 if FIVE else 16) + 32 * g[:, None] + lane[None, :])[None, :, :])
        q = q.to(tl.int32)  # [BN, 2, 32] (one sub-tile's bytes: both its nibble halves read them)
        pos = u * 256 + 64 * g[:, None] + lane[None, :]  # [2, 32]: the low nibbles' weights
        for hi in tl.static_range(2):
            nib = (q >> (4 * hi)) & 15
            if FIVE:
                nib |= ((qh >> (2 * g + hi)[None, :, None]) & 1) << 4
            sc, m = _k_scale_min(w1, w2, w3, 2 * g + hi)
            w = _affine(d * sc, -(dmin * m), _unit(nib, BITS), BITS)  # [BN, 2, 32]
            a = _cols(a_rows, a_ok, tl.reshape(pos + 32 * hi, [64]), K, True)
            acc = _dot(acc, a, _flat(w, BN, 64), W_IS_A, PRECISION)
    return acc


@triton.jit
def _q6_k_quarter(ql, qh, ds, c: tl.constexpr):
    """Weights 128 h + 32 c + l of Q6_K super-blocks (all h < 2, l < 32) as [BN, 2, 2, 16] (h, l // 16, l % 16):
    the low nibble of ql (high for c >= 2) under bits 2c, 2c + 1 of qh; ds [BN, 2, 2] the 16-weight scales."""
    nib = (ql & 15) if c < 2 else (ql >> 4)
    q = (nib | (((qh >> (2 * c)) & 3) << 4)).to(tl.int32)  # q + 32, 6 bits
    s = ds * 64
    return _unit(q, 6) * s[:, :, :, None] + (-32 * ds - s)[:, :, :, None]


@triton.jit
def _q6_k(acc, a_rows, a_ok, w_rows, u, K, W_IS_A: tl.constexpr, PRECISION: tl.constexpr):
    """Q6_K: weight 128 h + 32 c + l has its low 4 bits in byte 64 h + 32 (c % 2) + l (the high nibble for c >= 2),
    its top 2 in bits 2c of byte 128 + 32 h + l; a scale per 16 weights. Four sub-tiles, one per c."""
    BN: tl.constexpr = w_rows.shape[0]
    base = w_rows + u * 210  # [BN]
    h, r, lane = tl.arange(0, 2), tl.arange(0, 2), tl.arange(0, 16)
    ell = (16 * r[:, None] + lane[None, :])[None, None, :, :]  # [1, 1, 2, 16]: l
    hh = h[None, :, None, None]  # [1, 2, 1, 1]
    ptr = base[:, None, None, None]
    # bytes stay 8-bit until a sub-tile needs them (four to a register: the Q6_K tile's three loads live together)
    ql0 = tl.load(ptr + 64 * hh + ell)  # [BN, 2, 2, 16]: the low bits of c = 0 and c = 2
    ql1 = tl.load(ptr + 64 * hh + 32 + ell)  # c = 1 and c = 3
    qh = tl.load(ptr + 128 + 32 * hh + ell)
    d = _f16(base + 208, "")[:, None, None]  # [BN, 1, 1]
    for_c = 8 * h[:, None] + r[None, :]  # [2, 2]: scale index of (h, l // 16) at c = 0
    pos0 = u * 256 + 128 * h[:, None, None] + 16 * r[None, :, None] + lane[None, None, :]  # [2, 2, 16] at c = 0
    for c in tl.static_range(4):
        sc = tl.load(base[:, None, None] + 192 + (for_c + 2 * c)[None, :, :]).to(tl.int8, bitcast=True)
        w = _q6_k_quarter(ql0 if c % 2 == 0 else ql1, qh, d * sc.to(tl.float32), c)  # [BN, 2, 2, 16]
        pos = tl.reshape(pos0 + 32 * c, [64])
        acc = _dot(acc, _cols(a_rows, a_ok, pos, K, True), tl.reshape(w, [BN, 64]), W_IS_A, PRECISION)
    return acc


@triton.jit
def dot_unit(
    acc, a_rows, a_ok, w_rows, u, nblk, K, QTYPE: tl.constexpr, EVEN: tl.constexpr, W_IS_A: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """acc + the activations times unit u of the weight rows (see the module docstring). QTYPE: the GGML type id;
    nblk: blocks in a row; EVEN: the row is a whole number of units (`units`)."""
    if QTYPE == 12:
        acc = _q45_k(acc, a_rows, a_ok, w_rows, u, K, False, 4, W_IS_A, PRECISION)
    elif QTYPE == 13:
        acc = _q45_k(acc, a_rows, a_ok, w_rows, u, K, True, 5, W_IS_A, PRECISION)
    elif QTYPE == 14:
        acc = _q6_k(acc, a_rows, a_ok, w_rows, u, K, W_IS_A, PRECISION)
    elif QTYPE == 8:
        acc = _q8_0(acc, a_rows, a_ok, w_rows, u, nblk, K, NB8, EVEN, W_IS_A, PRECISION)
    elif QTYPE == 2:
        acc = _nibbles32(acc, a_rows, a_ok, w_rows, u, nblk, K, False, False, False, 4, NB32, EVEN, W_IS_A, PRECISION)
    elif QTYPE == 3:
        acc = _nibbles32(acc, a_rows, a_ok, w_rows, u, nblk, K, False, True, False, 4, NB32, EVEN, W_IS_A, PRECISION)
    elif QTYPE == 6:
        acc = _nibbles32(acc, a_rows, a_ok, w_rows, u, nblk, K, True, False, False, 5, NB32, EVEN, W_IS_A, PRECISION)
    elif QTYPE == 7:
        acc = _nibbles32(acc, a_rows, a_ok, w_rows, u, nblk, K, True, True, False, 5, NB32, EVEN, W_IS_A, PRECISION)
    else:
        tl.static_assert(QTYPE == 39, "unsupported block format")
        acc = _nibbles32(acc, a_rows, a_ok, w_rows, u, nblk, K, False, False, True, 1, NB32, EVEN, W_IS_A, PRECISION)
    return acc
