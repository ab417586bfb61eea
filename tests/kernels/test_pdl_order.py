"""What the engine launches around attention, built for sm_90 (Hopper, where PDL runs) on a machine without a GPU:
Triton compiles the real kernels offline with the arguments the engine's launchers pass (recorded with PDL on), and
the PTX shows the order the decode step relies on. The attention prologue lets paged attention be scheduled before
its own wait for qkv (`griddepcontrol.launch_dependents` before `griddepcontrol.wait`), and each partial program asks
L2 for its first K/V tile before its wait (`cp.async.bulk.prefetch.L2` before `griddepcontrol.wait`). Outputs are
tests/gpu's (bitwise across both switches); this file fails if a launcher stops passing the engine's settings or a
kernel stops issuing them before its wait. The checks run in a child process: compiling needs `triton.jit` without
the interpreter that tests/conftest.py turns on for a machine without CUDA."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]

_POINTEE = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.int64: "i64", torch.int32: "i32"}


class Recorder:
    """Stands in for a Triton kernel: `kernel[grid](*args, **kwargs)` records the kernel's arguments by name (positional
    or keyword) and the launch options (the other keywords)."""

    def __init__(self, kernel) -> None:
        self.kernel, self.calls = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            named = dict(zip(self.kernel.arg_names, args))
            named.update({k: v for k, v in kwargs.items() if k in self.kernel.arg_names})
            self.calls.append((named, {k: v for k, v in kwargs.items() if k not in named}))

        return launch


def ptx_for_sm90(kernel, args: dict, options: dict) -> str:
    """`kernel` compiled for sm_90 with the recorded `args` (constexpr parameters fixed, the rest typed from values)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    constexprs, signature = {}, {}
    for i, param in enumerate(kernel.params):
        value = args[param.name]
        if param.is_constexpr or value is None:  # (Triton specialises a None argument as a constexpr)
            constexprs[(i,)], signature[param.name] = value, "constexpr"
        elif isinstance(value, torch.Tensor):
            signature[param.name] = "*" + _POINTEE[value.dtype]
        elif isinstance(value, float):
            signature[param.name] = "fp32"
        else:
            signature[param.name] = "i64" if abs(value) >= 2**31 else "i32"
    source = ASTSource(kernel, signature, constexprs=constexprs)
    keep = {k: v for k, v in options.items() if k in ("num_warps", "num_stages")}
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=keep).asm["ptx"]


def pdl_on() -> None:
    from edgemoe.kernels import pdl

    pdl.use_pdl = lambda device: True  # launch_args' PDL flag (and so the K/V requests), as on an H200


def check_partial() -> None:
    from edgemoe.kernels import paged_attention

    pdl_on()
    heads, kv_heads, dim, bs, width = 32, 4, 128, 16, 4096  # qwen3-30b-a3b at batch 1
    q = torch.randn(1, heads, dim).bfloat16()
    cache = torch.randn(width + bs, kv_heads, dim).bfloat16()
    tables = torch.randperm(width // bs)[None]
    lens = torch.tensor([width])
    partial = paged_attention._partial = Recorder(paged_attention._partial)
    paged_attention._reduce = Recorder(paged_attention._reduce)
    paged_attention.paged_decode_attention(q, cache, cache, tables, lens, dim**-0.5, bs)
    ((args, options),) = partial.calls
    assert paged_attention.PREFETCH_TILES >= 1  # the engine's setting (docs/findings.md, "Attention")
    assert args["PREFETCH_N"] == paged_attention.PREFETCH_TILES * paged_attention.BLOCK_N and args["PDL"]
    ptx = ptx_for_sm90(partial.kernel, args, options)
    wait = ptx.index("griddepcontrol.wait")
    asks = [i for i in range(len(ptx)) if ptx.startswith("cp.async.bulk.prefetch.L2", i)]
    assert asks and max(asks) < wait, "the K/V tile requests must come before the wait"


def check_prologue() -> None:
    from edgemoe.kernels import norm_rope

    pdl_on()
    heads, kv_heads, dim = 32, 4, 128
    qkv = torch.randn(1, (heads + 2 * kv_heads) * dim).bfloat16()
    q, k, v = (t.view(1, -1, dim) for t in qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1))
    cache = torch.zeros(64, kv_heads, dim).bfloat16()
    cos_sin = torch.randn(2, 64, dim)
    norm_w = torch.ones(dim).bfloat16()
    prologue = norm_rope._attention_prologue = Recorder(norm_rope._attention_prologue)
    positions, slots = torch.tensor([5]), torch.tensor([5])
    norm_rope.attention_prologue(q, k, v, positions, cos_sin, cache, cache.clone(), slots, norm_w, norm_w)
    ((args, options),) = prologue.calls
    assert args["PDL"]
    args["RNE_BY_HAND"] = False  # the GPU build's (True only for the interpreter's CPU tensors)
    ptx = ptx_for_sm90(prologue.kernel, args, options)
    assert ptx.index("griddepcontrol.launch_dependents") < ptx.index("griddepcontrol.wait")


@pytest.mark.parametrize("check", ["check_partial", "check_prologue"])
def test_on_sm90(check: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = f"import tests.kernels.test_pdl_order as t; t.{check}()"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
