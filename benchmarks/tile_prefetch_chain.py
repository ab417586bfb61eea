"""Does loading the next GEMV's weights before its input exists, into shared memory, close the gap to HBM that a
kernel boundary (or a counter hand-off) leaves? A CUDA C++ persistent chain (`tile_prefetch_chain.cu`) against the
engine's launches and session 20's Triton static kernel, on the chain of `persistent_chain.py`, in one run.

    python benchmarks/tile_prefetch_chain.py [--layers 8] [--stages 2,4,8,12] [--reps 200] [--json OUT]

Why (issue #5, benchmarks/RESULTS.md, sessions 15-22): resident decode stops at ~0.6 of the HBM roofline, and a
chain of 16.8 MB GEMVs takes ~6.3 µs a GEMV against 3.9 µs of bytes, whether its GEMVs are PDL launches or one
persistent Triton kernel with counters between them. What is left is the time from a GEMV's last weight load to
the next GEMV's first, at every hand-off: HBM idles there. A Triton program can only hold a few KB of next weights
in registers across its wait (session 20: 1,024 columns preloaded, -0.4 µs). The kernel here gives the weights
their own producer: one thread an SM streams the block's rows of every GEMV, in order, into a ring of up to 12
chunks of 16 KB (192 KB an SM, 25 MB over 132 SMs: more than one whole GEMV), each completing on an mbarrier; the
consumer warps wait on the counter, read y, and find the weights already there. If HBM never idles, a GEMV costs
its bytes: the layer megakernel that issue #5's 0.7 needs would be built this way.

Variants, each checked against the float64 chain (two launches) before it is timed:
- `ahead`: the producer runs ahead across GEMVs, limited only by the ring (the design under test);
- `gated`: the producer also waits for GEMV i - 1 before asking for GEMV i's weights (the control: the same kernel
  with a grid-wide hand-off that HBM waits on, as launches and the Triton kernels have);
- `streaming`: no dependency waits at all (wrong outputs, not checked): the kernel's own bandwidth ceiling.
Needs a GPU of compute capability 9.0 or newer (cp.async.bulk, mbarrier transaction counts), nvcc to build the
kernel and CuPy to load and launch it (both on the GPU machine's image; not edgemoe dependencies).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import persistent_chain as pc  # noqa: E402

SOURCE = Path(__file__).with_suffix(".cu")
# the .cu's constants, mirrored for the host-side checks and the shared-memory size
CHUNK_BYTES, MAX_STAGES, CONSUMER_WARPS, WIDTHS = 16384, 12, 8, (2048, 4096)
SHARED_BYTES = MAX_STAGES * CHUNK_BYTES + 16 * MAX_STAGES
MODES = {"ahead": 0, "gated": 1, "streaming": 2}


def slice_limits(dim_a: int, dim_b: int) -> None:
    """The .cu's assumption about the shapes, as a one-line error: every GEMV's K is one of its built widths."""
    for k in (dim_a, dim_b):
        if k not in WIDTHS:
            raise SystemExit(f"a GEMV of {k} columns: the kernel is built for {' or '.join(map(str, WIDTHS))}")


def build() -> Path:
    """The .cu built by nvcc for sm_90 into a temporary cubin -> its path (a one-line exit if it cannot be)."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise SystemExit("benchmarks/tile_prefetch_chain.py needs nvcc (the CUDA toolkit) to build its kernel")
    out = Path(tempfile.mkdtemp()) / "tile_prefetch_chain.cubin"
    proc = subprocess.run([nvcc, "-arch=sm_90", "-cubin", "--resource-usage", str(SOURCE), "-o", str(out)],
                          capture_output=True, text=True)  # fmt: skip
    if proc.returncode:
        raise SystemExit(f"nvcc failed on {SOURCE.name}: {proc.stderr.strip().splitlines()[-1:]}")
    print(" ".join(line.split(":", 1)[-1].strip() for line in proc.stderr.splitlines() if "registers" in line))
    return out


class RingChain:
    """The CUDA kernel over a `persistent_chain.Chain`'s weights and buffers, with its own counters."""

    def __init__(self, chain: pc.Chain, blocks: int) -> None:
        import cupy as cp

        self.cp, self.chain, self.blocks = cp, chain, blocks
        slice_limits(chain.dim_a, chain.dim_b)
        module = cp.RawModule(path=str(build()))
        self.kernel = module.get_function("chain")
        self.kernel.max_dynamic_shared_size_bytes = SHARED_BYTES
        dev = chain.w.device
        self.ready = torch.zeros(chain.layers + 1, dtype=torch.int32, device=dev)
        self.done = torch.zeros(1, dtype=torch.int32, device=dev)
        self.epoch = torch.zeros(1, dtype=torch.int32, device=dev)
        self.failed = torch.zeros(1, dtype=torch.int32, device=dev)

    def __call__(self, stages: int, mode: str, max_spins: int = 1 << 22) -> torch.Tensor:
        """One launch -> the chain's last y (a view of its buffer)."""
        c = self.chain
        ptrs = [np.uint64(t.data_ptr()) for t in (c.w, c.ys, self.ready, self.done, self.epoch, self.failed)]
        ints = [np.int32(v) for v in (c.layers, c.dim_a, c.dim_b, c.ys.stride(0), stages, MODES[mode], max_spins)]
        with self.stream():
            self.kernel((self.blocks,), ((CONSUMER_WARPS + 1) * 32,), (*ptrs, *ints), shared_mem=SHARED_BYTES)
        return c.last_y()

    def stream(self):
        """Torch's current stream as CuPy's, so that a capture records the launch (CuPy 14 calls ExternalStream
        deprecated; its replacement needs a stream protocol torch 2.11's streams lack)."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return self.cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)

    def check(self, stages: int, mode: str) -> float:
        """Two launches against the float64 chain (the second waits on counters one launch higher); then every
        counter at its count and no wait timed out."""
        ref = pc.reference(self.chain)
        for _ in range(2):
            err = pc.relative_error(self(stages, mode), ref)
            if not err < 2**-5:  # as persistent_chain.check's
                raise AssertionError(f"ring chain ({stages} stages, {mode}) is off by {err:.1e}")
        launches = self.epoch.item()
        if (
            self.ready[1:].tolist() != [launches * self.blocks * CONSUMER_WARPS] * self.chain.layers
            or self.failed.item()
        ):
            raise AssertionError(f"ring chain counters {self.ready.tolist()} after {launches} launches")
        return err


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8, help="GEMVs in the chain (default 8: 134 MB of weights)")
    ap.add_argument("--stages", default="2,4,8,12", help=f"ring depths to time, each 1..{MAX_STAGES} chunks of 16 KB")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    try:
        stages = [int(v) for v in a.stages.split(",")]
    except ValueError:
        raise SystemExit(f"--stages {a.stages!r}: expected ring depths, e.g. 4,12") from None
    if a.layers < 1 or not all(1 <= s <= MAX_STAGES for s in stages):
        raise SystemExit(f"--layers >= 1; every --stages within 1..{MAX_STAGES}")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        raise SystemExit("benchmarks/tile_prefetch_chain.py needs a CUDA GPU of compute capability 9.0 or newer")
    try:
        import cupy  # noqa: F401
    except ImportError:
        raise SystemExit("benchmarks/tile_prefetch_chain.py needs CuPy to load and launch its kernel") from None
    import triton

    import edgemoe.kernels.dense_gemv as dg
    from edgemoe.bench import bandwidths, capture, timed

    dev = torch.device("cuda")
    hbm = bandwidths(dev, 1 << 20)["hbm_bytes_per_s"]
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    chain = pc.Chain(a.layers, 2048, 4096, dev)
    floor = chain.w.numel() * chain.w.element_size() / a.layers / hbm * 1e6  # µs a GEMV at HBM speed
    ref = pc.reference(chain)
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "hbm": hbm, "layers": a.layers, "floor_us_per_gemv": floor, "variants": {}}  # fmt: skip
    print(f"{results['device']}: HBM {hbm / 1e9:.0f} GB/s; {a.layers} GEMVs of 16.8 MB, {floor:.2f} µs each at HBM")

    def report(name: str, fn, err: float | None = None) -> None:
        if err is None:
            err = pc.relative_error(fn(), ref)
        graph = capture(fn)
        per = timed(graph.replay, dev, a.reps) * 1e6 / a.layers
        del graph
        results["variants"][name] = {"us_per_gemv": per, "over_hbm": floor / per, "error": err}
        print(f"{name:>44}: {per:5.2f} µs a GEMV, {floor / per:.2f} of HBM, {per - floor:4.2f} µs over"
              f" (error {err:.1e})")  # fmt: skip

    report("engine launches (PDL)", chain.engine)
    steps = dg.pick_steps
    dg.pick_steps = lambda k: (512, 3)  # one build for both shapes (session 20: the launches' best, 6.26 µs)
    report("engine launches, one build (512 x 3)", chain.engine)
    dg.pick_steps = steps
    report("Triton static, prefetch 1024", lambda: chain.static(4, 8, 1024, chain.static_programs(4, 8)))
    ring = RingChain(chain, sms)
    for mode in ("gated", "ahead"):
        for s in stages:
            report(f"ring {mode}, {s} x 16 KB an SM", lambda s=s, m=mode: ring(s, m), ring.check(s, mode))
    for s in (max(stages),):
        report(f"ring streaming (no waits), {s} x 16 KB", lambda s=s: ring(s, "streaming"), float("nan"))
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
