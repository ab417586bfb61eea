"""Is a kernel boundary what decode loses? A chain of dependent GEMVs, y[i+1] = W[i] @ y[i], run as the engine runs
its projections (one `dense_gemv.gemv` launch each, PDL between them, in a CUDA graph) against one persistent
launch in which each GEMV's row blocks wait on a counter for the GEMV before, not on a grid boundary.

    python benchmarks/persistent_chain.py [--layers 8] [--block-n 4] [--prefetch-k 0,512] [--static-blocks 4,8]
                                          [--json OUT]
    python benchmarks/persistent_chain.py --check      (no GPU: small shapes under Triton's interpreter)

Why (issue #5, benchmarks/RESULTS.md): resident qwen3-30b-a3b decode loses ~19 µs a layer to the HBM roofline
over ten kernels, and every lever inside one kernel has been worth <= 2-3 %. Session 5's dense-GEMV sweep fits
t = 3.8 µs + bytes / min(HBM, bytes in flight / 0.8 µs) (15 % rms): the engine's configs are past the knee, and what
is left is a fixed ~3-4 µs a call. If that fixed part is the boundary (the grid's tail, the wait's release, the next
grid's first loads), a persistent kernel removes most of it; if not, fusing the layer into one kernel is not worth
its complexity. This probe decides that before any such kernel is written.

Answer (H200, session 15, benchmarks/RESULTS.md): no. The engine's launches took 6.61 µs a GEMV (0.59 of HBM);
the persistent launch 7.61-8.04 at 4 rows a task and 4 programs an SM, 11.4-12.5 at 2, 6.95 at 8 rows and 4 an
SM; loading 512-1024 weight columns before the wait changed nothing beyond ±0.4 µs. Under PDL a boundary costs
less than a counter hand-off between tasks does here. Session 20 (static kernel below): 6.27-6.40 µs with 1024
columns preloaded, 6.68 without, against the engine's launches at 6.34-6.37 once every kernel shares one
shared-memory carveout (benchmarks/smem_carveout.py; without, the engine's two GEMV builds alternating here read
8.8): a tie. A hand-off costs what a PDL boundary does in both designs.

The persistent kernel: programs take tasks (GEMV i, row block b) in order from an atomic queue, so a task's inputs
belong to tasks already taken by running programs and it cannot deadlock, at any grid size (the interpreter runs
programs one after another: program 0 takes every task in order). A task may load its first `prefetch_k` columns
of weight before it waits, then spins (acquire) until GEMV i - 1 has stored all its blocks, then runs the engine's
GEMV loop over the rest; after its store it bumps GEMV i's counter (release). Only programs that have finished
GEMV i - 1's tasks take GEMV i's, so the weight loads ahead of a wait fill the tail of the GEMV before instead of
competing with its whole run (the PDL preloads that lost, RESULTS.md). Counters come in two sets, one for each
launch parity (a device `epoch` the last program to find the queue empty bumps); each launch clears the set the
launch before used, so no clearing races a late counter update.

The static kernel (`--static-blocks A,B`, session 20): no queue. Program p runs row block p (p + P, ...) of every
GEMV in order, A rows a block for the 2048-row GEMVs and B for the 4096-row ones, so at (4, 8) each of 512
programs holds one block of each GEMV: the engine's two configs, and each program's next weights are known before
its wait. Counters only grow (launch e waits for e + 1 launches' blocks), and the last program to finish bumps the
epoch. All programs must be resident at once; a wait gives up after 2^22 polls (wrong outputs, which the check
catches, instead of a hang).

Shapes alternate qwen3-30b-a3b's o-like 2048 x 4096 and its transpose (16.8 MB each), one weight per GEMV, more
bytes than L2 holds. Outputs are checked against a float64 torch chain before any timing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

if __name__ == "__main__" and "--check" in sys.argv and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton.jit decorates the kernels below

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from edgemoe.kernels.dense_gemv import BLOCK_K, STAGES, WARPS, gemv  # noqa: E402
from edgemoe.kernels.pdl import launch_args, wait_for_inputs  # noqa: E402

PROGRAMS_PER_SM = 4  # the engine's o GEMV puts ~3.9 programs on each SM (512 of 4 rows)


@triton.jit
def _task(tasks_a, tasks_b, t):
    """Task t -> (GEMV, row block): GEMVs alternate a (tasks_a blocks) and b (tasks_b blocks)."""
    pair = t // (tasks_a + tasks_b)
    rem = t % (tasks_a + tasks_b)
    second = rem >= tasks_a
    return 2 * pair + second.to(tl.int32), tl.where(second, rem - tasks_a, rem)


@triton.jit
def _chain(w, ys, ready, queue, epoch, layers, dim_a, dim_b, stride_y, total,
           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, PRE_K: tl.constexpr,
           PDL: tl.constexpr):  # fmt: skip
    # GEMV i: even i [dim_a, dim_b] (y[i] has dim_b entries, y[i + 1] dim_a), odd i the transpose; weights packed
    # one after another (dim_a * dim_b each), row-major. Two sets of counters, by the launch's parity (`epoch`):
    # queue[s], the next task; ready[s, i], the row blocks of GEMV i - 1 stored (ready[s, 0] unused).
    wait_for_inputs(PDL)  # the launch before has finished: its epoch and counters are settled
    e = tl.load(epoch)
    cur = e % 2
    ready_s = ready + cur * (layers + 1)
    if tl.program_id(0) == 0:  # the launch before used the other set and has finished: clear it for the next
        r = tl.arange(0, 64)
        for c0 in range(0, layers + 1, 64):
            tl.store(ready + (1 - cur) * (layers + 1) + c0 + r, tl.zeros([64], dtype=tl.int32), mask=c0 + r <= layers)
        tl.store(queue + 1 - cur, 0)
    tasks_a = tl.cdiv(dim_a, BLOCK_N)
    tasks_b = tl.cdiv(dim_b, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    rows = tl.arange(0, BLOCK_N)
    t = tl.atomic_add(queue + cur, 1, sem="relaxed")  # the order of tasks is all it decides
    while t < total:
        i, blk = _task(tasks_a, tasks_b, t)
        odd = i % 2 == 1
        N = tl.where(odd, dim_b, dim_a)
        K = tl.where(odd, dim_a, dim_b)
        n = blk * BLOCK_N + rows
        live = n < N
        w_rows = w + i.to(tl.int64) * dim_a * dim_b + n[:, None].to(tl.int64) * K  # [BLOCK_N, 1]
        w_ptr = w_rows + k[None, :]
        x_ptr = ys + i.to(tl.int64) * stride_y + k
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        if PRE_K > 0:  # independent of the wait: weight columns [0, PRE_K) asked for before it
            pk = tl.arange(0, PRE_K)
            pre = tl.load(w_rows + pk[None, :], mask=live[:, None] & (pk < K)[None, :], other=0.0)
        if i > 0:  # GEMV i - 1 has stored every block of y[i] (acquire: the loads below see them)
            blocks_before = tl.where(odd, tasks_a, tasks_b)
            while tl.atomic_add(ready_s + i, 0, sem="acquire", scope="gpu") < blocks_before:
                pass
        if PRE_K > 0:
            xp = tl.load(ys + i.to(tl.int64) * stride_y + pk, mask=pk < K, other=0.0, cache_modifier=".cg")
            out = tl.sum(pre.to(tl.float32) * xp.to(tl.float32)[None, :], axis=1)
        else:
            out = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in tl.range(PRE_K, K, BLOCK_K, num_stages=STAGES):
            cols = k0 + k < K
            wk = tl.load(w_ptr + k0, mask=live[:, None] & cols[None, :], other=0.0).to(tl.float32)
            xk = tl.load(x_ptr + k0, mask=cols, other=0.0, cache_modifier=".cg").to(tl.float32)  # L2: other SMs wrote y
            acc = tl.fma(wk, xk[None, :], acc)
        out += tl.sum(acc, axis=1)
        tl.store(ys + (i + 1).to(tl.int64) * stride_y + n, out.to(ys.dtype.element_ty), mask=live)
        tl.debug_barrier()  # every thread's stores, then one release for the block
        tl.atomic_add(ready_s + i + 1, 1, sem="release", scope="gpu")
        t = tl.atomic_add(queue + cur, 1, sem="relaxed")
    if t == total + tl.num_programs(0) - 1:  # the last program to find the queue empty: every program has read e
        tl.store(epoch, e + 1)


@triton.jit
def _static_gemv(w, ys, ready, e, pid, stride_y, G: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
                 BN: tl.constexpr, BEFORE: tl.constexpr, W_SIZE: tl.constexpr, BLOCK_K: tl.constexpr,
                 STAGES: tl.constexpr, PRE_K: tl.constexpr, SPINS: tl.constexpr):  # fmt: skip
    """GEMV G of `_chain_static` ([N, K], BN rows a block) for program pid; GEMV G - 1 stored BEFORE blocks."""
    rows = tl.arange(0, BN)
    k = tl.arange(0, BLOCK_K)
    for blk in range(pid, (N + BN - 1) // BN, tl.num_programs(0)):
        n = blk * BN + rows
        live = n < N
        w_rows = w + G * W_SIZE + n[:, None].to(tl.int64) * K  # [BN, 1]
        if PRE_K > 0:  # fixed weights: asked for before the wait, while GEMV G - 1 finishes
            pk = tl.arange(0, PRE_K)
            pre = tl.load(w_rows + pk[None, :], mask=live[:, None] & (pk < K)[None, :], other=0.0)
        if G > 0:
            if blk == pid:  # the program's first block of GEMV G: GEMV G - 1 has stored all of y[G]
                spins = 0
                # an atomic add of 0 with acquire: sm_90's ptxas makes it a strong load (LDG.E.STRONG.GPU), no RMW
                while (tl.atomic_add(ready + G, 0, sem="acquire", scope="gpu") < (e + 1) * BEFORE) & (spins < SPINS):
                    spins += 1
        out = tl.zeros([BN], dtype=tl.float32)
        if PRE_K > 0:
            xp = tl.load(ys + G * stride_y + pk, mask=pk < K, other=0.0, cache_modifier=".cg")
            out = tl.sum(pre.to(tl.float32) * xp.to(tl.float32)[None, :], axis=1)
        acc = tl.zeros([BN, BLOCK_K], dtype=tl.float32)
        for k0 in tl.range(PRE_K, K, BLOCK_K, num_stages=STAGES):
            cols = k0 + k < K
            wk = tl.load(w_rows + k0 + k[None, :], mask=live[:, None] & cols[None, :], other=0.0).to(tl.float32)
            xk = tl.load(ys + G * stride_y + k0 + k, mask=cols, other=0.0, cache_modifier=".cg").to(tl.float32)
            acc = tl.fma(wk, xk[None, :], acc)
        out += tl.sum(acc, axis=1)
        tl.store(ys + (G + 1) * stride_y + n, out.to(ys.dtype.element_ty), mask=live)
        tl.debug_barrier()  # every thread's stores, then one release for the block
        tl.atomic_add(ready + G + 1, 1, sem="release", scope="gpu")


@triton.jit
def _chain_static(w, ys, ready, done, epoch, stride_y, LAYERS: tl.constexpr, DIM_A: tl.constexpr,
                  DIM_B: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_K: tl.constexpr,
                  STAGES: tl.constexpr, PRE_K: tl.constexpr, MAX_SPINS: tl.constexpr,
                  PDL: tl.constexpr):  # fmt: skip
    # Static assignment: program p takes row blocks p, p + P, ... of every GEMV, in GEMV order (the GEMVs unrolled:
    # shapes and rows a block are constants, BLOCK_A for the [DIM_A, DIM_B] GEMVs, BLOCK_B for their transposes).
    # Counters only grow: ready[i] gains one a block of GEMV i - 1 stored, so launch e (read from `epoch`) waits
    # for (e + 1) times GEMV i - 1's blocks; the last program to finish bumps the epoch. Every program must be
    # resident at once (the caller's grid); a wait gives up after MAX_SPINS polls, so a grid too large for the GPU
    # ends with wrong outputs (which `check` reports) instead of hanging.
    wait_for_inputs(PDL)  # the launch before has finished: its counters and epoch are settled
    e = tl.load(epoch)
    pid = tl.program_id(0)
    for i in tl.static_range(LAYERS):
        if i % 2:  # the transpose, after a [DIM_A, DIM_B] GEMV
            _static_gemv(w, ys, ready, e, pid, stride_y, i, DIM_B, DIM_A, BLOCK_B, (DIM_A + BLOCK_A - 1) // BLOCK_A,
                         DIM_A * DIM_B, BLOCK_K, STAGES, PRE_K, MAX_SPINS)  # fmt: skip
        else:
            _static_gemv(w, ys, ready, e, pid, stride_y, i, DIM_A, DIM_B, BLOCK_A, (DIM_B + BLOCK_B - 1) // BLOCK_B,
                         DIM_A * DIM_B, BLOCK_K, STAGES, PRE_K, MAX_SPINS)  # fmt: skip
    if tl.atomic_add(done, 1, sem="acq_rel", scope="gpu") == (e + 1) * tl.num_programs(0) - 1:
        tl.store(epoch, e + 1)  # the last program: every program has read e


class Chain:
    """`layers` GEMVs alternating [dim_a, dim_b] and [dim_b, dim_a] (bf16 on CUDA, float32 on CPU)."""

    def __init__(self, layers: int, dim_a: int, dim_b: int, device: torch.device, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.layers, self.dim_a, self.dim_b = layers, dim_a, dim_b
        w = torch.randn(layers, dim_a * dim_b, generator=g) / max(dim_a, dim_b) ** 0.5 * 1.5
        self.w = w.to(device, dtype)
        self.width = max(dim_a, dim_b)
        self.x0 = torch.randn(dim_b, generator=g).to(device, dtype)
        self.ready = torch.zeros(2, layers + 1, dtype=torch.int32, device=device)  # a set a launch parity
        self.queue = torch.zeros(2, dtype=torch.int32, device=device)
        self.epoch = torch.zeros(1, dtype=torch.int32, device=device)
        self.static_ready = torch.zeros(layers + 1, dtype=torch.int32, device=device)  # the static kernel's: they
        self.done = torch.zeros(1, dtype=torch.int32, device=device)  # only grow (blocks stored, programs finished)
        self.static_epoch = torch.zeros(1, dtype=torch.int32, device=device)
        self.ys = torch.zeros(layers + 1, self.width, dtype=dtype, device=device)
        self.ys[0, :dim_b] = self.x0

    def weight(self, i: int) -> torch.Tensor:
        n, k = (self.dim_b, self.dim_a) if i % 2 else (self.dim_a, self.dim_b)
        return self.w[i].view(n, k)

    def engine(self, blocks: tuple[int, int] | None = None) -> torch.Tensor:
        """One engine GEMV launch per layer -> the last y; `blocks`: rows a program of the [dim_a, dim_b] GEMVs and
        of their transposes (None: the engine's `pick_block_n`)."""
        y = self.x0[None, :]
        for i in range(self.layers):
            y = gemv(y, self.weight(i), block_n=None if blocks is None else blocks[i % 2])
        return y[0]

    def persistent(self, block_n: int, prefetch_k: int, programs: int) -> torch.Tensor:
        """One launch of the persistent kernel -> the last y (a view of its buffer)."""
        blocks = triton.cdiv(self.dim_a, block_n) + triton.cdiv(self.dim_b, block_n)
        total = blocks * (self.layers // 2) + (triton.cdiv(self.dim_a, block_n) if self.layers % 2 else 0)
        _chain[(programs,)](
            self.w, self.ys, self.ready, self.queue, self.epoch, self.layers, self.dim_a, self.dim_b,
            self.ys.stride(0), total, block_n, BLOCK_K, STAGES, prefetch_k, num_warps=WARPS,
            **launch_args(self.w.device),
        )  # fmt: skip
        return self.last_y()

    def last_y(self) -> torch.Tensor:
        """The chain's output, a view of its buffer: dim_b entries after an even number of GEMVs, dim_a after odd."""
        return self.ys[self.layers, : self.dim_b if self.layers % 2 == 0 else self.dim_a]

    def static_programs(self, block_a: int, block_b: int) -> int:
        """The static kernel's grid: one program a row block of the GEMV with the most blocks (the fewest
        programs that leave none with two blocks of one GEMV; all must be resident at once)."""
        return max(triton.cdiv(self.dim_a, block_a), triton.cdiv(self.dim_b, block_b))

    def static(self, block_a: int, block_b: int, prefetch_k: int, programs: int) -> torch.Tensor:
        """One launch of the statically assigned kernel -> the last y (a view of its buffer)."""
        _chain_static[(programs,)](
            self.w, self.ys, self.static_ready, self.done, self.static_epoch, self.ys.stride(0), self.layers,
            self.dim_a, self.dim_b, block_a, block_b, BLOCK_K, STAGES, prefetch_k, 1 << 22,
            num_warps=WARPS, **launch_args(self.w.device),
        )  # fmt: skip
        return self.last_y()


def reference(chain: Chain) -> torch.Tensor:
    """The chain in float64, each y rounded to the weights' dtype as the kernels store it."""
    y = chain.x0.double()
    for i in range(chain.layers):
        y = (chain.weight(i).double() @ y).to(chain.w.dtype).double()
    return y


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest error of a chain's output against the float64 chain, relative to its largest entry."""
    return ((got.double() - ref).abs().max() / ref.abs().max()).item()


def check(chain: Chain, block_n: int, prefetch_k: int, programs: int) -> float:
    """Max error of the persistent chain's output (fp32 accumulation, each y rounded once) against the float64
    chain, relative to its largest entry. Twice: the second launch runs on the other set of counters."""
    ref = reference(chain)
    for _ in range(2):
        err = relative_error(chain.persistent(block_n, prefetch_k, programs), ref)
        if not err < 2**-5:  # one rounding a layer is 2^-8 relative in bf16; 2^-5 after 8 layers is a wrong kernel
            raise AssertionError(f"persistent chain (block_n {block_n}, prefetch {prefetch_k}) is off by {err:.1e}")
        nxt = chain.epoch.item() % 2
        if chain.ready[nxt].any() or chain.queue[nxt].item():
            raise AssertionError("the next launch's counters were not cleared")
    return err


def check_static(chain: Chain, block_a: int, block_b: int, prefetch_k: int, programs: int) -> float:
    """`check` for the statically assigned kernel: two launches (the second waits on counters one launch higher),
    then every counter at its count."""
    ref = reference(chain)
    for _ in range(2):
        err = relative_error(chain.static(block_a, block_b, prefetch_k, programs), ref)
        if not err < 2**-5:  # as `check`'s
            raise AssertionError(f"static chain ({block_a}/{block_b} rows, prefetch {prefetch_k}) is off by {err:.1e}")
    launches = chain.static_epoch.item()
    shapes = [(chain.dim_b, block_b) if i % 2 else (chain.dim_a, block_a) for i in range(chain.layers)]
    blocks = [triton.cdiv(n, rows) for n, rows in shapes]
    if chain.static_ready[1:].tolist() != [launches * b for b in blocks] or chain.done.item() != launches * programs:
        raise AssertionError(f"static chain counters {chain.static_ready.tolist()} after {launches} launches")
    return err


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8, help="GEMVs in the chain (default 8: 134 MB of weights)")
    ap.add_argument("--block-n", type=int, default=4, help="rows a task (default 4, the engine's o GEMV)")
    ap.add_argument("--prefetch-k", default="0,512,1024", help="weight columns loaded before the wait, each timed")
    ap.add_argument("--programs-per-sm", default="2,4", help="persistent grids, each timed")
    ap.add_argument("--static-blocks", default="4,8", help="rows a block of the two shapes, static assignment")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--check", action="store_true", help="correctness only (on CPU: small shapes, interpreter)")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    prefetch = [int(v) for v in a.prefetch_k.split(",")]
    per_sm = [int(v) for v in a.programs_per_sm.split(",")]
    try:
        block_a, block_b = (int(v) for v in a.static_blocks.split(","))
    except ValueError:
        raise SystemExit(f"--static-blocks {a.static_blocks!r}: expected two row counts, e.g. 4,8") from None
    sizes = [a.block_n, block_a, block_b]
    if a.layers < 1 or any(b < 1 or b & (b - 1) for b in sizes) or any(p & (p - 1) for p in prefetch if p):
        raise SystemExit("--layers >= 1; --block-n, --static-blocks, every --prefetch-k (or 0): powers of two")
    cuda = torch.cuda.is_available()
    if not cuda and not a.check:
        raise SystemExit("benchmarks/persistent_chain.py needs a CUDA GPU (or --check)")
    dev = torch.device("cuda" if cuda else "cpu")
    if a.check:
        dims = (2048, 4096) if cuda else (24, 40)  # off the blocks on CPU: masks on rows and columns
        for layers in sorted({a.layers, 3}):
            chain = Chain(layers, *dims, dev)
            for pk in prefetch if cuda else (0, 16, 64):  # 64: past both widths
                for programs in (1, 3):
                    err = check(chain, a.block_n, pk, programs)
            print(f"{layers} layers {dims}: persistent chain within {err:.1e} of the float64 chain")
            # all programs resident at once: on CPU the interpreter runs programs in turn, so one program
            programs = chain.static_programs(block_a, block_b) if cuda else 1
            for pk in prefetch if cuda else (0, 16, 64):
                err = check_static(chain, block_a, block_b, pk, programs)
            print(f"{layers} layers {dims}: static chain within {err:.1e} of the float64 chain")
        return
    from edgemoe.bench import bandwidths, capture, timed

    hbm = bandwidths(dev, 1 << 20)["hbm_bytes_per_s"]
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    chain = Chain(a.layers, 2048, 4096, dev)
    nbytes = chain.w.numel() * chain.w.element_size()
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "hbm": hbm, "layers": a.layers, "block_n": a.block_n, "bytes": nbytes}  # fmt: skip

    def report(name: str, fn) -> None:
        graph = capture(fn)
        us = timed(graph.replay, dev, a.reps) * 1e6
        del graph
        per = us / a.layers
        floor = nbytes / a.layers / hbm * 1e6
        results[name] = {"us": us, "us_per_gemv": per, "over_hbm": floor / per, "fixed_us_per_gemv": per - floor}
        print(f"{name:>36}: {us:7.1f} us, {per:5.2f} us a GEMV, {floor / per:.2f} of HBM, {per - floor:4.2f} us over")

    print(f"{results['device']}: HBM {hbm / 1e9:.0f} GB/s; {a.layers} GEMVs of 16.8 MB, {a.block_n} rows a task")
    report("engine (a launch a GEMV, PDL)", chain.engine)
    report(f"engine, {block_a} / {block_b} rows a program", lambda: chain.engine((block_a, block_b)))
    for programs in per_sm:
        for pk in prefetch:
            err = check(chain, a.block_n, pk, programs * sms)
            report(f"persistent x{programs}/SM, prefetch {pk}", lambda p=programs, k=pk: chain.persistent(
                a.block_n, k, p * sms))  # fmt: skip
            results[f"persistent x{programs}/SM, prefetch {pk}"]["error"] = err
    programs = chain.static_programs(block_a, block_b)  # 512 at (4, 8): one block of each GEMV a program
    for pk in prefetch:
        err = check_static(chain, block_a, block_b, pk, programs)
        name = f"static, {programs} programs, prefetch {pk}"
        report(name, lambda k=pk: chain.static(block_a, block_b, k, programs))
        results[name]["error"] = err
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
