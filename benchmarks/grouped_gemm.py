"""Prefill routed experts on CUDA: the grouped GEMM (`edgemoe.kernels.grouped_gemm`) against the plain-torch loop
(`prefill_reference`: one matmul pair per expert) at real geometries and prompt lengths, one MoE layer's call alone.

    python benchmarks/grouped_gemm.py [--dtype bfloat16] [--tokens 512,4096] [--json OUT]

FLOPs per call = pairs x 3 x 2 H I (gate, up and down, a multiply-add each); TFLOP/s is that over the call's time,
the call including the device-side schedule (sort, searches) and the per-token sum. Routing is uniform random (ids
top-k distinct per token), as random weights route; the torch loop syncs once per call (its expert counts).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from edgemoe.kernels.grouped_gemm import grouped_gemm
from edgemoe.moe.experts import prefill_reference
from edgemoe.tools.measure import timed
from edgemoe.tools.presets import PRESETS

DEV = torch.device("cuda")
GEOMETRIES = ("qwen3-30b-a3b", "qwen1.5-moe-a2.7b")


def problem(name: str, tokens: int, dtype: torch.dtype) -> tuple:
    g = PRESETS[name]
    hidden, inter, top_k, experts = (
        g["hidden_size"], g["moe_intermediate_size"], g["num_experts_per_tok"], g["num_experts"],
    )  # fmt: skip
    w13 = (torch.randn(experts, 2 * inter, hidden, device=DEV) / math.sqrt(hidden)).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, device=DEV) / math.sqrt(inter)).to(dtype)
    x = torch.randn(tokens, hidden, device=DEV).to(dtype)
    ids = torch.rand(tokens, experts, device=DEV).argsort(dim=-1)[:, :top_k]
    weights = torch.softmax(torch.randn(tokens, top_k, device=DEV), dim=-1).to(dtype)
    return x, ids, weights, w13, w2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--tokens", default="512,4096", help="comma-separated prompt lengths")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    dtype = getattr(torch, a.dtype)
    rows = []
    head = ("geometry", "tokens", "kernel ms", "TFLOP/s", "torch ms", "TFLOP/s", "speed-up")
    print(f"{head[0]:18} {head[1]:>6} {head[2]:>10} {head[3]:>8} {head[4]:>9} {head[5]:>8} {head[6]:>8}")
    for name in GEOMETRIES:
        for tokens in (int(t) for t in a.tokens.split(",")):
            x, ids, weights, w13, w2 = problem(name, tokens, dtype)
            flops = ids.numel() * 3 * 2 * w13.shape[2] * w2.shape[2]
            kernel = timed(lambda: grouped_gemm(x, ids, weights, w13, w2), DEV, a.reps)  # noqa: B023
            loop = timed(lambda: prefill_reference(x, ids, weights, w13, w2), DEV, a.reps)  # noqa: B023
            row = {
                "geometry": name,
                "tokens": tokens,
                "dtype": a.dtype,
                "kernel_ms": kernel * 1e3,
                "kernel_tflops": flops / kernel / 1e12,
                "torch_ms": loop * 1e3,
                "torch_tflops": flops / loop / 1e12,
                "speedup": loop / kernel,
            }
            rows.append(row)
            print(
                f"{name:18} {tokens:6d} {row['kernel_ms']:10.3f} {row['kernel_tflops']:8.1f} {row['torch_ms']:9.3f} "
                f"{row['torch_tflops']:8.1f} {row['speedup']:7.1f}x"
            )
    out = {"device": torch.cuda.get_device_name(DEV), "torch": torch.__version__, "rows": rows}
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
