"""Routed experts for decode on CUDA, reading each chosen expert in place (by id) from the expert bank or the offload
slot pool: out[t] = sum_k weights[t, k] * w2[e] @ (silu(w13[e, :I] @ x[t]) * w13[e, I:] @ x[t]), e = ids[t, k].
Its reference is `edgemoe.moe.experts.gathered_experts`, which copies every chosen expert first. Two GEMV kernels,
fp32 accumulation:

- up, program (pair, row block): BLOCK_N gate rows and the matching up rows of the pair's expert over all of H,
  then h = silu(gate) * up -> [pairs, I] in x's dtype (the reference rounds it there too; down re-reads h for
  every row block, so half the bytes of fp32).
- down, program (token, row block): BLOCK_N rows of w2 of all the token's top_k experts (a [top_k, BLOCK_N,
  BLOCK_K] tile per step) over all of I, then the weighted sum over k in registers: deterministic, no atomics.

Offloaded experts (given the miss copy's `Arrivals`): up does not wait for the copy kernel before it. Each program
finds its pair's slot in the copy list and, only if the slot is being filled, waits until that entry's counter says
all its rows arrived (an acquire, so the weight loads that follow see them). Hits, and each miss as soon as its rows
are in, compute while the rest of the list still crosses PCIe. Launched behind the copy with PDL, up's programs
share the SMs with the copy's (both grids resident: a dependent grid starts only once every program of the copy
has started, so the waits cannot block the copy). Without the predecessor's wait nothing promises that an SM's L1
is clean, so up reads its inputs and weights at L2 (`.cg`), and so does down for w2 (the copy wrote it; down's wait
is for up). Every entry has a pair waiting on it, so by the time up has finished the whole list has arrived.
When the copy engine does the copy (`edgemoe.offload.copy_service`) there is no copy grid: in a captured step `ensure`
posts the list itself and up follows it directly, so up waits for `ensure` (`Arrivals.after_ensure`) before it
reads the slots, then for its entries as above.

Pairs computed on the CPU (`cpu_out`; their id is -1: `edgemoe.offload.cpu_split`) read no weights: up leaves them
out and down takes their fp32 outputs from `cpu_out` (at L2) in place of its own, then weights and sums all pairs in k
order as always. In a captured step the copy service fills `cpu_out` while the kernels run: a down program whose
token has a CPU pair acquires the service's flag (`CpuWait`) after its own pairs' sums, before it reads those rows.

Grids and blocks follow from shapes alone (no autotuning), and nothing syncs with the host: CUDA-graph capturable
once compiled. `benchmarks/moe_gemv.py` times it against `gathered_experts` and sweeps the block sizes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from edgemoe.kernels.pdl import launch_args, wait_for_inputs
from edgemoe.kernels.protocol import Arrivals, CpuWait, PairBiases


@triton.jit
def _await_rows(slot, dst, count, arrived, M, CHUNKS: tl.constexpr, BLOCK_M: tl.constexpr):
    """If `slot` is in the copy list (dst[:count]), wait until its entry's CHUNKS work items are stored."""
    r = tl.arange(0, BLOCK_M)
    listed = tl.load(dst + r, mask=r < M, other=-1, cache_modifier=".cg")
    n = tl.load(count, cache_modifier=".cg")
    entry = tl.min(tl.where((listed == slot) & (r < n), r, BLOCK_M), 0)
    if entry < BLOCK_M:
        # one thread's acquire (an acquire load: the add of 0 writes nothing), handed to the others through the
        # program's barrier: every thread's weight loads come after the rows' stores
        while tl.atomic_add(arrived + entry, 0, sem="acquire", scope="gpu") < CHUNKS:
            pass


@triton.jit
def _with_cpu_rows(yk, on_cpu, pair, n, H, cpu_out, cpu_done, cpu_seq, CPU_WAIT: tl.constexpr):
    """A down program's pair outputs yk [BLOCK_P, BLOCK_N] with the rows of the pairs computed on the CPU (`on_cpu`
    [BLOCK_P]) taken from cpu_out [pairs, H] fp32 instead; with CPU_WAIT (a captured step, `CpuWait`) first waiting
    until the copy service has put them in and written the flag, if the token has any. Shared with quant_gemv."""
    if CPU_WAIT:
        if tl.sum(on_cpu.to(tl.int32), 0) > 0:
            want = tl.load(cpu_seq, cache_modifier=".cg")
            while tl.atomic_add(cpu_done, 0, sem="acquire", scope="gpu") < want:
                pass
    from_cpu = on_cpu[:, None] & (n < H)[None, :]
    rows = tl.load(cpu_out + pair[:, None].to(tl.int64) * H + n[None, :], mask=from_cpu, cache_modifier=".cg")
    return tl.where(from_cpu, rows, yk)


ACTS = {"silu": 0, "swiglu_oai": 1}  # the gated activations the expert kernels compute (`edgemoe.layers.mlp.GLUS`)


@triton.jit
def _glu(gate, up, b13, bias_ids, pair, n, inter, mask, ACT: tl.constexpr, BIAS: tl.constexpr):
    """A pair's gate and up rows n (fp32 sums) -> the down projection's input, fp32: first the pair's expert biases
    (b13 [experts, 2I], the expert bias_ids[pair]) where BIAS, then SiLU(gate) * up (ACT 0) or gpt-oss's clamped
    SwiGLU (ACT 1: `edgemoe.layers.mlp.swiglu_oai`). `pair` and `mask` are scalars or shaped like n's rows (the
    grouped GEMM's tiles). Shared with quant_gemv and grouped_gemm."""
    if BIAS:
        e = tl.load(bias_ids + pair).to(tl.int64)
        gate += tl.load(b13 + e * 2 * inter + n, mask=mask, other=0.0).to(tl.float32)
        up += tl.load(b13 + e * 2 * inter + inter + n, mask=mask, other=0.0).to(tl.float32)
    if ACT == 1:
        gate = tl.minimum(gate, 7.0)
        up = tl.minimum(tl.maximum(up, -7.0), 7.0)
        return (up + 1.0) * (gate * tl.sigmoid(gate * 1.702))
    return gate * tl.sigmoid(gate) * up


@triton.jit
def _plus_down_bias(y, b2, bias_ids, pair, n, H, mask, BIAS: tl.constexpr):
    """Pair outputs y [P, BLOCK_N] (pairs `pair` [P], rows n [BLOCK_N]) plus their experts' down biases (b2 [experts,
    H]) where BIAS."""
    if BIAS:
        e = tl.load(bias_ids + pair, mask=mask, other=0).to(tl.int64)
        y += tl.load(b2 + e[:, None] * H + n[None, :], mask=mask[:, None] & (n < H)[None, :], other=0.0).to(tl.float32)
    return y


@triton.jit
def _up(
    x,
    ids,
    w13,
    h,
    b13,
    bias_ids,
    dst,
    count,
    arrived,
    H,
    inter,
    top_k,
    stride_x,
    stride_e,
    stride_r,
    M,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    STAGES: tl.constexpr,
    STREAMED: tl.constexpr,
    AFTER_ENSURE: tl.constexpr,
    CHUNKS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CACHE: tl.constexpr,
    PDL: tl.constexpr,
    CPU: tl.constexpr,
    ACT: tl.constexpr,
    BIAS: tl.constexpr,
):
    pair = tl.program_id(0)
    if STREAMED:  # no wait for the copy kernel: only for this pair's rows, if they are in its list
        if AFTER_ENSURE:  # no copy kernel: the kernel before wrote the slots (and posted the list)
            wait_for_inputs(PDL)
        elif PDL:
            gdc_launch_dependents()
        expert = tl.load(ids + pair, cache_modifier=".cg").to(tl.int64)
        _await_rows(expert, dst, count, arrived, M, CHUNKS, BLOCK_M)
    else:
        wait_for_inputs(PDL)
        expert = tl.load(ids + pair).to(tl.int64)  # int64: slot * stride overflows int32 for real pools
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] rows of gate; up's are inter rows further
    k = tl.arange(0, BLOCK_K)
    if CPU:  # a pair computed on the CPU (slot -1): no rows to read, its h is unused
        rows = n < tl.where(expert >= 0, inter, 0)
    else:
        rows = n < inter
    gate_ptr = w13 + expert * stride_e + n[:, None] * stride_r + k[None, :]  # [BLOCK_N, BLOCK_K]
    up_ptr = gate_ptr + inter * stride_r
    x_ptr = x + (pair // top_k).to(tl.int64) * stride_x + k
    acc_gate = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)  # reduced once after the loop
    acc_up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in tl.range(0, H, BLOCK_K, num_stages=STAGES):  # STAGES > 1: the next steps' loads in flight
        if EVEN_K:
            xk = tl.load(x_ptr + k0, cache_modifier=CACHE)
            mask = rows[:, None]
        else:
            cols = k0 + k < H
            xk = tl.load(x_ptr + k0, mask=cols, other=0.0, cache_modifier=CACHE)
            mask = rows[:, None] & cols[None, :]
        xk = xk.to(tl.float32)[None, :]
        acc_gate += tl.load(gate_ptr + k0, mask=mask, other=0.0, cache_modifier=CACHE).to(tl.float32) * xk
        acc_up += tl.load(up_ptr + k0, mask=mask, other=0.0, cache_modifier=CACHE).to(tl.float32) * xk
    gate = tl.sum(acc_gate, axis=1)
    up = tl.sum(acc_up, axis=1)
    y = _glu(gate, up, b13, bias_ids, pair, n, inter, rows, ACT, BIAS)
    tl.store(h + pair * inter + n, y.to(h.dtype.element_ty), mask=rows)


@triton.jit
def _down(
    h,
    ids,
    weights,
    w2,
    out,
    b2,
    bias_ids,
    cpu_out,
    cpu_done,
    cpu_seq,
    H,
    inter,
    top_k,
    stride_o,
    stride_e,
    stride_r,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    STAGES: tl.constexpr,
    CACHE: tl.constexpr,
    PDL: tl.constexpr,
    CPU: tl.constexpr,
    CPU_WAIT: tl.constexpr,
    BIAS: tl.constexpr,
):
    wait_for_inputs(PDL)
    t = tl.program_id(0)
    p = tl.arange(0, BLOCK_P)  # the token's pairs (top_k padded to a power of two)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output rows
    k = tl.arange(0, BLOCK_K)
    pairs = p < top_k
    pair = t * top_k + p
    expert = tl.load(ids + pair, mask=pairs, other=0).to(tl.int64)  # [BLOCK_P]
    if CPU:  # pairs computed on the CPU (id -1) read no weights: their outputs come from cpu_out
        pairs_here = pairs & (expert >= 0)
    else:
        pairs_here = pairs
    rows = pairs_here[:, None, None] & (n < H)[None, :, None]
    w_ptr = w2 + expert[:, None, None] * stride_e + n[None, :, None] * stride_r + k[None, None, :]
    h_ptr = h + pair[:, None] * inter + k[None, :]  # [BLOCK_P, BLOCK_K]
    acc = tl.zeros([BLOCK_P, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in tl.range(0, inter, BLOCK_K, num_stages=STAGES):
        if EVEN_K:
            hk = tl.load(h_ptr + k0, mask=pairs[:, None], other=0.0)
            mask = rows
        else:
            cols = k0 + k < inter
            hk = tl.load(h_ptr + k0, mask=pairs[:, None] & cols[None, :], other=0.0)
            mask = rows & cols[None, None, :]
        w = tl.load(w_ptr + k0, mask=mask, other=0.0, cache_modifier=CACHE)
        acc += w.to(tl.float32) * hk.to(tl.float32)[:, None, :]
    wk = tl.load(weights + pair, mask=pairs, other=0.0).to(tl.float32)  # [BLOCK_P]
    yk = _plus_down_bias(tl.sum(acc, axis=2), b2, bias_ids, pair, n, H, pairs, BIAS)  # [BLOCK_P, BLOCK_N]
    if CPU:
        yk = _with_cpu_rows(yk, pairs & (expert < 0), pair, n, H, cpu_out, cpu_done, cpu_seq, CPU_WAIT)
    y = tl.sum(yk * wk[:, None], axis=0)  # [BLOCK_N] in k order
    tl.store(out + t * stride_o + n, y.to(out.dtype.element_ty), mask=n < H)


@dataclass(frozen=True)
class Blocks:
    """Rows per program and columns per step of each kernel, and their warps."""

    up_n: int
    up_k: int
    up_warps: int
    down_n: int
    down_k: int
    down_warps: int
    up_stages: int = 1  # loop steps in flight (software pipelining)
    down_stages: int = 1


@functools.cache
def pick_blocks(hidden: int, inter: int) -> Blocks:
    """Blocks from shapes alone, the best of a sweep at the real geometries (`benchmarks/moe_gemv.py --sweep`;
    docs/findings.md, "Blocks: what lost"): up, 16 rows x 128 columns over 8 warps, 4 loop steps in flight; down,
    one output row per program (many small programs keep loads in flight at one token), longer steps for long
    rows, no pipelining."""
    p2 = triton.next_power_of_2
    down_k = 128 if inter < 4096 else 256
    return Blocks(
        up_n=min(16, p2(inter)),
        up_k=min(128, p2(hidden)),
        up_warps=8,
        down_n=1,
        down_k=min(down_k, p2(inter)),
        down_warps=4,
        up_stages=4,
    )


def fused_experts(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    blocks: Blocks | None = None,
    arrivals: Arrivals | None = None,
    cpu_out: torch.Tensor | None = None,
    cpu_wait: CpuWait | None = None,
    bias: PairBiases | None = None,
    act: str = "silu",
) -> torch.Tensor:
    """x: [T, H]; ids: [T, K] rows of w13/w2 (expert ids, or slots of an offload pool); weights: [T, K] (float32 or
    x's dtype); w13: [N, 2I, H] (gate rows, then up rows); w2: [N, H, I] -> [T, H] in x's dtype. The weight banks
    may be any [N, ...] views contiguous in their last dim. `blocks` is for benchmarks/moe_gemv.py's sweep.
    `bias`: the pairs' expert biases (gpt-oss), added to gate/up before the activation and to each pair's output
    before its weight; `act`: the gated activation, a key of `ACTS`.
    `arrivals`: the miss copy launched just before is filling some of ids' slots; wait for those rows only.
    `cpu_out` [T * K, H] fp32: the outputs of the pairs whose id is -1, computed on the CPU
    (`edgemoe.offload.cpu_split`), weighted and summed over k in the same order as the others. `cpu_wait`: in a
    captured step those rows arrive from the copy service during the kernels; down waits for them (its programs
    whose token has a CPU pair, once their own pairs are summed)."""
    h = up_proj(x, ids, w13, blocks, arrivals, cpu=cpu_out is not None, bias=bias, act=act)
    return down_proj(
        h, ids, weights, w2, blocks, streamed=arrivals is not None, cpu_out=cpu_out, cpu_wait=cpu_wait, bias=bias
    )


def up_proj(
    x: torch.Tensor,
    ids: torch.Tensor,
    w13: torch.Tensor,
    blocks: Blocks | None = None,
    arrivals: Arrivals | None = None,
    cpu: bool = False,
    bias: PairBiases | None = None,
    act: str = "silu",
) -> torch.Tensor:
    """x: [T, H], ids: [T, K], w13: [N, 2I, H] -> h = silu(gate) * up [T * K, I] in x's dtype (`cpu`: ids -1 are
    pairs computed on the CPU, left out; `bias`, `act`: as `fused_experts`')."""
    (T, H), K, inter = x.shape, ids.shape[1], w13.shape[1] // 2
    assert w13.shape[2] == H and w13.stride(2) == 1
    x, ids = x if x.stride(1) == 1 else x.contiguous(), ids.contiguous()
    h = torch.empty(T * K, inter, dtype=x.dtype, device=x.device)  # [pairs, I]
    if T * K:
        b = blocks or pick_blocks(H, inter)
        a = arrivals or Arrivals(ids, ids, ids, 1)  # unread unless streamed
        M = a.dst.numel()
        # pairs on the fastest axis: pairs of one expert (other tokens) read the same rows together, from L2
        b13, bias_ids = bias_args(bias, ids)
        _up[(T * K, triton.cdiv(inter, b.up_n))](
            x, ids, w13, h, b13, bias_ids, a.dst, a.count, a.counters, H, inter, K, x.stride(0), w13.stride(0),
            w13.stride(1), M,
            b.up_n, b.up_k, H % b.up_k == 0, b.up_stages, arrivals is not None, a.after_ensure, a.chunks,
            triton.next_power_of_2(max(M, 1)), _cache(arrivals is not None), CPU=cpu, ACT=ACTS[act],
            BIAS=bias is not None, num_warps=b.up_warps, **launch_args(x.device),
        )  # fmt: skip
    return h


def bias_args(bias: PairBiases | None, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' bias arguments: a bias bank and each pair's expert id (`bias.gate_up` and `bias.experts`), or
    `ids` twice where there are none (unread)."""
    if bias is None:
        return ids, ids
    assert bias.gate_up.is_contiguous() and bias.down.is_contiguous() and bias.experts.numel() == ids.numel()
    return bias.gate_up, bias.experts.contiguous()


def _cache(streamed: bool) -> str:
    """The cache modifier of the weight (and up's input) loads: L2 only when streamed (see the module docstring)."""
    return ".cg" if streamed else ""


def down_proj(
    h: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w2: torch.Tensor,
    blocks: Blocks | None = None,
    streamed: bool = False,
    cpu_out: torch.Tensor | None = None,
    cpu_wait: CpuWait | None = None,
    bias: PairBiases | None = None,
) -> torch.Tensor:
    """h: [T * K, I] from `up_proj`, ids and weights: [T, K], w2: [N, H, I] -> [T, H] in h's dtype. `streamed`:
    up waited for the miss copy's rows, not for the copy kernel (read w2 at L2). `cpu_out`, `cpu_wait`, `bias`: as
    `fused_experts`'."""
    (T, K), H, inter = ids.shape, w2.shape[1], w2.shape[2]
    assert h.shape == (T * K, inter) and h.is_contiguous() and w2.stride(2) == 1
    ids, weights = ids.contiguous(), weights.contiguous()
    out = torch.empty(T, H, dtype=h.dtype, device=h.device)
    if T:
        b = blocks or pick_blocks(H, inter)
        if cpu_out is not None:
            assert cpu_out.shape == (T * K, H) and cpu_out.dtype == torch.float32 and cpu_out.is_contiguous()
        flag, seq = (ids, ids) if cpu_wait is None else (cpu_wait.done, cpu_wait.seq)  # unread without a wait
        b2, bias_ids = (ids, ids) if bias is None else (bias.down, bias_args(bias, ids)[1])
        _down[(T, triton.cdiv(H, b.down_n))](  # likewise tokens first
            h, ids, weights, w2, out, b2, bias_ids, h if cpu_out is None else cpu_out, flag, seq, H, inter, K,
            out.stride(0), w2.stride(0), w2.stride(1), triton.next_power_of_2(K), b.down_n, b.down_k,
            inter % b.down_k == 0, b.down_stages, _cache(streamed), CPU=cpu_out is not None,
            CPU_WAIT=cpu_wait is not None, BIAS=bias is not None, num_warps=b.down_warps, **launch_args(h.device),
        )  # fmt: skip
    return out
