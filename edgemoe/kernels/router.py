"""The MoE router of decode as one Triton launch on CUDA, where torch runs ~6 small kernels (gate GEMV, softmax,
top-k, renormalisation, cast, padding-row substitution). Its reference is `edgemoe.moe.router.route` applied to
`F.linear(x, gate_weight)`, followed by `SparseMoE._routed`'s substitution for CUDA-graph padding rows (rows with
`valid` False take row 0's ids and keep their own weights).

One program per token, in torch's order of operations:

- logits = x @ gate_weight.T over [BLOCK_E, BLOCK_H] tiles with fp32 accumulation (all experts per tile, a
  bounded number of elements so that the accumulators stay in registers), rounded to x's dtype as `self.gate(x)`
  returns it. A padding row also accumulates row 0's logits from the same weight tiles.
- softmax in fp32, in the order of torch's CUDA softmax for E <= 1024 (PersistentSoftmax.cuh: each of min(E', 32)
  lanes sums the elements lane, lane + 32, ... in turn from 0, then a butterfly over the lanes; E' =
  next_power_of_2(E)), with libdevice's expf and IEEE division as nvcc compiles `::exp` and `/` there (Triton's
  libdevice flushes subnormal results: probabilities below 2^-126 read 0 where torch keeps them).
- top-k by k rounds of (max, lowest expert holding it): descending, ties to the lower expert id. torch.topk leaves
  the order of ties unspecified (on the CPU, heap / introselect orders differ from that).
- optional renormalisation: the k weights summed in order from 0, IEEE division; cast to x's dtype.

`route_logits` runs the same kernel from precomputed logits (the tests feed it the fused path's own logits to hold
the routing part to `route` exactly). No host sync and only torch.empty outputs: CUDA-graph capturable once
compiled. Under Triton's interpreter (CPU tests) exp is numpy's and bf16 casts are rounded by hand.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from edgemoe.kernels.norm_rope import _round

_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
TILE = 8192  # weight elements per step: 32 fp32 accumulators a thread at 8 warps (two for padding rows)
NUM_WARPS = 8
NUM_STAGES = 3  # weight tiles in flight (cp.async): one program reads the whole gate, latency is the limit
MAX_EXPERTS = 1024  # torch's warp softmax, whose summation order the kernel follows, covers E <= 1024


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
        probs = tl.where(e == at, -1.0, probs)
    return ids, values, total


@triton.jit
def _route(x, w, logits, ids_out, weights_out, logits_out, valid, H, E, stride_x, stride_w, stride_l,
           K: tl.constexpr, K_PAD: tl.constexpr, NORMALIZE: tl.constexpr, FROM_LOGITS: tl.constexpr,
           STORE_LOGITS: tl.constexpr, HAS_VALID: tl.constexpr, BLOCK_E: tl.constexpr, WARP: tl.constexpr,
           LOG_WARP: tl.constexpr, BLOCK_H: tl.constexpr, EVEN_H: tl.constexpr, STAGES: tl.constexpr,
           X_TY: tl.constexpr, INTERPRETED: tl.constexpr):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    in_e = e < E
    if HAS_VALID:
        pad = tl.load(valid + t) == 0  # a CUDA-graph padding row
    if FROM_LOGITS:
        own = tl.load(logits + t * stride_l + e, mask=in_e, other=0.0).to(tl.float32)
    else:
        h = tl.arange(0, BLOCK_H)
        w_ptr = w + e[:, None] * stride_w + h[None, :]  # [BLOCK_E, BLOCK_H]
        x_ptr = x + t * stride_x + h
        acc = tl.zeros([BLOCK_E, BLOCK_H], tl.float32)  # reduced once after the loop
        acc0 = tl.zeros([BLOCK_E, BLOCK_H], tl.float32)  # row 0's, accumulated by padding rows only
        for h0 in tl.range(0, H, BLOCK_H, num_stages=STAGES):  # loop num_stages: pipelines loads without a dot
            if EVEN_H:
                wk = tl.load(w_ptr + h0, mask=in_e[:, None], other=0.0).to(tl.float32)
                xk = tl.load(x_ptr + h0).to(tl.float32)
            else:
                cols = h0 + h < H
                wk = tl.load(w_ptr + h0, mask=in_e[:, None] & cols[None, :], other=0.0).to(tl.float32)
                xk = tl.load(x_ptr + h0, mask=cols, other=0.0).to(tl.float32)
            acc += wk * xk[None, :]
            if HAS_VALID:
                if pad:  # uniform per program: valid rows skip the second product
                    x0 = tl.load(x + h0 + h, mask=h0 + h < H, other=0.0).to(tl.float32)
                    acc0 += wk * x0[None, :]
        own = _round(tl.sum(acc, 1), X_TY, INTERPRETED)  # self.gate(x) returns x's dtype
        if HAS_VALID:
            first = _round(tl.sum(acc0, 1), X_TY, INTERPRETED)
    own = tl.where(in_e, own, float("-inf"))
    if STORE_LOGITS:
        tl.store(logits_out + t * E + e, own.to(X_TY), mask=in_e)
    probs = tl.where(in_e, _softmax(own, BLOCK_E, WARP, LOG_WARP, INTERPRETED), -1.0)  # -1: below every prob
    ids, values, total = _top_k(probs, e, K, K_PAD, BLOCK_E)
    if NORMALIZE:
        values = tl.div_rn(values, total)
    if HAS_VALID:
        if pad:  # padding rows take row 0's experts (no extra fetches, no extra counts) but keep their weights
            if FROM_LOGITS:
                first = tl.load(logits + e, mask=in_e, other=0.0).to(tl.float32)
            first = tl.where(in_e, first, float("-inf"))
            probs0 = tl.where(in_e, _softmax(first, BLOCK_E, WARP, LOG_WARP, INTERPRETED), -1.0)
            ids = _top_k(probs0, e, K, K_PAD, BLOCK_E)[0]
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
    (T, H), E = x.shape, gate_weight.shape[0]
    if gate_weight.shape != (E, H) or gate_weight.dtype != x.dtype:
        raise ValueError(f"gate weight {gate_weight.dtype} {list(gate_weight.shape)} does not fit x {x.dtype} {[T, H]}")
    if logits_out is not None and (
        logits_out.shape != (T, E) or logits_out.dtype != x.dtype or not logits_out.is_contiguous()
    ):
        raise ValueError(f"logits_out: need contiguous [{T}, {E}] {x.dtype}, got {logits_out.dtype} {logits_out.shape}")
    x = x if x.stride(1) == 1 else x.contiguous()
    gate_weight = gate_weight if gate_weight.stride(1) == 1 else gate_weight.contiguous()
    return _launch(x, gate_weight, None, T, H, E, top_k, normalize, valid, logits_out)


def route_logits(
    logits: torch.Tensor, top_k: int, normalize: bool, valid: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`fused_route` from precomputed logits [T, E] (the routing part alone, for tests) -> (ids, weights)."""
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    return _launch(None, None, logits, logits.shape[0], 1, logits.shape[1], top_k, normalize, valid, None)


def _launch(
    x: torch.Tensor | None,
    w: torch.Tensor | None,
    logits: torch.Tensor | None,
    T: int,
    H: int,
    E: int,
    top_k: int,
    normalize: bool,
    valid: torch.Tensor | None,
    logits_out: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    src = x if x is not None else logits  # the dtype and device of everything
    if src.dtype not in _DTYPES:
        raise ValueError(f"the router takes float32, bfloat16 or float16, got {src.dtype}")
    if not 1 <= top_k <= E <= MAX_EXPERTS:
        raise ValueError(f"top_k {top_k} of {E} experts: need 1 <= top_k <= experts <= {MAX_EXPERTS}")
    if valid is not None and (valid.shape != (T,) or valid.dtype != torch.bool):
        raise ValueError(f"valid must be [{T}] bool, got {valid.dtype} {list(valid.shape)}")
    ids = torch.empty(T, top_k, dtype=torch.long, device=src.device)
    weights = torch.empty(T, top_k, dtype=src.dtype, device=src.device)
    if T == 0:
        return ids, weights
    block_e = triton.next_power_of_2(E)
    warp = min(block_e, 32)  # torch's lanes per row
    block_h = min(max(1, TILE // block_e), triton.next_power_of_2(H))
    flags = valid.contiguous().view(torch.uint8) if valid is not None else None  # bool pointers: uint8, no copy
    _route[(T,)](
        x, w, logits, ids, weights, logits_out, flags, H, E,
        x.stride(0) if x is not None else 0, w.stride(0) if w is not None else 0,
        logits.stride(0) if logits is not None else 0,
        top_k, triton.next_power_of_2(top_k), normalize, logits is not None, logits_out is not None,
        valid is not None, block_e, warp, warp.bit_length() - 1, block_h, H % block_h == 0, NUM_STAGES,
        _DTYPES[src.dtype], not src.is_cuda, num_warps=NUM_WARPS,
    )  # fmt: skip
    return ids, weights
