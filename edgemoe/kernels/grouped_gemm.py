"""Routed experts for prefill on CUDA: one grouped GEMM over every (token, expert) pair instead of a Python loop of
two matmuls per expert. out[t] = sum_k weights[t, k] * w2[e] @ (silu(w13[e, :I] @ x[t]) * w13[e, I:] @ x[t]),
e = ids[t, k]. Its reference is `edgemoe.moe.experts.pair_outputs_reference` (a loop over experts); decode has its
own GEMVs (`edgemoe.kernels.moe_gemv`).

The pairs are sorted by expert on the device (a stable sort, then each expert's first sorted position by a binary
search), and each expert's run of pairs is cut into tiles of BLOCK_M rows. How many tiles there are is known only on
the device, so the grid is a bound that needs no host read: sum_e cdiv(n_e, BLOCK_M) <= cdiv(pairs, BLOCK_M) +
(experts with pairs) <= cdiv(pairs, BLOCK_M) + min(experts, pairs); a program finds its tile's expert in a table
(`tile_expert`, a binary search over the tiles' running count) and exits at once when it lies past the work.

- gate_up, program (tile, column block): BLOCK_M pairs' rows of x gathered by token, times BLOCK_N gate columns and
  the matching up columns of the tile's expert (two fp32 accumulators, `tl.dot`); the epilogue writes
  h = silu(gate) * up [pairs, I] in x's dtype, in sorted order (down reads a tile's rows contiguously); with expert
  biases (gpt-oss) each pair's are added first, by its expert id, and gpt-oss's clamped SwiGLU may replace SiLU
  (moe_gemv's `_glu`).
- down, program (tile, column block): h's tile times BLOCK_N rows of w2 (plus the pair's down bias, if any), scaled
  by each pair's routing weight, into the pair's own row of y [pairs, H] (original pair order).

Then each token's top_k rows of y are summed in fp32 in pair order (`edgemoe.moe.experts.sum_pairs`): no atomics
anywhere, so results
are bitwise the same run to run. Each expert's pairs form the same tiles whichever bank rows they are read from and
whichever other pairs the launch computes, so offloaded prefill (`OffloadedExperts`, experts made resident in waves,
read from their slots) is bitwise the resident result. A pair whose row is -1 is skipped (its row of y is left as
it was): how a wave leaves other waves' pairs alone.

Blocks follow from the dtype alone (no autotuning, nothing specialised on the token count), so one compile serves
every prompt length: the engine's warm-up compiles it. `benchmarks/grouped_gemm.py` times it against the loop.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from edgemoe.kernels.moe_gemv import ACTS, _glu, _plus_down_bias, bias_args
from edgemoe.kernels.protocol import PairBiases


@triton.jit
def _gate_up(
    x, order, tile_expert, tile_first, starts, w13, h, bank_of, b13, bias_ids,
    n_rows, H, inter, top_k, stride_x, stride_e, stride_r,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    STAGES: tl.constexpr, PRECISION: tl.constexpr, MAP: tl.constexpr, ACT: tl.constexpr, BIAS: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    num_n = tl.cdiv(inter, BLOCK_N)
    tile, nb = pid // num_n, pid % num_n  # column blocks fastest: a tile's rows of x stay in L2
    e = tl.load(tile_expert + tile)
    if e >= n_rows:
        return
    w = e
    if MAP:  # the row's expert is read from bank row bank_of[e] (-1: not in this launch)
        w = tl.load(bank_of + e)
        if w < 0:
            return
    row0 = tl.load(starts + e) + (tile - tl.load(tile_first + e)) * BLOCK_M
    m = row0 + tl.arange(0, BLOCK_M)  # [BLOCK_M] sorted positions
    in_tile = m < tl.load(starts + e + 1)
    pair = tl.load(order + m, mask=in_tile, other=0)
    tok = pair // top_k
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    cols = n < inter
    a_ptr = x + tok.to(tl.int64)[:, None] * stride_x + k[None, :]  # [BLOCK_M, BLOCK_K]
    g_ptr = w13 + w.to(tl.int64) * stride_e + n[None, :] * stride_r + k[:, None]  # [BLOCK_K, BLOCK_N]
    u_ptr = g_ptr + inter * stride_r
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(0, H, BLOCK_K, num_stages=STAGES):
        if EVEN_K:
            a = tl.load(a_ptr + k0, mask=in_tile[:, None], other=0.0)
            bmask = cols[None, :]
        else:
            ks = k0 + k < H
            a = tl.load(a_ptr + k0, mask=in_tile[:, None] & ks[None, :], other=0.0)
            bmask = ks[:, None] & cols[None, :]
        acc_g = tl.dot(a, tl.load(g_ptr + k0, mask=bmask, other=0.0), acc_g, input_precision=PRECISION)
        acc_u = tl.dot(a, tl.load(u_ptr + k0, mask=bmask, other=0.0), acc_u, input_precision=PRECISION)
    mask = in_tile[:, None] & cols[None, :]
    out = _glu(acc_g, acc_u, b13, bias_ids, pair[:, None], n[None, :], inter, mask, ACT, BIAS)
    h_ptr = h + m.to(tl.int64)[:, None] * inter + n[None, :]
    tl.store(h_ptr, out.to(h.dtype.element_ty), mask=mask)


@triton.jit
def _down(
    h, order, weights, tile_expert, tile_first, starts, w2, y, bank_of, b2, bias_ids,
    n_rows, H, inter, stride_e, stride_r, stride_y,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    STAGES: tl.constexpr, PRECISION: tl.constexpr, MAP: tl.constexpr, BIAS: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    num_n = tl.cdiv(H, BLOCK_N)
    tile, nb = pid // num_n, pid % num_n
    e = tl.load(tile_expert + tile)
    if e >= n_rows:
        return
    w = e
    if MAP:
        w = tl.load(bank_of + e)
        if w < 0:
            return
    row0 = tl.load(starts + e) + (tile - tl.load(tile_first + e)) * BLOCK_M
    m = row0 + tl.arange(0, BLOCK_M)
    in_tile = m < tl.load(starts + e + 1)
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    cols = n < H
    a_ptr = h + m.to(tl.int64)[:, None] * inter + k[None, :]  # [BLOCK_M, BLOCK_K]
    b_ptr = w2 + w.to(tl.int64) * stride_e + n[None, :] * stride_r + k[:, None]  # [BLOCK_K, BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(0, inter, BLOCK_K, num_stages=STAGES):
        if EVEN_K:
            a = tl.load(a_ptr + k0, mask=in_tile[:, None], other=0.0)
            bmask = cols[None, :]
        else:
            ks = k0 + k < inter
            a = tl.load(a_ptr + k0, mask=in_tile[:, None] & ks[None, :], other=0.0)
            bmask = ks[:, None] & cols[None, :]
        acc = tl.dot(a, tl.load(b_ptr + k0, mask=bmask, other=0.0), acc, input_precision=PRECISION)
    pair = tl.load(order + m, mask=in_tile, other=0)
    wk = tl.load(weights + pair, mask=in_tile, other=0.0).to(tl.float32)
    acc = _plus_down_bias(acc, b2, bias_ids, pair, n, H, in_tile, BIAS)
    y_ptr = y + pair.to(tl.int64)[:, None] * stride_y + n[None, :]
    tl.store(y_ptr, (acc * wk[:, None]).to(y.dtype.element_ty), mask=in_tile[:, None] & cols[None, :])


@dataclass(frozen=True)
class Blocks:
    """Pairs per tile (both kernels), columns and reduction step of each kernel, warps and loop steps in flight."""

    m: int
    up_n: int
    up_k: int
    down_n: int
    down_k: int
    warps: int = 4
    stages: int = 3


@functools.cache
def pick_blocks(dtype: torch.dtype) -> Blocks:
    """64-pair tiles (one Hopper warpgroup MMA tall); gate_up 64 columns of gate and of up (two accumulators), down
    128 columns; 64-wide reduction steps, 3 in flight (fp32: 2, twice the bytes per stage)."""
    return Blocks(m=64, up_n=64, up_k=64, down_n=128, down_k=64, stages=2 if dtype == torch.float32 else 3)


def schedule(rows: torch.Tensor, n_rows: int, block_m: int) -> tuple[torch.Tensor, ...]:
    """rows: [pairs] bank row per pair (-1: skip) -> order [pairs] (pair indices by row, stable), starts [n_rows + 1]
    (each row's first sorted position; the last: the end of the work), tile_expert [bound] (n_rows past the work),
    tile_first [n_rows] (each row's first tile). Device ops only: no host synchronisation."""
    device, pairs = rows.device, rows.numel()
    key = torch.where(rows < 0, n_rows, rows)  # skipped pairs sort last, past every row's run
    sorted_key, order = torch.sort(key, stable=True)
    starts = torch.searchsorted(sorted_key, torch.arange(n_rows + 1, device=device))
    tiles = (starts[1:] - starts[:-1] + block_m - 1) // block_m  # [n_rows]
    tile_end = tiles.cumsum(0)
    bound = triton.cdiv(pairs, block_m) + min(n_rows, pairs)
    tile_expert = torch.searchsorted(tile_end, torch.arange(bound, device=device), right=True)
    return order, starts, tile_expert, tile_end - tiles


def pair_outputs(
    x: torch.Tensor,
    rows: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    out: torch.Tensor | None = None,
    blocks: Blocks | None = None,
    plan: tuple[torch.Tensor, ...] | None = None,
    bank_of: torch.Tensor | None = None,
    bias: PairBiases | None = None,
    act: str = "silu",
) -> torch.Tensor:
    """x: [T, H]; rows: [T * K] the bank row of each pair (token t = pair // K; -1: skipped); weights: [T * K];
    w13: [N, 2I, H] (gate rows, then up rows); w2: [N, H, I] -> out [T * K, H] in x's dtype: each computed pair's
    expert output times its weight (skipped pairs' rows untouched; a fresh `out` leaves them uninitialised). The banks
    may be any [N, ...] views contiguous in their last dim (a slot pool's). `plan`, `bank_of`: `rows` index experts
    [0, R) whose weights lie at bank rows bank_of [R] (-1: the expert's pairs are skipped), scheduled once by `plan`
    (`schedule(rows, R, blocks.m)`), so that several launches over other banks reuse one schedule (quantized
    prefill's waves). `bias`, `act`: the pairs' expert biases and the gated activation, as
    `edgemoe.kernels.moe_gemv.fused_experts`' (a pair's bias is read by its expert id, whatever its row)."""
    (T, H), P, (N, two_i, _) = x.shape, rows.numel(), w13.shape
    inter, K = two_i // 2, P // max(T, 1)
    assert w13.shape[2] == H and w2.shape[1:] == (H, inter) and w13.stride(2) == 1 and w2.stride(2) == 1
    assert P == T * K and x.dtype == w13.dtype == w2.dtype
    if out is None:
        out = torch.empty(P, H, dtype=x.dtype, device=x.device)
    assert out.shape == (P, H) and out.stride(1) == 1
    if P == 0:
        return out
    b = blocks or pick_blocks(x.dtype)
    x, weights = x if x.stride(1) == 1 else x.contiguous(), weights.contiguous()
    order, starts, tile_expert, tile_first = plan or schedule(rows.flatten(), N, b.m)
    R = N if bank_of is None else bank_of.numel()
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # fp32 as torch's matmul computes it (no TF32)
    h = torch.empty(P, inter, dtype=x.dtype, device=x.device)  # [pairs, I] in sorted order
    tiles, mapped = tile_expert.numel(), bank_of if bank_of is not None else rows
    b13, bias_ids = bias_args(bias, rows)
    b2 = rows if bias is None else bias.down
    _gate_up[(tiles * triton.cdiv(inter, b.up_n),)](
        x, order, tile_expert, tile_first, starts, w13, h, mapped, b13, bias_ids, R, H, inter, K, x.stride(0),
        w13.stride(0), w13.stride(1), b.m, b.up_n, b.up_k, H % b.up_k == 0, b.stages, precision, bank_of is not None,
        ACTS[act], bias is not None, num_warps=b.warps,
    )  # fmt: skip
    _down[(tiles * triton.cdiv(H, b.down_n),)](
        h, order, weights, tile_expert, tile_first, starts, w2, out, mapped, b2, bias_ids, R, H, inter, w2.stride(0),
        w2.stride(1), out.stride(0), b.m, b.down_n, b.down_k, inter % b.down_k == 0, b.stages, precision,
        bank_of is not None, bias is not None, num_warps=b.warps,
    )  # fmt: skip
    return out


def grouped_gemm(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    blocks: Blocks | None = None,
    bias: PairBiases | None = None,
    act: str = "silu",
) -> torch.Tensor:
    """x: [T, H]; ids, weights: [T, K]; w13: [N, 2I, H]; w2: [N, H, I] -> [T, H] in x's dtype (`prefill_reference`'
    signature; `act` in place of its `glu`)."""
    y = pair_outputs(x, ids.flatten(), weights.flatten(), w13, w2, blocks=blocks, bias=bias, act=act)
    return y.view(-1, ids.shape[1], y.shape[-1]).sum(dim=1, dtype=torch.float32).to(y.dtype)  # as `sum_pairs`
