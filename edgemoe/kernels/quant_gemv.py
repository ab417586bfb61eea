"""Routed experts for decode on CUDA with the experts' weights in GGUF block formats (`edgemoe.quant`), read
in place from the expert bank or the slot pool: out[t] = sum_k weights[t, k] * W2[e] @ (silu(W1[e] @ x[t]) *
W3[e] @ x[t]), e = ids[t, k]. gate_up (W1 rows, then W3 rows: [2I, H]) and down ([H, I]) are raw blocks, uint8
[N, 2I, row_bytes(q_gate_up, H)] and [N, H, row_bytes(q_down, I)]; the two may differ in format (Q4_K_M files
mix Q4_K and Q6_K). The programs are `edgemoe.kernels.moe_gemv`'s, fp32 accumulation, h rounded to x's dtype:

- up, program (pair, row block): up_n gate rows and the matching up rows, one [2, up_n] tile of rows, over all H.
- down, program (token, row block): down_n rows of w2 of all the token's top_k experts ([top_k, down_n] rows) over
  all I, then the weighted sum over k in registers (no atomics).

Each loop step decodes a whole number of blocks of every row of the tile in registers: the quant bytes as 16- or
32-byte runs of one block ([rows, groups, lanes] tiles), the scales once per group (a sub-block or a block), each
weight dequantized as `quant.dequantize` computes it (up to one FMA's rounding) and multiplied by the input
element it meets (the x or h positions of each nibble are loaded to match the bytes, which are never permuted;
`quant_decode.py`). Rows past the end are clamped, not
masked (the loads stay in the expert's rows; their results are never stored), and blocks past a row's end meet
zeros of x/h, so only the x/h loads carry masks, and only when a row is not a whole number of steps.

Offloaded experts (`Arrivals`): as in moe_gemv, up waits only for its own pair's slot if the miss copy lists it
(moe_gemv's `_await_rows`; the copy moves bytes, indifferent to the format) and reads at L2 when streamed.
Pairs computed on the CPU (`cpu_out`, id -1: `edgemoe.offload.cpu_split`), as in moe_gemv: up reads no blocks for
them, down takes their fp32 outputs from `cpu_out` in place of its own (waiting in a captured step for the copy
service's flag) and weights and sums all pairs in k order as always.
Grids and blocks follow from shapes alone and nothing syncs with the host: CUDA-graph capturable once compiled.
Its reference is `quant_experts_reference` (dequantize the chosen experts, then gathered_experts' math);
`benchmarks/quant_gemv.py` times it against HBM bandwidth.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from edgemoe.kernels.moe_gemv import ACTS, _await_rows, _glu, _plus_down_bias, _with_cpu_rows, bias_args
from edgemoe.kernels.pdl import launch_args, wait_for_inputs
from edgemoe.kernels.protocol import Arrivals, CpuWait, PairBiases
from edgemoe.kernels.quant_decode import ALIGN, GROUPS, decode_step
from edgemoe.quant import QuantLike, QuantType, dequantize, quant_type, row_bytes


@triton.jit
def _up(
    x, ids, w13, h, b13, bias_ids, dst, count, arrived, inter, top_k, nblk, stride_x, stride_e, stride_r, M,
    QTYPE: tl.constexpr, NB: tl.constexpr, G: tl.constexpr, L: tl.constexpr, BLOCK_N: tl.constexpr,
    EVEN: tl.constexpr, STAGES: tl.constexpr, STREAMED: tl.constexpr, AFTER_ENSURE: tl.constexpr,
    CHUNKS: tl.constexpr, BLOCK_M: tl.constexpr, CACHE: tl.constexpr, UNIT: tl.constexpr, PDL: tl.constexpr,
    CPU: tl.constexpr, ACT: tl.constexpr, BIAS: tl.constexpr,
):  # fmt: skip
    pair = tl.program_id(0)
    if STREAMED:  # as moe_gemv's up: no wait for the copy kernel, only for this pair's rows if listed
        if AFTER_ENSURE:
            wait_for_inputs(PDL)
        elif PDL:
            gdc_launch_dependents()
        expert = tl.load(ids + pair, cache_modifier=".cg").to(tl.int64)
        _await_rows(expert, dst, count, arrived, M, CHUNKS, BLOCK_M)
    else:
        wait_for_inputs(PDL)
        expert = tl.load(ids + pair).to(tl.int64)  # int64: slot * stride overflows int32 for real pools
    blocks = nblk
    if CPU:  # a pair computed on the CPU (id -1): no blocks read (its h, zeros, is unused)
        blocks = tl.where(expert >= 0, nblk, 0)
        expert = tl.maximum(expert, 0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] gate rows; up's are inter rows further
    half = tl.arange(0, 2)  # 0: gate, 1: up
    row = half[:, None] * inter + tl.minimum(n, inter - 1)[None, :]  # [2, BLOCK_N], the ragged end clamped
    rows = w13 + (expert * stride_e + row.to(tl.int64) * stride_r) * UNIT  # [2, BLOCK_N] row starts (bytes)
    vec = x + (pair // top_k).to(tl.int64) * stride_x + tl.zeros([1, 1], dtype=tl.int64)  # [1, 1] x's row
    acc = tl.zeros([2, BLOCK_N, G, L], dtype=tl.float32)  # reduced once after the loop
    for blk in tl.range(0, blocks, NB, num_stages=STAGES):
        acc = decode_step(acc, rows, vec, blk, nblk, QTYPE, NB, EVEN, CACHE, CACHE)
    r = tl.sum(tl.sum(acc, axis=3), axis=2)  # [2, BLOCK_N]
    gate = tl.sum(tl.where(half[:, None] == 0, r, 0.0), axis=0)
    up = tl.sum(tl.where(half[:, None] == 1, r, 0.0), axis=0)
    y = _glu(gate, up, b13, bias_ids, pair, n, inter, n < inter, ACT, BIAS)
    tl.store(h + pair * inter + n, y.to(h.dtype.element_ty), mask=n < inter)


@triton.jit
def _down(
    h, ids, weights, w2, out, b2, bias_ids, cpu_out, cpu_done, cpu_seq, H, inter, top_k, nblk, stride_o, stride_e,
    stride_r,
    QTYPE: tl.constexpr, NB: tl.constexpr, G: tl.constexpr, L: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr, EVEN: tl.constexpr, STAGES: tl.constexpr, CACHE: tl.constexpr, UNIT: tl.constexpr,
    PDL: tl.constexpr, CPU: tl.constexpr, CPU_WAIT: tl.constexpr, BIAS: tl.constexpr,
):  # fmt: skip
    wait_for_inputs(PDL)
    t = tl.program_id(0)
    p = tl.arange(0, BLOCK_P)  # the token's pairs (top_k padded to a power of two)
    pairs = p < top_k
    pair = t * top_k + tl.minimum(p, top_k - 1)  # padding repeats the last pair, weighted 0 below
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output rows
    expert = tl.load(ids + pair).to(tl.int64)  # [BLOCK_P]
    if CPU:  # a pair computed on the CPU (id -1) reads expert 0's rows in its place; its output comes from cpu_out
        on_cpu = pairs & (expert < 0)
        expert = tl.maximum(expert, 0)
    row = tl.minimum(n, H - 1)[None, :].to(tl.int64)
    rows = w2 + (expert[:, None] * stride_e + row * stride_r) * UNIT  # [BLOCK_P, BLOCK_N] row starts (bytes)
    vec = h + (pair * inter).to(tl.int64)[:, None]  # [BLOCK_P, 1] each pair's h
    acc = tl.zeros([BLOCK_P, BLOCK_N, G, L], dtype=tl.float32)
    for blk in tl.range(0, nblk, NB, num_stages=STAGES):
        acc = decode_step(acc, rows, vec, blk, nblk, QTYPE, NB, EVEN, CACHE, "")
    wk = tl.load(weights + pair, mask=pairs, other=0.0).to(tl.float32)  # [BLOCK_P]
    r = _plus_down_bias(tl.sum(tl.sum(acc, axis=3), axis=2), b2, bias_ids, pair, n, H, pairs, BIAS)  # [P, BLOCK_N]
    if CPU:
        r = _with_cpu_rows(r, on_cpu, pair, n, H, cpu_out, cpu_done, cpu_seq, CPU_WAIT)
    y = tl.sum(tl.where(pairs[:, None], r * wk[:, None], 0.0), axis=0)  # [BLOCK_N]
    tl.store(out + t * stride_o + n, y.to(out.dtype.element_ty), mask=n < H)


@triton.jit
def _linear(
    x, w, bias, y, N, nblk, stride_x, stride_w, stride_y, QTYPE: tl.constexpr, NB: tl.constexpr, G: tl.constexpr,
    L: tl.constexpr, BLOCK_N: tl.constexpr, EVEN: tl.constexpr, STAGES: tl.constexpr, UNIT: tl.constexpr,
    HAS_BIAS: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """A dense quantized weight's GEMV, program (token, row block): BLOCK_N rows of w [N, row_bytes] against the
    token's x, over all K (`up`'s loop, one [1, BLOCK_N] tile of rows)."""
    wait_for_inputs(PDL)
    T = tl.num_programs(0) // tl.cdiv(N, BLOCK_N)
    # tokens fastest: a row block's programs are neighbours, its blocks read once from HBM (one grid dimension: an
    # lm_head's row blocks outnumber a second dimension's 65,535)
    t, nb = tl.program_id(0) % T, tl.program_id(0) // T
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = w + (tl.minimum(n, N - 1).to(tl.int64) * stride_w * UNIT)[None, :]  # [1, BLOCK_N]
    vec = x + t.to(tl.int64) * stride_x + tl.zeros([1, 1], dtype=tl.int64)
    acc = tl.zeros([1, BLOCK_N, G, L], dtype=tl.float32)
    for blk in tl.range(0, nblk, NB, num_stages=STAGES):
        acc = decode_step(acc, rows, vec, blk, nblk, QTYPE, NB, EVEN, "", "")
    out = tl.sum(tl.sum(tl.sum(acc, axis=3), axis=2), axis=0)  # [BLOCK_N]
    if HAS_BIAS:
        out += tl.load(bias + n, mask=n < N, other=0.0).to(tl.float32)
    tl.store(y + t.to(tl.int64) * stride_y + n, out.to(y.dtype.element_ty), mask=n < N)


@dataclass(frozen=True)
class QuantBlocks:
    """Rows per program, quant blocks per loop step, warps and pipelining of each kernel."""

    up_n: int
    up_blocks: int
    up_warps: int
    down_n: int
    down_blocks: int
    down_warps: int
    up_stages: int = 1
    down_stages: int = 1


def _step_blocks(q: QuantType, n: int, weights: int = 256) -> int:
    """Blocks per step: `weights` of a row (a power of two of blocks), at most the row."""
    return min(max(weights // q.block_weights, 1), triton.next_power_of_2(n // q.block_weights))


@functools.cache
def pick_blocks(qtype_gate_up: QuantType, qtype_down: QuantType, hidden: int, inter: int) -> QuantBlocks:
    """Up's fields depend on gate_up's format only, down's on down's: the shapes `benchmarks/quant_gemv.py --sweep`
    chose at qwen3's shape (up 16 rows over 8 warps, Q8_0's 8 rows over 4 warps and 1,024 weights a step; down on 4
    warps, the K formats 8 rows and two stages, the 32-weight formats 4 rows); formats not swept take the nearest swept
    one's. The figures, and why they are not faster: docs/findings.md, "Quantized expert GEMV"."""
    k_down = qtype_down.name in ("Q4_K", "Q5_K", "Q6_K")
    q8_up = qtype_gate_up.name == "Q8_0"
    return QuantBlocks(
        up_n=min(8 if q8_up else 16, triton.next_power_of_2(inter)),
        up_blocks=_step_blocks(qtype_gate_up, hidden, 1024 if q8_up else 256),
        up_warps=4 if q8_up else 8,
        down_n=min(8 if k_down else 4, triton.next_power_of_2(hidden)),
        down_blocks=_step_blocks(qtype_down, inter),
        down_warps=4,
        down_stages=2 if k_down else 1,
    )


def quant_fused_experts(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    qtype_gate_up: QuantLike,
    qtype_down: QuantLike,
    inter: int,
    hidden: int,
    blocks: QuantBlocks | None = None,
    arrivals: Arrivals | None = None,
    cpu_out: torch.Tensor | None = None,
    cpu_wait: CpuWait | None = None,
    bias: PairBiases | None = None,
    act: str = "silu",
) -> torch.Tensor:
    """x: [T, H] (bf16, fp16 or fp32); ids: [T, K] rows of w13/w2 (expert ids or slots); weights: [T, K]; w13:
    uint8 [N, 2I, row_bytes(qtype_gate_up, H)]; w2: uint8 [N, H, row_bytes(qtype_down, I)] -> [T, H] in x's
    dtype. The banks may be views with any expert stride (a joined row per expert) and any row stride, each row's
    bytes contiguous. `blocks` is for benchmarks; `arrivals`, `cpu_out` (the outputs of pairs of id -1, computed on
    the CPU), `cpu_wait`, `bias` (expert biases) and `act` (the gated activation) as in `moe_gemv.fused_experts`."""
    q13, q2 = quant_type(qtype_gate_up), quant_type(qtype_down)
    b = blocks or pick_blocks(q13, q2, hidden, inter)
    h = quant_up_proj(x, ids, w13, q13, inter, hidden, b, arrivals, cpu=cpu_out is not None, bias=bias, act=act)
    streamed = arrivals is not None
    return quant_down_proj(
        h, ids, weights, w2, q2, inter, hidden, b, streamed, cpu_out=cpu_out, cpu_wait=cpu_wait, bias=bias
    )


def _strides(w: torch.Tensor, rows: int, q: QuantType, n: int) -> tuple[int, int, int]:
    """Checks a bank -> (expert stride, row stride, unit): the strides in units of the largest power of two up to
    16 that divides both and the address. The kernels multiply by the unit in-kernel, so that the compiler sees
    the alignment of the row starts (it assumes 16 of arguments that are multiples of 16, else nothing): Q6_K's
    630-byte rows of qwen3's down are then read two bytes at a time, not one."""
    assert w.dtype == torch.uint8 and w.dim() == 3, "a quantized bank is uint8 [N, rows, row_bytes]"
    assert w.shape[1:] == (rows, row_bytes(q, n)) and w.stride(2) == 1, f"expected [N, {rows}, {row_bytes(q, n)}]"
    unit = 16
    while w.data_ptr() % unit or w.stride(0) % unit or w.stride(1) % unit:
        unit //= 2
    assert unit >= ALIGN[q.name], f"{q.name} blocks must start {ALIGN[q.name]}-aligned (scales load as halves or words)"
    return w.stride(0) // unit, w.stride(1) // unit, unit


def quant_up_proj(
    x: torch.Tensor,
    ids: torch.Tensor,
    w13: torch.Tensor,
    qtype: QuantLike,
    inter: int,
    hidden: int,
    blocks: QuantBlocks | None = None,
    arrivals: Arrivals | None = None,
    cpu: bool = False,
    bias: PairBiases | None = None,
    act: str = "silu",
) -> torch.Tensor:
    """x: [T, H], ids: [T, K], w13: uint8 [N, 2I, row_bytes] -> h = silu(gate) * up [T * K, I] in x's dtype (`cpu`:
    ids -1 are pairs computed on the CPU, left out; `bias`, `act`: as `quant_fused_experts`')."""
    q = quant_type(qtype)
    (T, H), K = x.shape, ids.shape[1]
    assert H == hidden
    stride_e, stride_r, unit = _strides(w13, 2 * inter, q, hidden)
    x, ids = x if x.stride(1) == 1 else x.contiguous(), ids.contiguous()
    h = torch.empty(T * K, inter, dtype=x.dtype, device=x.device)  # [pairs, I]
    if T * K:
        b = blocks or pick_blocks(q, q, hidden, inter)
        a = arrivals or Arrivals(ids, ids, ids, 1)  # unread unless streamed
        M, nblk = a.dst.numel(), hidden // q.block_weights
        groups, lanes = GROUPS[q.name]
        b13, bias_ids = bias_args(bias, ids)
        _up[(T * K, triton.cdiv(inter, b.up_n))](
            x, ids, w13, h, b13, bias_ids, a.dst, a.count, a.counters, inter, K, nblk, x.stride(0), stride_e,
            stride_r, M,
            int(q.ggml_type), b.up_blocks, groups * b.up_blocks, lanes, b.up_n, nblk % b.up_blocks == 0, b.up_stages,
            arrivals is not None, a.after_ensure, a.chunks, triton.next_power_of_2(max(M, 1)),
            ".cg" if arrivals is not None else "", unit, CPU=cpu, ACT=ACTS[act], BIAS=bias is not None,
            num_warps=b.up_warps, **launch_args(x.device),
        )  # fmt: skip
    return h


def quant_down_proj(
    h: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w2: torch.Tensor,
    qtype: QuantLike,
    inter: int,
    hidden: int,
    blocks: QuantBlocks | None = None,
    streamed: bool = False,
    cpu_out: torch.Tensor | None = None,
    cpu_wait: CpuWait | None = None,
    bias: PairBiases | None = None,
) -> torch.Tensor:
    """h: [T * K, I] from `quant_up_proj`, ids and weights: [T, K], w2: uint8 [N, H, row_bytes] -> [T, H] in h's
    dtype. `streamed`: up waited for the miss copy's rows, not for the copy kernel (read w2 at L2). `cpu_out`,
    `cpu_wait`, `bias`: as `quant_fused_experts`'."""
    q = quant_type(qtype)
    T, K = ids.shape
    assert h.shape == (T * K, inter) and h.is_contiguous()
    stride_e, stride_r, unit = _strides(w2, hidden, q, inter)
    ids, weights = ids.contiguous(), weights.contiguous()
    out = torch.empty(T, hidden, dtype=h.dtype, device=h.device)
    if T:
        b = blocks or pick_blocks(q, q, hidden, inter)
        nblk = inter // q.block_weights
        groups, lanes = GROUPS[q.name]
        if cpu_out is not None:
            assert cpu_out.shape == (T * K, hidden) and cpu_out.dtype == torch.float32 and cpu_out.is_contiguous()
        flag, seq = (ids, ids) if cpu_wait is None else (cpu_wait.done, cpu_wait.seq)  # unread without a wait
        b2, bias_ids = (ids, ids) if bias is None else (bias.down, bias_args(bias, ids)[1])
        _down[(T, triton.cdiv(hidden, b.down_n))](
            h, ids, weights, w2, out, b2, bias_ids, h if cpu_out is None else cpu_out, flag, seq, hidden, inter, K,
            nblk,
            out.stride(0), stride_e, stride_r, int(q.ggml_type), b.down_blocks, groups * b.down_blocks, lanes,
            triton.next_power_of_2(K), b.down_n, nblk % b.down_blocks == 0, b.down_stages, ".cg" if streamed else "",
            unit, CPU=cpu_out is not None, CPU_WAIT=cpu_wait is not None, BIAS=bias is not None,
            num_warps=b.down_warps, **launch_args(h.device),
        )  # fmt: skip
    return out


def quant_experts_reference(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    qtype_gate_up: QuantLike,
    qtype_down: QuantLike,
    inter: int,
    hidden: int,
) -> torch.Tensor:
    """`quant_fused_experts` in plain torch: the chosen experts dequantized (`quant.dequantize`, float32),
    then `gathered_experts`' math in float32 with h rounded to x's dtype, as the kernels round it."""
    tokens, top_k = ids.shape
    flat = ids.flatten()
    g13 = dequantize(w13[flat], qtype_gate_up, hidden)  # [pairs, 2I, H]
    g2 = dequantize(w2[flat], qtype_down, inter)  # [pairs, H, I]
    xs = x.float().repeat_interleave(top_k, dim=0)[:, :, None]  # [pairs, H, 1]
    gate, up = torch.bmm(g13, xs)[:, :, 0].chunk(2, dim=-1)  # [pairs, I] each
    h = (F.silu(gate) * up).to(x.dtype).float()[:, :, None]
    out = torch.bmm(g2, h)[:, :, 0].view(tokens, top_k, -1)  # [tokens, top_k, H]
    return (out * weights.float()[:, :, None]).sum(dim=1).to(x.dtype)


def quant_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    qtype: QuantLike,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    tile: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Decode's dense projection on GGUF blocks: x [T, K] @ dequant(w).T (+ bias) -> [T, N] in x's dtype (or into
    `out`, any [T, N] view with unit column stride: a part of a fused projection's output); w uint8 [N, row_bytes].
    Each token's row is computed by its own programs alike whatever T (batch-invariant); graph-capturable. Blocks:
    `pick_blocks`' up kernel's, its [2, up_n] rows as one tile of 2 up_n, fewer for short weights (`linear_rows`);
    `tile` (rows a program, warps) is for benchmarks."""
    q = quant_type(qtype)
    (T, K), N = x.shape, w.shape[0]
    assert w.dtype == torch.uint8 and w.dim() == 2 and w.shape[1] == row_bytes(q, K) and w.stride(1) == 1
    out = torch.empty(T, N, dtype=x.dtype, device=x.device) if out is None else out
    assert out.shape == (T, N) and out.stride(1) == 1
    if T == 0:
        return out
    b = pick_blocks(q, q, K, N)
    (_, stride_w, unit), nblk = _strides(w[None], N, q, K), K // q.block_weights
    groups, lanes = GROUPS[q.name]
    block_n, warps = tile or linear_rows(N, 2 * b.up_n, b.up_warps)
    x = x if x.stride(1) == 1 else x.contiguous()
    _linear[(T * triton.cdiv(N, block_n),)](
        x, w, x if bias is None else bias, out, N, nblk, x.stride(0), stride_w, out.stride(0), int(q.ggml_type),
        b.up_blocks, groups * b.up_blocks, lanes, block_n, nblk % b.up_blocks == 0, b.up_stages, unit,
        bias is not None, num_warps=warps, **launch_args(x.device),
    )  # fmt: skip
    return out


LINEAR_PROGRAMS = 256  # a GEMV's programs at least, where rows allow (the H100 sweep's best for qkv and o)


def linear_rows(n: int, most: int, warps: int) -> tuple[int, int]:
    """(rows a program, warps) of `quant_linear` over n rows: `most` (the up kernel's tile) where that still makes
    LINEAR_PROGRAMS programs, else fewer rows (at least 2): a short projection at `most` rows has too few programs,
    each a long serial loop (docs/findings.md, "Quantized dense weights")."""
    rows = most
    while rows > 2 and n // rows < LINEAR_PROGRAMS:
        rows //= 2
    return rows, warps
