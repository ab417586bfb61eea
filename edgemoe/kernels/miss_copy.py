"""Miss copy on CUDA: the rows of a copy list, pinned host bank -> device slot pool, read by the GPU through unified
addressing (a pinned host tensor's pointer is valid on the device). `copy_rows_pair` copies both banks of the
experts (gate_up and down) in one launch, one fewer per MoE layer and decode step; `copy_rows` copies one bank.

The grid is fixed by the copy list's capacity M, not its length: program (c, r) copies chunk c of entry r, the
chunks of the first bank's row then the second's, and entries at or past the device-side `count` exit at once. No
host synchronisation, so it can be captured in a CUDA graph. Its oracle is `expert_cache.copy_rows_reference`;
`benchmarks/miss_copy.py` measures it against a plain pinned `copy_`. Imported only on CUDA devices (CPU-only
machines never import triton).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096  # elements per program: 8 KiB of bf16, many programs in flight to cover PCIe latency


@triton.jit
def _copy_chunk(bank, pool, src, dst, chunk, row: tl.constexpr, BLOCK: tl.constexpr, EVEN: tl.constexpr):
    offs = chunk.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # src, dst: int64, rows of GiBs overflow int32
    if EVEN:
        tl.store(pool + dst * row + offs, tl.load(bank + src * row + offs))
    else:
        mask = offs < row
        tl.store(pool + dst * row + offs, tl.load(bank + src * row + offs, mask=mask), mask=mask)


@triton.jit
def _copy_rows(
    src_ids,
    dst_ids,
    count,
    bank_a,
    pool_a,
    bank_b,
    pool_b,
    row_a: tl.constexpr,
    row_b: tl.constexpr,
    CHUNKS_A: tl.constexpr,
    BLOCK: tl.constexpr,
    EVEN_A: tl.constexpr,
    EVEN_B: tl.constexpr,
):
    # chunks on axis 0 (up to 2^31 - 1 programs): a row pair of a large expert passes axis 1's 65535
    r = tl.program_id(1)
    if r < tl.load(count):
        src = tl.load(src_ids + r).to(tl.int64)
        dst = tl.load(dst_ids + r).to(tl.int64)
        c = tl.program_id(0)
        if c < CHUNKS_A:
            _copy_chunk(bank_a, pool_a, src, dst, c, row_a, BLOCK, EVEN_A)
        else:
            _copy_chunk(bank_b, pool_b, src, dst, c - CHUNKS_A, row_b, BLOCK, EVEN_B)


def copy_rows_pair(
    pools: tuple[torch.Tensor, torch.Tensor],
    banks: tuple[torch.Tensor, torch.Tensor],
    src: torch.Tensor,
    dst: torch.Tensor,
    count: torch.Tensor,
    block: int = BLOCK,
    num_warps: int = 4,
) -> None:
    """pools[k][dst[i]] = banks[k][src[i]] for both k and i < count, in one launch. pools: [S + 1, ...] on the GPU;
    banks: [E, ...] contiguous pinned host memory (or device memory), each of its pool's dtype and row shape; src,
    dst: [M] int64, count: [] int64 (device). `block` and `num_warps` are for benchmarks/miss_copy.py's sweep."""
    _launch(pools, banks, src, dst, count, block, num_warps)


def copy_rows(
    pool: torch.Tensor,
    bank: torch.Tensor,
    src: torch.Tensor,
    dst: torch.Tensor,
    count: torch.Tensor,
    block: int = BLOCK,
    num_warps: int = 4,
) -> None:
    """`copy_rows_pair` of one bank: pool[dst[i]] = bank[src[i]] for i < count."""
    _launch((pool,), (bank,), src, dst, count, block, num_warps)


def _launch(
    pools: tuple[torch.Tensor, ...],
    banks: tuple[torch.Tensor, ...],
    src: torch.Tensor,
    dst: torch.Tensor,
    count: torch.Tensor,
    block: int,
    num_warps: int,
) -> None:
    for pool, bank in zip(pools, banks, strict=True):
        assert pool.dtype == bank.dtype and pool.shape[1:] == bank.shape[1:], "a bank and its pool differ"
    rows = [pool[0].numel() for pool in pools]
    block = min(block, triton.next_power_of_2(max(rows)))
    chunks = [triton.cdiv(row, block) for row in rows]
    if not src.numel():
        return
    a, b = 0, len(pools) - 1  # one bank: the second pair is the first again, given no chunks
    _copy_rows[(sum(chunks), src.numel())](
        src, dst, count, banks[a], pools[a], banks[b], pools[b], rows[a], rows[b], chunks[a], block,
        rows[a] % block == 0, rows[b] % block == 0, num_warps=num_warps,
    )  # fmt: skip
