"""Miss copy on CUDA: the rows of a copy list, pinned host bank -> device slot pool, read by the GPU through unified
addressing (a pinned host tensor's pointer is valid on the device).

The grid is fixed by the copy list's capacity M, not its length: program (r, c) copies chunk c of entry r, and
entries at or past the device-side `count` exit at once. No host synchronisation, so it can be captured in a CUDA
graph. Its oracle is `ExpertCache.copy_rows_reference`; `benchmarks/miss_copy.py` measures it against a plain
pinned `copy_`. Imported only on CUDA devices (CPU-only machines never import triton).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096  # elements per program: 8 KiB of bf16, many programs in flight to cover PCIe latency


@triton.jit
def _copy_rows(src_ids, dst_ids, count, bank, pool, row: tl.constexpr, BLOCK: tl.constexpr, EVEN: tl.constexpr):
    r = tl.program_id(0)
    if r < tl.load(count):
        src = tl.load(src_ids + r).to(tl.int64)
        dst = tl.load(dst_ids + r).to(tl.int64)
        offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        if EVEN:
            tl.store(pool + dst * row + offs, tl.load(bank + src * row + offs))
        else:
            mask = offs < row
            tl.store(pool + dst * row + offs, tl.load(bank + src * row + offs, mask=mask), mask=mask)


def copy_rows(
    pool: torch.Tensor,
    bank: torch.Tensor,
    src: torch.Tensor,
    dst: torch.Tensor,
    count: torch.Tensor,
    block: int = BLOCK,
    num_warps: int = 4,
) -> None:
    """pool[dst[i]] = bank[src[i]] for i < count. pool: [S + 1, ...] on the GPU; bank: [E, ...] pinned host
    memory (or device memory) of the same dtype and row shape; src, dst: [M] int64, count: [] int64 (device).
    `block` and `num_warps` are for benchmarks/miss_copy.py's sweep."""
    row = pool[0].numel()
    block = min(block, triton.next_power_of_2(row))
    grid = (src.numel(), triton.cdiv(row, block))
    if grid[0]:
        _copy_rows[grid](src, dst, count, bank, pool, row, block, row % block == 0, num_warps=num_warps)
