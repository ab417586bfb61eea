"""Decode's dense projections on CUDA: cuBLAS (`F.linear`) against the engine's Triton GEMV
(`edgemoe.kernels.dense_gemv.gemv`, its default config) and against that GEMV swept over configs, replayed from CUDA
graphs, against HBM bandwidth (a device-to-device copy) in the same run.

    python benchmarks/dense_gemv.py [--tokens 1,4] [--shapes qwen3] [--configs n4_k512_w4_s4,...] [--json OUT]
                                                                      (tokens <= 4: the GEMV's limit)

Each line prints cuBLAS | engine | best. `--configs` replaces the sweep's configs (nB_kK_wW_sS: BLOCK_N, BLOCK_K,
warps, stages), `--shapes` keeps the shapes whose names start with one of the given prefixes. Why the engine runs
this GEMV at one row, and how its configs were chosen: docs/findings.md, "Dense GEMV".

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

from edgemoe.kernels.dense_gemv import WARPS, gemv, pick_block_n, pick_steps
from edgemoe.tools.measure import bandwidths, capture, timed

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


def name(config: tuple[int, int, int, int]) -> str:
    return "n{}_k{}_w{}_s{}".format(*config)


def swept(x: torch.Tensor, w: torch.Tensor, config: tuple[int, int, int, int]) -> torch.Tensor:
    block_n, block_k, warps, stages = config
    return gemv(x, w, block_n=block_n, block_k=block_k, warps=warps, stages=stages)


def graph_us(call, reps: int = 20) -> float:
    graph = capture(lambda: [call(i) for i in range(SETS)])
    us = timed(graph.replay, torch.device("cuda"), reps) / SETS * 1e6
    del graph
    return us


def parse_config(text: str, flag: str = "--configs") -> tuple[int, int, int, int]:
    """'n4_k512_w4_s4' -> (BLOCK_N, BLOCK_K, warps, stages); a bad name exits with one line naming `flag`."""
    parts = text.split("_")
    if len(parts) != 4 or [p[:1] for p in parts] != ["n", "k", "w", "s"] or not all(p[1:].isdigit() for p in parts):
        raise SystemExit(f"{flag}: {text!r} is not nB_kK_wW_sS (e.g. n4_k512_w4_s4)")
    return tuple(int(p[1:]) for p in parts)


def measure(out_features: int, in_features: int, tokens: int, hbm: float, configs: list) -> dict:
    dev = torch.device("cuda")
    w = (torch.randn(SETS, out_features, in_features, device=dev) / in_features**0.5).bfloat16()
    x = torch.randn(SETS, tokens, in_features, device=dev).bfloat16()
    nbytes = out_features * in_features * 2
    ref = F.linear(x[0].double(), w[0].double())
    engine = (pick_block_n(out_features), pick_steps(in_features)[0], WARPS, pick_steps(in_features)[1])
    r = {"bytes": nbytes, "cublas_us": graph_us(lambda i: F.linear(x[i], w[i])), "engine": name(engine)}
    r["engine_us"] = graph_us(lambda i: gemv(x[i], w[i]))  # the engine's call: its default config
    r["candidate_us"] = {}
    for config in configs:
        got = swept(x[0], w[0], config).double()
        err = ((got - ref).abs().max() / ref.abs().max()).item()
        if err > 2**-7:  # one bf16 rounding of the output is 2^-8 relative: anything far past it is a wrong kernel
            raise AssertionError(f"config {name(config)} is wrong: max error {err:.1e} relative to the largest output")
        r["candidate_us"][name(config)] = graph_us(lambda i, c=config: swept(x[i], w[i], c))
    best = min(r["candidate_us"], key=r["candidate_us"].get)
    r["best"], r["best_us"] = best, r["candidate_us"][best]
    for key in ("cublas", "engine", "best"):
        r[f"{key}_over_hbm"] = nbytes / (r[f"{key}_us"] / 1e6) / hbm
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1,4", help="decode batch sizes (default: 1,4)")
    ap.add_argument("--shapes", default="", help="name prefixes, comma-separated (default: every shape)")
    ap.add_argument("--configs", default="", help="nB_kK_wW_sS, comma-separated (default: the sweep's)")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    configs = [parse_config(c) for c in a.configs.split(",")] if a.configs else CONFIGS
    prefixes = [p for p in a.shapes.split(",") if p]
    shapes = {k: v for k, v in SHAPES.items() if not prefixes or any(k.startswith(p) for p in prefixes)}
    if not shapes:
        raise SystemExit(f"--shapes {a.shapes!r} matches none of {list(SHAPES)}")
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/dense_gemv.py needs a CUDA GPU")
    hbm = bandwidths(torch.device("cuda"), 1 << 20)["hbm_bytes_per_s"]
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "hbm": hbm}
    print(
        f"{results['device']}: HBM copy {hbm / 1e9:.0f} GB/s; shape, T: cuBLAS | engine | best config (graph replays)"
    )
    for (shape, (n, k)), tokens in itertools.product(shapes.items(), map(int, a.tokens.split(","))):
        r = results[f"{shape}/T{tokens}"] = measure(n, k, tokens, hbm, configs)
        us = {
            key: f"{r[key + '_us']:6.1f} us ({r[key + '_over_hbm']:.2f} of HBM)" for key in ("cublas", "engine", "best")
        }
        print(
            f"{shape:>34} T={tokens}: {us['cublas']} | {us['engine']} {r['engine']} "
            f"{r['cublas_us'] / r['engine_us']:.2f}x | {us['best']} {r['best']} {r['cublas_us'] / r['best_us']:.2f}x"
        )
        torch.cuda.empty_cache()
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
