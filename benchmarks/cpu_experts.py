"""The CPU expert executor (`edgemoe/offload/cpu_experts.py`) per format and thread count, against host memory reads.

At qwen3-30b-a3b's expert shape (H 2048, I 768), per format (bf16, Q8_0, Q4_K, Q6_K, Q4_K_M's Q4_K + Q6_K) and
thread count (the caller included; default 1 to the physical cores):

    python benchmarks/cpu_experts.py [--threads 1,2,4] [--formats bf16,Q4_K] [--experts 128] [--pairs 8] [--json OUT]

One call computes `pairs` distinct experts for one token (a decode step's misses at batch 1), each call a fresh random
set from a bank of `experts` (128: 1.2 GB of bf16, 340 MB of Q4_K; 8 random experts tiled, so the addresses are
distinct and calls do not run from the caches). Bytes per call = pairs x an expert's used row (gate_up + down, scales
included; x, h and the output not counted). The bound: the same run's host memory read rate at the same thread
count, torch summing the bank's bytes as int64 (`mem GB/s`; one pass, the adds far from limiting), and `of mem` is
the ratio. Results are checked against a float64 reference before timing.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time
from pathlib import Path

import torch

from edgemoe.offload.cpu_experts import CpuExperts, physical_cores
from edgemoe.offload.layout import ExpertLayout, QuantExpertLayout
from edgemoe.quant import dequantize, random_blocks

H, INTER, TILE = 2048, 768, 8  # qwen3-30b-a3b
FORMATS = {"bf16": None, "Q8_0": ("Q8_0", "Q8_0"), "Q4_K": ("Q4_K", "Q4_K"), "Q6_K": ("Q6_K", "Q6_K"),
           "Q4_K_M": ("Q4_K", "Q6_K"), "Q4_0": ("Q4_0", "Q4_0"), "Q5_K": ("Q5_K", "Q5_K"),
           "MXFP4": ("MXFP4", "MXFP4"), "Q4_1": ("Q4_1", "Q4_1"), "Q5_0": ("Q5_0", "Q5_0"),
           "Q5_1": ("Q5_1", "Q5_1")}  # fmt: skip
DEFAULT = "bf16,Q8_0,Q4_K,Q6_K,Q4_K_M"  # what users run


def make_bank(name: str, experts: int) -> tuple[torch.Tensor, ExpertLayout, int]:
    """(bank [experts, row], its layout, used bytes an expert): TILE random experts repeated."""
    g = torch.Generator().manual_seed(0)
    if FORMATS[name] is None:
        layout = ExpertLayout(H, INTER, torch.bfloat16)
        w13 = torch.randn(TILE, 2 * INTER * H, generator=g) * H**-0.5
        base = torch.cat([w13, torch.randn(TILE, H * INTER, generator=g) * INTER**-0.5], dim=1).bfloat16()
        used = layout.row_bytes
    else:
        q13, q2 = FORMATS[name]
        layout = QuantExpertLayout(H, INTER, q13, q2, torch.float32)
        w13 = random_blocks((TILE, 2 * INTER, H), q13, g, std=H**-0.5)
        base = torch.cat([w13.flatten(1), random_blocks((TILE, H, INTER), q2, g, std=INTER**-0.5).flatten(1)], 1)
        used = layout.used
    return base.repeat(math.ceil(experts / TILE), 1)[:experts].contiguous(), layout, used


def check(pool: CpuExperts, bank: torch.Tensor, layout: ExpertLayout, x: torch.Tensor) -> float:
    """Largest |out - ref| / max|ref| over one call on the first TILE experts (ref: float64 from the dequantized
    weights)."""
    n = min(TILE, bank.shape[0])
    tokens, experts = torch.zeros(n, dtype=torch.int64), torch.arange(n)
    out = pool.compute(bank, layout, x, tokens, experts, torch.empty(n, H))
    w13, w2 = layout.views(bank[:n])
    if isinstance(layout, QuantExpertLayout):
        w13, w2 = dequantize(w13, layout.q_gate_up, H), dequantize(w2, layout.q_down, INTER)
    gate, up = (w13.double() @ x[0].double()).chunk(2, dim=-1)
    ref = (w2.double() @ (torch.nn.functional.silu(gate) * up)[:, :, None])[..., 0]
    return ((out.double() - ref).abs().max() / ref.abs().max()).item()


def seconds_per_call(pool: CpuExperts, bank: torch.Tensor, layout: ExpertLayout, pairs: int, calls: int) -> float:
    """Median over 5 runs of `calls` calls, each on its own random distinct experts."""
    g = torch.Generator().manual_seed(1)
    x, out, tokens = torch.randn(1, H, generator=g), torch.empty(pairs, H), torch.zeros(pairs, dtype=torch.int64)
    sets = [torch.randperm(bank.shape[0], generator=g)[:pairs] for _ in range(calls)]
    jobs = [pool.job(bank, layout, x, tokens, experts, out) for experts in sets]
    for job in jobs[:3]:
        pool.run(job)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        for job in jobs:
            pool.run(job)
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def memory_read(bank: torch.Tensor, threads: int) -> float:
    """Bytes/s of torch summing `bank` as int64 with `threads` threads (best of 3)."""
    torch.set_num_threads(threads)
    words = bank.view(-1).view(torch.int64)
    words.sum()
    best = math.inf
    for _ in range(3):
        start = time.perf_counter()
        words.sum()
        best = min(best, time.perf_counter() - start)
    return bank.nbytes / best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cores = physical_cores()
    ap.add_argument("--threads", default=",".join(map(str, range(1, cores + 1))), help=f"(default 1..{cores})")
    ap.add_argument("--formats", default=DEFAULT, help=f"of {', '.join(FORMATS)} (default: {DEFAULT})")
    ap.add_argument("--experts", type=int, default=128, help="experts in the bank (default: 128)")
    ap.add_argument("--pairs", type=int, default=8, help="distinct experts a call (default: 8)")
    ap.add_argument("--calls", type=int, default=20, help="calls a timed run (default: 20)")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    threads = [int(t) for t in a.threads.split(",")]
    results = {"machine": platform.processor() or platform.machine(), "cores": cores, "torch": torch.__version__,
               "shape": [H, INTER], "experts": a.experts, "pairs": a.pairs, "memory_read": {}, "rows": []}  # fmt: skip
    print(f"{results['machine']}, {cores} physical cores; qwen3-30b-a3b experts, {a.pairs} of {a.experts} a call")
    print("format  threads   ms/call  experts/s   GB/s  mem GB/s  of mem")
    for name in a.formats.split(","):
        bank, layout, used = make_bank(name, a.experts)
        for n in threads:
            mem = results["memory_read"].setdefault(n, memory_read(bank, n))
            with CpuExperts(n) as pool:
                results["isa"] = pool.isa
                error = check(pool, bank, layout, torch.randn(1, H))
                t = seconds_per_call(pool, bank, layout, a.pairs, a.calls)
            row = {"format": name, "threads": n, "ms_per_call": t * 1e3, "experts_per_s": a.pairs / t,
                   "bytes_per_s": a.pairs * used / t, "memory_read_bytes_per_s": mem,
                   "of_memory_read": a.pairs * used / t / mem, "rel_error": error}  # fmt: skip
            results["rows"].append(row)
            print(f"{name:7} {n:7} {row['ms_per_call']:9.3f} {row['experts_per_s']:10.0f} "
                  f"{row['bytes_per_s'] / 1e9:6.1f} {mem / 1e9:9.1f} {row['of_memory_read']:7.2f}")  # fmt: skip
        del bank
    print(f"vector path: {results['isa']}")
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
