"""Prefill with offloaded experts against resident prefill and the streaming bound (#36): one chunk of N prompt tokens
through the model runner, on a random-weight model of a real geometry.

    python benchmarks/prefill_stream.py [--geometry qwen3-30b-a3b] [--layers 12] [--fraction 0.25 | --vram-budget 16GiB]
                                        [--tokens 512,4096,16384] [--json OUT]

Offloaded: the expert cache holds `--fraction` of all experts, or what `--vram-budget` leaves beside the dense weights,
the KV cache and the longest prompt's activations (`edgemoe.engine.activations`), as the engine sizes it (at least two
layers' worth and not all, so prefill may stream whole layers: `edgemoe.offload.prefill_stream`, which does while most
of a chunk's experts miss; a warm-up leaves the last two layers cached); resident: every expert on
the device, the same values. Per N: seconds of each, the expert bytes the offloaded prefill copied (the cache's stats),
and two bounds from figures of the same run: `serial` = bytes / H2D rate + resident seconds (copy and compute one after
the other, the issue's bound) and `overlap` = max(bytes / H2D rate, resident seconds) (perfect overlap, the tighter
one). A ratio is bound / measured time (1.0: at the bound). Each N is timed after a warm-up prefill of the same N
(compilation, allocator).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys

import torch

from edgemoe.config import ExpertCacheConfig, parse_size
from edgemoe.engine.activations import prefill_activation_bytes
from edgemoe.offload.experts import attach_expert_cache, cache_slots, expert_bytes
from edgemoe.tools.bench import build_model, make_runner, prefill
from edgemoe.tools.measure import bandwidths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--geometry", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=12, help="layers of the geometry (default 12)")
    ap.add_argument("--fraction", type=float, default=0.25, help="experts cached, offloaded (default 0.25)")
    ap.add_argument("--vram-budget", help="size the cache from a device memory budget instead, e.g. 16GiB")
    ap.add_argument("--tokens", default="512,4096,16384", help="prompt tokens, one chunk each")
    ap.add_argument("--device", default="cuda", help="cuda (the figures); cpu runs a smoke test without bounds")
    ap.add_argument("--json")
    a = ap.parse_args()
    device = torch.device(a.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tokens = [int(t) for t in a.tokens.split(",")]
    longest = max(tokens)
    result = {"geometry": a.geometry, "layers": a.layers, "fraction": a.fraction, "runs": []}
    times: dict[str, dict[int, float]] = {"offload": {}, "resident": {}}
    copied: dict[int, int] = {}
    for strategy in ("offload", "resident"):
        model = build_model(a.geometry, a.layers, device, dtype, longest + 16, strategy == "resident")
        runner = make_runner(model, longest + 16)
        cache = None
        if strategy == "offload":
            per = expert_bytes(model, dtype)
            result["expert_bytes"] = per
            result.update(bandwidths(device, per))
            if a.vram_budget:
                cfg, kv = model.config, runner.kv
                dense = sum(t.numel() * t.element_size() for n, t in model.named_parameters() if ".experts." not in n)
                acts = prefill_activation_bytes(cfg, longest, 1, longest + 16, dtype)
                room = parse_size(a.vram_budget) - dense - 2 * kv.k.numel() * kv.k.element_size() - acts
                moe = ExpertCacheConfig(moe_strategy="offload", vram_budget=a.vram_budget)
                slots = cache_slots(moe, cfg, 1, per, room)
            else:
                moe = ExpertCacheConfig(moe_strategy="offload", moe_cache_fraction=a.fraction)
                slots = cache_slots(moe, model.config, 1, per, None)
            cache = attach_expert_cache(model, slots, "lru", True, device, dtype)
            total = model.config.num_experts * sum(model.config.moe_layers)
            result |= {"slots": slots, "vram_budget": a.vram_budget, "streams": cache.prefill_stream is not None}
            print(f"{slots} slots ({slots / total:.0%}); streamed prefill: {result['streams']}", file=sys.stderr)
        with torch.inference_mode():
            for n in tokens:
                prefill(runner, n)  # warm-up
                before = int(cache.stats[:, 4].sum()) if cache is not None else 0
                times[strategy][n] = prefill(runner, n)
                if cache is not None:
                    copied[n] = int(cache.stats[:, 4].sum()) - before
                print(f"  {strategy:>8} {n:>6} tokens: {n / times[strategy][n]:9.1f} tok/s", file=sys.stderr)
        del runner, model, cache
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    h2d = result["h2d_bytes_per_s"] or float("inf")  # no bound off CUDA
    for n in tokens:
        t_off, t_res = times["offload"][n], times["resident"][n]
        copy = copied[n] / h2d
        run = {
            "tokens": n, "offload_s": t_off, "resident_s": t_res, "bytes_copied": copied[n], "copy_s": copy,
            "offload_tok_s": n / t_off, "resident_tok_s": n / t_res,
            "serial_bound_ratio": (copy + t_res) / t_off, "overlap_bound_ratio": max(copy, t_res) / t_off,
        }  # fmt: skip
        result["runs"].append(run)
        line = (
            f"{n:>6} tokens: offloaded {n / t_off:8.1f} tok/s, resident {n / t_res:8.1f} tok/s; copied "
            f"{copied[n] / 2**30:.1f} GiB ({copy * 1e3:.0f} ms at {h2d / 1e9:.1f} GB/s); bound ratio serial "
            f"{run['serial_bound_ratio']:.2f}, overlap {run['overlap_bound_ratio']:.2f}"
        )
        print(line, file=sys.stderr)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
