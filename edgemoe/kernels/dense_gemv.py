"""The dense projections of decode as a Triton GEMV: y = x @ weight.T (+ bias), its reference `F.linear` (cuBLAS).
One program per (BLOCK_N output rows, group of TOKEN_GROUP tokens), fp32 accumulation over K in BLOCK_K steps with
STAGES steps in flight, every token of the group against one read of each weight tile (the groups of one row block
are neighbouring programs, so a second group finds the tile in L2).

Why: a token's output does not depend on the others of its batch. Every token's sum over K runs in the same order,
whatever its group's size (`token_group`), so a token gets bitwise the same row alone, in a batch of any size, or in
a padded CUDA graph; cuBLAS picks its kernel (and split-K) by the row count, so its rows
change with the batch. Speed: at one token it beats cuBLAS on qkv, o and the shared expert's down, and loses at four
(docs/findings.md, "Triton GEMV against cuBLAS at one token"); `edgemoe.layers.linear.DecodeLinear` runs it for every
decode step (batch invariance is the contract: README, "What is guaranteed").

`norm_gemv` also takes the pre-norm block's residual add and RMSNorm before it (decode's qkv projection: every
program normalises the row it multiplies, so the norm's own launch goes; the engine runs it only on GPUs without
PDL: `Attention.fuses_norm`). FMA contraction is off so that the norm rounds as
`add_rms_norm` does; the GEMV's multiply-adds are written as FMAs, as the compiler contracted them before.

No host sync and only a torch.empty output: CUDA-graph capturable once compiled.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from edgemoe.kernels.norm_rope import _inv_rms, _norm_warps, _normalize, _round
from edgemoe.kernels.pdl import launch_args, wait_for_inputs

TOKEN_GROUP = 4  # tokens a program holds accumulators for at most ([group, BLOCK_N, BLOCK_K] fp32): `token_group`
BLOCK_K, WARPS, STAGES = 256, 4, 4  # the best of a sweep at the shapes it runs (benchmarks/dense_gemv.py)
LONG_ROW = 4096  # rows this long: wider steps, fewer in flight (`pick_steps`)
SHORT_STEPS, LONG_STEPS = (BLOCK_K, STAGES), (512, 3)  # (columns a step, steps in flight)
MAX_NORM_HIDDEN = 8192  # norm_gemv: the row's 1 / rms from one tile, 16 fp32 registers a thread at 16 warps
_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def token_group(tokens: int) -> int:
    """Tokens a program computes: the next power of two of T up to TOKEN_GROUP. A row comes out bitwise the same in
    groups of 1, 2 and 4 (each token's sum over K runs in the same order whatever the group: the GPU test at the
    engine's shapes), and a group of 4 at one token costs 30 % on qkv (padded rows are multiplied too)."""
    return min(triton.next_power_of_2(max(tokens, 1)), TOKEN_GROUP)


def pick_block_n(n: int) -> int:
    """Output rows per program: 4 won at N = 2048 (o, down), 8 at N = 5120 and 6144 (qkv)."""
    return 4 if n <= 4096 else 8


def pick_steps(k: int) -> tuple[int, int]:
    """(columns a loop step, steps in flight) for rows of k: LONG_STEPS from LONG_ROW on, else SHORT_STEPS.
    Wider steps pay only over a long loop (docs/findings.md, "Long rows: 512-column steps, 3 stages")."""
    return LONG_STEPS if k >= LONG_ROW else SHORT_STEPS


@triton.jit
def _gemv(x, w, bias, y, res, norm_w, h_out, T, N, K, stride_x, stride_w, stride_y, inv_dim, eps,
          T_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
          HAS_BIAS: tl.constexpr, NORM: tl.constexpr, K_PAD: tl.constexpr, Y_TY: tl.constexpr,
          RNE_BY_HAND: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    wait_for_inputs(PDL)
    groups = tl.cdiv(T, T_PAD)
    n = (tl.program_id(0) // groups) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    t = (tl.program_id(0) % groups) * T_PAD + tl.arange(0, T_PAD)
    rows = n < N
    w_ptr = w + n[:, None].to(tl.int64) * stride_w + k[None, :]  # [BLOCK_N, BLOCK_K]
    x_ptr = x + t[:, None] * stride_x + k[None, :]  # [T_PAD, BLOCK_K]
    if NORM:  # one token: h = x + res and its 1 / rms over the whole row first, as add_rms_norm computes them
        row = tl.arange(0, K_PAD)
        xf = tl.load(x + row, mask=row < K, other=0.0).to(tl.float32)
        rf = tl.load(res + row, mask=row < K, other=0.0).to(tl.float32)
        hs = _round(xf + rf, Y_TY, RNE_BY_HAND)  # torch's x + residual; padding adds 0 to the sum of squares
        r = _inv_rms(hs, inv_dim, eps)
        if tl.program_id(0) == 0:  # one program stores the new residual, into a new tensor: no program's input
            tl.store(h_out + row, hs.to(Y_TY), mask=row < K)
    acc = tl.zeros([T_PAD, BLOCK_N, BLOCK_K], dtype=tl.float32)  # reduced once after the loop
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):  # STAGES > 1: the next steps' loads in flight
        cols = k0 + k < K
        wk = tl.load(w_ptr + k0, mask=rows[:, None] & cols[None, :], other=0.0).to(tl.float32)
        xk = tl.load(x_ptr + k0, mask=(t < T)[:, None] & cols[None, :], other=0.0).to(tl.float32)
        if NORM:  # this step's columns of the normalised row, recomputed elementwise: bitwise add_rms_norm's
            rk = tl.load(res + k0 + k, mask=cols, other=0.0).to(tl.float32)[None, :]
            nw = tl.load(norm_w + k0 + k, mask=cols, other=0.0).to(tl.float32)[None, :]
            xk = _normalize(_round(xk + rk, Y_TY, RNE_BY_HAND), nw, r, Y_TY, Y_TY, RNE_BY_HAND)
        acc = tl.fma(wk[None, :, :], xk[:, None, :], acc)  # explicit: FMA contraction is off (the norm's sums)
    out = tl.sum(acc, axis=2)  # [T_PAD, BLOCK_N]
    if HAS_BIAS:
        out += tl.load(bias + n, mask=rows, other=0.0).to(tl.float32)[None, :]
    out = _round(out, Y_TY, RNE_BY_HAND)  # the one rounding, to nearest even under the interpreter too
    tl.store(y + t[:, None] * stride_y + n[None, :], out.to(Y_TY), mask=(t < T)[:, None] & rows[None, :])


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    block_n: int | None = None,
    block_k: int | None = None,
    warps: int = WARPS,
    stages: int | None = None,
    group: int | None = None,
) -> torch.Tensor:
    """x [T, K] @ weight [N, K].T (+ bias [N]) -> y [T, N] in x's dtype; weight and bias in x's dtype, x and
    weight contiguous in K. fp32 accumulation; the bias is added in fp32 before the one rounding of y, as F.linear's
    cuBLAS does (at T = 1 addmm copies the bias into the output and the GEMM adds it as C with beta 1 in fp32; at
    T > 1 cublasLt's bias epilogue, also fp32). The keywords are for benchmarks/dense_gemv.py's sweep: block_n,
    block_k and stages None are the engine's choice (`pick_block_n`, `pick_steps`); `group` (None:
    `token_group`) the tokens a program holds."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"gemv needs x [T, K] and weight [N, K], got {list(x.shape)} and {list(weight.shape)}")
    T, N = x.shape[0], weight.shape[0]
    if x.dtype not in _DTYPES or weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        raise ValueError(f"gemv takes float32, bfloat16 or float16 x, weight and bias alike, got {dtypes}")
    if bias is not None and bias.shape != (N,):
        raise ValueError(f"bias must be [{N}], got {list(bias.shape)}")
    if x.stride(1) != 1 or weight.stride(1) != 1 or (bias is not None and bias.stride(0) != 1):
        raise ValueError("gemv needs x and weight contiguous in K and a contiguous bias")
    if weight.device != x.device or (bias is not None and bias.device != x.device):
        raise ValueError(f"x, weight and bias must share a device, got {x.device}, {weight.device}")
    sizes = [b for b in (block_n, block_k, group) if b is not None]
    if any(b < 1 or b & (b - 1) for b in sizes) or warps < 1 or (stages is not None and stages < 1):
        raise ValueError(
            f"block_n {block_n}, block_k {block_k} and group {group} must be powers of two, warps and stages >= 1"
        )
    y = torch.empty(T, N, dtype=x.dtype, device=x.device)
    if T == 0 or N == 0:
        return y
    k, s = pick_steps(x.shape[1])
    block_k, stages = k if block_k is None else block_k, s if stages is None else stages
    _launch(x, weight, bias, y, None, block_n or pick_block_n(N), block_k, warps, stages, group or token_group(T))
    return y


def norm_warps(hidden: int) -> int:
    """`norm_gemv`'s warps: add_rms_norm's at this hidden size, so that the sum of squares runs in its order (4, the
    GEMV's own, at qwen3-30b-a3b's and qwen1.5-moe's 2048)."""
    return _norm_warps(triton.next_power_of_2(hidden))


def norm_gemv(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A pre-norm block's residual add and RMSNorm fused into the GEMV that follows it, for one token: x (the last
    block's output) and residual [1, K], norm_weight [K], weight [N, K], bias [N] or None, all of one dtype, K at most
    MAX_NORM_HIDDEN (the row sits in registers) -> (y, h) with (xn, h) = `add_rms_norm(x, residual, norm_weight,
    eps)` and y = `gemv(xn, weight, bias, warps=norm_warps(K))`, bitwise (the same arithmetic: each program computes
    h's 1 / rms over the whole row, then normalises each step's columns as it loads them; one program stores h).
    Decode's qkv projection: one launch fewer a layer."""
    if x.dim() != 2 or x.shape[0] != 1 or residual.shape != x.shape or norm_weight.shape != x.shape[1:]:
        shapes = [list(t.shape) for t in (x, residual, norm_weight)]
        raise ValueError(f"norm_gemv takes one token: x, residual [1, K] and norm weight [K], got {shapes}")
    if weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"norm_gemv needs weight [N, {x.shape[1]}], got {list(weight.shape)}")
    if x.shape[1] > MAX_NORM_HIDDEN:
        raise ValueError(f"norm_gemv holds a row in registers: hidden size {x.shape[1]} > {MAX_NORM_HIDDEN}")
    tensors = (x, residual, norm_weight, weight) + (() if bias is None else (bias,))
    if len({t.dtype for t in tensors}) != 1 or x.dtype not in _DTYPES:
        raise ValueError(f"norm_gemv takes one float dtype for all its tensors, got {[t.dtype for t in tensors]}")
    if len({t.device for t in tensors}) != 1:
        raise ValueError("norm_gemv's tensors must share a device")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias must be [{weight.shape[0]}], got {list(bias.shape)}")
    x, residual, norm_weight, weight = (t if t.stride(-1) == 1 else t.contiguous() for t in tensors[:4])
    bias = bias if bias is None or bias.stride(0) == 1 else bias.contiguous()
    N = weight.shape[0]
    y = torch.empty(1, N, dtype=x.dtype, device=x.device)
    h = torch.empty_like(x, memory_format=torch.contiguous_format)
    if N:
        warps = norm_warps(x.shape[1])
        block_k = pick_steps(x.shape[1])[0]  # gemv's: the same sums, bitwise (stages do not change them)
        norm = (residual, norm_weight, eps, h)
        _launch(x, weight, bias, y, norm, pick_block_n(N), block_k, warps, STAGES, 1)
    else:
        torch.add(x, residual, out=h)
    return y, h


def _launch(
    x, weight, bias, y, norm: tuple | None, block_n: int, block_k: int, warps: int, stages: int, group: int
) -> None:  # fmt: skip
    (T, K), N = x.shape, weight.shape[0]
    res, norm_w, eps, h = (x, x, 0.0, x) if norm is None else norm  # unused without the norm
    _gemv[(triton.cdiv(N, block_n) * triton.cdiv(T, group),)](
        x, weight, weight if bias is None else bias, y, res, norm_w, h, T, N, K, x.stride(0), weight.stride(0),
        y.stride(0), 1.0 / K, eps, group, block_n, block_k, stages, bias is not None,
        norm is not None, triton.next_power_of_2(K) if norm else 1, _DTYPES[x.dtype], not x.is_cuda, num_warps=warps,
        enable_fp_fusion=False, **launch_args(x.device),  # no FMA in the norm's sums; the GEMV's are explicit
    )  # fmt: skip
