"""Does loading the next GEMV's weights before its input exists, into shared memory, close the gap to HBM that a
kernel boundary (or a counter hand-off) leaves? A CUDA C++ persistent chain (`tile_prefetch_chain.cu`) against the
engine's launches and session 20's Triton static kernel, on the chain of `persistent_chain.py`, in one run.

    python benchmarks/tile_prefetch_chain.py [--layers 8] [--chunks-kb 16,8] [--loaders tma,lanes]
                                             [--modes gated,ahead,streaming] [--inflight 0,2,4]
                                             [--handoffs flags,counter] [--trace]
                                             [--reps 200] [--json OUT]

Why (issue #5, benchmarks/RESULTS.md, sessions 15-22): resident decode stops at ~0.6 of the HBM roofline, and a
chain of 16.8 MB GEMVs takes ~6.3 µs a GEMV against 3.9 µs of bytes, whether its GEMVs are PDL launches or one
persistent Triton kernel with counters between them. What is left is the time from a GEMV's last weight load to
the next GEMV's first, at every hand-off: HBM idles there. A Triton program can only hold a few KB of next weights
in registers across its wait (session 20: 1,024 columns preloaded, -0.4 µs). The kernel here gives the weights
their own producer warp: it streams the block's rows of every GEMV, in order, into 192 KB of shared-memory slots an
SM (25 MB over 132 SMs: more than one whole GEMV), each completing on an mbarrier, by the copy engine (`--loaders
tma`) or by 16-byte cp.async (`lanes`); each consumer warp owns `depth` slots of 16 or 8 KB (`--chunks-kb`);
`--inflight` caps the requests an SM has in flight. The consumers read y once an SM, either until its entries carry
this GEMV's tag (`--handoffs flags`: each 64-bit entry holds its tag, as NCCL's LL protocol does; no counter, fence
or release) or after a counter of releases (`counter`), and find the weights already there. If HBM never idles, a
GEMV costs its bytes: the layer megakernel that issue #5's 0.7 needs would be built this way. `--trace` stamps one
launch of the fastest variants (%globaltimer) and prints, per GEMV, when its weights were asked for, when its input
was seen, when its chunks were taken and when it was done.

Variants, each checked against the float64 chain (two launches) before it is timed:
- `ahead`: the producer runs ahead across GEMVs, limited only by the slots (the design under test);
- `gated`: the producer also waits for GEMV i - 1 before asking for GEMV i's weights (the control: the same kernel
  with a grid-wide hand-off that HBM waits on, as launches and the Triton kernels have);
- `streaming`: no dependency waits at all (wrong outputs, not checked): the kernel's own bandwidth ceiling.
Needs a GPU of compute capability 9.0 or newer (cp.async.bulk, mbarrier transaction counts), nvcc to build the
kernel and CuPy to load and launch it (both on the GPU machine's image; not edgemoe dependencies).

Answer (H200, session 23, benchmarks/RESULTS.md): no. Ahead beats gated by 1.5-2 µs a GEMV, but the best variant
(7.57 µs with this file's design; 6.53 with call 1's, cc394d8) loses to the engine's launches (6.28-6.35): a
hand-off across all SMs costs 2.3 µs with the memory system idle and 3-5 µs with the next weights in flight, more
than a PDL boundary. `handoff_latency.py` measures the hand-offs alone.
"""

from __future__ import annotations

import argparse
import itertools
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
RING_BYTES, CONSUMER_WARPS, WIDTHS, TRACE_EVENTS, MAX_INFLIGHT = 196608, 8, (2048, 4096), 512, 32
MODES = {"ahead": 0, "gated": 1, "streaming": 2}
LOADERS = {"tma": 0, "lanes": 1}
HANDOFFS = {
    "flags": 0,
    "counter": 1,
}  # y's own tags; a release counter a GEMV  # cp.async.bulk by one thread; 16-byte cp.async by a warp's 32 lanes


def slice_limits(dim_a: int, dim_b: int, chunk: int) -> None:
    """The .cu's assumptions about the shapes, as a one-line error: every GEMV's K is one of its built widths and
    a row fits a chunk."""
    for k in (dim_a, dim_b):
        if k not in WIDTHS or 2 * k > chunk:
            raise SystemExit(f"a GEMV of {k} columns: the kernel takes {' or '.join(map(str, WIDTHS))}, a row within a"
                             f" {chunk // 1024} KB chunk")  # fmt: skip


def nvcc_build(source: Path, *defines: str) -> Path:
    """`source` built by nvcc for sm_90 (with `-D` defines) into a temporary cubin -> its path; a one-line exit if
    it cannot be. Prints ptxas's register and shared-memory use."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise SystemExit(f"benchmarks/{source.stem}.py needs nvcc (the CUDA toolkit) to build its kernels")
    out = Path(tempfile.mkdtemp()) / f"{source.stem}.cubin"
    cmd = [nvcc, "-arch=sm_90", "-cubin", "--resource-usage", *(f"-D{d}" for d in defines), str(source), "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"nvcc failed on {source.name}: {proc.stderr.strip().splitlines()[-1:]}")
    usage = [line.split(":", 1)[-1].strip() for line in proc.stderr.splitlines() if "registers" in line]
    print(f"{source.name} {' '.join(defines)}: {'; '.join(usage)}")
    return out


def build(chunk: int) -> Path:
    """The chain's kernel with `chunk`-byte chunks (`nvcc_build`)."""
    return nvcc_build(SOURCE, f"CHUNK_BYTES={chunk}")


class RingChain:
    """The CUDA kernel, built for `chunk`-byte chunks, over a `persistent_chain.Chain`'s weights and buffers, with
    its own counters."""

    def __init__(self, chain: pc.Chain, blocks: int, chunk: int) -> None:
        import cupy as cp

        slice_limits(chain.dim_a, chain.dim_b, chunk)
        self.cp, self.chain, self.blocks, self.chunk = cp, chain, blocks, chunk
        self.slots = RING_BYTES // chunk
        self.shared = self.slots * chunk + 16 * self.slots
        self.kernel = cp.RawModule(path=str(build(chunk))).get_function("chain")
        self.kernel.max_dynamic_shared_size_bytes = self.shared
        dev = chain.w.device
        # y with its flags: 64-bit entries {tag << 32 | bf16 bits}; y[0] (the input) with tag 0
        self.ys = torch.zeros(chain.layers + 1, chain.width, dtype=torch.int64, device=dev)
        self.ys[0, : chain.dim_b] = chain.x0.view(torch.int16).to(torch.int64) & 0xFFFF
        self.ready = torch.zeros(chain.layers + 1, dtype=torch.int32, device=dev)  # `counter`'s, only grow
        self.done = torch.zeros(1, dtype=torch.int32, device=dev)
        self.epoch = torch.zeros(1, dtype=torch.int32, device=dev)
        self.failed = torch.zeros(1, dtype=torch.int32, device=dev)

    def depths(self) -> list[int]:
        """The ring depths (slots a consumer warp) that fit in RING_BYTES."""
        return list(range(1, self.slots // CONSUMER_WARPS + 1))

    def __call__(self, depth: int, mode: str, loader: str, inflight: int = 0, handoff: str = "flags",
                 trace: torch.Tensor | None = None, max_spins: int = 1 << 22) -> torch.Tensor:  # fmt: skip
        """One launch -> the chain's last y (a view of its buffer)."""
        if depth not in self.depths():
            raise ValueError(f"depth {depth}: {self.chunk // 1024} KB chunks allow {self.depths()}")
        c = self.chain
        tensors = (c.w, self.ys, self.ready, self.done, self.epoch, self.failed)
        ptrs = [np.uint64(t.data_ptr()) for t in tensors] + [np.uint64(0 if trace is None else trace.data_ptr())]
        ints = [np.int32(v) for v in (c.layers, c.dim_a, c.dim_b, self.ys.stride(0), depth, MODES[mode],
                                      LOADERS[loader], inflight, HANDOFFS[handoff], max_spins)]  # fmt: skip
        with self.stream():
            self.kernel((self.blocks,), ((CONSUMER_WARPS + 1) * 32,), (*ptrs, *ints), shared_mem=self.shared)
        return self.last_y()

    def last_y(self) -> torch.Tensor:
        """The chain's output: the bf16 halves of its last y's entries (little-endian: the low 16 bits first)."""
        n = self.chain.last_y().numel()
        return self.ys[self.chain.layers, :n].view(torch.int16).view(n, 4)[:, 0].contiguous().view(torch.bfloat16)

    def stream(self):
        """Torch's current stream as CuPy's, so that a capture records the launch (CuPy 14 calls ExternalStream
        deprecated; its replacement needs a stream protocol torch 2.11's streams lack)."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return self.cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)

    def check(self, depth: int, mode: str, loader: str, inflight: int = 0, handoff: str = "flags") -> float:
        """Two launches against the float64 chain (the second waits for tags one launch higher); then no read gave
        up, and the launches were counted."""
        ref = pc.reference(self.chain)
        self.failed.zero_()
        for _ in range(2):
            err = pc.relative_error(self(depth, mode, loader, inflight, handoff), ref)
            if not err < 2**-5:  # as persistent_chain.check's
                raise AssertionError(
                    f"ring chain ({depth}, {mode}, {loader}, {inflight}, {handoff}) is off by {err:.1e}"
                )
        launches = self.epoch.item()
        if self.failed.item() or self.done.item() != launches * self.blocks:
            done = self.done.item()
            raise AssertionError(f"ring chain: failed {self.failed.item()}, {done} blocks done in {launches} launches")
        return err

    def chunks(self, i: int) -> list[int]:
        """Each block's chunks of GEMV i (the .cu's `gemv_of`)."""
        n, k = (self.chain.dim_b, self.chain.dim_a) if i % 2 else (self.chain.dim_a, self.chain.dim_b)
        per = self.chunk // (2 * k)
        return [-(-((c + 1) * n // self.blocks - c * n // self.blocks) // per) for c in range(self.blocks)]

    def trace(self, depth: int, mode: str, loader: str, inflight: int = 0, handoff: str = "flags") -> list[dict]:
        """One launch with %globaltimer stamps -> per GEMV, in µs from the launch's first chunk request: the median
        over blocks of its first request, its dependency seen, its first and last chunk taken, its last release;
        and the latest release of any block (the GEMV done everywhere)."""
        stamps = torch.zeros(self.blocks, 4, TRACE_EVENTS, dtype=torch.int64, device=self.chain.w.device)
        self(depth, mode, loader, inflight, handoff, stamps)
        t = stamps.cpu().numpy().astype(np.float64)
        t0 = t[:, 0, 0].min()
        t = (t - t0) / 1e3
        rows, seq0 = [], np.zeros(self.blocks, dtype=np.int64)
        for i in range(self.chain.layers):
            n = np.array(self.chunks(i))
            if (seq0 + n).max() > TRACE_EVENTS or (i + 1) * CONSUMER_WARPS > TRACE_EVENTS:
                break
            b = np.arange(self.blocks)
            take = [t[c, 1, seq0[c] : seq0[c] + n[c]] for c in b]
            release = t[:, 3, i * CONSUMER_WARPS : (i + 1) * CONSUMER_WARPS].max(axis=1)
            rows.append({
                "gemv": i,
                "requested": float(np.median(t[b, 0, seq0])),
                "input_seen": float(np.median(t[:, 2, i])) if i else 0.0,
                "first_taken": float(np.median([x.min() for x in take])),
                "last_taken": float(np.median([x.max() for x in take])),
                "released": float(np.median(release)),
                "done_everywhere": float(release.max()),
            })  # fmt: skip
            seq0 += n
        return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8, help="GEMVs in the chain (default 8: 134 MB of weights)")
    ap.add_argument("--chunks-kb", default="16,8", help="chunk sizes to build, KB (16 or 8: a row of 4,096 fits)")
    ap.add_argument("--loaders", default="tma,lanes", help="tma: cp.async.bulk; lanes: 16-byte cp.async by a warp")
    ap.add_argument("--modes", default="gated,ahead,streaming", help="which hand-offs to time (see above)")
    ap.add_argument(
        "--handoffs", default="flags,counter", help="flags: y's entries carry tags; counter: a release a warp"
    )
    ap.add_argument("--inflight", default="0,2,4", help="requests a block may have in flight (0: as many as slots)")
    ap.add_argument("--trace", action="store_true", help="also a stamped launch of the fastest checked variant")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    try:
        chunks = [int(v) * 1024 for v in a.chunks_kb.split(",")]
    except ValueError:
        raise SystemExit(f"--chunks-kb {a.chunks_kb!r}: expected sizes in KB, e.g. 16,8") from None
    loaders, modes, handoffs = a.loaders.split(","), a.modes.split(","), a.handoffs.split(",")
    try:
        inflight = [int(v) for v in a.inflight.split(",")]
    except ValueError:
        raise SystemExit(f"--inflight {a.inflight!r}: expected request counts, e.g. 0,2,4") from None
    if not all(0 <= v <= MAX_INFLIGHT for v in inflight):
        raise SystemExit(f"--inflight: each within 0..{MAX_INFLIGHT}")
    if a.layers < 1 or any(c not in (8192, 16384) for c in chunks):
        raise SystemExit("--layers >= 1; --chunks-kb from 16 and 8")
    if any(x not in LOADERS for x in loaders) or any(m not in MODES for m in modes):
        raise SystemExit(f"--loaders from {', '.join(LOADERS)}; --modes from {', '.join(MODES)}")
    if any(h not in HANDOFFS for h in handoffs):
        raise SystemExit(f"--handoffs from {', '.join(HANDOFFS)}")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        raise SystemExit("benchmarks/tile_prefetch_chain.py needs a CUDA GPU of compute capability 9.0 or newer")
    try:
        import cupy  # noqa: F401
    except ImportError:
        raise SystemExit("benchmarks/tile_prefetch_chain.py needs CuPy to load and launch its kernel") from None
    import triton
    from edgemoe.bench import bandwidths, capture, timed

    import edgemoe.kernels.dense_gemv as dg

    dev = torch.device("cuda")
    hbm = bandwidths(dev, 1 << 20)["hbm_bytes_per_s"]
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    chain = pc.Chain(a.layers, 2048, 4096, dev)
    floor = chain.w.numel() * chain.w.element_size() / a.layers / hbm * 1e6  # µs a GEMV at HBM speed
    ref = pc.reference(chain)
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "hbm": hbm, "layers": a.layers, "floor_us_per_gemv": floor, "variants": {}, "traces": {}}  # fmt: skip
    print(f"{results['device']}: HBM {hbm / 1e9:.0f} GB/s; {a.layers} GEMVs of 16.8 MB, {floor:.2f} µs each at HBM")

    def report(name: str, fn, err: float | None = None) -> float:
        if err is None:
            err = pc.relative_error(fn(), ref)
        graph = capture(fn)
        per = timed(graph.replay, dev, a.reps) * 1e6 / a.layers
        del graph
        results["variants"][name] = {"us_per_gemv": per, "over_hbm": floor / per, "error": err}
        print(f"{name:>44}: {per:5.2f} µs a GEMV, {floor / per:.2f} of HBM, {per - floor:4.2f} µs over"
              f" (error {err:.1e})")  # fmt: skip
        return per

    report("engine launches (PDL)", chain.engine)
    steps = dg.pick_steps
    dg.pick_steps = lambda k: (512, 3)  # one build for both shapes (session 20: the launches' best, 6.26 µs)
    report("engine launches, one build (512 x 3)", chain.engine)
    dg.pick_steps = steps
    report("Triton static, prefetch 1024", lambda: chain.static(4, 8, 1024, chain.static_programs(4, 8)))
    best: dict[str, tuple[float, RingChain, tuple]] = {}
    for chunk in chunks:
        ring = RingChain(chain, sms, chunk)
        for loader in loaders:
            for depth, limit, handoff, mode in itertools.product(ring.depths(), inflight, handoffs, modes):
                name = f"ring {mode}, {loader}, {chunk // 1024} KB x {depth}, {limit or 'all'} in flight, {handoff}"
                args = (depth, mode, loader, limit, handoff)
                err = float("nan") if mode == "streaming" else ring.check(*args)  # streaming: wrong outputs
                per = report(name, lambda r=ring, x=args: r(*x), err)
                if mode not in best or per < best[mode][0]:
                    best[mode] = (per, ring, args)
    if a.trace:
        for mode in ("ahead", "gated"):
            if mode in best:
                _, ring, args = best[mode]
                rows = ring.trace(*args)
                name = (
                    f"{mode}, {args[2]}, {ring.chunk // 1024} KB x {args[0]}, {args[3] or 'all'} in flight, {args[4]}"
                )
                results["traces"][name] = rows
                print(f"trace of the fastest {name} (µs from the first request; medians over blocks):")
                print("  gemv  requested  input_seen  first_taken  last_taken  released  done_everywhere")
                for r in rows:
                    print(f"  {r['gemv']:4d} {r['requested']:10.2f} {r['input_seen']:11.2f} {r['first_taken']:12.2f}"
                          f" {r['last_taken']:11.2f} {r['released']:9.2f} {r['done_everywhere']:16.2f}")  # fmt: skip
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
