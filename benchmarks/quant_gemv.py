"""Quantized decode experts on CUDA (`edgemoe.kernels.quant_gemv`), per GGUF format, against HBM bandwidth.

At qwen3-30b-a3b's expert shape, one format (or Q4_K_M's mix) at a time, against a device-to-device copy's bandwidth
measured in the same run:

    python benchmarks/quant_gemv.py [--tokens 1] [--formats Q4_K,Q8_0,...] [--sweep] [--json OUT]

Bytes per call = pairs x (2I row_bytes(gate_up, H) + H row_bytes(down, I)): each (token, expert) pair's blocks read
once, as the kernels read them (scales included; x, h and the output are not counted). Every call of a timed run
reads its own random routing (one of `SETS`; ids top-k distinct per token) from a bank of all 128 experts (8 random
experts tiled: distinct addresses, 16x the L2), so repeated calls do not measure the L2 cache. Times are graph
replays (as decode runs them), the eager figure adds Triton's launch overhead; `up` and `down` time each kernel
alone, and `bf16` is `moe_gemv.fused_experts` on bf16 banks for comparison. `--sweep` times each kernel over block
shapes (rows per program, warps, pipelining, blocks per loop step) and prints the fastest.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path

import torch

SETS = 16
H, INTER, TOP_K, EXPERTS = 2048, 768, 8, 128  # qwen3-30b-a3b
FORMATS = {"Q4_0": ("Q4_0", "Q4_0"), "Q8_0": ("Q8_0", "Q8_0"), "MXFP4": ("MXFP4", "MXFP4"), "Q4_K": ("Q4_K", "Q4_K"),
           "Q5_K": ("Q5_K", "Q5_K"), "Q6_K": ("Q6_K", "Q6_K"), "Q4_K_M": ("Q4_K", "Q6_K")}  # fmt: skip
DEV = torch.device("cuda")


def banks(q13: str, q2: str, tile: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """One joined row per expert, the banks views of it (as the expert pools hold them)."""
    from edgemoe.quant import random_blocks, row_bytes

    g = torch.Generator().manual_seed(0)
    w13 = random_blocks((tile, 2 * INTER, H), q13, g, std=H**-0.5)
    w2 = random_blocks((tile, H, INTER), q2, g, std=INTER**-0.5)
    base = torch.cat([w13.flatten(1), w2.flatten(1)], dim=1).to(DEV)
    joined = base.repeat(EXPERTS // tile, 1)  # [E, a + b]
    a = 2 * INTER * row_bytes(q13, H)
    return joined[:, :a].view(EXPERTS, 2 * INTER, -1), joined[:, a:].view(EXPERTS, H, -1)


def routing(tokens: int, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.randn(SETS, tokens, H, device=DEV).to(dtype)
    ids = torch.rand(SETS, tokens, EXPERTS, device=DEV).argsort(dim=-1)[..., :TOP_K]  # [sets, tokens, top_k]
    weights = torch.rand(SETS, tokens, TOP_K, device=DEV)
    return x, ids, weights


def graph_seconds(call: Callable[[int], object], reps: int = 20) -> float:
    """Seconds per call, `SETS` calls (one per input set) captured in one graph and replayed."""
    from edgemoe.tools.measure import capture, timed

    graph = capture(lambda: [call(i) for i in range(SETS)])  # warm-up (compile, allocator), then capture
    seconds = timed(graph.replay, DEV, reps) / SETS
    del graph
    return seconds


def eager_seconds(call: Callable[[int], object], reps: int = 5) -> float:
    from edgemoe.tools.measure import timed

    counter = itertools.count()
    return timed(lambda: call(next(counter) % SETS), DEV, reps * SETS)


def measure(q13: str, q2: str, tokens: int, hbm: float) -> dict:
    from edgemoe.kernels.quant_gemv import (
        pick_blocks,
        quant_down_proj,
        quant_experts_reference,
        quant_fused_experts,
        quant_up_proj,
    )
    from edgemoe.quant import quant_type

    w13, w2 = banks(q13, q2)
    x, ids, weights = routing(tokens)
    h = [quant_up_proj(x[i], ids[i], w13, q13, INTER, H) for i in range(SETS)]
    calls = {
        "fused": lambda i: quant_fused_experts(x[i], ids[i], weights[i], w13, w2, q13, q2, INTER, H),
        "up": lambda i: quant_up_proj(x[i], ids[i], w13, q13, INTER, H),
        "down": lambda i: quant_down_proj(h[i], ids[i], weights[i], w2, q2, INTER, H),
    }
    ref = quant_experts_reference(x[0], ids[0], weights[0], w13, w2, q13, q2, INTER, H).float()
    up_bytes, down_bytes = w13[0].numel() * tokens * TOP_K, w2[0].numel() * tokens * TOP_K
    r = {"bytes": up_bytes + down_bytes, "blocks": vars(pick_blocks(quant_type(q13), quant_type(q2), H, INTER))}
    r["rel_diff_vs_reference"] = ((calls["fused"](0).float() - ref).norm() / ref.norm()).item()
    for name, call in calls.items():
        r[f"{name}_graph_us"] = graph_seconds(call) * 1e6
    r["fused_eager_us"] = eager_seconds(calls["fused"]) * 1e6
    r["fused_bytes_per_s"] = r["bytes"] / (r["fused_graph_us"] / 1e6)
    r["fused_over_hbm"] = r["fused_bytes_per_s"] / hbm
    r["up_over_hbm"] = up_bytes / (r["up_graph_us"] / 1e6) / hbm
    r["down_over_hbm"] = down_bytes / (r["down_graph_us"] / 1e6) / hbm
    return r


def measure_bf16(tokens: int, hbm: float) -> dict:
    from edgemoe.kernels.moe_gemv import fused_experts

    w13 = (torch.randn(EXPERTS, 2 * INTER, H, device=DEV) / math.sqrt(H)).to(torch.bfloat16)
    w2 = (torch.randn(EXPERTS, H, INTER, device=DEV) / math.sqrt(INTER)).to(torch.bfloat16)
    x, ids, weights = routing(tokens)
    us = graph_seconds(lambda i: fused_experts(x[i], ids[i], weights[i], w13, w2)) * 1e6
    nbytes = tokens * TOP_K * 3 * H * INTER * 2
    return {"bytes": nbytes, "fused_graph_us": us, "fused_over_hbm": nbytes / (us / 1e6) / hbm}


def sweep(q13: str, q2: str, tokens: int) -> dict:
    """Each kernel's time alone (graph, us) per block shape: rows per program, warps, stages, blocks per loop step (the
    default step, 256 weights, and 2x, 4x where the row has them)."""
    from edgemoe.kernels.quant_gemv import pick_blocks, quant_down_proj, quant_up_proj
    from edgemoe.quant import quant_type

    w13, w2 = banks(q13, q2)
    x, ids, weights = routing(tokens)
    h = [quant_up_proj(x[i], ids[i], w13, q13, INTER, H) for i in range(SETS)]
    d = pick_blocks(quant_type(q13), quant_type(q2), H, INTER)
    out = {"up": {}, "down": {}}

    def record(kernel: str, name: str, call: Callable[[int], object]) -> None:
        try:
            out[kernel][name] = graph_seconds(call) * 1e6
        except Exception as e:  # a shape the compiler refuses (shared memory, registers): noted, the sweep goes on
            print(f"  {kernel} {name}: {type(e).__name__}: {str(e)[:100]}")

    up_steps = [d.up_blocks * m for m in (1, 2, 4) if d.up_blocks * m * quant_type(q13).block_weights <= H]
    for n, warps, stages, nb in itertools.product((8, 16, 32), (4, 8), (1, 2), up_steps):
        b = dataclasses.replace(d, up_n=n, up_warps=warps, up_stages=stages, up_blocks=nb)
        key = f"n{n}_w{warps}_s{stages}_b{nb}"
        record("up", key, lambda i, b=b: quant_up_proj(x[i], ids[i], w13, q13, INTER, H, b))
    down_steps = [d.down_blocks * m for m in (1, 2, 4) if d.down_blocks * m * quant_type(q2).block_weights <= INTER]
    for n, warps, stages, nb in itertools.product((2, 4, 8), (4, 8), (1, 2), down_steps):
        b = dataclasses.replace(d, down_n=n, down_warps=warps, down_stages=stages, down_blocks=nb)
        key = f"n{n}_w{warps}_s{stages}_b{nb}"
        record("down", key, lambda i, b=b: quant_down_proj(h[i], ids[i], weights[i], w2, q2, INTER, H, b))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1", help="decode batch sizes (default: 1)")
    ap.add_argument("--formats", default=",".join(FORMATS), help=f"of {', '.join(FORMATS)} (default: all)")
    ap.add_argument("--sweep", action="store_true", help="also time block shapes (slow: many compilations)")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/quant_gemv.py needs a CUDA GPU; none is visible")
    from edgemoe.tools.measure import bandwidths

    hbm = bandwidths(DEV, 1 << 20)["hbm_bytes_per_s"]
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "hbm": hbm, "shape": [H, INTER]}
    print(f"{results['device']}: HBM copy {hbm / 1e9:.0f} GB/s (read + write); qwen3-30b-a3b experts, top_k {TOP_K}")
    print("format, T: fused us (graph) -> GB/s, of HBM | eager us | up us, of HBM | down us, of HBM")
    for tokens in map(int, a.tokens.split(",")):
        r = results[f"bf16/T{tokens}"] = measure_bf16(tokens, hbm)
        print(f"bf16, T={tokens}: {r['fused_graph_us']:.1f} us -> {r['fused_over_hbm']:.2f} of HBM (moe_gemv)")
        for name in a.formats.split(","):
            q13, q2 = FORMATS[name]
            r = results[f"{name}/T{tokens}"] = measure(q13, q2, tokens, hbm)
            print(
                f"{name}, T={tokens}: {r['fused_graph_us']:.1f} us -> {r['fused_bytes_per_s'] / 1e9:.0f} GB/s, "
                f"{r['fused_over_hbm']:.2f} | {r['fused_eager_us']:.1f} us | {r['up_graph_us']:.1f} us "
                f"{r['up_over_hbm']:.2f} | {r['down_graph_us']:.1f} us {r['down_over_hbm']:.2f} "
                f"(rel diff {r['rel_diff_vs_reference']:.1e})"
            )
            if a.sweep:
                s = r["sweep"] = sweep(q13, q2, tokens)
                for kernel in ("up", "down"):
                    ranked = sorted(s[kernel], key=s[kernel].get)[:4]
                    default = f"{r[f'{kernel}_graph_us']:.1f} us with the default"
                    print(f"  sweep {kernel} ({default}): " + ", ".join(f"{c} {s[kernel][c]:.1f}" for c in ranked))
            torch.cuda.empty_cache()
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
