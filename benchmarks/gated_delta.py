"""The Gated DeltaNet decode step on CUDA: `gated_delta_decode` (`edgemoe.kernels.gated_delta`, two launches on the
state pools in place) against its reference `GatedDeltaNet._decode` (conv_step, recurrent_step, gathered from and
scattered back to the slots), at Qwen3-Next's geometry (16 q/k heads, 32 value heads of 128, 8192 channels, kernel 4;
Qwen3.5-35B-A3B's is the same), batch 1 and 8, against HBM bandwidth (a device-to-device copy) in the same run.

    python benchmarks/gated_delta.py [--dtype bfloat16] [--batches 1,8] [--prefill-tokens 4096,16384] [--json OUT]

Bytes per call = the states a step must read and write: the fp32 matrices (v_heads x k_dim x v_dim per sequence)
and the convolution's last inputs (channels x (kernel - 1) per sequence, the model's dtype), each read once and
written once; the step's inputs and outputs (a few KB a sequence) and the conv weight are not counted. "of copy" is
that rate over the copy's (read + write) rate. Calls cycle over `layers` layers whose states share one StateCache
pool (as the engine's do), enough that they do not fit in L2. The graph figure is what decode runs (one call per
layer captured in one graph); the eager one includes launch overhead.

Prefill (`--prefill-tokens`, default 4096,16384): one sequence of that many tokens from a random state through
`delta_rule_prefill` (`kernels/gated_delta_prefill.py`, two launches) against `chunked_delta_rule` (the layer's
plain-torch prefill) on the convolved channels, eager: ms per call and tokens/s per layer. A size whose reference
runs out of GPU memory is reported as such and skipped.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from edgemoe.engine.state_cache import StateCache
from edgemoe.kernels.gated_delta import gated_delta_decode
from edgemoe.kernels.gated_delta_prefill import delta_rule_prefill
from edgemoe.layers.linear_attention import GatedDeltaNet, chunked_delta_rule
from edgemoe.tools.measure import bandwidths, capture, timed

DEV = torch.device("cuda")
# name -> (k_heads, v_heads, k_dim, v_dim, kernel, tiled)
GEOMETRIES = {
    "qwen3-next": (16, 32, 128, 128, 4, False),
    "qwen3.5-gguf": (16, 32, 128, 128, 4, True),  # llama.cpp's value-head order
}


class Problem:
    """`layers` Gated DeltaNet layers sharing a state pool, `batch` sequences on shuffled slots, random states and
    step inputs (the projections' outputs)."""

    def __init__(self, geometry: tuple, batch: int, dtype: torch.dtype) -> None:
        k_heads, v_heads, k_dim, v_dim, kernel, tiled = geometry
        self.channels = 2 * k_heads * k_dim + v_heads * v_dim  # q, k, v
        recurrent = batch * v_heads * k_dim * v_dim * 4
        conv = batch * self.channels * (kernel - 1) * dtype.itemsize
        self.state_bytes = 2 * (recurrent + conv)  # read and written once each
        l2 = getattr(torch.cuda.get_device_properties(DEV), "L2_cache_size", 50 << 20)
        self.layers = max(2, min(64, math.ceil(4 * l2 / self.state_bytes)))
        shape = (64, k_heads, v_heads, k_dim, v_dim, kernel, 1e-6)  # (hidden: only the unused projections')
        self.model = nn.ModuleList(GatedDeltaNet(*shape, tiled=tiled) for _ in range(self.layers)).to(DEV, dtype)
        slots = 2 * batch
        self.cache = StateCache(self.model, slots, dtype, DEV)
        for layer in self.model:
            layer.conv1d.weight.data.normal_(0, 0.5)
            layer.conv_state.copy_(torch.randn(layer.conv_state.shape, device=DEV))
            layer.recurrent_state.copy_(0.5 * torch.randn(layer.recurrent_state.shape, device=DEV))
        self.slots = torch.randperm(slots, device=DEV)[:batch]
        self.mixed = torch.randn(self.layers, batch, self.channels, device=DEV).to(dtype)
        self.b = torch.randn(self.layers, batch, v_heads, device=DEV).to(dtype)  # the gate projections' rows
        self.a = torch.randn(self.layers, batch, v_heads, device=DEV).to(dtype)
        for layer in self.model:
            layer.A.data = -torch.rand(v_heads, device=DEV)
            layer.dt_bias.data.normal_()

    def kernel(self, i: int) -> torch.Tensor:
        m = self.model[i]
        return gated_delta_decode(
            self.mixed[i], self.b[i], self.a[i], m.A, m.dt_bias, self.slots, m.conv1d.weight, m.conv_state,
            m.recurrent_state, m.k_heads, m.tiled,
        )  # fmt: skip

    def reference(self, i: int) -> torch.Tensor:
        m = self.model[i]
        return m._decode(self.mixed[i], *m.gates(self.b[i], self.a[i]), self.slots)  # the gates: 5 launches


def graph_seconds(call: Callable[[int], object], layers: int, reps: int = 10) -> float:
    """Seconds per call: one call per layer captured in one graph, replayed."""
    graph = capture(lambda: [call(i) for i in range(layers)])  # warm-up (compile, allocator), then capture
    seconds = timed(graph.replay, DEV, reps) / layers
    del graph
    return seconds


def eager_seconds(call: Callable[[int], object], layers: int, reps: int = 3) -> float:
    counter = itertools.count()
    return timed(lambda: call(next(counter) % layers), DEV, reps * layers)


def measure(p: Problem, hbm: float) -> dict:
    before = p.cache.pool.clone()
    ref = p.reference(0).float()
    p.cache.pool.copy_(before)
    diff = (p.kernel(0).float() - ref).abs().max().item()
    r = {"state_bytes": p.state_bytes, "layers": p.layers, "max_abs_diff_vs_torch": diff}
    for mode, seconds in (("graph", graph_seconds), ("eager", eager_seconds)):
        for name, call in (("kernel", p.kernel), ("torch", p.reference)):
            r[f"{name}_{mode}_us"] = seconds(call, p.layers) * 1e6
        r[f"speedup_{mode}"] = r[f"torch_{mode}_us"] / r[f"kernel_{mode}_us"]
    for name in ("kernel", "torch"):
        r[f"{name}_bytes_per_s"] = p.state_bytes / (r[f"{name}_graph_us"] / 1e6)
        r[f"{name}_over_copy"] = r[f"{name}_bytes_per_s"] / hbm
    return r


def measure_prefill(geometry: tuple, tokens: int, dtype: torch.dtype, reps: int = 5) -> dict:
    """One sequence of `tokens` from slot 1 of a 2-slot state: the kernel against `chunked_delta_rule`."""
    k_heads, v_heads, k_dim, v_dim, kernel, tiled = geometry
    layer = GatedDeltaNet(64, k_heads, v_heads, k_dim, v_dim, kernel, 1e-6, tiled=tiled).to(DEV, dtype)
    channels = torch.nn.functional.silu(2 * torch.randn(tokens, layer.channels, device=DEV)).to(dtype)
    beta = torch.sigmoid(2 * torch.randn(tokens, v_heads, device=DEV)).to(dtype)
    g = -0.5 * torch.rand(tokens, v_heads, device=DEV)
    start = 0.5 * torch.randn(2, v_heads, k_dim, v_dim, device=DEV)
    state, slots = start.clone(), torch.tensor([1], device=DEV)
    cu = torch.tensor([0, tokens], dtype=torch.int32, device=DEV)
    q, k, v = layer._heads(channels)

    def kernel() -> torch.Tensor:
        return delta_rule_prefill(channels, beta, g, state, slots, cu, tokens, k_heads, tiled)

    def reference() -> tuple[torch.Tensor, torch.Tensor]:
        return chunked_delta_rule(q, k, v, g, beta, start[1])

    out, (ref, ref_state) = kernel(), reference()
    r = {"tokens": tokens, "max_abs_diff_vs_torch": (out.float() - ref.float()).abs().max().item()}
    r["state_max_abs_diff_vs_torch"] = (state[1] - ref_state).abs().max().item()
    for name, call in (("kernel", kernel), ("torch", reference)):
        r[f"{name}_ms"] = timed(call, DEV, reps) * 1e3
        r[f"{name}_tokens_per_s"] = tokens / (r[f"{name}_ms"] / 1e3)
    r["speedup"] = r["torch_ms"] / r["kernel_ms"]
    return r


def prefill(names: list[str], sizes: list[int], dtype: torch.dtype, results: dict) -> None:
    print("prefill, geometry, tokens: kernel / torch ms -> speedup | kernel tokens/s a layer")
    for name, tokens in itertools.product(names, sizes):
        try:
            r = measure_prefill(GEOMETRIES[name], tokens, dtype)
        except torch.cuda.OutOfMemoryError:
            results[f"{name}/prefill{tokens}"] = "out of GPU memory"
            print(f"{name}, {tokens} tokens: out of GPU memory, skipped")
            torch.cuda.empty_cache()
            continue
        results[f"{name}/prefill{tokens}"] = r
        print(
            f"{name}, {tokens} tokens: {r['kernel_ms']:.2f} / {r['torch_ms']:.2f} ms -> {r['speedup']:.1f}x | "
            f"{r['kernel_tokens_per_s'] / 1e3:.0f}K tokens/s (max diff {r['max_abs_diff_vs_torch']:.1e}, state "
            f"{r['state_max_abs_diff_vs_torch']:.1e})"
        )
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--batches", default="1,8", help="decode batch sizes (default: 1,8)")
    ap.add_argument("--geometries", default="qwen3-next", help=f"comma-separated, of {', '.join(GEOMETRIES)}")
    ap.add_argument("--prefill-tokens", default="4096,16384", help="prefill lengths (default: 4096,16384; '' skips)")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    dtype = getattr(torch, a.dtype)
    names = [n for n in a.geometries.split(",") if n]
    if unknown := [n for n in names if n not in GEOMETRIES]:
        ap.error(f"unknown geometries {unknown}; known: {', '.join(GEOMETRIES)}")
    hbm = bandwidths(DEV, 1 << 20)["hbm_bytes_per_s"]
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "dtype": a.dtype}
    results["copy_bytes_per_s"] = hbm
    print(f"{results['device']}, {a.dtype}: HBM copy {hbm / 1e9:.0f} GB/s (read + write)")
    print("geometry, batch: kernel / torch us (graph) -> speedup | eager -> speedup | state MB, GB/s, of copy")
    with torch.no_grad():
        for name, batch in itertools.product(names, map(int, a.batches.split(","))):
            p = Problem(GEOMETRIES[name], batch, dtype)
            r = measure(p, hbm)
            results[f"{name}/B{batch}"] = r
            print(
                f"{name}, B={batch}: {r['kernel_graph_us']:.1f} / {r['torch_graph_us']:.1f} us -> "
                f"{r['speedup_graph']:.1f}x | {r['kernel_eager_us']:.1f} / {r['torch_eager_us']:.1f} us -> "
                f"{r['speedup_eager']:.1f}x | {p.state_bytes / 1e6:.2f} MB: kernel "
                f"{r['kernel_bytes_per_s'] / 1e9:.0f} GB/s ({r['kernel_over_copy']:.2f}), torch "
                f"{r['torch_bytes_per_s'] / 1e9:.0f} GB/s ({r['torch_over_copy']:.2f}) "
                f"(max diff {r['max_abs_diff_vs_torch']:.1e}, {p.layers} layers)"
            )
            del p
            torch.cuda.empty_cache()
        prefill(names, [int(n) for n in a.prefill_tokens.split(",") if n], dtype, results)
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
