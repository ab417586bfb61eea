"""Where an offloaded decode step spends GPU time: kernels of a few eager steps under torch.profiler, grouped.

    python benchmarks/offload_profile.py [--geometry qwen3-30b-a3b] [--layers 8] [--fraction 0.25] [--policy lru]

Builds the `edgemoe bench` model (random weights, synthetic skewed routing), warms the cache, profiles `--steps`
eager steps and prints per step: kernel count and summed GPU time, and the top kernels by GPU time. Kernel times
are those a CUDA graph replays too; the graph removes the launch gaps, not the kernels.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import torch
from edgemoe.bench import Decoder, build_model
from edgemoe.moe.cache_sim import synthetic_trace
from edgemoe.moe.offload import attach_expert_cache
from torch.profiler import ProfilerActivity, profile

from edgemoe.engine.kv_cache import KVCache


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--geometry", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--fraction", type=float, default=0.25)
    ap.add_argument("--policy", default="lru")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    model = build_model(a.geometry, a.layers, torch.device("cuda"), torch.bfloat16)
    cfg = model.config
    L = sum(cfg.moe_layers)
    kv = KVCache(cfg, -(-(a.context + 64) // 16), 16, torch.bfloat16, torch.device("cuda"))
    kv.bind([layer.self_attn.attn for layer in model.model.layers])
    attach_expert_cache(model, round(a.fraction * L * cfg.num_experts), a.policy, True, "cuda", torch.bfloat16)
    dec = Decoder(model, kv, a.context, synthetic_trace(64, L, cfg.num_experts, cfg.top_k, 1.0, 0.3, seed=0))
    with torch.inference_mode():
        for _ in range(16):
            dec.step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(a.steps):
                dec.step()
            torch.cuda.synchronize()
    dec.close()
    kernels: dict[str, list[float]] = defaultdict(list)
    for e in prof.events():
        if e.device_type.name == "CUDA":
            kernels[e.name[:90]].append(e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total)
    count = sum(len(v) for v in kernels.values()) / a.steps
    total = sum(sum(v) for v in kernels.values()) / a.steps
    top = sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:25]
    print(
        f"{a.geometry} {cfg.num_layers} layers, {a.fraction:.0%} cached, {a.policy}: {count:.0f} kernels and "
        f"{total / 1e3:.2f} ms of GPU time per step ({count / cfg.num_layers:.0f} kernels per layer)"
    )
    rows = []
    for name, times in top:
        rows.append({"kernel": name, "per_step": len(times) / a.steps, "us_per_step": sum(times) / a.steps})
        print(f"{sum(times) / a.steps:9.1f} us {len(times) / a.steps:6.0f}x  {name}")
    if a.json:
        a.json.write_text(json.dumps({"kernels_per_step": count, "gpu_us_per_step": total, "top": rows}, indent=1))


if __name__ == "__main__":
    main()
