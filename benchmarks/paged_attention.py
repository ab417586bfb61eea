"""Paged decode attention on CUDA: the Triton kernel (`edgemoe.kernels.paged_attention`) against its reference
`PagedAttention._decode_torch`, contexts of 4K and 32K tokens at batch 1 and 4, each in block tables padded to a 40K
width (CUDA-graph decode's, qwen3's max_model_len) and in tables as wide as the context, against HBM bandwidth (a
device-to-device copy) in the same run; gpt-oss's layers too: a sliding one (a window of 128 and sinks), which reads
only its window's blocks (at a 32K context ~1/250 of the KV the context holds), and a full one with sinks.

    python benchmarks/paged_attention.py [--dtype bfloat16] [--width 40960] [--shapes qwen3] [--sweep] [--json OUT]

KV bytes per call = the K and V bytes attention must read (the contexts', or their windows'); "of copy" is their
rate over the copy's (read + write) rate. Calls cycle over `layers` KV caches sharing one block table (as decode's
layers do), enough that they do not fit in L2 (and within 16 GiB), so repeated calls do not measure the L2 cache.
The graph figure is what decode runs (the calls of all layers captured in one graph); the eager one includes launch
overhead. The kernel runs with the splits `choose_splits` picks for this GPU (the engine's); the splits line times
forced splits S next to it, so one run shows whether the pick is the best. `--sweep` times the kernel over tiles,
warps and pipeline stages at the chosen splits.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
from collections.abc import Callable
from pathlib import Path

import torch

from edgemoe.context import ForwardContext
from edgemoe.kernels.paged_attention import (
    BLOCK_N,
    PROGRAMS_PER_SM,
    STAGES,
    WARPS,
    choose_splits,
    min_split_tiles,
    paged_decode_attention,
)
from edgemoe.layers.attention import PagedAttention
from edgemoe.tools.measure import bandwidths, capture, timed

DEV = torch.device("cuda")
BLOCK_SIZE = 16  # the engine's default
# (heads, kv_heads, head_dim, window, sinks)
SHAPES = {
    "16/16/128 (olmoe, qwen1.5-moe)": (16, 16, 128, None, False),
    "32/4/128 (qwen3-30b-a3b)": (32, 4, 128, None, False),
    "4/1/64 (mqa)": (4, 1, 64, None, False),
    "64/8/64 plain (gpt-oss's shape without sinks or window)": (64, 8, 64, None, False),
    "64/8/64 window 128 + sinks (gpt-oss sliding)": (64, 8, 64, 128, True),
    "64/8/64 sinks (gpt-oss full)": (64, 8, 64, None, True),
}
CACHE_LIMIT = 16 << 30  # the layers' caches together (a window reads little of a cache that holds the context)
FORCED_SPLITS = (1, 8, 32, 64, 128, 256)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Problem:
    """`layers` caches [slots, kv_heads, dim], one block table: `batch` sequences of `context` tokens on shuffled
    blocks, padded with the pad block to `width` tokens; one query per layer."""

    def __init__(self, shape: tuple, batch: int, context: int, width: int, dtype) -> None:
        heads, kv_heads, dim, self.window, sinks = shape
        used = -(-context // BLOCK_SIZE)
        num_blocks = batch * used
        self.cache_bytes = 2 * batch * context * kv_heads * dim * dtype.itemsize  # what the contexts hold
        read = context if self.window is None else min(context, self.window)
        self.kv_bytes = 2 * batch * read * kv_heads * dim * dtype.itemsize
        l2 = getattr(torch.cuda.get_device_properties(DEV), "L2_cache_size", 50 << 20)
        slots = (num_blocks + 1) * BLOCK_SIZE
        by_memory = CACHE_LIMIT // (2 * slots * kv_heads * dim * dtype.itemsize)
        self.layers = max(2, min(64, math.ceil(4 * l2 / self.kv_bytes), by_memory))
        self.k = torch.randn(self.layers, slots, kv_heads, dim, device=DEV).to(dtype)
        self.v = torch.randn(self.layers, slots, kv_heads, dim, device=DEV).to(dtype)
        self.q = torch.randn(self.layers, batch, heads, dim, device=DEV).to(dtype)
        self.tables = torch.full((batch, width // BLOCK_SIZE), num_blocks, dtype=torch.long, device=DEV)
        self.tables[:, :used] = torch.randperm(num_blocks, device=DEV).view(batch, used)
        self.lens = torch.full((batch,), context, dtype=torch.long, device=DEV)
        sms = torch.cuda.get_device_properties(DEV).multi_processor_count
        self.splits = choose_splits(kv_heads, sms)  # what the kernel picks with splits=None
        # the kernel's split length at this context (on the device there), for the report
        min_tiles = min_split_tiles(kv_heads, self.splits, sms)
        keys = context if self.window is None else context - max(0, context - self.window) // BLOCK_N * BLOCK_N
        self.split_len = max(min_tiles, cdiv(cdiv(keys, self.splits), BLOCK_N)) * BLOCK_N
        self.programs = batch * kv_heads * self.splits  # the partial kernel's grid
        self.active = batch * kv_heads * cdiv(keys, self.split_len)  # its programs that hold tokens
        self.attn = []
        sink_values = torch.randn(heads, device=DEV)
        for i in range(self.layers):
            attn = PagedAttention(heads, kv_heads, dim, self.window, sinks).to(DEV)
            if sinks:
                attn.sinks.data = sink_values
            attn.bind(self.k[i], self.v[i], BLOCK_SIZE)
            self.attn.append(attn)
        self.ctx = ForwardContext(False, torch.empty(0, dtype=torch.long, device=DEV), self.lens, self.tables)

    def kernel(self, i: int, **opts) -> torch.Tensor:
        a = self.attn[i]
        return paged_decode_attention(
            self.q[i], a.k_cache, a.v_cache, self.tables, self.lens, a.scale, BLOCK_SIZE, a.window, a.sinks, **opts
        )

    def reference(self, i: int) -> torch.Tensor:
        return self.attn[i]._decode_torch(self.q[i], self.ctx)


def graph_seconds(call: Callable[[int], object], layers: int, reps: int = 10) -> float:
    """Seconds per call: one call per layer captured in one graph, replayed."""
    graph = capture(lambda: [call(i) for i in range(layers)])  # warm-up (compile, allocator), then capture
    seconds = timed(graph.replay, DEV, reps) / layers
    del graph
    return seconds


def eager_seconds(call: Callable[[int], object], layers: int, reps: int = 3) -> float:
    counter = itertools.count()
    return timed(lambda: call(next(counter) % layers), DEV, reps * layers)


def measure(p: Problem, hbm: float, sweep: bool) -> dict:
    ref = p.reference(0).float()
    diff = (p.kernel(0).float() - ref).abs().max().item()
    r = {"kv_bytes": p.kv_bytes, "context_kv_bytes": p.cache_bytes, "layers": p.layers, "max_abs_diff_vs_torch": diff}
    r.update(splits=p.splits, split_len=p.split_len, partial_programs=p.programs, partial_programs_with_tokens=p.active)
    for mode, seconds in (("graph", graph_seconds), ("eager", eager_seconds)):
        for name, call in (("kernel", p.kernel), ("torch", p.reference)):
            r[f"{name}_{mode}_us"] = seconds(call, p.layers) * 1e6
        r[f"speedup_{mode}"] = r[f"torch_{mode}_us"] / r[f"kernel_{mode}_us"]
    for name in ("kernel", "torch"):
        r[f"{name}_kv_bytes_per_s"] = p.kv_bytes / (r[f"{name}_graph_us"] / 1e6)
        r[f"{name}_over_copy"] = r[f"{name}_kv_bytes_per_s"] / hbm
    r["splits_graph_us"] = {
        s: graph_seconds(lambda i, o=s: p.kernel(i, splits=o), p.layers) * 1e6 for s in FORCED_SPLITS
    }
    r["splits_over_copy"] = {s: p.kv_bytes / (us / 1e6) / hbm for s, us in r["splits_graph_us"].items()}
    if sweep:
        r["sweep_graph_us"] = {}
        for block_n, warps, stages in itertools.product((32, 64, 128), (4, 8), (1, 2, 3)):
            opts = dict(splits=p.splits, block_n=block_n, num_warps=warps, stages=stages)
            key = f"n{block_n}_w{warps}_s{stages}"
            try:
                r["sweep_graph_us"][key] = graph_seconds(lambda i, o=opts: p.kernel(i, **o), p.layers) * 1e6
            except Exception as exc:  # e.g. out of shared memory: reported, not fatal
                r.setdefault("sweep_errors", {})[key] = f"{type(exc).__name__}: {exc}"
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--width", type=int, default=40960, help="padded block-table width in tokens (default: 40960)")
    ap.add_argument("--contexts", default="4096,32768", help="context lengths (default: 4096,32768)")
    ap.add_argument("--batches", default="1,4", help="decode batch sizes (default: 1,4)")
    ap.add_argument(
        "--shapes",
        default="",
        help="only the shapes whose name contains one of these, comma-separated (e.g. qwen3; default: all)",
    )
    ap.add_argument("--sweep", action="store_true", help="also time tiles / warps at the chosen splits")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    dtype = getattr(torch, a.dtype)
    hbm = bandwidths(DEV, 1 << 20)["hbm_bytes_per_s"]
    results = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "dtype": a.dtype,
        "width": a.width,
        "defaults": {"splits": "choose_splits", "block_n": BLOCK_N, "num_warps": WARPS, "stages": STAGES},
        "sms": torch.cuda.get_device_properties(DEV).multi_processor_count,
        "programs_per_sm": PROGRAMS_PER_SM,
        "copy_bytes_per_s": hbm,
    }
    print(f"{results['device']}, {a.dtype}: HBM copy {hbm / 1e9:.0f} GB/s (read + write)")
    print("shape, batch, context, width: kernel / torch us (graph) -> speedup | eager -> speedup | KV GB/s, of copy")
    batches, contexts = map(int, a.batches.split(",")), map(int, a.contexts.split(","))
    wanted = [w for w in a.shapes.split(",") if w]
    shapes = {k: v for k, v in SHAPES.items() if not wanted or any(w in k for w in wanted)}
    if not shapes:
        ap.error(f"--shapes {a.shapes!r} matches none of {', '.join(SHAPES)}")
    for (name, shape), batch, context in itertools.product(shapes.items(), list(batches), list(contexts)):
        for width in sorted({a.width, context}, reverse=True):  # padded as in a CUDA graph, then tight
            if context > width:
                continue
            r = measure(Problem(shape, batch, context, width, dtype), hbm, a.sweep)
            results[f"{name}/B{batch}/C{context}/W{width}"] = r
            print(
                f"{name}, B={batch}, C={context}, W={width}: {r['kernel_graph_us']:.1f} / {r['torch_graph_us']:.1f} "
                f"us -> {r['speedup_graph']:.1f}x | {r['kernel_eager_us']:.1f} / {r['torch_eager_us']:.1f} us -> "
                f"{r['speedup_eager']:.1f}x | kernel {r['kernel_kv_bytes_per_s'] / 1e9:.0f} GB/s "
                f"({r['kernel_over_copy']:.2f}), torch {r['torch_kv_bytes_per_s'] / 1e9:.0f} GB/s "
                f"({r['torch_over_copy']:.2f}) (max diff {r['max_abs_diff_vs_torch']:.1e})"
            )
            if r["kv_bytes"] < r["context_kv_bytes"]:
                print(f"  window: reads {r['kv_bytes'] / r['context_kv_bytes']:.4f} of the context's KV")
            forced = ", ".join(
                f"S{k} {us:.1f} ({r['splits_over_copy'][k]:.2f})" for k, us in r["splits_graph_us"].items()
            )
            print(
                f"  splits: chose S{r['splits']} ({r['partial_programs']} programs, "
                f"{r['partial_programs_with_tokens']} with tokens, {r['split_len']} tokens each) "
                f"{r['kernel_graph_us']:.1f} us ({r['kernel_over_copy']:.2f}) | forced, us (of copy): {forced}"
            )
            if a.sweep and r["sweep_graph_us"]:
                s = r["sweep_graph_us"]
                best = min(s, key=s.get)
                print(f"  sweep: best {best} {s[best]:.1f} us (default {r['kernel_graph_us']:.1f})")
            torch.cuda.empty_cache()
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
