"""`edgemoe bench` with the decode path changed in one place, for A/B figures in one session
(benchmarks/RESULTS.md) without switches in the engine:

    python benchmarks/decode_variants.py --gemv plain --copy-programs-per-sm 8 -- --geometry qwen3-30b-a3b ...

`--gemv plain`: the expert GEMV waits for the whole miss copy (the engine before per-pair arrivals,
`edgemoe.kernels.miss_copy.Arrivals`); `streamed` (default): the engine's. `--copy-programs-per-sm`: the miss copy's
persistent grid (default: the engine's `PROGRAMS_PER_SM`). `--no-pdl`: ordinary launches everywhere, so that
`--profile`'s per-kernel table shows each kernel's own time (under PDL a kernel's time includes its wait for the one
before). Everything after `--` goes to `edgemoe bench`.
"""

from __future__ import annotations

import argparse
import sys

import edgemoe.kernels.miss_copy as miss_copy
import edgemoe.kernels.pdl as pdl
from edgemoe.cli import main as edgemoe_main
from edgemoe.moe.expert_cache import ExpertCache


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gemv", choices=["streamed", "plain"], default="streamed")
    ap.add_argument("--copy-programs-per-sm", type=int, default=miss_copy.PROGRAMS_PER_SM)
    ap.add_argument("--no-pdl", action="store_true")
    ap.add_argument("bench_args", nargs=argparse.REMAINDER, help="-- then the arguments of `edgemoe bench`")
    a = ap.parse_args()
    if a.copy_programs_per_sm < 1:
        raise SystemExit("--copy-programs-per-sm must be >= 1")
    if a.gemv == "plain":
        ExpertCache.arrivals = lambda self, copy: None  # decode_experts then waits for the copy kernel as a whole
    miss_copy.PROGRAMS_PER_SM = a.copy_programs_per_sm
    if a.no_pdl:
        pdl.use_pdl = lambda device: False  # launch_args looks it up at each launch
    args = a.bench_args[1:] if a.bench_args[:1] == ["--"] else a.bench_args
    return edgemoe_main(["bench", *args])


if __name__ == "__main__":
    sys.exit(main())
