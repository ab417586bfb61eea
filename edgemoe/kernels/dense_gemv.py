"""The dense projections of batch-1 decode as a Triton GEMV: y = x @ weight.T (+ bias), its reference `F.linear`
(cuBLAS, which the engine ran before). One program per BLOCK_N output rows, fp32 accumulation over K in BLOCK_K steps
with STAGES steps in flight, every token's row against one read of each weight tile.

Why: on an H200 at one token in bf16 (graph replays, no weight in L2; `python benchmarks/dense_gemv.py`) it
beat cuBLAS on qwen3-30b-a3b's qkv 5120x2048 (7.9 vs 8.4 µs) and o 2048x4096 (7.3 vs 9.5, where cuBLAS also
launches a split-K reduce), and qwen1.5-moe-a2.7b's qkv (9.0 vs 9.7), o (4.9 vs 6.2) and shared-expert down
2048x5632 (8.8 vs 11.1); it lost on the shared gate_up 11264x2048 (15.0 vs 14.1) and, at 4 tokens, on qkv (0.81x).
Hence `edgemoe.layers.linear.DecodeLinear` runs it for exactly those winners at one row.

No host sync and only a torch.empty output: CUDA-graph capturable once compiled.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from edgemoe.kernels.norm_rope import _round
from edgemoe.kernels.pdl import launch_args, wait_for_inputs

MAX_TOKENS = 4  # every token's accumulator lives in registers: [T, BLOCK_N, BLOCK_K] fp32
BLOCK_K, WARPS, STAGES = 256, 4, 4  # the best of the H200 sweep at the winning shapes: n4/n8_k256_w4_s4
_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def pick_block_n(n: int) -> int:
    """Output rows per program: 4 won at N = 2048 (o, down), 8 at N = 5120 and 6144 (qkv)."""
    return 4 if n <= 4096 else 8


@triton.jit
def _gemv(x, w, bias, y, T, N, K, stride_x, stride_w, stride_y, T_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
          BLOCK_K: tl.constexpr, STAGES: tl.constexpr, HAS_BIAS: tl.constexpr, Y_TY: tl.constexpr,
          RNE_BY_HAND: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    wait_for_inputs(PDL)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    t = tl.arange(0, T_PAD)
    rows = n < N
    w_ptr = w + n[:, None].to(tl.int64) * stride_w + k[None, :]  # [BLOCK_N, BLOCK_K]
    x_ptr = x + t[:, None] * stride_x + k[None, :]  # [T_PAD, BLOCK_K]
    acc = tl.zeros([T_PAD, BLOCK_N, BLOCK_K], dtype=tl.float32)  # reduced once after the loop
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):  # STAGES > 1: the next steps' loads in flight
        cols = k0 + k < K
        wk = tl.load(w_ptr + k0, mask=rows[:, None] & cols[None, :], other=0.0).to(tl.float32)
        xk = tl.load(x_ptr + k0, mask=(t < T)[:, None] & cols[None, :], other=0.0).to(tl.float32)
        acc += wk[None, :, :] * xk[:, None, :]
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
    block_k: int = BLOCK_K,
    warps: int = WARPS,
    stages: int = STAGES,
) -> torch.Tensor:
    """x [T, K] (T <= 4) @ weight [N, K].T (+ bias [N]) -> y [T, N] in x's dtype; weight and bias in x's dtype, x and
    weight contiguous in K. fp32 accumulation; the bias is added in fp32 before the one rounding of y, as F.linear's
    cuBLAS does (at T = 1 addmm copies the bias into the output and the GEMM adds it as C with beta 1 in fp32; at
    T > 1 cublasLt's bias epilogue, also fp32). The keywords are for benchmarks/dense_gemv.py's sweep: block_n None
    is the engine's choice (`pick_block_n`)."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"gemv needs x [T, K] and weight [N, K], got {list(x.shape)} and {list(weight.shape)}")
    (T, K), N = x.shape, weight.shape[0]
    if T > MAX_TOKENS:
        raise ValueError(f"gemv holds every token's accumulator in registers: T <= {MAX_TOKENS}, got {T}")
    if x.dtype not in _DTYPES or weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        raise ValueError(f"gemv takes float32, bfloat16 or float16 x, weight and bias alike, got {dtypes}")
    if bias is not None and bias.shape != (N,):
        raise ValueError(f"bias must be [{N}], got {list(bias.shape)}")
    if x.stride(1) != 1 or weight.stride(1) != 1 or (bias is not None and bias.stride(0) != 1):
        raise ValueError("gemv needs x and weight contiguous in K and a contiguous bias")
    if weight.device != x.device or (bias is not None and bias.device != x.device):
        raise ValueError(f"x, weight and bias must share a device, got {x.device}, {weight.device}")
    block_n = block_n or pick_block_n(N)
    if any(b & (b - 1) for b in (block_n, block_k)) or min(block_n, block_k, warps, stages) < 1:
        raise ValueError(f"block_n {block_n} and block_k {block_k} must be powers of two, warps and stages >= 1")
    y = torch.empty(T, N, dtype=x.dtype, device=x.device)
    if T == 0 or N == 0:
        return y
    _gemv[(triton.cdiv(N, block_n),)](
        x, weight, weight if bias is None else bias, y, T, N, K, x.stride(0), weight.stride(0), y.stride(0),
        triton.next_power_of_2(T), block_n, block_k, stages, bias is not None, _DTYPES[x.dtype], not x.is_cuda,
        num_warps=warps, **launch_args(x.device),
    )  # fmt: skip
    return y
