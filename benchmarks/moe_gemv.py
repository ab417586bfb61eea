"""Decode routed experts on CUDA: the fused GEMVs (`edgemoe.kernels.moe_gemv`) against `gathered_experts` at real
geometries, replayed from a CUDA graph and eager, against HBM bandwidth (a device-to-device copy) in the same run.

    python benchmarks/moe_gemv.py [--dtype bfloat16] [--tokens 1,4] [--sweep] [--sweep-stages] [--json OUT]

Bytes per call = pairs x 3 H I x itemsize, each (token, expert) pair's weights read once, as the kernels do; "distinct"
counts each expert of a call once (at T > 1, pairs of one expert share rows through L2, so the pairs figure can pass
1). Every call of a timed run reads its own set of random inputs (one of `SETS`; ids top-k distinct per token) from a
bank of all the layer's experts, so repeated calls do not measure the L2 cache. The graph figure is what decode runs
(one graph per step); the eager one adds Triton's launch overhead. `up` and `down` time each kernel alone;
`--sweep` times each over block sizes, `--sweep-stages` over software pipelining.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
from collections.abc import Callable
from pathlib import Path

import torch

from edgemoe import demo_model_path
from edgemoe.kernels.moe_gemv import down_proj, fused_experts, pick_blocks, up_proj
from edgemoe.moe.experts import gathered_experts
from edgemoe.tools.measure import bandwidths, capture, timed
from edgemoe.tools.presets import PRESETS

SETS = 16
DEV = torch.device("cuda")


def geometries() -> dict[str, tuple[int, int, int, int]]:
    """name -> (hidden, inter, top_k, experts)."""
    out = {}
    for name in ("qwen3-30b-a3b", "qwen1.5-moe-a2.7b", "mixtral-8x7b"):
        g = PRESETS[name]
        out[name] = g["hidden_size"], g["moe_intermediate_size"], g["num_experts_per_tok"], g["num_experts"]
    demo = json.loads((demo_model_path() / "config.json").read_text())
    out["demo"] = demo["hidden_size"], demo["moe_intermediate_size"], demo["num_experts_per_tok"], demo["num_experts"]
    return out


def problem(hidden: int, inter: int, top_k: int, experts: int, tokens: int, dtype: torch.dtype) -> tuple:
    w13 = (torch.randn(experts, 2 * inter, hidden, device=DEV) / math.sqrt(hidden)).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, device=DEV) / math.sqrt(inter)).to(dtype)
    x = torch.randn(SETS, tokens, hidden, device=DEV).to(dtype)
    ids = torch.rand(SETS, tokens, experts, device=DEV).argsort(dim=-1)[..., :top_k]  # [sets, tokens, top_k]
    weights = torch.rand(SETS, tokens, top_k, device=DEV).to(dtype)
    return x, ids, weights, w13, w2


def graph_seconds(call: Callable[[int], object], reps: int = 20) -> float:
    """Seconds per call, `SETS` calls (one per input set) captured in one graph and replayed."""
    graph = capture(lambda: [call(i) for i in range(SETS)])  # warm-up (compile, allocator), then capture
    seconds = timed(graph.replay, DEV, reps) / SETS
    del graph
    return seconds


def eager_seconds(call: Callable[[int], object], reps: int = 5) -> float:
    counter = itertools.count()
    return timed(lambda: call(next(counter) % SETS), DEV, reps * SETS)


def measure(geometry: tuple[int, int, int, int], tokens: int, dtype: torch.dtype, hbm: float) -> dict:
    H, inter, top_k, experts = geometry
    x, ids, weights, w13, w2 = problem(H, inter, top_k, experts, tokens, dtype)
    h = [up_proj(x[i], ids[i], w13) for i in range(SETS)]
    calls = {
        "fused": lambda i: fused_experts(x[i], ids[i], weights[i], w13, w2),
        "gathered": lambda i: gathered_experts(x[i], ids[i], weights[i], w13, w2),
        "up": lambda i: up_proj(x[i], ids[i], w13),
        "down": lambda i: down_proj(h[i], ids[i], weights[i], w2),
    }
    ref = calls["gathered"](0).float()
    expert = 3 * H * inter * w13.element_size()
    distinct = sum(len(ids[i].unique()) for i in range(SETS)) / SETS  # repeats across tokens may hit L2
    r = {
        "bytes": tokens * top_k * expert,
        "distinct_expert_bytes": distinct * expert,
        "blocks": vars(pick_blocks(H, inter)),
    }
    r["rel_diff_vs_gathered"] = ((calls["fused"](0).float() - ref).norm() / ref.norm()).item()
    for name, call in calls.items():
        r[f"{name}_graph_us"] = graph_seconds(call) * 1e6
    for name in ("fused", "gathered"):
        r[f"{name}_eager_us"] = eager_seconds(calls[name]) * 1e6
    for mode in ("graph", "eager"):
        r[f"speedup_{mode}"] = r[f"gathered_{mode}_us"] / r[f"fused_{mode}_us"]
    r["fused_bytes_per_s"] = r["bytes"] / (r["fused_graph_us"] / 1e6)
    r["fused_over_hbm"] = r["fused_bytes_per_s"] / hbm
    r["fused_distinct_over_hbm"] = r["distinct_expert_bytes"] / (r["fused_graph_us"] / 1e6) / hbm
    r["up_over_hbm"] = r["bytes"] * 2 / 3 / (r["up_graph_us"] / 1e6) / hbm
    r["down_over_hbm"] = r["bytes"] / 3 / (r["down_graph_us"] / 1e6) / hbm
    return r


def sweep(geometry: tuple[int, int, int, int], tokens: int, dtype: torch.dtype) -> dict:
    """Each kernel's time alone (graph, us) per block choice."""
    H, inter, top_k, experts = geometry
    x, ids, weights, w13, w2 = problem(H, inter, top_k, experts, tokens, dtype)
    h = [up_proj(x[i], ids[i], w13) for i in range(SETS)]
    p = 1 << (top_k - 1).bit_length()
    default = pick_blocks(H, inter)  # each kernel's other choices (e.g. its pipelining) as the engine runs them
    out = {"up": {}, "down": {}}
    for n, k, warps in itertools.product((1, 2, 4, 8, 16, 32), (64, 128, 256, 512), (4, 8)):
        if n * k <= 8192:
            b = dataclasses.replace(default, up_n=n, up_k=k, up_warps=warps)
            out["up"][f"n{n}_k{k}_w{warps}"] = graph_seconds(lambda i, b=b: up_proj(x[i], ids[i], w13, b)) * 1e6
    for n, k, warps in itertools.product((1, 2, 4, 8, 16), (64, 128, 256, 512), (2, 4, 8)):
        if p * n * k <= 16384:
            b = dataclasses.replace(default, down_n=n, down_k=k, down_warps=warps)
            us = graph_seconds(lambda i, b=b: down_proj(h[i], ids[i], weights[i], w2, b)) * 1e6
            out["down"][f"n{n}_k{k}_w{warps}"] = us
    return out


def sweep_stages(geometry: tuple[int, int, int, int], tokens: int, dtype: torch.dtype) -> dict:
    """Software pipelining (loop steps in flight) around the default blocks and two neighbours: each kernel's time
    alone (graph, us)."""
    H, inter, top_k, experts = geometry
    x, ids, weights, w13, w2 = problem(H, inter, top_k, experts, tokens, dtype)
    h = [up_proj(x[i], ids[i], w13) for i in range(SETS)]
    d = pick_blocks(H, inter)
    out = {"up": {}, "down": {}}
    for n, k, warps in ((d.up_n, d.up_k, d.up_warps), (16, 256, 8), (8, 128, 4)):
        for stages in (1, 2, 3, 4):
            b = dataclasses.replace(d, up_n=n, up_k=k, up_warps=warps, up_stages=stages)
            us = graph_seconds(lambda i, b=b: up_proj(x[i], ids[i], w13, b)) * 1e6
            out["up"][f"n{n}_k{k}_w{warps}_s{stages}"] = us
    for n, k, warps in ((d.down_n, d.down_k, d.down_warps), (2, 128, 4)):
        for stages in (1, 2, 3, 4):
            b = dataclasses.replace(d, down_n=n, down_k=k, down_warps=warps, down_stages=stages)
            us = graph_seconds(lambda i, b=b: down_proj(h[i], ids[i], weights[i], w2, b)) * 1e6
            out["down"][f"n{n}_k{k}_w{warps}_s{stages}"] = us
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--tokens", default="1,4", help="decode batch sizes (default: 1,4)")
    ap.add_argument("--sweep", action="store_true", help="also time block-size choices (slow: many compilations)")
    ap.add_argument("--sweep-stages", action="store_true", help="also time software pipelining (stages 1-4)")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    dtype = getattr(torch, a.dtype)
    hbm = bandwidths(DEV, 1 << 20)["hbm_bytes_per_s"]
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "dtype": a.dtype, "hbm": hbm}
    print(f"{results['device']}, {a.dtype}: HBM copy {hbm / 1e9:.0f} GB/s (read + write)")
    print("geometry, T: fused / gathered us (graph) -> speedup | eager -> speedup | of HBM (distinct) | up, down")
    for name, geometry in geometries().items():
        for tokens in map(int, a.tokens.split(",")):
            r = measure(geometry, tokens, dtype, hbm)
            results[f"{name}/T{tokens}"] = r
            print(
                f"{name}, T={tokens}: {r['fused_graph_us']:.1f} / {r['gathered_graph_us']:.1f} us -> "
                f"{r['speedup_graph']:.2f}x | {r['fused_eager_us']:.1f} / {r['gathered_eager_us']:.1f} us -> "
                f"{r['speedup_eager']:.2f}x | {r['fused_over_hbm']:.2f} ({r['fused_distinct_over_hbm']:.2f}) | "
                f"{r['up_graph_us']:.1f} us {r['up_over_hbm']:.2f}, {r['down_graph_us']:.1f} us "
                f"{r['down_over_hbm']:.2f} (rel diff {r['rel_diff_vs_gathered']:.1e})"
            )
            for flag, fn in (("sweep", sweep), ("sweep_stages", sweep_stages)):
                if not getattr(a, flag):
                    continue
                s = r[flag] = fn(geometry, tokens, dtype)
                for kernel in ("up", "down"):
                    ranked = sorted(s[kernel], key=s[kernel].get)[:4]
                    print(f"  sweep {kernel}: " + ", ".join(f"{c} {s[kernel][c]:.1f}" for c in ranked))
            torch.cuda.empty_cache()
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
