"""Decode's dense projections on CUDA: cuBLAS (`F.linear`, what the engine runs) against a candidate Triton GEMV,
replayed from CUDA graphs, against HBM bandwidth (a device-to-device copy) in the same run.

    python benchmarks/dense_gemv.py [--tokens 1,4] [--json OUT]

Why: with every expert cached, a qwen3-30b-a3b layer's qkv and o projections take 7.6 and 7.2 µs under cuBLAS, 0.65
and 0.55 of HBM (benchmarks/RESULTS.md), where the routed-expert GEMVs of `kernels/moe_gemv.py` reach 0.77. The
candidate: one program per BLOCK_N output rows, fp32 accumulation over K in BLOCK_K steps with `STAGES` steps in
flight, every token's row against one read of each weight tile (tokens <= 4 at decode). It is swept over blocks,
warps and stages per shape; the best is reported next to cuBLAS. It moves into `edgemoe/kernels/` only if it wins.

Shapes (out x in, bf16): qwen3-30b-a3b's qkv (5120 x 2048) and o (2048 x 4096); qwen1.5-moe-a2.7b's qkv (6144 x
2048), o (2048 x 2048) and shared-expert gate_up (11264 x 2048) and down (2048 x 5632). Every call of a timed graph
reads its own copy of the weight (`SETS` copies, more bytes than L2 holds), so no call finds it in L2.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from edgemoe.bench import bandwidths, capture, timed

SETS = 8
SHAPES = {
    "qwen3-30b-a3b qkv": (5120, 2048),
    "qwen3-30b-a3b o": (2048, 4096),
    "qwen1.5-moe-a2.7b qkv": (6144, 2048),
    "qwen1.5-moe-a2.7b o": (2048, 2048),
    "qwen1.5-moe-a2.7b shared gate_up": (11264, 2048),
    "qwen1.5-moe-a2.7b shared down": (2048, 5632),
}
CONFIGS = list(itertools.product((4, 8, 16), (128, 256), (4, 8), (1, 4)))  # (BLOCK_N, BLOCK_K, warps, stages)


@triton.jit
def _gemv(x, w, y, T, N, K, stride_x, stride_w, stride_y, T_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
          BLOCK_K: tl.constexpr, STAGES: tl.constexpr):  # fmt: skip
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    t = tl.arange(0, T_PAD)
    rows = n < N
    w_ptr = w + n[:, None].to(tl.int64) * stride_w + k[None, :]  # [BLOCK_N, BLOCK_K]
    x_ptr = x + t[:, None] * stride_x + k[None, :]  # [T_PAD, BLOCK_K]
    acc = tl.zeros([T_PAD, BLOCK_N, BLOCK_K], dtype=tl.float32)  # every token against one read of the tile
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        cols = k0 + k < K
        wk = tl.load(w_ptr + k0, mask=rows[:, None] & cols[None, :], other=0.0).to(tl.float32)
        xk = tl.load(x_ptr + k0, mask=(t < T)[:, None] & cols[None, :], other=0.0).to(tl.float32)
        acc += wk[None, :, :] * xk[:, None, :]
    out = tl.sum(acc, axis=2)  # [T_PAD, BLOCK_N]
    tl.store(y + t[:, None] * stride_y + n[None, :], out.to(y.dtype.element_ty), mask=(t < T)[:, None] & rows[None, :])


def gemv(x: torch.Tensor, w: torch.Tensor, config: tuple[int, int, int, int]) -> torch.Tensor:
    """x [T, K] @ w [N, K].T -> [T, N] in x's dtype (no bias)."""
    (T, K), N = x.shape, w.shape[0]
    block_n, block_k, warps, stages = config
    y = torch.empty(T, N, dtype=x.dtype, device=x.device)
    _gemv[(triton.cdiv(N, block_n),)](
        x,
        w,
        y,
        T,
        N,
        K,
        x.stride(0),
        w.stride(0),
        y.stride(0),
        triton.next_power_of_2(T),
        block_n,
        block_k,
        stages,
        num_warps=warps,
    )
    return y


def graph_us(call, reps: int = 20) -> float:
    graph = capture(lambda: [call(i) for i in range(SETS)])
    us = timed(graph.replay, torch.device("cuda"), reps) / SETS * 1e6
    del graph
    return us


def measure(out_features: int, in_features: int, tokens: int, hbm: float) -> dict:
    dev = torch.device("cuda")
    w = (torch.randn(SETS, out_features, in_features, device=dev) / in_features**0.5).bfloat16()
    x = torch.randn(SETS, tokens, in_features, device=dev).bfloat16()
    nbytes = out_features * in_features * 2
    ref = F.linear(x[0].double(), w[0].double())
    r = {"bytes": nbytes, "cublas_us": graph_us(lambda i: F.linear(x[i], w[i])), "candidate_us": {}}
    for config in CONFIGS:
        got = gemv(x[0], w[0], config).double()
        err = ((got - ref).abs().max() / ref.abs().max()).item()
        if err > 2**-7:  # one bf16 rounding of the output is 2^-9 relative: anything far past it is a wrong kernel
            raise AssertionError(f"candidate {config} is wrong: max error {err:.1e} relative to the largest output")
        r["candidate_us"]["n{}_k{}_w{}_s{}".format(*config)] = graph_us(lambda i, c=config: gemv(x[i], w[i], c))
    best = min(r["candidate_us"], key=r["candidate_us"].get)
    r["best"], r["best_us"] = best, r["candidate_us"][best]
    r["cublas_over_hbm"] = nbytes / (r["cublas_us"] / 1e6) / hbm
    r["best_over_hbm"] = nbytes / (r["best_us"] / 1e6) / hbm
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1,4", help="decode batch sizes (default: 1,4)")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/dense_gemv.py needs a CUDA GPU")
    hbm = bandwidths(torch.device("cuda"), 1 << 20)["hbm_bytes_per_s"]
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "hbm": hbm}
    print(f"{results['device']}: HBM copy {hbm / 1e9:.0f} GB/s; shape, T: cuBLAS | best candidate (graph replays)")
    for (name, (n, k)), tokens in itertools.product(SHAPES.items(), map(int, a.tokens.split(","))):
        r = results[f"{name}/T{tokens}"] = measure(n, k, tokens, hbm)
        print(
            f"{name:>34} T={tokens}: {r['cublas_us']:6.1f} us ({r['cublas_over_hbm']:.2f} of HBM) | "
            f"{r['best_us']:6.1f} us ({r['best_over_hbm']:.2f}) {r['best']} -> {r['cublas_us'] / r['best_us']:.2f}x"
        )
        torch.cuda.empty_cache()
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
