"""`ensure` on CUDA: the fused Triton kernel (`edgemoe.kernels.ensure`) against the plain-torch `_ensure_torch` on
the same device, per call, both captured in a CUDA graph (as decode runs them), for real geometries.

    python benchmarks/ensure.py [--tokens 1] [--steps 16] [--geometries qwen3-30b-a3b] [--sweep] [--json OUT]

Each geometry's whole model is one cache (all MoE layers, a quarter or half of all experts as slots) driven by
the synthetic routing trace `edgemoe bench` uses; the cache is first warmed eagerly over the trace, then `steps`
decode steps (every layer's ensure) are captured once per implementation and replayed. Both implementations see
the same trace rows from the same warm state, so they do the same work (hits, misses, victim searches).
`--sweep` times the fused kernel alone over slots per step of its key pass (`ensure_fused`'s `block_s`; the engine's
`BLOCK_S` is the default), at the engine's warps.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from edgemoe.kernels.ensure import BLOCK_S, NUM_WARPS, ensure_fused
from edgemoe.offload.expert_cache import ExpertCache
from edgemoe.tools.cache_sim import synthetic_trace
from edgemoe.tools.measure import capture, timed
from edgemoe.tools.presets import PRESETS

GEOMETRIES = ("qwen3-30b-a3b", "qwen1.5-moe-a2.7b", "mixtral-8x7b")


def per_call_us(
    geometry: str, fraction: float, policy: str, tokens: int, steps: int, fused: bool, block_s: int | None = None
) -> float:
    """µs per `ensure` call; `fused` False: the plain-torch oracle; `block_s`: the fused kernel's key-pass step."""
    p = PRESETS[geometry]
    L, E = p["num_hidden_layers"], p.get("num_experts") or p["num_local_experts"]
    k = p["num_experts_per_tok"]
    S = max(round(fraction * L * E), min(E, tokens * k))
    trace = synthetic_trace(4 * steps + 64, L, E, k, skew=1.0, repeat=0.3, seed=0)  # [steps, layers, k]
    ids = torch.from_numpy(trace).long().cuda()
    cache = ExpertCache(L, E, S, policy, "cuda", 1, collect_stats=True)
    if not fused:
        ensure = cache._ensure_torch
    elif block_s is None:
        ensure = cache.ensure
    else:

        def ensure(layer: int, ids: torch.Tensor) -> object:
            return ensure_fused(cache, layer, ids, block_s=block_s)

    def step(rows: torch.Tensor) -> None:  # rows: [layers, k] for token 0; more tokens repeat other rows
        for layer in range(L):
            ensure(layer, torch.stack([rows[(layer + t) % L] for t in range(tokens)]))

    for s in range(64):  # warm: the cache fills and the policy state settles
        step(ids[s])
    window = ids[64 : 64 + steps]
    graph = capture(lambda: [step(window[s]) for s in range(steps)])
    return timed(graph.replay, torch.device("cuda"), 5) / (steps * L) * 1e6


SWEEP = (1024, 2048, 4096)  # BLOCK_S candidates


def sweep(geometry: str, fraction: float, policy: str, tokens: int, steps: int) -> dict[str, float]:
    """The fused kernel's µs per call at each key-pass step of SWEEP."""
    return {f"s{b}": per_call_us(geometry, fraction, policy, tokens, steps, True, b) for b in SWEEP}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1, help="decode batch (distinct ids per layer: up to tokens x k)")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--geometries", default=",".join(GEOMETRIES), help="comma-separated (default: all three)")
    ap.add_argument("--sweep", action="store_true", help="the fused kernel over its key-pass step instead")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    geometries = [g for g in a.geometries.split(",") if g]
    unknown = sorted(set(geometries) - set(GEOMETRIES))
    if unknown:
        ap.error(f"unknown geometries {unknown}; choose from {', '.join(GEOMETRIES)}")
    rows = []
    for geometry in geometries:
        for fraction in (0.25, 0.5):
            for policy in ("lru", "scored"):
                row = dict(geometry=geometry, fraction=fraction, policy=policy)
                if a.sweep:
                    row["fused_us"] = sweep(geometry, fraction, policy, a.tokens, a.steps)
                    line = " ".join(f"{k} {v:5.1f}" for k, v in row["fused_us"].items())
                    engine = f"engine s{BLOCK_S}, {NUM_WARPS} warps"
                    print(f"{geometry:>18} {fraction:.0%} {policy:>6}: us per call ({engine}): {line}")
                else:
                    fused = per_call_us(geometry, fraction, policy, a.tokens, a.steps, True)
                    torch_ = per_call_us(geometry, fraction, policy, a.tokens, a.steps, False)
                    row.update(fused_us=fused, torch_us=torch_)
                    print(
                        f"{geometry:>18} {fraction:.0%} {policy:>6}: fused {fused:6.1f} us, torch {torch_:6.1f} us "
                        f"per call ({torch_ / fused:.1f}x)"
                    )
                rows.append(row)
    if a.json:
        a.json.write_text(
            json.dumps({"device": torch.cuda.get_device_name(), "tokens": a.tokens, "rows": rows}, indent=1)
        )


if __name__ == "__main__":
    main()
