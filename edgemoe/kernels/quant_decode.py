"""One loop step of the quantized expert GEMVs (`edgemoe.kernels.quant_gemv`): NB blocks of every row of a tile of
rows, dequantized in registers and multiplied by the input elements they meet, added to a [A, B, G, L] float32
accumulator. `edgemoe.quant` gives the byte layouts and is the reference.

`rows` [A, B] points at the rows' first bytes; `vec` [A or 1, B or 1] at the x (or h) row each row of the tile is
dotted with. A step covers blocks blk .. blk + NB - 1 as G groups of L lanes, each lane one quant byte (Q8_0: one
int8), a group one contiguous run of a block; a nibble format's byte holds two weights, and the x positions of both
are loaded to match, so no byte has to reach another byte's position (the compiler may still re-lay a tile out to
meet x's layout: `quant_gemv.pick_blocks`). GROUPS gives (G / NB, L) per format. Scales are decoded once per group;
blocks past the row's end (EVEN false) are clamped to its last block and meet x = 0.

Quants become floats without int-to-float conversions (an eighth of the FMA rate on Hopper: one per weight would
cap a Q4_K GEMV near half of HBM bandwidth): `_unit` ORs q's bits under the exponent of 1.0, f = 1 + q / 2^BITS
exactly, and the block's affine map w = s q + o becomes one FMA, w = (2^BITS s) f + (o - 2^BITS s), which rounds
at most ~2^(BITS - 23) of a quant step s: the kernels match `dequantize` to ~1e-7 relative, not bitwise.
"""

from __future__ import annotations

import triton
import triton.language as tl

# format -> (groups per block, lanes): the 32-weight nibble formats a block's 16 nibble bytes; Q8_0 its 32 int8;
# Q4_K/Q5_K the 4 runs of 32 nibble bytes (2 sub-blocks each); Q6_K 8 runs of 16 (a scale per 16 weights)
GROUPS: dict[str, tuple[int, int]] = {
    "Q4_0": (1, 16),
    "Q4_1": (1, 16),
    "Q5_0": (1, 16),
    "Q5_1": (1, 16),
    "Q8_0": (1, 32),
    "MXFP4": (1, 16),
    "Q4_K": (4, 32),
    "Q5_K": (4, 32),
    "Q6_K": (8, 16),
}
# bytes every block start must be aligned to (the widest scalar the step loads from a block)
ALIGN: dict[str, int] = {"Q4_0": 2, "Q8_0": 2, "MXFP4": 1, "Q4_K": 4, "Q5_K": 4, "Q6_K": 2, "Q4_1": 4, "Q5_0": 2,
                         "Q5_1": 4}  # fmt: skip


@triton.jit
def _vec(vec, pos, ok, EVEN: tl.constexpr, CACHE: tl.constexpr):
    """vec [A', B'] row pointers, pos [G, L] positions in the row, ok [G, 1] block in the row -> [A', B', G, L]."""
    ptr = vec[:, :, None, None] + pos[None, None, :, :]
    if EVEN:
        v = tl.load(ptr, cache_modifier=CACHE)
    else:
        v = tl.load(ptr, mask=ok[None, None, :, :], other=0.0, cache_modifier=CACHE)
    return v.to(tl.float32)


@triton.jit
def _blocks(blk, nblk, NB: tl.constexpr, PER_BLOCK: tl.constexpr, EVEN: tl.constexpr):
    """Block of each of the step's NB * PER_BLOCK groups ([G], clamped to the row) and whether it is in the row."""
    b = blk + tl.arange(0, NB * PER_BLOCK) // PER_BLOCK
    ok = b < nblk
    if not EVEN:
        b = tl.minimum(b, nblk - 1)
    return b, ok[:, None]


@triton.jit
def _lanes(ptr, LANES: tl.constexpr, CACHE: tl.constexpr):
    """The LANES bytes from each of byte pointers `ptr` [A, B, G] -> [A, B, G, LANES] int32."""
    lane = tl.arange(0, LANES)[None, None, None, :]
    return tl.load(ptr[:, :, :, None] + lane, cache_modifier=CACHE).to(tl.int32)


@triton.jit
def _f16(ptr, CACHE: tl.constexpr):
    """The half at byte pointers `ptr` (2-byte aligned) as float32."""
    return tl.load(ptr.to(tl.pointer_type(tl.float16)), cache_modifier=CACHE).to(tl.float32)


@triton.jit
def _word(ptr, CACHE: tl.constexpr):
    """The int32 at byte pointers `ptr` (4-byte aligned)."""
    return tl.load(ptr.to(tl.pointer_type(tl.int32)), cache_modifier=CACHE)


@triton.jit
def _unit(q, BITS: tl.constexpr):
    """1 + q / 2^BITS as float32 (exact, 0 <= q < 2^BITS): q's bits under the exponent of 1.0."""
    return ((q << (23 - BITS)) | 0x3F800000).to(tl.float32, bitcast=True)


@triton.jit
def _affine(scale, offset, f, BITS: tl.constexpr):
    """scale q + offset for f = _unit(q, BITS), as one FMA; scale, offset [A, B, G], f [A, B, G, L]."""
    s = scale * (1 << BITS)
    return f * s[:, :, :, None] + (offset - s)[:, :, :, None]


@triton.jit
def _nibbles32(
    acc, rows, vec, blk, nblk, FIVE: tl.constexpr, MIN: tl.constexpr, BITS: tl.constexpr, NB: tl.constexpr,
    EVEN: tl.constexpr, CACHE: tl.constexpr, VCACHE: tl.constexpr,
):  # fmt: skip
    """The 32-weight nibble formats: 16 bytes of nibbles (byte j: weights j and j + 16) after a header of d, then m
    (MIN: Q4_1, Q5_1; w = d q + m) and the fifth bits (FIVE: Q5_0, Q5_1); without m, w = d (q - 2^(BITS - 1))
    (Q4_0, Q5_0)."""
    b, ok = _blocks(blk, nblk, NB, 1, EVEN)
    head = 4 if MIN else 2
    base = rows[:, :, None] + (b * (head + (4 if FIVE else 0) + 16))[None, None, :]  # [A, B, G]
    d = _f16(base, CACHE)
    q = _lanes(base + head + (4 if FIVE else 0), 16, CACHE)  # [A, B, G, 16]
    lo, hi = q & 15, q >> 4
    if FIVE:  # bit j of the little-endian word: weight j's fifth bit (two halves: Q5_0's word is 2-aligned)
        bits = tl.load((base + head).to(tl.pointer_type(tl.uint16)), cache_modifier=CACHE).to(tl.int32) | (
            tl.load((base + head + 2).to(tl.pointer_type(tl.uint16)), cache_modifier=CACHE).to(tl.int32) << 16
        )
        lane = tl.arange(0, 16)[None, None, None, :]
        lo |= ((bits[:, :, :, None] >> lane) & 1) << 4
        hi |= ((bits[:, :, :, None] >> (lane + 16)) & 1) << 4
    m = _f16(base + 2, CACHE) if MIN else -(1 << (BITS - 1)) * d
    pos = b[:, None] * 32 + tl.arange(0, 16)[None, :]
    acc += _affine(d, m, _unit(lo, BITS), BITS) * _vec(vec, pos, ok, EVEN, VCACHE)
    return acc + _affine(d, m, _unit(hi, BITS), BITS) * _vec(vec, pos + 16, ok, EVEN, VCACHE)


@triton.jit
def _q8_0(acc, rows, vec, blk, nblk, NB: tl.constexpr, EVEN: tl.constexpr, CACHE: tl.constexpr, VCACHE: tl.constexpr):
    b, ok = _blocks(blk, nblk, NB, 1, EVEN)
    base = rows[:, :, None] + (b * 34)[None, None, :]
    d = _f16(base, CACHE)
    u = _lanes(base + 2, 32, CACHE) ^ 0x80  # the int8 q + 128
    w = _affine(d, -128 * d, _unit(u, 8), 8)
    return acc + w * _vec(vec, b[:, None] * 32 + tl.arange(0, 32)[None, :], ok, EVEN, VCACHE)


@triton.jit
def _mxfp4(acc, rows, vec, blk, nblk, NB: tl.constexpr, EVEN: tl.constexpr, CACHE: tl.constexpr, VCACHE: tl.constexpr):
    b, ok = _blocks(blk, nblk, NB, 1, EVEN)
    base = rows[:, :, None] + (b * 17)[None, None, :]
    e = tl.load(base, cache_modifier=CACHE).to(tl.int32)
    # 2^(e - 128), half the E8M0 scale (the E2M1 values are doubled below, as gguf's table); e < 2: a subnormal
    d = tl.where(e < 2, 0x00200000 << tl.minimum(e, 1), (e - 1) << 23).to(tl.float32, bitcast=True)[:, :, :, None]
    q = _lanes(base + 1, 16, CACHE)
    pos = b[:, None] * 32 + tl.arange(0, 16)[None, :]
    acc += d * _e2m1_doubled(q & 15) * _vec(vec, pos, ok, EVEN, VCACHE)
    return acc + d * _e2m1_doubled(q >> 4) * _vec(vec, pos + 16, ok, EVEN, VCACHE)


@triton.jit
def _e2m1_doubled(nib):
    """Twice the E2M1 value of a nibble (sign, 2-bit exponent, 1-bit mantissa), built as float32 bits: 0, 1
    (subnormals doubled), then 2^e (1 + m / 2)."""
    c = nib & 7
    normal = (((c >> 1) + 127) << 23) | ((c & 1) << 22)
    bits = tl.where(c >= 2, normal, tl.where(c == 1, 0x3F800000, 0))
    return (bits | ((nib & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def _k_scale_min(words, j):
    """The 6-bit scale and min of sub-blocks j [G] of Q4_K/Q5_K super-blocks, from the scale bytes' three words
    ([A, B, G] each) -> [A, B, G] int32 each, as `quant._k_scales` decodes them."""
    w1, w2, w3 = words
    shift = (8 * (j % 4))[None, None, :]
    a, b, c = (w1 >> shift) & 255, (w2 >> shift) & 255, (w3 >> shift) & 255  # bytes j % 4 (+ 4, + 8)
    low = (j < 4)[None, None, :]
    sc = tl.where(low, a & 63, (c & 15) | ((a >> 6) << 4))
    m = tl.where(low, b & 63, (c >> 4) | ((b >> 6) << 4))
    return sc.to(tl.float32), m.to(tl.float32)


@triton.jit
def _q45_k(
    acc, rows, vec, blk, nblk, FIVE: tl.constexpr, BITS: tl.constexpr, NB: tl.constexpr, EVEN: tl.constexpr,
    CACHE: tl.constexpr, VCACHE: tl.constexpr,
):  # fmt: skip
    """Q4_K, and with FIVE (BITS 5) Q5_K (its 32 bytes of fifth bits between the scales and the nibbles)."""
    b, ok = _blocks(blk, nblk, NB, 4, EVEN)  # group g of 32 bytes: sub-blocks 2 g (low nibbles) and 2 g + 1
    g = tl.arange(0, 4 * NB) % 4
    base = rows[:, :, None] + (b * (176 if FIVE else 144))[None, None, :]  # [A, B, G]
    head = _word(base, CACHE)  # d (low half), dmin (high half)
    d = (head & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    dmin = (head >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    words = (_word(base + 4, CACHE), _word(base + 8, CACHE), _word(base + 12, CACHE))
    q = _lanes(base + ((48 if FIVE else 16) + 32 * g)[None, None, :], 32, CACHE)  # [A, B, G, 32]
    lo, hi = q & 15, q >> 4
    if FIVE:  # bit j of byte l: the fifth bit of weight l of sub-block j
        qh = _lanes(base + 16, 32, CACHE)
        shift = 2 * g[None, None, :, None]
        lo |= ((qh >> shift) & 1) << 4
        hi |= ((qh >> (shift + 1)) & 1) << 4
    pos = (b * 256 + 64 * g)[:, None] + tl.arange(0, 32)[None, :]
    sc, m = _k_scale_min(words, 2 * g)
    acc += _affine(d * sc, -(dmin * m), _unit(lo, BITS), BITS) * _vec(vec, pos, ok, EVEN, VCACHE)
    sc, m = _k_scale_min(words, 2 * g + 1)
    return acc + _affine(d * sc, -(dmin * m), _unit(hi, BITS), BITS) * _vec(vec, pos + 32, ok, EVEN, VCACHE)


@triton.jit
def _q6_k(acc, rows, vec, blk, nblk, NB: tl.constexpr, EVEN: tl.constexpr, CACHE: tl.constexpr, VCACHE: tl.constexpr):
    # group u (of a block): half hf = u // 4, c = (u // 2) % 2, 16-lane run r = u % 2. Its low nibbles are weights
    # 128 hf + 32 c + 16 r + lane, its high nibbles those 64 further (c + 2); the high bits of both share a byte
    b, ok = _blocks(blk, nblk, NB, 8, EVEN)
    u = tl.arange(0, 8 * NB) % 8
    hf, c, r = u // 4, (u // 2) % 2, u % 2
    base = rows[:, :, None] + (b * 210)[None, None, :]  # [A, B, G]
    ql = _lanes(base + (64 * hf + 32 * c + 16 * r)[None, None, :], 16, CACHE)  # [A, B, G, 16]
    qh = _lanes(base + (128 + 32 * hf + 16 * r)[None, None, :], 16, CACHE)
    shift = 2 * c[None, None, :, None]
    lo = (ql & 15) | (((qh >> shift) & 3) << 4)  # q + 32, 6 bits
    hi = (ql >> 4) | (((qh >> (shift + 4)) & 3) << 4)
    d = _f16(base + 208, CACHE)
    scale = base + 192 + (8 * hf + 2 * c + r)[None, None, :]  # one int8 scale per 16 weights
    ds = d * tl.load(scale, cache_modifier=CACHE).to(tl.int8, bitcast=True).to(tl.float32)
    pos = (b * 256 + 128 * hf + 32 * c + 16 * r)[:, None] + tl.arange(0, 16)[None, :]
    acc += _affine(ds, -32 * ds, _unit(lo, 6), 6) * _vec(vec, pos, ok, EVEN, VCACHE)
    ds = d * tl.load(scale + 4, cache_modifier=CACHE).to(tl.int8, bitcast=True).to(tl.float32)
    return acc + _affine(ds, -32 * ds, _unit(hi, 6), 6) * _vec(vec, pos + 64, ok, EVEN, VCACHE)


@triton.jit
def decode_step(
    acc, rows, vec, blk, nblk, QTYPE: tl.constexpr, NB: tl.constexpr, EVEN: tl.constexpr, CACHE: tl.constexpr,
    VCACHE: tl.constexpr,
):  # fmt: skip
    """acc [A, B, G, L] + the step's blocks blk .. blk + NB - 1 of each row dotted with its vec row. QTYPE: the GGML
    type id; CACHE, VCACHE: the weight and vec loads' cache modifiers."""
    if QTYPE == 2:
        acc = _nibbles32(acc, rows, vec, blk, nblk, False, False, 4, NB, EVEN, CACHE, VCACHE)
    elif QTYPE == 3:
        acc = _nibbles32(acc, rows, vec, blk, nblk, False, True, 4, NB, EVEN, CACHE, VCACHE)
    elif QTYPE == 6:
        acc = _nibbles32(acc, rows, vec, blk, nblk, True, False, 5, NB, EVEN, CACHE, VCACHE)
    elif QTYPE == 7:
        acc = _nibbles32(acc, rows, vec, blk, nblk, True, True, 5, NB, EVEN, CACHE, VCACHE)
    elif QTYPE == 8:
        acc = _q8_0(acc, rows, vec, blk, nblk, NB, EVEN, CACHE, VCACHE)
    elif QTYPE == 39:
        acc = _mxfp4(acc, rows, vec, blk, nblk, NB, EVEN, CACHE, VCACHE)
    elif QTYPE == 12:
        acc = _q45_k(acc, rows, vec, blk, nblk, False, 4, NB, EVEN, CACHE, VCACHE)
    elif QTYPE == 13:
        acc = _q45_k(acc, rows, vec, blk, nblk, True, 5, NB, EVEN, CACHE, VCACHE)
    else:
        tl.static_assert(QTYPE == 14, "unsupported block format")
        acc = _q6_k(acc, rows, vec, blk, nblk, NB, EVEN, CACHE, VCACHE)
    return acc
