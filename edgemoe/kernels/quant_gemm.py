"""Matrix products whose weights stay in GGUF block formats, dequantized tile by tile in registers and multiplied on
the tensor cores (`edgemoe.kernels.quant_tiles`), never written out dequantized:

- `quant_pair_outputs` / `quant_grouped_gemm`: prefill's routed experts, the grouped GEMM of
  `edgemoe.kernels.grouped_gemm` (same schedule: pairs sorted by expert on the device, tiles of BLOCK_M pairs, no host
  sync, no atomics) over quantized banks. Each expert's pairs form the same tiles whichever rows they are read from
  and whichever other pairs the launch computes, so offloaded prefill (waves, streamed layers) is bitwise resident.
- `quant_matmul`: y = x @ dequant(W).T (+ bias) for a dense quantized weight [N, row_bytes] (attention, shared
  experts, lm_head of a GGUF file): tiles of BLOCK_M tokens by BLOCK_N rows; at few tokens (decode) the weights are
  the MMA's tall side (`W_IS_A`) and the tokens are padded to 16. Each token's row is computed alike whatever the
  other rows (the MMA's sums do not mix rows), so decode stays batch-invariant.

References: `quant_experts_reference`-style plain torch (`layers/quant.dequantize`, then the float matmul).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from edgemoe.kernels.grouped_gemm import schedule, sum_pairs
from edgemoe.kernels.quant_decode import ALIGN
from edgemoe.kernels.quant_tiles import dot_unit, units
from edgemoe.layers.quant import QuantLike, QuantType, quant_type, row_bytes


@triton.jit
def _gate_up(
    x, order, tile_expert, tile_first, starts, w13, h, n_rows, H, inter, top_k, stride_x, stride_e, stride_r,
    n_units, nblk, QTYPE: tl.constexpr, EVEN: tl.constexpr, UNIT: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, STAGES: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    num_n = tl.cdiv(inter, BLOCK_N)
    tile, nb = pid // num_n, pid % num_n  # column blocks fastest: a tile's rows of x stay in L2
    e = tl.load(tile_expert + tile)
    if e >= n_rows:
        return
    row0 = tl.load(starts + e) + (tile - tl.load(tile_first + e)) * BLOCK_M
    m = row0 + tl.arange(0, BLOCK_M)  # [BLOCK_M] sorted positions
    in_tile = m < tl.load(starts + e + 1)
    tok = tl.load(order + m, mask=in_tile, other=0) // top_k
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(n, inter - 1).to(tl.int64)  # the ragged end clamped (never stored)
    g_rows = w13 + (e.to(tl.int64) * stride_e + rows * stride_r) * UNIT  # [BLOCK_N] byte pointers
    u_rows = g_rows + inter * stride_r * UNIT
    a_rows = x + tok.to(tl.int64)[:, None] * stride_x  # [BLOCK_M, 1]
    a_ok = in_tile[:, None]
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for u in tl.range(0, n_units, num_stages=STAGES):
        acc_g = dot_unit(acc_g, a_rows, a_ok, g_rows, u, nblk, H, QTYPE, EVEN, False, PRECISION)
        acc_u = dot_unit(acc_u, a_rows, a_ok, u_rows, u, nblk, H, QTYPE, EVEN, False, PRECISION)
    out = acc_g * tl.sigmoid(acc_g) * acc_u
    h_ptr = h + m.to(tl.int64)[:, None] * inter + n[None, :]
    tl.store(h_ptr, out.to(h.dtype.element_ty), mask=in_tile[:, None] & (n < inter)[None, :])


@triton.jit
def _down(
    h, order, weights, tile_expert, tile_first, starts, w2, y, n_rows, H, inter, stride_e, stride_r, stride_y,
    n_units, nblk, QTYPE: tl.constexpr, EVEN: tl.constexpr, UNIT: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, STAGES: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    num_n = tl.cdiv(H, BLOCK_N)
    tile, nb = pid // num_n, pid % num_n
    e = tl.load(tile_expert + tile)
    if e >= n_rows:
        return
    row0 = tl.load(starts + e) + (tile - tl.load(tile_first + e)) * BLOCK_M
    m = row0 + tl.arange(0, BLOCK_M)
    in_tile = m < tl.load(starts + e + 1)
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(n, H - 1).to(tl.int64)
    w_rows = w2 + (e.to(tl.int64) * stride_e + rows * stride_r) * UNIT
    a_rows = h + m.to(tl.int64)[:, None] * inter
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for u in tl.range(0, n_units, num_stages=STAGES):
        acc = dot_unit(acc, a_rows, in_tile[:, None], w_rows, u, nblk, inter, QTYPE, EVEN, False, PRECISION)
    pair = tl.load(order + m, mask=in_tile, other=0)
    wk = tl.load(weights + pair, mask=in_tile, other=0.0).to(tl.float32)
    y_ptr = y + pair.to(tl.int64)[:, None] * stride_y + n[None, :]
    tl.store(y_ptr, (acc * wk[:, None]).to(y.dtype.element_ty), mask=in_tile[:, None] & (n < H)[None, :])


@triton.jit
def _matmul(
    x, w, bias, y, M, N, K, stride_x, stride_w, stride_y, n_units, nblk, QTYPE: tl.constexpr, EVEN: tl.constexpr,
    UNIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, W_IS_A: tl.constexpr, HAS_BIAS: tl.constexpr,
    STAGES: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    nb, mb = pid // num_m, pid % num_m  # token blocks fastest: a weight tile is read once from HBM
    m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = w + tl.minimum(n, N - 1).to(tl.int64) * stride_w * UNIT
    a_rows = x + tl.minimum(m, M - 1).to(tl.int64)[:, None] * stride_x
    a_ok = (m < M)[:, None]
    if W_IS_A:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for u in tl.range(0, n_units, num_stages=STAGES):
        acc = dot_unit(acc, a_rows, a_ok, w_rows, u, nblk, K, QTYPE, EVEN, W_IS_A, PRECISION)
    if W_IS_A:
        acc = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
    if HAS_BIAS:
        acc += tl.load(bias + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
    y_ptr = y + m.to(tl.int64)[:, None] * stride_y + n[None, :]
    tl.store(y_ptr, acc.to(y.dtype.element_ty), mask=(m < M)[:, None] & (n < N)[None, :])


@triton.jit
def _up_pairs(
    x, ids, w13, h, H, inter, top_k, stride_x, stride_e, stride_r, n_units, nblk, QTYPE: tl.constexpr,
    EVEN: tl.constexpr, UNIT: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Decode's gate_up, program (pair, row block): the pair's x as row 0 of a 16-row MMA operand (rows 1-15 masked,
    never read), BLOCK_N gate rows and the matching up rows of its expert as the tall side."""
    pair = tl.program_id(0)
    expert = tl.load(ids + pair).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(n, inter - 1).to(tl.int64)
    g_rows = w13 + (expert * stride_e + rows * stride_r) * UNIT
    u_rows = g_rows + inter * stride_r * UNIT
    m = tl.arange(0, 16)
    a_rows = x + (pair // top_k).to(tl.int64) * stride_x + tl.zeros([16, 1], dtype=tl.int64)
    a_ok = (m == 0)[:, None]
    acc_g = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    for u in tl.range(0, n_units, num_stages=STAGES):
        acc_g = dot_unit(acc_g, a_rows, a_ok, g_rows, u, nblk, H, QTYPE, EVEN, True, PRECISION)
        acc_u = dot_unit(acc_u, a_rows, a_ok, u_rows, u, nblk, H, QTYPE, EVEN, True, PRECISION)
    gate = tl.sum(tl.where(m[None, :] == 0, acc_g, 0.0), axis=1)  # [BLOCK_N]: column 0
    up = tl.sum(tl.where(m[None, :] == 0, acc_u, 0.0), axis=1)
    tl.store(h + pair * inter + n, (gate * tl.sigmoid(gate) * up).to(h.dtype.element_ty), mask=n < inter)


@triton.jit
def _down_pairs(
    h, ids, weights, w2, out, H, inter, top_k, stride_o, stride_e, stride_r, n_units, nblk, QTYPE: tl.constexpr,
    EVEN: tl.constexpr, UNIT: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Decode's down, program (token, row block): each of the token's pairs in k order (its h as row 0 of the MMA
    operand), weighted and summed in registers."""
    t = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(n, H - 1).to(tl.int64)
    m = tl.arange(0, 16)
    a_ok = (m == 0)[:, None]
    y = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k in range(top_k):
        pair = t * top_k + k
        expert = tl.load(ids + pair).to(tl.int64)
        w_rows = w2 + (expert * stride_e + rows * stride_r) * UNIT
        a_rows = h + pair.to(tl.int64) * inter + tl.zeros([16, 1], dtype=tl.int64)
        acc = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
        for u in tl.range(0, n_units, num_stages=STAGES):
            acc = dot_unit(acc, a_rows, a_ok, w_rows, u, nblk, inter, QTYPE, EVEN, True, PRECISION)
        y += tl.load(weights + pair).to(tl.float32) * tl.sum(tl.where(m[None, :] == 0, acc, 0.0), axis=1)
    tl.store(out + t * stride_o + n, y.to(out.dtype.element_ty), mask=n < H)


@dataclass(frozen=True)
class QuantTiles:
    """Tile shapes of the quantized matrix kernels: pairs or tokens per tile, weight rows per tile, warps, stages."""

    m: int = 64
    n: int = 64
    warps: int = 8
    stages: int = 2


DECODE_TILES = QuantTiles(m=16, n=64, warps=4)


@functools.cache
def pick_tiles(tokens: int) -> QuantTiles:
    """Prefill tiles: 64 x 64 over 8 warps (as the bf16 grouped GEMM's; on 4 warps the two accumulators and a
    dequantized tile take ~240 registers: sm_90 offline compile); at most 16 tokens (decode, an agent's short turn)
    the weights are the tall side: 16 tokens by 64 rows, 4 warps."""
    return DECODE_TILES if tokens <= 16 else QuantTiles()


def _unit_strides(w: torch.Tensor, q: QuantType) -> tuple[int, ...]:
    """(stride in units..., unit): the bank's strides in the largest power of two up to 16 dividing them and its
    address, so that the compiler sees the rows' alignment (the K formats' scales load as words)."""
    unit = 16
    while w.data_ptr() % unit or any(s % unit for s in w.stride()[:-1]):
        unit //= 2
    if unit < ALIGN[q.name]:
        raise ValueError(f"{q.name} rows must start {ALIGN[q.name]}-byte aligned (its scales load as halves or words)")
    return (*(s // unit for s in w.stride()[:-1]), unit)


def _precision(x: torch.Tensor) -> str:
    return "ieee" if x.dtype == torch.float32 else "tf32"  # fp32 as torch computes it; ignored for 16-bit inputs


def quant_pair_outputs(
    x: torch.Tensor,
    rows: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    q13: QuantLike,
    q2: QuantLike,
    out: torch.Tensor | None = None,
    tiles: QuantTiles | None = None,
) -> torch.Tensor:
    """`grouped_gemm.pair_outputs` over quantized banks: x [T, H]; rows [T * K] (-1: skipped); weights [T * K];
    w13 uint8 [N, 2I, row_bytes(q13, H)]; w2 uint8 [N, H, row_bytes(q2, I)] -> out [T * K, H] in x's dtype."""
    q13, q2 = quant_type(q13), quant_type(q2)
    (T, H), P, N = x.shape, rows.numel(), w13.shape[0]
    inter, K = w13.shape[1] // 2, P // max(T, 1)
    assert w13.shape[2] == row_bytes(q13, H) and w2.shape[1:] == (H, row_bytes(q2, inter)) and P == T * K
    assert w13.dtype == w2.dtype == torch.uint8 and w13.stride(2) == 1 and w2.stride(2) == 1
    out = torch.empty(P, H, dtype=x.dtype, device=x.device) if out is None else out
    assert out.shape == (P, H) and out.stride(1) == 1
    if P == 0:
        return out
    t = tiles or QuantTiles()
    x, weights = x if x.stride(1) == 1 else x.contiguous(), weights.contiguous()
    order, starts, tile_expert, tile_first = schedule(rows.flatten(), N, t.m)
    h = torch.empty(P, inter, dtype=x.dtype, device=x.device)  # [pairs, I] in sorted order
    tiles_n, prec = tile_expert.numel(), _precision(x)
    *s13, u13 = _unit_strides(w13, q13)
    n_units, even = units(q13.name, H)
    _gate_up[(tiles_n * triton.cdiv(inter, t.n),)](
        x, order, tile_expert, tile_first, starts, w13, h, N, H, inter, K, x.stride(0), s13[0], s13[1], n_units,
        H // q13.block_weights, q13.ggml_type, even, u13, t.m, t.n, t.stages, prec, num_warps=t.warps,
    )  # fmt: skip
    *s2, u2 = _unit_strides(w2, q2)
    n_units, even = units(q2.name, inter)
    _down[(tiles_n * triton.cdiv(H, t.n),)](
        h, order, weights, tile_expert, tile_first, starts, w2, out, N, H, inter, s2[0], s2[1], out.stride(0),
        n_units, inter // q2.block_weights, q2.ggml_type, even, u2, t.m, t.n, t.stages, prec, num_warps=t.warps,
    )  # fmt: skip
    return out


def quant_grouped_gemm(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, q13: QuantLike,
    q2: QuantLike,
) -> torch.Tensor:  # fmt: skip
    """x: [T, H]; ids, weights: [T, K] -> [T, H]: every pair's expert output, each token's K summed in fp32."""
    y = quant_pair_outputs(x, ids.flatten(), weights.flatten(), w13, w2, q13, q2)
    return sum_pairs(y, ids.shape[1])


def quant_matmul(
    x: torch.Tensor,
    w: torch.Tensor,
    qtype: QuantLike,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    tiles: QuantTiles | None = None,
) -> torch.Tensor:
    """x [M, K] @ dequant(w).T (+ bias) -> [M, N] in x's dtype (or into `out`, any [M, N] view with unit column
    stride: a slice of a wider output); w uint8 [N, row_bytes(qtype, K)], rows contiguous."""
    q = quant_type(qtype)
    (M, K), N = x.shape, w.shape[0]
    assert w.dtype == torch.uint8 and w.dim() == 2 and w.shape[1] == row_bytes(q, K) and w.stride(1) == 1
    out = torch.empty(M, N, dtype=x.dtype, device=x.device) if out is None else out
    assert out.shape == (M, N) and out.stride(1) == 1
    if M == 0:
        return out
    t = tiles or pick_tiles(M)
    x = x if x.stride(1) == 1 else x.contiguous()
    (stride_w, unit), (n_units, even) = _unit_strides(w, q), units(q.name, K)
    grid = (triton.cdiv(M, t.m) * triton.cdiv(N, t.n),)
    _matmul[grid](
        x, w, bias if bias is not None else x, out, M, N, K, x.stride(0), stride_w, out.stride(0), n_units,
        K // q.block_weights, q.ggml_type, even, unit, t.m, t.n, t.m <= 16, bias is not None, t.stages, _precision(x),
        num_warps=t.warps,
    )  # fmt: skip
    return out


def quant_decode_experts(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    q13: QuantLike,
    q2: QuantLike,
    tiles: QuantTiles = DECODE_TILES,
) -> torch.Tensor:
    """Decode's routed experts on the tensor cores: x [T, H], ids and weights [T, K], banks as `quant_pair_outputs`'
    -> [T, H] (`quant_gemv.quant_fused_experts`' math: fp32 sums, h rounded to x's dtype)."""
    q13, q2 = quant_type(q13), quant_type(q2)
    (T, H), K = x.shape, ids.shape[1]
    inter = w13.shape[1] // 2
    x, ids, weights = x.contiguous(), ids.contiguous(), weights.contiguous()
    h = torch.empty(T * K, inter, dtype=x.dtype, device=x.device)
    out = torch.empty(T, H, dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    prec = _precision(x)
    *s13, u13 = _unit_strides(w13, q13)
    n_units, even = units(q13.name, H)
    _up_pairs[(T * K, triton.cdiv(inter, tiles.n))](
        x, ids, w13, h, H, inter, K, x.stride(0), s13[0], s13[1], n_units, H // q13.block_weights, q13.ggml_type,
        even, u13, tiles.n, tiles.stages, prec, num_warps=tiles.warps,
    )  # fmt: skip
    *s2, u2 = _unit_strides(w2, q2)
    n_units, even = units(q2.name, inter)
    _down_pairs[(T, triton.cdiv(H, tiles.n))](
        h, ids, weights, w2, out, H, inter, K, out.stride(0), s2[0], s2[1], n_units, inter // q2.block_weights,
        q2.ggml_type, even, u2, tiles.n, tiles.stages, prec, num_warps=tiles.warps,
    )  # fmt: skip
    return out
