"""Session 20, call 4: why does benchmarks/persistent_chain.py's engine chain take ~8.8 us a GEMV (session 15:
6.61)? The same chain with the engine's GEMV at other step widths, and with ordinary launches instead of PDL.
Run on a GPU as: PYTHONPATH=. python benchmarks/h200_session20/call4_engine_chain.py"""

import os
import sys

import torch

sys.path.insert(0, "benchmarks")
import persistent_chain as pc  # noqa: E402
import smem_carveout  # noqa: E402
from edgemoe.bench import bandwidths, capture, timed  # noqa: E402

import edgemoe.kernels.dense_gemv as dg  # noqa: E402
import edgemoe.kernels.pdl as pdl  # noqa: E402

if os.environ.get("EDGEMOE_SMEM_CARVEOUT"):  # call 5: one carveout for every kernel
    smem_carveout.install(int(os.environ["EDGEMOE_SMEM_CARVEOUT"]))
    print("carveout", os.environ["EDGEMOE_SMEM_CARVEOUT"])
dev = torch.device("cuda")
hbm = bandwidths(dev, 1 << 20)["hbm_bytes_per_s"]
chain = pc.Chain(8, 2048, 4096, dev)
floor = chain.w.numel() * 2 / 8 / hbm * 1e6
ref = pc.reference(chain)


def run(name, fn):
    err = ((fn().double() - ref).abs().max() / ref.abs().max()).item()
    g = capture(fn)
    us = timed(g.replay, dev, 200) * 1e6 / 8
    print(f"{name:>44}: {us:5.2f} us a GEMV, {floor / us:.2f} of HBM (error {err:.1e})")


steps = dg.pick_steps
for label, fixed in [("engine steps", None), ("256 columns x 4 stages", (256, 4)), ("512 x 3", (512, 3))]:
    dg.pick_steps = steps if fixed is None else (lambda k, f=fixed: f)
    for rows in (None, (4, 8)):
        run(f"{label}, rows {rows or 'engine'}", lambda r=rows: chain.engine(r))
dg.pick_steps = steps
args = dg.launch_args
dg.launch_args = lambda d: {**args(d), "launch_pdl": False}
run("engine, ordinary launches (no PDL)", chain.engine)
dg.launch_args = args
run("static, prefetch 1024", lambda: chain.static(4, 8, 1024, 512))
print("pdl:", pdl.use_pdl(dev))
