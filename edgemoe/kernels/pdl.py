"""Programmatic dependent launch (PDL; compute capability 9.0 and newer): a kernel launched with it may be scheduled
while the kernel before it on the stream is still running. Each of our decode kernels calls `wait_for_inputs` before it
reads anything a kernel of the step writes: it waits (`griddepcontrol.wait`: the previous kernel has finished and its
writes are visible), then lets the next kernel be scheduled. What no kernel of the step writes (the step's inputs,
copied in before its first kernel, such as positions, KV slots and context lengths, and fixed tables) may be read before
the wait, so that those round trips overlap the previous kernel (paged attention, the attention prologue). Two kernels
at most are resident at once (the next is scheduled only once every program of this one has passed its wait), except
after the attention prologue, which triggers paged attention before its own wait (`trigger_dependents`), so that
attention's K/V requests into L2 overlap the qkv GEMV; and a kernel launched without PDL after ours, or ours after a
torch or cuBLAS kernel, keeps the ordinary full dependency.
CUDA-graph capture keeps these programmatic edges, so within a decode step the next kernel's launch and scheduling
overlap the current one's work instead of following it. Under Triton's interpreter (CPU tests) and on older GPUs it is
off: the same kernels, ordinary launches.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    if PDL:
        gdc_wait()  # the previous kernel's writes are visible past this point
        gdc_launch_dependents()  # after the wait: two kernels in flight (`trigger_dependents`: three)


@triton.jit
def trigger_dependents(PDL: tl.constexpr):
    """Let the next kernel be scheduled now, before this one waits (`wait_for_inputs` triggers again, harmlessly):
    three kernels may then be in flight, the next one doing what it does before its own wait while this one waits
    for the one before. For a short kernel whose successor has step inputs to read early (the attention prologue)."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def prefetch_rows_l2(ptrs, nbytes):
    """Ask L2 for `nbytes` (multiples of 16; 0: nothing) from each of `ptrs` (16-byte aligned): one bulk request per
    element, from the thread that holds it (`prefetch_l2`'s instruction; sm_90+). Elements that a small tensor repeats
    over several threads are asked for more than once, which costs only the requests."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.u32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r",
        [ptrs.to(tl.int64), nbytes.to(tl.int32)],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def prefetch_l2(ptr, nbytes):
    """Ask L2 for `nbytes` (a multiple of 16) from `ptr` (16-byte aligned), in one bulk request that the program's
    first thread hands to its SM's TMA unit (`cp.async.bulk.prefetch.L2`; compute capability 9.0 and newer, where
    `use_pdl` holds): no registers, no wait. Before `wait_for_inputs`, a kernel can have data that the kernel it
    waits for does not write start moving into L2 (`edgemoe.kernels.ensure`: the cache state)."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .b32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0;"
        " @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r",
        [ptr.to(tl.int64), tl.zeros([], tl.int32) + nbytes],  # nbytes may be a tensor or a constant
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@functools.cache
def _supported(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def use_pdl(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL: CUDA devices of compute capability 9.0 or newer."""
    if device.type != "cuda":
        return False
    return _supported(device.index if device.index is not None else torch.cuda.current_device())


def launch_args(device: torch.device) -> dict[str, bool]:
    """The keyword arguments of a launch on `device` of a kernel that starts with `wait_for_inputs`."""
    flag = use_pdl(device)
    return {"PDL": flag, "launch_pdl": flag}
