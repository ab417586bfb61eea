"""GGUF block formats of routed experts, in plain torch: the bytes of each row kept as the file stores them (blocks of
weights sharing a scale), and their dequantization, bitwise as the `gguf` package's numpy code gives it.

A row of n weights is n / block_weights blocks of block_bytes each, back to back; every tensor of blocks here is
uint8 [..., row_bytes]. Layouts of one block (little-endian; "f16" an IEEE half, sub-blocks of 32 weights):

- Q4_0 (32 in 18 B): f16 d, 16 B of nibbles; byte j holds weight j (low nibble) and j + 16 (high). w = d (q - 8).
- Q4_1 (32 in 20 B): f16 d, f16 m, Q4_0's nibbles. w = d q + m.
- Q5_0 (32 in 22 B): f16 d, 4 B of fifth bits (a little-endian uint32: bit j belongs to weight j), Q4_0's nibbles.
  w = d (q - 16).
- Q5_1 (32 in 24 B): f16 d, f16 m, Q5_0's fifth bits and nibbles. w = d q + m.
- Q8_0 (32 in 34 B): f16 d, 32 int8 q. w = d q.
- MXFP4 (32 in 17 B): E8M0 exponent e, nibbles as Q4_0 of E2M1 values (sign, 2-bit exponent, 1-bit mantissa).
  w = 2^(e - 127) e2m1(q), computed as gguf does: the table of doubled E2M1 values times 2^(e - 128).
- Q4_K (256 in 144 B): f16 d, f16 dmin, 12 B of 6-bit scales and mins of the 8 sub-blocks, 128 B of nibbles: byte
  32 g + l holds weight 64 g + l (sub-block 2 g, low nibble) and 64 g + 32 + l (sub-block 2 g + 1, high).
  w = (d sc_j) q - (dmin m_j).
- Q5_K (256 in 176 B): Q4_K's header, 32 B of fifth bits (bit j of byte l: weight l of sub-block j), Q4_K's nibbles.
- Q6_K (256 in 210 B): 128 B of low nibbles, 64 B of high bit pairs, 16 int8 scales (one per 16 weights), f16 d.
  Weight 128 h + 32 c + l (h < 2, c < 4, l < 32): low nibble of byte 64 h + 32 (c % 2) + l (the high nibble for
  c >= 2), high bits (byte 128 + 32 h + l) >> 2 c. w = (d sc) (q - 32).

The Triton decode kernels (`edgemoe.kernels.quant_gemv`) read the same bytes; `dequantize` is their reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class QuantType:
    """One GGUF block format: `block_weights` weights stored in `block_bytes` bytes. `ggml_type` is its
    `gguf.GGMLQuantizationType` value (an IntEnum: the two compare equal)."""

    name: str
    ggml_type: int
    block_weights: int
    block_bytes: int


# name -> GGML type id, weights and bytes per block: gguf's GGMLQuantizationType and GGML_QUANT_SIZES (the tests
# compare them), written out so that the decode path needs no gguf (the GPU machines' image lacks it)
_FORMATS = {"Q4_0": (2, 32, 18), "Q8_0": (8, 32, 34), "Q4_K": (12, 256, 144), "Q5_K": (13, 256, 176),
            "Q6_K": (14, 256, 210), "MXFP4": (39, 32, 17), "Q4_1": (3, 32, 20), "Q5_0": (6, 32, 22),
            "Q5_1": (7, 32, 24)}  # fmt: skip
QUANT_TYPES: dict[str, QuantType] = {name: QuantType(name, *spec) for name, spec in _FORMATS.items()}
Q4_0, Q8_0, Q4_K, Q5_K, Q6_K, MXFP4, Q4_1, Q5_0, Q5_1 = QUANT_TYPES.values()
# the types gguf has a quantizer for (the K types have only dequantizers there)
QUANTIZABLE = (Q4_0, Q8_0, MXFP4, Q4_1, Q5_0, Q5_1)
# E2M1 values doubled, indexed by the nibble (sign bit 3), as gguf's table (its -0 entry is +0)
_E2M1_DOUBLED = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
QuantLike = QuantType | int | str  # a format, its GGML type (a gguf.GGMLQuantizationType or its id) or its name


def quant_type(qtype: QuantLike) -> QuantType:
    """The supported format named by a QuantType, a GGML type (gguf's enum or its id) or a name ("Q4_K");
    ValueError otherwise."""
    if isinstance(qtype, QuantType):
        return qtype
    by_id = {q.ggml_type: q for q in QUANT_TYPES.values()}
    if isinstance(qtype, int) and qtype in by_id:
        return by_id[qtype]
    name = getattr(qtype, "name", str(qtype).upper())
    if isinstance(qtype, int) or name not in QUANT_TYPES:
        raise ValueError(f"unsupported block format {name!r} (supported: {', '.join(QUANT_TYPES)})")
    return QUANT_TYPES[name]


def row_bytes(qtype: QuantLike, n: int) -> int:
    """Bytes of one row of `n` weights; `n` must be a whole number of blocks."""
    q = quant_type(qtype)
    if n <= 0 or n % q.block_weights:
        raise ValueError(f"a {q.name} row holds a positive multiple of {q.block_weights} weights, not {n}")
    return n // q.block_weights * q.block_bytes


def _blocks(raw: torch.Tensor, q: QuantType, n: int) -> torch.Tensor:
    """raw [..., row_bytes] -> [..., blocks, block_bytes] (checked)."""
    if raw.dtype != torch.uint8 or raw.shape[-1:] != (row_bytes(q, n),):
        raise ValueError(f"expected uint8 [..., {row_bytes(q, n)}] for {n} {q.name} weights, got {raw.dtype} "
                         f"{tuple(raw.shape)}")  # fmt: skip
    return raw.reshape(*raw.shape[:-1], n // q.block_weights, q.block_bytes)


def _f16(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Two uint8 tensors (a half's little-endian bytes) -> float32."""
    bits = lo.to(torch.int32) | (hi.to(torch.int32) << 8)
    return (bits - ((bits & 0x8000) << 1)).to(torch.int16).view(torch.float16).float()  # bits as signed int16


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """uint8 [..., m] -> [..., 2, m]: the low nibbles, then the high ones."""
    return torch.stack([qs & 15, qs >> 4], dim=-2)


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12 scale bytes of Q4_K / Q5_K [..., 12] -> 6-bit scales and mins [..., 8] (int32). Sub-blocks 0-3 keep
    theirs in the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); 4-7 have their low 4 bits in bytes 8-11 (scale
    low nibble, min high nibble) and their top 2 in the spare top bits of bytes 0-3 and 4-7."""
    s = s.to(torch.int32)
    a, b, c = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([a & 63, (c & 15) | ((a >> 6) << 4)], dim=-1)
    m = torch.cat([b & 63, (c >> 4) | ((b >> 6) << 4)], dim=-1)
    return sc, m


def _pack_k_scales(sc: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """`_k_scales`'s inverse: 6-bit scales and mins [..., 8] -> the 12 bytes [..., 12] (uint8)."""
    hi_sc, hi_m = sc[..., 4:], m[..., 4:]
    packed = [
        (sc[..., :4] & 63) | ((hi_sc >> 4) << 6),
        (m[..., :4] & 63) | ((hi_m >> 4) << 6),
        (hi_sc & 15) | ((hi_m & 15) << 4),
    ]
    return torch.cat(packed, dim=-1).to(torch.uint8)


def _q4_0(b: torch.Tensor) -> torch.Tensor:  # [..., blocks, 18] -> [..., blocks, 32]
    d = _f16(b[..., 0], b[..., 1])
    q = _nibbles(b[..., 2:]).flatten(-2).to(torch.int32) - 8
    return d[..., None] * q.float()


def _q4_1(b: torch.Tensor) -> torch.Tensor:  # [..., blocks, 20] -> [..., blocks, 32]
    d, m = _f16(b[..., 0], b[..., 1]), _f16(b[..., 2], b[..., 3])
    return d[..., None] * _nibbles(b[..., 4:]).flatten(-2).float() + m[..., None]  # two roundings, as gguf's


def _q5(b: torch.Tensor) -> torch.Tensor:
    """Q5_0 / Q5_1's 5-bit quants [..., blocks, 32] (int32) from the fifth bits' 4 bytes and the nibbles after them."""
    qh = b[..., :4].to(torch.int64)
    bits = qh[..., 0] | (qh[..., 1] << 8) | (qh[..., 2] << 16) | (qh[..., 3] << 24)  # [..., blocks]
    fifth = (bits[..., None] >> torch.arange(32, device=b.device)) & 1  # [..., blocks, 32]
    return (_nibbles(b[..., 4:]).flatten(-2).to(torch.int64) | (fifth << 4)).to(torch.int32)


def _q5_0(b: torch.Tensor) -> torch.Tensor:  # [..., blocks, 22] -> [..., blocks, 32]
    return _f16(b[..., 0], b[..., 1])[..., None] * (_q5(b[..., 2:]) - 16).float()


def _q5_1(b: torch.Tensor) -> torch.Tensor:  # [..., blocks, 24] -> [..., blocks, 32]
    d, m = _f16(b[..., 0], b[..., 1]), _f16(b[..., 2], b[..., 3])
    return d[..., None] * _q5(b[..., 4:]).float() + m[..., None]


def _q8_0(b: torch.Tensor) -> torch.Tensor:  # [..., blocks, 34] -> [..., blocks, 32]
    return _f16(b[..., 0], b[..., 1])[..., None] * b[..., 2:].view(torch.int8).float()


def _mxfp4(b: torch.Tensor) -> torch.Tensor:  # [..., blocks, 17] -> [..., blocks, 32]
    e = b[..., 0].to(torch.int32)
    # 2^(e - 128) (half the E8M0 scale, the table being doubled); e < 2 is a subnormal float32
    bits = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23)
    return bits.view(torch.float32)[..., None] * _e2m1_doubled(_nibbles(b[..., 1:]).flatten(-2))


def _e2m1_doubled(q: torch.Tensor) -> torch.Tensor:
    """E2M1 codes -> `_E2M1_DOUBLED`'s values (float32), computed rather than looked up: a table made on the device at
    each call would be a host-to-device copy, which a CUDA graph capture refuses (the plain-torch decode of MXFP4
    experts runs inside one for gpt-oss)."""
    i = (q & 7).to(torch.int32)  # magnitudes 0 1 2 3 4 6 8 12: (2 | odd) << (i / 2 - 1) from i = 2
    mag = torch.where(i < 2, i, (2 + (i & 1)) << ((i >> 1) - 1).clamp(min=0))
    return torch.where(q >= 8, -mag, mag).float()  # an integer -0 is 0: gguf's -0 entry is +0 too


def _q4_k_like(b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Q4_K and Q5_K given the quants q [..., blocks, 8, 32]: (d sc) q - (dmin m), in that order (bitwise gguf)."""
    d, dmin = _f16(b[..., 0], b[..., 1]), _f16(b[..., 2], b[..., 3])  # [..., blocks]
    sc, m = _k_scales(b[..., 4:16])  # [..., blocks, 8]
    ds = (d[..., None] * sc.float())[..., None]  # [..., blocks, 8, 1]
    dm = (dmin[..., None] * m.float())[..., None]
    return (ds * q.float() - dm).flatten(-2)


def _q4_k(b: torch.Tensor) -> torch.Tensor:  # [..., blocks, 144] -> [..., blocks, 256]
    qs = b[..., 16:].unflatten(-1, (4, 32))  # [..., blocks, 4, 32]: sub-blocks 2g (low) and 2g + 1 (high)
    return _q4_k_like(b, _nibbles(qs).flatten(-3, -2))


def _q5_k(b: torch.Tensor) -> torch.Tensor:  # [..., blocks, 176] -> [..., blocks, 256]
    qh = b[..., 16:48].to(torch.int32)  # [..., blocks, 32]
    low = _nibbles(b[..., 48:].unflatten(-1, (4, 32))).flatten(-3, -2).to(torch.int32)  # [..., blocks, 8, 32]
    shift = torch.arange(8, device=b.device)[:, None]  # sub-block j's fifth bit is bit j
    return _q4_k_like(b, low | (((qh[..., None, :] >> shift) & 1) << 4))


def _q6_k(b: torch.Tensor) -> torch.Tensor:  # [..., blocks, 210] -> [..., blocks, 256]
    ql = _nibbles(b[..., :128].unflatten(-1, (2, 64)))  # [..., blocks, h, nibble, 64]: c = 2 nibble + l // 32
    shift = 2 * torch.arange(4, device=b.device)[:, None]
    qh = (b[..., 128:192].unflatten(-1, (2, 1, 32)).to(torch.int32) >> shift) & 3  # [..., blocks, h, c, 32]
    q = (ql.flatten(-3).to(torch.int32) | (qh.flatten(-3) << 4)) - 32  # [..., blocks, 256]
    ds = _f16(b[..., 208], b[..., 209])[..., None] * b[..., 192:208].view(torch.int8).float()  # [..., blocks, 16]
    return (ds[..., None] * q.unflatten(-1, (16, 16)).float()).flatten(-2)


_DEQUANTIZE = {"Q4_0": _q4_0, "Q8_0": _q8_0, "MXFP4": _mxfp4, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k,
               "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1}  # fmt: skip


def dequantize(raw: torch.Tensor, qtype: QuantLike, n: int) -> torch.Tensor:
    """raw: uint8 [..., row_bytes(qtype, n)] -> float32 [..., n], on raw's device, bitwise `gguf.quants.dequantize`."""
    q = quant_type(qtype)
    return _DEQUANTIZE[q.name](_blocks(raw, q, n)).flatten(-2)


def mxfp4_from_packed(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 as the OCP layout packs it (the gpt-oss checkpoints' `*_blocks` and `*_scales`) -> rows of MXFP4 blocks
    (above), bytes moved and nothing rounded: packed uint8 [..., blocks, 16], byte j holding weights 2j (low nibble)
    and 2j + 1 (high), the same E2M1 codes; scales uint8 [..., blocks], the same E8M0 exponents -> uint8
    [..., blocks * 17]."""
    codes = torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2)  # [..., blocks, 32] in weight order
    nibbles = codes[..., :16] | (codes[..., 16:] << 4)  # byte j: weight j (low), weight j + 16 (high)
    return torch.cat((scales[..., None], nibbles), dim=-1).flatten(-2)


def quantize(w: torch.Tensor, qtype: QuantLike) -> torch.Tensor:
    """w: [..., n] (any float dtype) -> uint8 [..., row_bytes(qtype, n)] on w's device, by gguf's own quantizer (in
    numpy on the CPU: for loading, not for the decode path). Not the K types: gguf has no quantizer for them
    (`random_blocks` makes valid ones)."""
    q = quant_type(qtype)
    if q not in QUANTIZABLE:
        names = ", ".join(t.name for t in QUANTIZABLE)
        raise NotImplementedError(f"gguf has no {q.name} quantizer (quantizable: {names})")
    row_bytes(q, w.shape[-1])  # checks n
    import gguf  # a dependency, but only loading needs it

    out = gguf.quants.quantize(w.detach().to("cpu", torch.float32).numpy(), gguf.GGMLQuantizationType(q.ggml_type))
    return torch.from_numpy(np.ascontiguousarray(out)).to(w.device)


def _f16_bytes(v: torch.Tensor) -> torch.Tensor:
    """float [...] -> its IEEE half's bytes, uint8 [..., 2]."""
    return v.to(torch.float16)[..., None].contiguous().view(torch.uint8)


def random_blocks(
    shape: tuple[int, ...] | torch.Size,
    qtype: QuantLike,
    generator: torch.Generator | None = None,
    std: float = 0.02,
) -> torch.Tensor:
    """Valid random blocks for weights of `shape` [..., n]: uint8 [..., row_bytes(qtype, n)] on the CPU. Every quant
    bit is random (uniform bytes); scales are finite, positive (Q4_0's either sign; Q6_K's int8 scales any value),
    drawn so that the dequantized weights have a standard deviation of about `std` (within a factor of ~2), and
    the K types' mins roughly centre each sub-block on zero. For tests and random checkpoints."""
    q = quant_type(qtype)
    *lead, n = shape
    blocks = (*lead, row_bytes(q, n) // q.block_bytes)
    g = generator

    def uniform(*size: int) -> torch.Tensor:  # in [0.5, 1.5): scales vary by block
        return 0.5 + torch.rand(*blocks, *size, generator=g)

    def randbytes(*size: int) -> torch.Tensor:
        return torch.randint(0, 256, (*blocks, *size), generator=g, dtype=torch.uint8)

    if q.name in ("Q8_0", "Q4_0"):
        qstd = 73.9 if q.name == "Q8_0" else 4.61  # of uniform int8, of uniform q - 8
        d = std / qstd * uniform()
        if q.name == "Q4_0":  # gguf's quantizer stores d = max / -8: either sign
            d = torch.where(torch.rand(*blocks, generator=g) < 0.5, -d, d)
        parts = [_f16_bytes(d), randbytes(q.block_bytes - 2)]
    elif q.name in ("Q4_1", "Q5_0", "Q5_1"):  # q uniform in [0, 2^b): std 0.29 2^b; Q5_0 centred, Q4_1/Q5_1 by m
        levels = 16 if q.name == "Q4_1" else 32
        d = std / (0.29 * levels) * uniform()
        scale = [_f16_bytes(d)] if q.name == "Q5_0" else [_f16_bytes(d), _f16_bytes(-d * (levels - 1) / 2)]
        parts = [*scale, randbytes(q.block_bytes - 2 * len(scale))]
    elif q.name == "MXFP4":  # 5.85: the RMS of E2M1 (doubled) values
        e = 128 + round(math.log2(std / 5.85)) + torch.randint(-1, 2, blocks, generator=g)
        parts = [e.clamp(2, 254).to(torch.uint8)[..., None], randbytes(16)]
    elif q.name in ("Q4_K", "Q5_K"):
        qmax = 15 if q.name == "Q4_K" else 31
        d = std / (36.4 * qmax * 0.29) * uniform()  # 36.4: RMS of a 6-bit scale; 0.29 qmax: the std of uniform q
        sc = torch.randint(1, 64, (*blocks, 8), generator=g)
        m = (sc + torch.randint(-3, 4, sc.shape, generator=g)).clamp(0, 63)  # dmin m ~ d sc qmax / 2
        dmin = d * qmax / 2
        fifth = [randbytes(32)] if q.name == "Q5_K" else []
        parts = [_f16_bytes(d), _f16_bytes(dmin), _pack_k_scales(sc, m), *fifth, randbytes(128)]
    else:  # Q6_K: 73.9 the RMS of a random int8 scale, 18.5 the std of uniform q - 32
        d = std / (73.9 * 18.5) * uniform()
        parts = [randbytes(192), randbytes(16), _f16_bytes(d)]
    raw = torch.cat(parts, dim=-1)  # [..., blocks, block_bytes]
    assert raw.shape[-1] == q.block_bytes
    return raw.flatten(-2)
