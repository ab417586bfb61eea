"""What one hand-off of a 768-wide vector costs when every block of a group needs all of it: a hardware cluster
barrier with distributed shared memory (8 blocks) against the two software hand-offs across the whole GPU of
`tile_prefetch_chain.py` (flags in the data; a counter), in one run.

    python benchmarks/handoff_latency.py [--rounds 2000] [--blocks 128] [--loaders 0,264] [--json OUT]

Why (issue #5, benchmarks/RESULTS.md session 23): a layer megakernel built from hand-offs across all SMs loses to
PDL launches, because such a hand-off costs 2.3-5 µs. A kernel whose dependencies stay inside a thread-block cluster
(one expert's up and down, say, passing the 768-wide intermediate through distributed shared memory) would pay a
cluster barrier instead. `handoff_latency.cu` runs `--rounds` rounds of write-share, hand off, read-all and check
the sum, in `--blocks` blocks of 256 threads; each block stamps %globaltimer around its rounds. Reported: the median
and the slowest block's µs a round, and the launch's own time a round (CUDA events). `--loaders N` adds N blocks to
the launch that only read a 2 GB buffer from HBM until the rounds are done (with their read rate): the hand-off
beside streaming weights, which session 23's chain found to slow the software hand-offs 2-3 times. Needs a GPU of
compute capability 9.0 (clusters), nvcc and CuPy (on the GPU machine's image; not edgemoe dependencies).

Answer (H200, session 23, benchmarks/RESULTS.md), µs a round idle / beside HBM loads: cluster barrier 0.74-0.77 /
1.48, flags 1.17-1.22 / 3.60, counter 1.54-1.56 / 4.07.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tile_prefetch_chain import nvcc_build  # noqa: E402

SOURCE = Path(__file__).with_suffix(".cu")
WIDTH, THREADS, CLUSTER = 768, 256, 8  # the .cu's


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2000)
    ap.add_argument("--blocks", type=int, default=128, help=f"blocks of {THREADS} threads, a multiple of {CLUSTER}")
    ap.add_argument("--loaders", default="0,264", help="blocks that only load HBM meanwhile, each count timed")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    try:
        loader_counts = [int(v) for v in a.loaders.split(",")]
    except ValueError:
        raise SystemExit(f"--loaders {a.loaders!r}: expected block counts, e.g. 0,264") from None
    if a.rounds < 1 or a.blocks < CLUSTER or a.blocks % CLUSTER or any(v < 0 or v % CLUSTER for v in loader_counts):
        raise SystemExit(f"--rounds >= 1; --blocks and every --loaders a multiple of {CLUSTER}")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        raise SystemExit("benchmarks/handoff_latency.py needs a CUDA GPU of compute capability 9.0 or newer")
    try:
        import cupy as cp
    except ImportError:
        raise SystemExit("benchmarks/handoff_latency.py needs CuPy to load and launch its kernels") from None
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if a.blocks > sms:
        raise SystemExit(f"--blocks {a.blocks}: the software hand-offs need every block resident ({sms} SMs)")
    module = cp.RawModule(path=str(nvcc_build(SOURCE)))
    dev = torch.device("cuda")
    stamps = torch.zeros(a.blocks, dtype=torch.int64, device=dev)
    failed = torch.zeros(1, dtype=torch.int32, device=dev)
    flags = torch.zeros(2 * WIDTH, dtype=torch.int64, device=dev)
    plain = torch.zeros(2 * WIDTH, dtype=torch.int32, device=dev)
    counter = torch.zeros(1, dtype=torch.int32, device=dev)
    load = torch.empty(2 << 30, dtype=torch.uint8, device=dev).view(torch.int32).random_()  # larger than L2
    stop = torch.zeros(1, dtype=torch.int32, device=dev)
    sink = torch.zeros(2, dtype=torch.int64, device=dev)
    ptr = lambda t: np.uint64(t.data_ptr())  # noqa: E731
    tail = (ptr(load), np.uint64(load.numel() // 4), ptr(stop), ptr(sink))  # the loaders' arguments
    launches = {"flag_rounds": 0, "counter_rounds": 0}

    def args(name: str) -> tuple:
        n = launches.get(name, 0)
        launches[name] = n + 1
        mine = (np.int32(a.blocks), *tail)
        if name == "cluster_rounds":
            return (np.int32(a.rounds), ptr(stamps), ptr(failed), *mine)
        if name == "flag_rounds":  # tags grow from launch to launch (1 + n * rounds + r)
            return (np.int32(a.rounds), ptr(flags), np.uint32(1 + n * a.rounds), ptr(stamps), ptr(failed), *mine)
        return (np.int32(a.rounds), ptr(plain), ptr(counter), np.uint32(n * a.rounds * a.blocks), ptr(stamps),
                ptr(failed), *mine)  # fmt: skip

    results = {"device": torch.cuda.get_device_name(), "rounds": a.rounds, "blocks": a.blocks, "kernels": {}}
    print(f"{results['device']}: {a.rounds} rounds of a {WIDTH}-wide hand-off, {a.blocks} blocks")
    kernels = (("cluster_rounds", f"cluster barrier, {CLUSTER} blocks, DSMEM"),
               ("flag_rounds", f"flags in the data, all {a.blocks} blocks"),
               ("counter_rounds", f"counter (fence + atomic), all {a.blocks} blocks"))  # fmt: skip
    for loaders in loader_counts:
        print(f"with {loaders} blocks loading HBM meanwhile:")
        for name, label in kernels:
            kernel = module.get_function(name)
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                stream = cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
            failed.zero_()
            with stream:
                for timed_launch in (False, True):  # a warm launch, then the timed one
                    stop.zero_()
                    sink.zero_()
                    if timed_launch:
                        begin.record()
                    kernel((a.blocks + loaders,), (THREADS,), args(name))
            end.record()
            torch.cuda.synchronize()
            if failed.item():
                raise SystemExit(f"{name}: a round read a wrong or stale entry")
            per = stamps.cpu().numpy() / 1e3
            seconds = begin.elapsed_time(end) / 1e3
            read = sink[1].item() * 16 / seconds
            row = {"median_us": float(np.median(per)), "max_us": float(per.max()),
                   "launch_us_per_round": seconds * 1e6 / a.rounds, "loaders_read_bytes_per_s": read}  # fmt: skip
            results["kernels"][f"{name}, {loaders} loaders"] = row
            print(f"{label:>44}: {row['median_us']:5.2f} µs a round (slowest block {row['max_us']:5.2f}; launch"
                  f" {row['launch_us_per_round']:5.2f}); loaders read {read / 1e9:5.0f} GB/s")  # fmt: skip
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
