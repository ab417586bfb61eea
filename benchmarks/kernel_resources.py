"""Registers, stack and shared memory of the paged-attention `partial` kernel compiled offline for sm_90 (no GPU:
Triton builds the cubin with its own ptxas, and its wheel's `cuobjdump` reads the resource use), over block_n x warps
x stages. A kernel whose registers allow few programs an SM, or that keeps a stack (spills), shows it here before
any device time is spent (benchmarks/RESULTS.md, issue #5).

    python benchmarks/kernel_resources.py [--block-n 16,32,64] [--warps 2,4,8] [--stages 1,3] [--chain]

`--chain` also prints, from the Triton wheel's `nvdisasm`, each build's memory and barrier instructions from its
PDL wait (ACQBULK) to its first tensor-core MMA: the loads a program issues, and waits for, before it computes.
The engine's build (64-token tiles, 4 warps, 3 stages) loads q and stores it to shared memory (which waits for q
to arrive), then asks for the first tile's block-table entries, waits for them (DEPBAR), and only then asks for K
and V: two L2 round trips after the wait before the first HBM read. Session 7 moved the table loads before the
wait (k2: 367.8 against 368.0 tok/s, RESULTS.md), so one of those round trips is not what `partial` loses.
Figures depend on the Triton version: the GPU machine's 3.6 gives 107 registers at 4 warps (4 programs an SM), this
machine's 3.9 gives 96 (5).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from edgemoe.kernels import paged_attention

TYPES = {"q": "*bf16", "k_cache": "*bf16", "v_cache": "*bf16", "block_tables": "*i64", "context_lens": "*i64",
         "out": "*bf16", "m_part": "*fp32", "l_part": "*fp32", "acc_part": "*fp32", "qk_scale": "fp32"}  # fmt: skip
# integer arguments that are multiples of 16 at qwen3-30b-a3b's decode shapes (a 40K-token table, 128 splits, 32
# heads of 128, 4 KV heads): at run time Triton specializes them, and every pointer, as divisible by 16, which is
# what lets it vectorise the loads; an offline build must say so, or it sees 2-byte loads and their registers
ALIGNED = {"width", "num_splits", "heads", "stride_qs", "stride_qh", "stride_ks", "stride_kh", "stride_vs", "stride_vh",
           "stride_bt", "stride_os", "stride_oh"}  # fmt: skip
REGISTERS_PER_SM = 65536


def build(block_n: int, warps: int, stages: int, prefetch_tiles: int = 0):
    """The partial kernel at qwen3-30b-a3b's shape (8 query heads a KV head, head_dim 128, bf16, 16-token KV
    blocks, PDL), compiled for sm_90."""
    kernel = paged_attention._partial
    consts = dict(GROUP=8, G_PAD=16, D=128, BS=16, BLOCK_N=block_n, SINGLE=False, DOT_TY=tl.bfloat16,
                  PRECISION="tf32", PREFETCH_N=prefetch_tiles * block_n, ROW_BYTES=256, PDL=True)  # fmt: skip
    names = kernel.arg_names
    signature = {n: "constexpr" if n in consts else TYPES.get(n, "i32") for n in names}
    aligned = [i for i, n in enumerate(names) if n in ALIGNED or TYPES.get(n, "").startswith("*")]
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    source = ASTSource(kernel, signature, constexprs={(names.index(k),): v for k, v in consts.items()}, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})


def _tool(name: str, compiled, *args: str) -> str:
    """Run the Triton wheel's CUDA binary `name` on the compiled kernel's cubin -> its stdout."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        return subprocess.run([tool, *args, f.name], capture_output=True, text=True, check=True).stdout


CHAIN_OPS = ("ACQBULK", "LDG", "LDGSTS", "LDGDEPBAR", "DEPBAR", "STS", "LDS", "BAR.SYNC", "HMMA")


def chain(compiled) -> list[str]:
    """Memory and barrier instructions from the PDL wait to the first MMA, consecutive repeats counted."""
    lines, seen = [], False
    for raw in _tool("nvdisasm", compiled, "-c").splitlines():
        if "/*" not in raw or ";" not in raw:
            continue
        ins = raw.split("*/", 1)[1].split(";")[0].strip()
        op = next((o for o in CHAIN_OPS if o in ins.split()[0 if not ins.startswith("@") else 1]), None)
        seen = seen or op == "ACQBULK"
        if not (seen and op):
            continue
        name = ins.split()[1] if ins.startswith("@") else ins.split()[0]
        if lines and lines[-1].split(" x")[0] == name:
            count = int(lines[-1].split(" x")[1]) + 1 if " x" in lines[-1] else 2
            lines[-1] = f"{name} x{count}"
        else:
            lines.append(name)
        if op == "HMMA":
            break
    return lines


def resources(block_n: int, warps: int, stages: int) -> str:
    compiled = build(block_n, warps, stages)
    out = _tool("cuobjdump", compiled, "-res-usage")
    usage = next(line.strip() for line in out.splitlines() if "REG:" in line)
    regs = int(usage.split("REG:")[1].split()[0])
    per_sm = REGISTERS_PER_SM // (regs * 32 * warps)
    return f"{usage.split(' CONSTANT')[0]}, dynamic shared {compiled.metadata.shared} B, {per_sm} programs an SM"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ints = lambda s: [int(v) for v in s.split(",")]  # noqa: E731
    ap.add_argument("--block-n", type=ints, default=[16, 32, 64])
    ap.add_argument("--warps", type=ints, default=[2, 4, 8])
    ap.add_argument("--stages", type=ints, default=[3])
    ap.add_argument("--chain", action="store_true", help="also the instructions from the PDL wait to the first MMA")
    a = ap.parse_args()
    for block_n in a.block_n:
        for warps in a.warps:
            for stages in a.stages:
                print(f"block_n {block_n:3d} warps {warps} stages {stages}: {resources(block_n, warps, stages)}")
                if a.chain:
                    print("  after the wait: " + ", ".join(chain(build(block_n, warps, stages))))


if __name__ == "__main__":
    main()
