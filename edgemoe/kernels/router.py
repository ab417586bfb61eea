"""The MoE router of decode as two Triton launches on CUDA, where torch runs ~6 small kernels (gate GEMV, softmax,
top-k, renormalisation, cast, padding-row substitution). Its reference is `edgemoe.moe.router.route` applied to
`F.linear(x, gate_weight)`, followed by `SparseMoE._routed`'s substitution for CUDA-graph padding rows (rows with
`valid` False take row 0's ids and keep their own weights).

- `gate_logits`, the gate GEMV: a program per (token, block of BLOCK_E experts), so that many SMs share the reading
  of the gate (timed in benchmarks/router.py). x @ gate_weight.T over [BLOCK_E, BLOCK_H] tiles with fp32
  accumulation (one tile holds the block's rows where H allows: all its loads in flight at once), rounded to x's
  dtype as `self.gate(x)` returns it, into a logits buffer.
- `route_logits`, the routing: one program per token on those logits, in torch's order of operations:
  - softmax in fp32, in the order of torch's CUDA softmax for E <= 1024 (PersistentSoftmax.cuh: each of
    min(E', 32) lanes sums the elements lane, lane + 32, ... in turn from 0, then a butterfly over the lanes;
    E' = next_power_of_2(E)), with libdevice's expf and IEEE division as nvcc compiles `::exp` and `/` there
    (Triton's libdevice flushes subnormal results: probabilities below 2^-126 read 0 where torch keeps them).
  - top-k by k rounds of (max, lowest expert holding it): descending, ties to the lower expert id. torch.topk
    leaves the order of ties unspecified (on the CPU, heap / introselect orders differ from that).
  - optional renormalisation: the k weights summed in order from 0, IEEE division; cast to x's dtype.
  - a padding row routes row 0's logits for its ids (the same logits row 0 routes: the same ids).

`grouped_route` is GLM-4.5's (DeepSeek-V3's) routing, `edgemoe.moe.router.route_grouped`, in the same two launches:
the gate GEMV in fp32 (its weight is kept fp32), then a program per token: sigmoid scores (libdevice expf, IEEE
division), plus the correction bias to choose; with group limits each group's worth is its two best biased scores
and the `topk_group` best groups (ties to the lower group) stay; the top k biased scores (ties to the lower expert);
their plain scores summed in order, divided by the sum + 1e-20 where normalised, times the scaling factor, cast to
x's dtype.

`fused_route` is the two in turn. `norm_route` also takes the block's residual add and RMSNorm into the gate GEMV
(decode's MoE layers: one launch fewer a layer; each gate program normalises its token's row). No host sync and
only torch.empty outputs: CUDA-graph capturable once compiled. Under Triton's interpreter (CPU tests) exp is numpy's
and bf16 casts are rounded by hand.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from edgemoe.kernels.norm_rope import _inv_rms, _norm_warps, _normalize, _round
from edgemoe.kernels.pdl import launch_args, wait_for_inputs

_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
TILE = 8192  # gate elements a GEMV program holds at once: 32 fp32 accumulators a thread at 8 warps
MIN_PROGRAMS = 64  # GEMV programs per token wanted, where the experts allow: the gate's reading spread over SMs
MAX_EXPERTS = 1024  # torch's warp softmax, whose summation order the routing follows, covers E <= 1024
MAX_NORM_HIDDEN = TILE  # norm_route normalises a row in one tile


@triton.jit
def _exp(x, INTERPRETED: tl.constexpr):
    if INTERPRETED:  # no libdevice in the interpreter
        y = tl.exp(x)
    else:
        y = libdevice.exp(x)  # expf, as torch's CUDA softmax; tl.exp is ex2.approx
    return y


@triton.jit
def _softmax(logits, BLOCK_E: tl.constexpr, WARP: tl.constexpr, LOG_WARP: tl.constexpr, INTERPRETED: tl.constexpr):
    """fp32 logits [BLOCK_E] (-inf past E) -> probabilities, rounded as torch's CUDA warp softmax rounds them.
    WARP = min(BLOCK_E, 32) lanes, LOG_WARP = log2(WARP)."""
    ex = _exp(logits - tl.max(logits, 0), INTERPRETED)  # 0 past E, as torch's -inf padding
    lanes = tl.reshape(ex, [BLOCK_E // WARP, WARP])  # [iterations, lanes]: element it * WARP + lane
    it = tl.arange(0, BLOCK_E // WARP)[:, None]
    s = tl.zeros([WARP], tl.float32)
    for i in tl.static_range(BLOCK_E // WARP):  # each lane adds its elements in turn; one nonzero term each: exact
        s += tl.sum(tl.where(it == i, lanes, 0.0), 0)
    for i in tl.static_range(LOG_WARP):  # butterfly: lane l + lane l ^ WARP/2, then ^ WARP/4, ...
        s = tl.sum(tl.reshape(s, [2, WARP >> (i + 1)]), 0)  # v[:n] + v[n:], one add per pair
    return tl.div_rn(ex, tl.sum(s, 0))


@triton.jit
def _top_k(probs, e, K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_E: tl.constexpr):
    """The K largest probs [BLOCK_E] (< 0 past E) in decreasing order, ties to the lower expert
    -> (ids [K_PAD], values [K_PAD], their sum in order)."""
    j = tl.arange(0, K_PAD)
    ids = tl.zeros([K_PAD], tl.int32)
    values = tl.zeros([K_PAD], tl.float32)
    total = tl.zeros([], tl.float32)
    for i in tl.static_range(K):
        top = tl.max(probs, 0)
        at = tl.min(tl.where(probs == top, e, BLOCK_E), 0)  # ties explicit, not left to tl.argmax
        ids = tl.where(j == i, at, ids)
        values = tl.where(j == i, top, values)
        total += top
        probs = tl.where(e == at, float("-inf"), probs)
    return ids, values, total


@triton.jit
def _gate_gemv(x, w, out, res, norm_w, xn_out, h_out, H, E, stride_x, stride_w, stride_r, inv_dim, eps,
               BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, EVEN_H: tl.constexpr, NORM: tl.constexpr,
               X_TY: tl.constexpr, L_TY: tl.constexpr, INTERPRETED: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    in_e = e < E
    h = tl.arange(0, BLOCK_H)
    w_ptr = w + e[:, None].to(tl.int64) * stride_w + h[None, :]  # [BLOCK_E, BLOCK_H]
    x_ptr = x + t * stride_x + h
    if NORM:  # x + res, RMSNorm-ed as add_rms_norm computes it, then the GEMV on it: the whole row in one step
        cols = h < H
        wk = tl.load(w_ptr, mask=in_e[:, None] & cols[None, :], other=0.0)  # a fixed weight: before the wait
        wait_for_inputs(PDL)
        xf = tl.load(x_ptr, mask=cols, other=0.0).to(tl.float32)
        rf = tl.load(res + t * stride_r + h, mask=cols, other=0.0).to(tl.float32)
        hs = _round(xf + rf, X_TY, INTERPRETED)  # torch's x + residual; padding adds 0 to the sum of squares
        nw = tl.load(norm_w + h, mask=cols, other=0.0).to(tl.float32)
        xn = _normalize(hs, nw, _inv_rms(hs, inv_dim, eps), X_TY, X_TY, INTERPRETED)
        if tl.program_id(1) == 0:  # one program a token stores them, into new tensors: no program's input
            tl.store(h_out + t * H + h, hs.to(X_TY), mask=cols)
            tl.store(xn_out + t * H + h, xn.to(X_TY), mask=cols)
        acc = wk.to(tl.float32) * xn[None, :]
    else:
        wait_for_inputs(PDL)
        acc = tl.zeros([BLOCK_E, BLOCK_H], tl.float32)  # reduced once after the loop
        for h0 in range(0, H, BLOCK_H):  # one step where H <= BLOCK_H: all of a program's loads in flight at once
            if EVEN_H:
                wk = tl.load(w_ptr + h0, mask=in_e[:, None], other=0.0)
                xk = tl.load(x_ptr + h0)
            else:
                cols = h0 + h < H
                wk = tl.load(w_ptr + h0, mask=in_e[:, None] & cols[None, :], other=0.0)
                xk = tl.load(x_ptr + h0, mask=cols, other=0.0)
            acc += wk.to(tl.float32) * xk.to(tl.float32)[None, :]
    logits = _round(tl.sum(acc, 1), L_TY, INTERPRETED)  # self.gate(x)'s dtype: x's, or fp32 for an fp32 gate
    tl.store(out + t * E + e, logits.to(L_TY), mask=in_e)


@triton.jit
def _route(logits, ids_out, weights_out, valid, E, stride_l, K: tl.constexpr, K_PAD: tl.constexpr,
           NORMALIZE: tl.constexpr, HAS_VALID: tl.constexpr, BLOCK_E: tl.constexpr, WARP: tl.constexpr,
           LOG_WARP: tl.constexpr, X_TY: tl.constexpr, INTERPRETED: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    wait_for_inputs(PDL)
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    in_e = e < E
    own = tl.load(logits + t * stride_l + e, mask=in_e, other=float("-inf")).to(tl.float32)
    probs = tl.where(in_e, _softmax(own, BLOCK_E, WARP, LOG_WARP, INTERPRETED), -1.0)  # -1: below every prob
    ids, values, total = _top_k(probs, e, K, K_PAD, BLOCK_E)
    if NORMALIZE:
        values = tl.div_rn(values, total)
    if HAS_VALID:
        if tl.load(valid + t) == 0:  # a CUDA-graph padding row: row 0's experts (no extra fetches or counts)
            first = tl.load(logits + e, mask=in_e, other=float("-inf")).to(tl.float32)
            probs0 = tl.where(in_e, _softmax(first, BLOCK_E, WARP, LOG_WARP, INTERPRETED), -1.0)
            ids = _top_k(probs0, e, K, K_PAD, BLOCK_E)[0]  # the weights stay its own
    j = tl.arange(0, K_PAD)
    tl.store(ids_out + t * K + j, ids.to(tl.int64), mask=j < K)
    tl.store(weights_out + t * K + j, _round(values, X_TY, INTERPRETED).to(X_TY), mask=j < K)


def fused_route(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    top_k: int,
    normalize: bool,
    valid: torch.Tensor | None = None,
    *,
    logits_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [T, H]; gate_weight: [E, H] in x's dtype (no bias); valid: [T] bool or None -> (ids [T, top_k] int64,
    weights [T, top_k] in x's dtype). Dtypes float32, bfloat16, float16; E <= 1024. `logits_out` ([T, E]
    contiguous, x's dtype; for tests) receives the logits the routing used."""
    _check_routing(x.shape[0], gate_weight.shape[0], top_k, x.dtype, valid)
    logits = gate_logits(x, gate_weight, logits_out)  # [T, E]
    return _launch_route(logits, top_k, normalize, valid)


def gate_logits(
    x: torch.Tensor, gate_weight: torch.Tensor, out: torch.Tensor | None = None, block_e: int | None = None
) -> torch.Tensor:
    """x [T, H] @ gate_weight [E, H].T with fp32 accumulation, rounded to x's dtype: `F.linear(x, gate_weight)` up to
    the order of the sum; an fp32 gate (GLM's) gives fp32 logits, `F.linear(x.float(), gate_weight)`. `out`: [T, E]
    contiguous in the logits' dtype, else a new one. `block_e` (a power of two; for benchmarks and tests) overrides
    the experts per program."""
    (T, H), E = x.shape, gate_weight.shape[0]
    if x.dtype not in _DTYPES:
        raise ValueError(f"the router takes float32, bfloat16 or float16, got {x.dtype}")
    if gate_weight.shape != (E, H) or gate_weight.dtype not in (x.dtype, torch.float32):
        raise ValueError(f"gate weight {gate_weight.dtype} {list(gate_weight.shape)} does not fit x {x.dtype} {[T, H]}")
    out = _logits_out(T, E, x, out, gate_weight.dtype)
    if T == 0 or E == 0:
        return out
    _launch_gate(x, gate_weight, out, block_e)
    return out


def norm_route(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    gate_weight: torch.Tensor,
    top_k: int,
    normalize: bool,
    valid: torch.Tensor | None = None,
    *,
    logits_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pre-norm block's residual add and RMSNorm fused into `fused_route`'s gate GEMV: x (the attention
    output) and residual [T, H], norm_weight [H], all of gate_weight's dtype, H <= MAX_NORM_HIDDEN -> (xn, h, ids,
    weights) with (xn, h) = `add_rms_norm(x, residual, norm_weight, eps)` (same arithmetic; new tensors, the inputs
    only read) and (ids, weights) = `fused_route(xn, ...)`. One launch fewer a MoE layer in decode: every gate
    program normalises the row it multiplies (a few KiB from L2) instead of waiting for a norm kernel, and loads its
    gate rows before its PDL wait (a fixed weight). `logits_out` as in `fused_route`."""
    (T, H), E = x.shape, gate_weight.shape[0]
    _check_routing(T, E, top_k, x.dtype, valid)
    if residual.shape != x.shape or norm_weight.shape != (H,) or gate_weight.shape != (E, H):
        shapes = [list(t.shape) for t in (x, residual, norm_weight, gate_weight)]
        raise ValueError(f"norm_route: x, residual [T, H], norm weight [H], gate [E, H] do not fit: {shapes}")
    if len({t.dtype for t in (x, residual, norm_weight, gate_weight)}) != 1:
        raise ValueError("norm_route takes x, residual, norm weight and gate weight of one dtype")
    if H > MAX_NORM_HIDDEN:
        raise ValueError(f"norm_route holds a row in one tile: hidden size {H} > {MAX_NORM_HIDDEN}")
    logits = _logits_out(T, E, x, logits_out)
    xn, h = torch.empty(T, H, dtype=x.dtype, device=x.device), torch.empty(T, H, dtype=x.dtype, device=x.device)
    if T and E:
        _launch_gate(x, gate_weight, logits, None, (residual, norm_weight, eps, xn, h))
    return (xn, h, *_launch_route(logits, top_k, normalize, valid))


def _logits_out(
    T: int, E: int, x: torch.Tensor, out: torch.Tensor | None, gate: torch.dtype | None = None
) -> torch.Tensor:
    dtype = torch.promote_types(x.dtype, gate or x.dtype)
    if out is None:
        return torch.empty(T, E, dtype=dtype, device=x.device)
    if out.shape != (T, E) or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"logits out: need contiguous [{T}, {E}] {dtype}, got {out.dtype} {list(out.shape)}")
    return out


def _launch_gate(
    x: torch.Tensor, gate_weight: torch.Tensor, out: torch.Tensor, block_e: int | None, norm: tuple | None = None
) -> None:
    """The gate GEMV into out [T, E]; with norm = (residual, norm weight, eps, xn out, h out), on the row
    add_rms_norm'd first (one tile a row, at add_rms_norm's warps: its order of the sum of squares)."""
    (T, H), E = x.shape, gate_weight.shape[0]
    x = x if x.stride(1) == 1 else x.contiguous()
    gate_weight = gate_weight if gate_weight.stride(1) == 1 else gate_weight.contiguous()
    width = triton.next_power_of_2(H)
    if block_e is None:  # gate rows that fit one tile, yet MIN_PROGRAMS programs where E allows
        block_e = min(max(1, TILE // width), _floor_power_of_2(max(1, E // MIN_PROGRAMS)))
    block_h = min(width, max(1, TILE // block_e))
    warps = min(8, max(1, block_e * block_h // 256))  # >= 8 elements (16 bytes of bf16) a thread
    if norm is None:
        res = norm_w = xn = h = x  # unused
        stride_r, eps = 0, 0.0
    else:
        res, norm_w, eps, xn, h = norm
        res = res if res.stride(1) == 1 else res.contiguous()
        norm_w = norm_w if norm_w.stride(0) == 1 else norm_w.contiguous()
        stride_r, block_h, warps = res.stride(0), width, _norm_warps(width)
    _gate_gemv[(T, triton.cdiv(E, block_e))](
        x, gate_weight, out, res, norm_w, xn, h, H, E, x.stride(0), gate_weight.stride(0), stride_r, 1.0 / H, eps,
        block_e, block_h, H % block_h == 0, norm is not None, _DTYPES[x.dtype], _DTYPES[out.dtype], not x.is_cuda,
        num_warps=warps,
        enable_fp_fusion=norm is None, **launch_args(x.device),  # the norm as add_rms_norm: no FMA in its sums
    )  # fmt: skip


def route_logits(
    logits: torch.Tensor, top_k: int, normalize: bool, valid: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing part of `fused_route` from logits [T, E] -> (ids, weights)."""
    _check_routing(logits.shape[0], logits.shape[1], top_k, logits.dtype, valid)
    return _launch_route(logits if logits.stride(1) == 1 else logits.contiguous(), top_k, normalize, valid)


def _floor_power_of_2(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def _check_routing(T: int, E: int, top_k: int, dtype: torch.dtype, valid: torch.Tensor | None) -> None:
    if dtype not in _DTYPES:
        raise ValueError(f"the router takes float32, bfloat16 or float16, got {dtype}")
    if not 1 <= top_k <= E <= MAX_EXPERTS:
        raise ValueError(f"top_k {top_k} of {E} experts: need 1 <= top_k <= experts <= {MAX_EXPERTS}")
    if valid is not None and (valid.shape != (T,) or valid.dtype != torch.bool):
        raise ValueError(f"valid must be [{T}] bool, got {valid.dtype} {list(valid.shape)}")


def _launch_route(
    logits: torch.Tensor, top_k: int, normalize: bool, valid: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    T, E = logits.shape
    ids = torch.empty(T, top_k, dtype=torch.long, device=logits.device)
    weights = torch.empty(T, top_k, dtype=logits.dtype, device=logits.device)
    if T == 0:
        return ids, weights
    block_e = triton.next_power_of_2(E)
    warp = min(block_e, 32)  # torch's lanes per row
    flags = valid.contiguous().view(torch.uint8) if valid is not None else None  # bool pointers: uint8, no copy
    _route[(T,)](
        logits, ids, weights, flags, E, logits.stride(0), top_k, triton.next_power_of_2(top_k), normalize,
        valid is not None, block_e, warp, warp.bit_length() - 1, _DTYPES[logits.dtype], not logits.is_cuda,
        num_warps=min(4, max(1, block_e // 256)),  # one warp up to 256 experts: reductions stay in shuffles
        **launch_args(logits.device),
    )  # fmt: skip
    return ids, weights


@triton.jit
def _route_grouped(logits, bias, ids_out, weights_out, valid, E, stride_l, group_size, scale, K: tl.constexpr,
                   K_PAD: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, NORMALIZE: tl.constexpr,
                   HAS_VALID: tl.constexpr, BLOCK_E: tl.constexpr, W_TY: tl.constexpr, INTERPRETED: tl.constexpr,
                   PDL: tl.constexpr):  # fmt: skip
    wait_for_inputs(PDL)
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    in_e = e < E
    b = tl.load(bias + e, mask=in_e, other=0.0).to(tl.float32)  # a fixed weight
    lg = tl.load(logits + t * stride_l + e, mask=in_e, other=0.0).to(tl.float32)
    scores = tl.div_rn(tl.zeros_like(lg) + 1.0, 1.0 + _exp(-lg, INTERPRETED))  # torch's sigmoid: 1 / (1 + exp(-x))
    ids = _grouped_top_k(scores + b, e, in_e, group_size, K, K_PAD, N_GROUP, TOPK_GROUP, BLOCK_E)
    j = tl.arange(0, K_PAD)
    values = tl.zeros([K_PAD], tl.float32)
    total = tl.zeros([], tl.float32)
    for i in tl.static_range(K):  # the chosen experts' plain scores (scores.gather), summed in order
        id_i = tl.sum(tl.where(j == i, ids, 0), 0)
        v = tl.sum(tl.where(e == id_i, scores, 0.0), 0)
        values = tl.where(j == i, v, values)
        total += v
    if NORMALIZE:
        values = tl.div_rn(values, tl.zeros_like(values) + (total + 1e-20))
    values = values * scale
    if HAS_VALID:
        if tl.load(valid + t) == 0:  # a CUDA-graph padding row: row 0's experts (no extra fetches or counts)
            first = tl.load(logits + e, mask=in_e, other=0.0).to(tl.float32)
            first = tl.div_rn(tl.zeros_like(first) + 1.0, 1.0 + _exp(-first, INTERPRETED))
            ids = _grouped_top_k(first + b, e, in_e, group_size, K, K_PAD, N_GROUP, TOPK_GROUP, BLOCK_E)  # own weights
    tl.store(ids_out + t * K + j, ids.to(tl.int64), mask=j < K)
    tl.store(weights_out + t * K + j, _round(values, W_TY, INTERPRETED).to(W_TY), mask=j < K)


@triton.jit
def _grouped_top_k(choice, e, in_e, group_size, K: tl.constexpr, K_PAD: tl.constexpr, N_GROUP: tl.constexpr,
                   TOPK_GROUP: tl.constexpr, BLOCK_E: tl.constexpr):  # fmt: skip
    """The K experts of the best biased scores `choice` [BLOCK_E] among the TOPK_GROUP best of N_GROUP groups of
    `group_size` consecutive experts (a group's worth: its two best scores), ties to the lower group and expert."""
    choice = tl.where(in_e, choice, float("-inf"))
    if TOPK_GROUP < N_GROUP:
        group = e // group_size
        g = tl.arange(0, N_GROUP)
        worth = tl.zeros([N_GROUP], tl.float32)
        for gi in tl.static_range(N_GROUP):
            mine = tl.where(group == gi, choice, float("-inf"))
            best = tl.max(mine, 0)
            at = tl.min(tl.where(mine == best, e, BLOCK_E), 0)
            second = tl.max(tl.where(e == at, float("-inf"), mine), 0)
            worth = tl.where(g == gi, best + second, worth)
        kept = tl.zeros([BLOCK_E], tl.int32)
        for _ in tl.static_range(TOPK_GROUP):
            top = tl.max(worth, 0)
            at = tl.min(tl.where(worth == top, g, N_GROUP), 0)
            kept = tl.where(group == at, 1, kept)
            worth = tl.where(g == at, float("-inf"), worth)
        choice = tl.where(kept == 1, choice, float("-inf"))
    return _top_k(choice, e, K, K_PAD, BLOCK_E)[0]


def grouped_route(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    normalize: bool,
    scale: float,
    valid: torch.Tensor | None = None,
    *,
    logits_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`route_grouped(F.linear(x.float(), gate_weight), bias, ...)` with the weights cast to x's dtype and padding
    rows (`valid` False) on row 0's experts, in two launches. x: [T, H]; gate_weight [E, H] and bias [E] fp32 (as the
    family keeps them); n_group divides E, topk_group <= n_group <= 32 -> (ids [T, top_k] int64, weights [T, top_k] in
    x's dtype). `logits_out` ([T, E] fp32 contiguous; for tests) receives the logits."""
    T, E = x.shape[0], gate_weight.shape[0]
    _check_routing(T, E, top_k, x.dtype, valid)
    if gate_weight.dtype != torch.float32 or bias.dtype != torch.float32 or bias.shape != (E,):
        raise ValueError(f"grouped_route takes an fp32 gate [E, H] and bias [E], got {gate_weight.dtype}, {bias.dtype} "
                         f"{list(bias.shape)}")  # fmt: skip
    if n_group < 1 or E % n_group or not 1 <= topk_group <= n_group <= 32 or n_group & (n_group - 1):
        raise ValueError(f"grouped_route: {n_group} groups (a power of two up to 32 dividing {E} experts), "
                         f"{topk_group} kept")  # fmt: skip
    if top_k > topk_group * (E // n_group):
        raise ValueError(f"top_k {top_k} > the {topk_group * (E // n_group)} experts of the kept groups")
    logits = gate_logits(x, gate_weight, logits_out)
    ids = torch.empty(T, top_k, dtype=torch.long, device=x.device)
    weights = torch.empty(T, top_k, dtype=x.dtype, device=x.device)
    if T == 0:
        return ids, weights
    block_e = triton.next_power_of_2(E)
    flags = valid.contiguous().view(torch.uint8) if valid is not None else None
    _route_grouped[(T,)](
        logits, bias.contiguous(), ids, weights, flags, E, logits.stride(0), E // n_group, float(scale), top_k,
        triton.next_power_of_2(top_k), n_group, topk_group, normalize, valid is not None, block_e, _DTYPES[x.dtype],
        not x.is_cuda, num_warps=min(4, max(1, block_e // 256)), **launch_args(x.device),
    )  # fmt: skip
    return ids, weights
