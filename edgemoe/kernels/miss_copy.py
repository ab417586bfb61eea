"""Miss copy on CUDA: the rows of a copy list, pinned host bank -> device slot pool, read by the GPU through unified
addressing (a pinned host tensor's pointer is valid on the device). `copy_rows_pair` copies both banks of the
experts (gate_up and down) in one launch, one fewer per MoE layer and decode step; `copy_rows` copies one bank.

A persistent grid: P programs (PROGRAMS_PER_SM per SM, fixed, so capturable in a CUDA graph) walk the work items of the
device-side copy list in strides of P. Item i is chunk i % C of entry i // C (C chunks per entry: the first bank's
row, then the second's), so at any moment the P programs read P consecutive chunks of host memory. The grid no
longer scales with the list's capacity: an empty list (every hit) costs P programs that read `count` and exit,
where a grid of chunks x capacity ran thousands. No host synchronisation. Its oracle is
`expert_cache.copy_rows_reference`; `benchmarks/miss_copy.py` measures it against a plain pinned `copy_` and sweeps
P, the block and the warps. Imported only on CUDA devices and by the interpreter tests (CPU-only machines without
triton never import it).

Arrivals: given a counter per list entry (zeroed by `ensure`), every work item adds one to its entry's counter once
its chunk is stored (a program barrier, then a release at GPU scope), so an entry has arrived when its counter
reaches `chunks_per_entry`. The expert GEMV (`edgemoe.kernels.moe_gemv`) waits on those counters, pair by pair,
instead of on the whole copy: the experts that hit, and each missed expert as soon as its rows are in, run while
the rest are still crossing PCIe.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from edgemoe.kernels.pdl import launch_args, wait_for_inputs
from edgemoe.kernels.protocol import CPU_HEADER, HEADER, CpuWait, PostTarget

_HEADER = tl.constexpr(HEADER)  # a jitted function reads only constexpr globals
_CPU_HEADER = tl.constexpr(CPU_HEADER)

BLOCK = 4096  # elements per work item: 8 KiB of bf16
# programs of the persistent grid per SM: P x BLOCK bytes in flight cover PCIe's latency; beside the expert GEMV,
# 2 decode at least as fast as 8 (docs/findings.md, "Copy grid, copy stream, capture hygiene")
PROGRAMS_PER_SM = 2
INTERPRETED_PROGRAMS = 3  # the grid under Triton's interpreter (CPU tests): several programs, several items each


@triton.jit
def _copy_chunk(
    bank, pool, src, dst, chunk, bank_stride, pool_stride, row: tl.constexpr, BLOCK: tl.constexpr, EVEN: tl.constexpr
):  # fmt: skip
    offs = chunk.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # src, dst: int64, rows of GiBs overflow int32
    to, at = pool + dst * pool_stride + offs, bank + src * bank_stride + offs
    if EVEN:
        tl.store(to, tl.load(at))
    else:
        mask = offs < row
        tl.store(to, tl.load(at, mask=mask), mask=mask)


@triton.jit
def _copy_rows(
    src_ids,
    dst_ids,
    count,
    arrived,
    bank_a,
    pool_a,
    bank_b,
    pool_b,
    bank_stride_a,
    pool_stride_a,
    bank_stride_b,
    pool_stride_b,
    row_a: tl.constexpr,
    row_b: tl.constexpr,
    CHUNKS_A: tl.constexpr,
    CHUNKS: tl.constexpr,
    BLOCK: tl.constexpr,
    EVEN_A: tl.constexpr,
    EVEN_B: tl.constexpr,
    ARRIVALS: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    items = tl.load(count) * CHUNKS
    for i in range(tl.program_id(0), items, tl.num_programs(0)):
        r = i // CHUNKS
        c = i % CHUNKS
        src = tl.load(src_ids + r).to(tl.int64)
        dst = tl.load(dst_ids + r).to(tl.int64)
        if c < CHUNKS_A:
            _copy_chunk(bank_a, pool_a, src, dst, c, bank_stride_a, pool_stride_a, row_a, BLOCK, EVEN_A)
        else:
            _copy_chunk(bank_b, pool_b, src, dst, c - CHUNKS_A, bank_stride_b, pool_stride_b, row_b, BLOCK, EVEN_B)
        if ARRIVALS:
            tl.debug_barrier()  # every thread's stores of the chunk, then one release for the program
            tl.atomic_add(arrived + r, 1, sem="release", scope="gpu")


@functools.cache
def _sm_count(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_programs(device: torch.device) -> int:
    """The persistent grid's size on `device`: PROGRAMS_PER_SM per SM on CUDA, INTERPRETED_PROGRAMS elsewhere."""
    if device.type != "cuda":
        return INTERPRETED_PROGRAMS
    return PROGRAMS_PER_SM * _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def chunks_per_entry(pools: tuple[torch.Tensor, ...], block: int = BLOCK) -> int:
    """Work items per copy-list entry: each pool's row in chunks of `block` elements (at most the longest row)."""
    rows = [pool[0].numel() for pool in pools]
    block = min(block, triton.next_power_of_2(max(rows)))
    return sum(triton.cdiv(row, block) for row in rows)


def copy_rows_pair(
    pools: tuple[torch.Tensor, torch.Tensor],
    banks: tuple[torch.Tensor, torch.Tensor],
    src: torch.Tensor,
    dst: torch.Tensor,
    count: torch.Tensor,
    arrived: torch.Tensor | None = None,
    block: int = BLOCK,
    num_warps: int = 4,
    programs: int | None = None,
) -> None:
    """pools[k][dst[i]] = banks[k][src[i]] for both k and i < count, in one launch. pools: [S + 1, ...] on the GPU;
    banks: [E, ...] pinned host memory (or device memory), each of its pool's dtype and row shape, every row
    contiguous (rows may lie any distance apart: `edgemoe.offload.layout.split_rows`'s views); src,
    dst: [M] int64, count: [] int64 (device). `arrived`: [>= M] int64 zeros, counting each entry's stored work
    items (see Arrivals). `block`, `num_warps` and `programs` (default: `default_programs`) are for
    benchmarks/miss_copy.py's sweep."""
    _launch(pools, banks, src, dst, count, arrived, block, num_warps, programs)


def copy_rows(
    pool: torch.Tensor,
    bank: torch.Tensor,
    src: torch.Tensor,
    dst: torch.Tensor,
    count: torch.Tensor,
    block: int = BLOCK,
    num_warps: int = 4,
    programs: int | None = None,
) -> None:
    """`copy_rows_pair` of one bank: pool[dst[i]] = bank[src[i]] for i < count."""
    _launch((pool,), (bank,), src, dst, count, None, block, num_warps, programs)


def _launch(
    pools: tuple[torch.Tensor, ...],
    banks: tuple[torch.Tensor, ...],
    src: torch.Tensor,
    dst: torch.Tensor,
    count: torch.Tensor,
    arrived: torch.Tensor | None,
    block: int,
    num_warps: int,
    programs: int | None,
) -> None:
    for pool, bank in zip(pools, banks, strict=True):
        assert pool.dtype == bank.dtype and pool.shape[1:] == bank.shape[1:], "a bank and its pool differ"
        assert pool[0].is_contiguous() and bank[0].is_contiguous(), "rows must be contiguous (the rows' stride is free)"
    rows = [pool[0].numel() for pool in pools]
    block = min(block, triton.next_power_of_2(max(rows)))
    chunks = [triton.cdiv(row, block) for row in rows]
    if not src.numel():
        return
    a, b = 0, len(pools) - 1  # one bank: the second pair is the first again, given no chunks
    grid = programs or default_programs(pools[0].device)
    _copy_rows[(grid,)](
        src, dst, count, count if arrived is None else arrived, banks[a], pools[a], banks[b], pools[b],
        banks[a].stride(0), pools[a].stride(0), banks[b].stride(0), pools[b].stride(0), rows[a], rows[b], chunks[a],
        sum(chunks), block, rows[a] % block == 0, rows[b] % block == 0, arrived is not None,
        num_warps=num_warps, **launch_args(src.device),
    )  # fmt: skip


@triton.jit
def _fence_system(x):
    """x, after a fence at system scope: the thread's earlier stores (and, after a barrier, the program's) are
    visible to the host before any store that uses the result."""
    return tl.inline_asm_elementwise(
        "fence.sc.sys; mov.b64 $0, $1;", "=l,l", [x], dtype=tl.int64, is_pure=False, pack=1
    )


@triton.jit
def claim_row(tick, mailbox, RING: tl.constexpr, WIDTH: tl.constexpr):
    """-> (the mailbox's next row, its sequence number tick + 1), the number stored back to tick."""
    seq = tl.load(tick) + 1
    tl.debug_barrier()  # every thread has read the tick before it moves
    tl.store(tick, seq)
    return mailbox + ((seq - 1) % RING) * WIDTH, seq


@triton.jit
def write_list(row, src, dst, n, bank_a, bank_b, M, r, MAX: tl.constexpr):
    """The copy list src, dst [M] (n valid entries) and the banks' addresses into mailbox row `row`. `r`: an arange
    over at least M positions."""
    tl.store(row + 1, n)
    tl.store(row + 2, bank_a)
    tl.store(row + 3, bank_b)
    tl.store(row + _HEADER + r, tl.load(src + r, mask=r < M), mask=r < M)
    tl.store(row + _HEADER + MAX + r, tl.load(dst + r, mask=r < M), mask=r < M)


@triton.jit
def write_cpu_list(row, seq, layer, count, experts, listed, at, ids, n_ids, top_k, x, stride_x, cpu_x, H, max_tokens,
                   MAX: tl.constexpr, RING: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_X: tl.constexpr):  # fmt: skip
    """The CPU section of mailbox row `row` (edgemoe.kernels.protocol): the layer, `count` experts the CPU computes
    (`experts` where `listed`, at positions `at`), the step's routed ids [n_ids] (top_k a token); and, when count > 0,
    the step's x [n_ids // top_k, H] (row stride `stride_x`) as fp32 into the row's part of cpu_x [RING, max_tokens,
    H]."""
    c = row + _HEADER + 2 * MAX
    tl.store(c, layer)
    tl.store(c + 1, count)
    tl.store(c + 2, n_ids)
    tl.store(c + 3, top_k)
    tl.store(c + _CPU_HEADER + at, experts, mask=listed)
    for n0 in range(0, n_ids, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        tl.store(c + _CPU_HEADER + MAX + n, tl.load(ids + n, mask=n < n_ids), mask=n < n_ids)
    if count > 0:
        xs = cpu_x + ((seq - 1) % RING) * max_tokens * H
        total = n_ids // top_k * H
        for i0 in range(0, total, BLOCK_X):
            i = i0 + tl.arange(0, BLOCK_X)
            v = tl.load(x + (i // H).to(tl.int64) * stride_x + i % H, mask=i < total, other=0.0)
            tl.store(xs + i, v.to(tl.float32), mask=i < total)


@triton.jit
def publish_row(row, seq):
    """After every thread's stores of the row (and of its x): a system-scope fence, then `seq` into the row's first
    field: the host reads the row once it changes."""
    tl.debug_barrier()
    tl.store(row, _fence_system(seq))


@triton.jit
def post_list(src, dst, n, tick, mailbox, bank_a, bank_b, M, r, RING: tl.constexpr, MAX: tl.constexpr,
              WIDTH: tl.constexpr):  # fmt: skip
    """The copy list src, dst [M] (n > 0 valid entries) and the banks' addresses into the mailbox's next row (WIDTH
    fields: `edgemoe.kernels.protocol.row_width`), with no CPU pairs, then the row's sequence number (tick + 1, stored
    back to tick). `r`: an arange over at least M positions. The calling program's own stores of src and dst must be
    behind a barrier."""
    row, seq = claim_row(tick, mailbox, RING, WIDTH)
    write_list(row, src, dst, n, bank_a, bank_b, M, r, MAX)
    tl.store(row + _HEADER + 2 * MAX + 1, 0)  # the CPU section's count
    publish_row(row, seq)


@triton.jit
def _await_copy_list(count, arrived, CHUNKS: tl.constexpr, PDL: tl.constexpr):
    wait_for_inputs(PDL)
    n = tl.load(count)
    for i in range(n):
        while tl.atomic_add(arrived + i, 0, sem="acquire", scope="gpu") < CHUNKS:
            pass


def await_copy_list(count: torch.Tensor, arrived: torch.Tensor, chunks: int) -> None:
    """The stream waits until the first `count` entries' counters reached `chunks` (one program, no host sync)."""
    _await_copy_list[(1,)](count, arrived, chunks, num_warps=1, **launch_args(count.device))


@triton.jit
def _await_cpu_rows(count, done, seq, PDL: tl.constexpr):
    wait_for_inputs(PDL)
    if tl.load(count) > 0:
        want = tl.load(seq)
        while tl.atomic_add(done, 0, sem="acquire", scope="gpu") < want:
            pass


def await_cpu_rows(wait: CpuWait) -> None:
    """The stream waits until the copy service has put this layer-step's CPU rows in `wait.rows` (none to wait for
    when it has no CPU pairs): for readers that do not wait themselves (one program, no host sync)."""
    _await_cpu_rows[(1,)](wait.count, wait.done, wait.seq, num_warps=1, **launch_args(wait.done.device))


@triton.jit
def _post_cpu_probe(tick, mailbox, ids, x, cpu_x, H, max_tokens, count, RING: tl.constexpr, MAX: tl.constexpr,
                    WIDTH: tl.constexpr, BLOCK_X: tl.constexpr):  # fmt: skip
    mail, seq = claim_row(tick, mailbox, RING, WIDTH)
    tl.store(mail + 1, 0)  # no copies
    r = tl.arange(0, 2)
    n = tl.load(count)
    experts = tl.load(ids + r, mask=r < 1, other=0)
    write_cpu_list(mail, seq, 0, n, experts, r < n, r, ids, 1, 1, x, H, cpu_x, H, max_tokens, MAX, RING, 2, BLOCK_X)
    publish_row(mail, seq)


def post_cpu_probe(target: PostTarget, expert: torch.Tensor, x: torch.Tensor, count: torch.Tensor) -> None:
    """A mailbox row of MoE layer 0 with no copies and `count` ([] int64, 0 or 1) CPU pairs: one token, routed to
    `expert` ([1] int64), over x [1, H] (`edgemoe.offload.cpu_split.measure`'s round trip)."""
    _post_cpu_probe[(1,)](target.tick, target.mailbox, expert, x, target.cpu_x, x.shape[1], target.cpu_x.shape[1],
                          count, target.ring, target.max_entries, target.width, 1024, num_warps=4)  # fmt: skip
