"""The MoE router of decode on CUDA: `fused_route` (`edgemoe.kernels.router`: the gate GEMV, then the routing) against
torch's path (`F.linear` + `edgemoe.moe.router.route` + `SparseMoE._routed`'s padding-row substitution), both replayed
from CUDA graphs, per geometry and decode batch.

    python benchmarks/router.py [--dtype bfloat16] [--tokens 1,4] [--sweep] [--json OUT]

Each graph holds `calls` routes, each on its own gate and hidden states from a bank of at least twice the L2 cache,
so that every call reads its gate from HBM as decode does (one gate per layer, the experts' weights in between).
"of HBM": gate bytes per call over the time of a call, as a fraction of a device-to-device copy's rate (read +
write bytes) in the same run. `gemv` times `gate_logits` alone, `routing` `route_logits` alone; `--sweep` times
the GEMV per experts-per-program choice.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from edgemoe.engine.cuda_graphs import capture_graph
from edgemoe.moe.router import route
from edgemoe.tools.measure import bandwidths, timed

DEV = torch.device("cuda")
# name -> (hidden, experts, top_k, normalize)
GEOMETRIES = {
    "qwen3-30b-a3b": (2048, 128, 8, True),
    "qwen1.5-moe-a2.7b": (2048, 60, 4, False),
    "mixtral-8x7b": (4096, 8, 2, True),
    "large-4096x512": (4096, 512, 10, True),
}
MAX_CALLS = 2048  # routes per graph (mixtral's 64 KiB gate needs ~2000 to pass twice the L2)


def torch_route(
    x: torch.Tensor, w: torch.Tensor, top_k: int, normalize: bool, valid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """What `SparseMoE._routed` ran in decode before the fused kernel."""
    ids, weights = route(F.linear(x, w), top_k, normalize)
    return torch.where(valid[:, None], ids, ids[:1]), weights


def graph_us(call: Callable[[int], object], calls: int, reps: int = 10) -> float:
    """Microseconds per call, `calls` calls (one per bank entry) captured in one graph and replayed."""
    graph, _ = capture_graph(lambda: [call(i) for i in range(calls)])  # eager once (compiles), then captured
    us = timed(graph.replay, DEV, reps) / calls * 1e6
    del graph
    return us


def measure(geometry: tuple[int, int, int, bool], tokens: int, dtype: torch.dtype, hbm: float, sweep: bool) -> dict:
    from edgemoe.kernels.router import fused_route, gate_logits, route_logits

    H, E, top_k, normalize = geometry
    gate_bytes = E * H * torch.finfo(dtype).bits // 8
    l2 = torch.cuda.get_device_properties(DEV).L2_cache_size
    calls = min(MAX_CALLS, max(16, -(-2 * l2 // gate_bytes)))
    w = (2 * torch.randn(calls, E, H, device=DEV) / H**0.5).to(dtype)  # [calls, E, H]: logits of a few units
    x = torch.randn(calls, tokens, H, device=DEV).to(dtype)  # [calls, tokens, H]
    logits = torch.bmm(x, w.transpose(1, 2))  # [calls, tokens, E]
    valid = torch.ones(tokens, dtype=torch.bool, device=DEV)  # decode graphs pass one; all rows real here
    ids_fused = torch.stack([fused_route(x[i], w[i], top_k, normalize, valid)[0] for i in range(16)])
    ids_torch = torch.stack([torch_route(x[i], w[i], top_k, normalize, valid)[0] for i in range(16)])
    r = {
        "hidden": H, "experts": E, "top_k": top_k, "tokens": tokens, "calls": calls, "gate_bytes": gate_bytes,
        "ids_agree": (ids_fused == ids_torch).all(-1).float().mean().item(),  # ties and rounding may differ
        "fused_us": graph_us(lambda i: fused_route(x[i], w[i], top_k, normalize, valid), calls),
        "torch_us": graph_us(lambda i: torch_route(x[i], w[i], top_k, normalize, valid), calls),
        "gemv_us": graph_us(lambda i: gate_logits(x[i], w[i]), calls),
        "routing_us": graph_us(lambda i: route_logits(logits[i], top_k, normalize, valid), calls),
    }  # fmt: skip
    r["speedup"] = r["torch_us"] / r["fused_us"]
    r["fused_over_hbm"] = gate_bytes / (r["fused_us"] / 1e6) / hbm
    r["gemv_over_hbm"] = gate_bytes / (r["gemv_us"] / 1e6) / hbm
    if sweep:
        blocks = [b for b in (1, 2, 4, 8, 16, 32, 64) if b < 2 * E]  # up to next_power_of_2(E)
        r["gemv_us_by_block_e"] = {
            b: graph_us(lambda i, b=b: gate_logits(x[i], w[i], block_e=b), calls) for b in blocks
        }
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--tokens", default="1,4", help="decode batch sizes (default: 1,4)")
    ap.add_argument("--sweep", action="store_true", help="also time the GEMV per experts-per-program choice")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/router.py times CUDA graphs of Triton kernels: it needs a CUDA GPU")
    dtype = getattr(torch, a.dtype)
    hbm = bandwidths(DEV, 1 << 20)["hbm_bytes_per_s"]
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "dtype": a.dtype, "hbm": hbm}
    print(f"{results['device']}, {a.dtype}: HBM copy {hbm / 1e9:.0f} GB/s (read + write)")
    for name, geometry in GEOMETRIES.items():
        for tokens in map(int, a.tokens.split(",")):
            r = results[f"{name}/T{tokens}"] = measure(geometry, tokens, dtype, hbm, a.sweep)
            print(
                f"{name:>18} T={tokens}: fused {r['fused_us']:5.1f} us ({r['fused_over_hbm']:.0%} of HBM), "
                f"torch {r['torch_us']:5.1f} us ({r['speedup']:.1f}x) | gemv {r['gemv_us']:4.1f} us "
                f"({r['gemv_over_hbm']:.0%}), routing {r['routing_us']:4.1f} us | ids agree {r['ids_agree']:.0%}"
            )
            if a.sweep:
                print("  gemv by block_e: " + ", ".join(f"{b} {us:.1f}" for b, us in r["gemv_us_by_block_e"].items()))
            torch.cuda.empty_cache()
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
