"""Row gather for the `host` and `disk` per-layer-embedding backends on CUDA: out[t] = table[idx[t]], the table (the
whole PLE table, or the disk backend's staging buffer) in pinned host memory read by the GPU through unified
addressing (a pinned tensor's pointer is valid on the device), the indices and the output on the device.

Why a kernel: torch's `index_select` cannot read a host tensor by device indices, and a copy of the whole table (or
staging buffer) per step would move far more than the step's rows. One program per (row, chunk of BLOCK elements);
a fixed grid for a fixed token count and no host synchronisation, so a CUDA graph captures it. Its oracle is
`edgemoe.layers.ple.gather_rows_reference` (`index_select`); under Triton's interpreter (CPU tests) the same kernel
reads CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048  # elements per program: 4 KiB of bf16 in flight each, many programs to cover PCIe's latency


@triton.jit
def _gather_rows(table, idx, out, ROW: tl.constexpr, BLOCK: tl.constexpr, EVEN: tl.constexpr):
    t = tl.program_id(0)
    src = tl.load(idx + t).to(tl.int64)  # int64: a table of GiBs has offsets past int32
    offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    at, to = table + src * ROW + offs, out + t.to(tl.int64) * ROW + offs
    if EVEN:
        tl.store(to, tl.load(at))
    else:
        mask = offs < ROW
        tl.store(to, tl.load(at, mask=mask), mask=mask)


def gather_rows(table: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """table [rows, row] (contiguous; pinned host or device memory), idx [n] int64 on the device -> [n, row] on
    idx's device, table[idx]."""
    assert table.is_contiguous() and idx.dtype == torch.int64, "rows must be contiguous, ids int64"
    n, row = idx.shape[0], table.shape[1]
    out = torch.empty(n, row, dtype=table.dtype, device=idx.device)
    if n == 0:
        return out
    block = min(BLOCK, triton.next_power_of_2(row))
    _gather_rows[(n, triton.cdiv(row, block))](table, idx, out, row, block, row % block == 0)
    return out
