"""Quantized weights in matrix products, against bf16 and HBM in one run on one GPU:

    python benchmarks/quant_matmul.py [--tokens 1,4] [--prefill 512,4096] [--sweep] [--json OUT]

- decode: `quant_gemv.quant_linear` on qwen3-30b-a3b's projections as a Q4_K_M file stores them (qkv: q and k in
  Q4_K, v in Q6_K; o in Q4_K; the lm_head in Q6_K), GB/s of blocks read and its ratio to a device copy; beside it
  `dense_gemv.gemv` on the same shapes in bf16. Small weights rotate over copies so that L2 does not serve them.
- dequantization (`dequant.dequantize_rows`): one MoE layer's 128 experts, GB/s read + written against the copy.
- prefill: `dequant.quant_pair_outputs` (waves of experts dequantized, then the bf16 grouped GEMM; Q4_K gate_up and
  Q6_K down, Q4_K_M's experts; and Q8_0) against `grouped_gemm` on bf16 banks, one MoE layer of qwen3-30b-a3b (128
  experts, top 8) at each token count: ms and TFLOP/s.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path

import torch

DEV = torch.device("cuda")
H, INTER, EXPERTS, TOP_K = 2048, 768, 128, 8
# name -> (rows per part and format...), in_features: qwen3-30b-a3b as a Q4_K_M file stores it
DENSE = {
    "qkv": ([(4096 + 512, "Q4_K"), (512, "Q6_K")], 2048),
    "o": ([(2048, "Q4_K")], 4096),
    "lm_head": ([(151936, "Q6_K")], 2048),
}
L2_BYTES = 64 << 20  # more than an H100's or H200's L2: rotate copies up to 4x this


def seconds(call: Callable[[int], object], sets: int, reps: int = 20) -> float:
    """Seconds per call: `sets` calls (one per input set) captured in one graph, replayed."""
    from edgemoe.tools.measure import capture, timed

    graph = capture(lambda: [call(i) for i in range(sets)])
    t = timed(graph.replay, DEV, reps) / sets
    del graph
    return t


def dense_case(name: str, tokens: int, hbm: float, sweep: bool = False) -> dict:
    from edgemoe.kernels.dense_gemv import gemv
    from edgemoe.kernels.quant_gemv import quant_linear
    from edgemoe.quant import random_blocks

    parts, K = DENSE[name]
    g = torch.Generator().manual_seed(0)
    one = [random_blocks((rows, K), q, g, std=K**-0.5).to(DEV) for rows, q in parts]
    nbytes = sum(w.numel() for w in one)
    sets = max(1, min(16, 4 * L2_BYTES // nbytes))
    weights = [[w.clone() for w in one] for _ in range(sets)]
    N = sum(rows for rows, _ in parts)
    x = torch.randn(sets, tokens, K, device=DEV, dtype=torch.bfloat16)
    out = torch.empty(tokens, N, device=DEV, dtype=torch.bfloat16)

    def call(i: int, tile: tuple[int, int] | None = None) -> None:
        start = 0
        for (rows, q), w in zip(parts, weights[i]):
            quant_linear(x[i], w, q, out=out[:, start : start + rows], tile=tile)
            start += rows

    t = seconds(call, sets)
    r = {"bytes": nbytes, "us": t * 1e6, "over_hbm": nbytes / t / hbm, "sets": sets}
    bf = [torch.randn(N, K, device=DEV, dtype=torch.bfloat16) / math.sqrt(K) for _ in range(max(1, sets // 4))]
    tb = seconds(lambda i: gemv(x[i], bf[i % len(bf)], None), sets)
    r |= {"bf16_us": tb * 1e6, "bf16_over_hbm": N * K * 2 / tb / hbm}
    if sweep and tokens == 1:  # rows a program, warps
        r["sweep"] = {f"r{n}_w{w}": seconds(lambda i, t=(n, w): call(i, t), sets) * 1e6
                      for n in (2, 4, 8, 16, 32) for w in (2, 4, 8)}  # fmt: skip
    return r


def banks(q13: str, q2: str) -> tuple[torch.Tensor, torch.Tensor]:
    from edgemoe.quant import random_blocks

    g, tile = torch.Generator().manual_seed(1), 8
    w13 = random_blocks((tile, 2 * INTER, H), q13, g, std=H**-0.5).to(DEV).repeat(EXPERTS // tile, 1, 1)
    w2 = random_blocks((tile, H, INTER), q2, g, std=INTER**-0.5).to(DEV).repeat(EXPERTS // tile, 1, 1)
    return w13, w2


def dequant_case(hbm: float) -> dict:
    from edgemoe.kernels.dequant import dequantize_rows

    w13, w2 = banks("Q4_K", "Q6_K")
    idx = torch.arange(EXPERTS, device=DEV)
    t = seconds(lambda i: (dequantize_rows(w13, idx, "Q4_K", H), dequantize_rows(w2, idx, "Q6_K", INTER)), 1)
    moved = w13.numel() + w2.numel() + EXPERTS * 3 * H * INTER * 2
    return {"us": t * 1e6, "bytes": moved, "over_hbm": moved / t / hbm}


def prefill_case(q13: str, q2: str, tokens: int) -> dict:
    from edgemoe.kernels.dequant import quant_pair_outputs
    from edgemoe.kernels.grouped_gemm import grouped_gemm
    from edgemoe.moe.experts import sum_pairs

    w13, w2 = banks(q13, q2)
    x = torch.randn(tokens, H, device=DEV, dtype=torch.bfloat16)
    ids = torch.rand(tokens, EXPERTS, device=DEV).argsort(dim=-1)[:, :TOP_K]
    wts = torch.rand(tokens, TOP_K, device=DEV)
    flops = 2 * tokens * TOP_K * 3 * H * INTER
    from edgemoe.tools.measure import timed

    # eager (its one host sync a call), as prefill runs it
    t = timed(lambda: sum_pairs(quant_pair_outputs(x, ids.flatten(), wts.flatten(), w13, w2, q13, q2), TOP_K), DEV, 5)
    b13 = torch.randn(EXPERTS, 2 * INTER, H, device=DEV, dtype=torch.bfloat16) / math.sqrt(H)
    b2 = torch.randn(EXPERTS, H, INTER, device=DEV, dtype=torch.bfloat16) / math.sqrt(INTER)
    tb = timed(lambda: grouped_gemm(x, ids, wts, b13, b2), DEV, 5)
    return {"ms": t * 1e3, "tflops": flops / t / 1e12, "bf16_ms": tb * 1e3, "bf16_tflops": flops / tb / 1e12}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1,4", help="decode batch sizes")
    ap.add_argument("--prefill", default="512,4096", help="prefill token counts (0: none)")
    ap.add_argument("--sweep", action="store_true", help="also time quant_linear's rows a program and warps")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/quant_matmul.py needs a CUDA GPU; none is visible")
    from edgemoe.tools.measure import bandwidths

    hbm = bandwidths(DEV, 1 << 20)["hbm_bytes_per_s"]
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "hbm": hbm, "dense": {}, "prefill": {}}
    print(f"{res['device']}: HBM copy {hbm / 1e9:.0f} GB/s; qwen3-30b-a3b as a Q4_K_M file stores it")
    for tokens in map(int, a.tokens.split(",")):
        for name in DENSE:
            r = res["dense"][f"{name}/T{tokens}"] = dense_case(name, tokens, hbm, a.sweep)
            line = f"decode {name} T={tokens}: {r['us']:.1f} us, {r['over_hbm']:.2f} of HBM"
            print(f"{line} | bf16 gemv {r['bf16_us']:.1f} us, {r['bf16_over_hbm']:.2f}")
            if "sweep" in r:
                best = sorted(r["sweep"], key=r["sweep"].get)[:5]
                print("  sweep: " + ", ".join(f"{k} {r['sweep'][k]:.1f}" for k in best))
            torch.cuda.empty_cache()
    r = res["dequant"] = dequant_case(hbm)
    print(f"dequantize 128 Q4_K_M experts to bf16: {r['us']:.0f} us, {r['over_hbm']:.2f} of HBM (read + write)")
    for tokens in (int(t) for t in a.prefill.split(",") if int(t)):
        for q13, q2 in (("Q4_K", "Q6_K"), ("Q8_0", "Q8_0")):
            r = res["prefill"][f"{q13}+{q2}/{tokens}"] = prefill_case(q13, q2, tokens)
            print(
                f"prefill {q13}+{q2} {tokens} tokens: {r['ms']:.2f} ms, {r['tflops']:.0f} TFLOP/s | bf16 "
                f"{r['bf16_ms']:.2f} ms, {r['bf16_tflops']:.0f} TFLOP/s"
            )
            torch.cuda.empty_cache()
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
