"""Probe: the miss copy by the copy engine, its rows chosen on the device and serviced by a host thread.

    python benchmarks/copy_service.py [--layers 48] [--rows 0,1,2,3] [--json OUT]
    python benchmarks/copy_service.py --rows 2 --contend tolist|launches   (one process each: a hang exits 1)

A decode graph cannot hold copy-engine copies whose addresses it decides itself (switch nodes cost ~7-10 us each:
benchmarks/miss_copy_graph.py), and SM reads of pinned memory stop near 0.90 of a pinned memcpy. Here each MoE
layer's graph step posts its copy list to a mailbox in pinned host memory (a one-program Triton kernel: the list,
then a fence, then a sequence number) and waits on per-entry arrival counters (as the expert GEMV does). A host
thread polls the mailbox, issues one `cuMemcpyHtoDAsync` per bank row on a copy stream, and after each entry's rows
a `cuStreamWriteValue64` that sets its counter. Two hosts are compared: a pthread in a small C library compiled at
run time with the system's C compiler (Triton needs one too), and a Python thread calling libcuda through ctypes.

Each variant copies the same rows (qwen3-30b-a3b experts: 6 + 3 MiB, `--rows` per layer, `--layers` layers) in one
CUDA graph replay, against a pinned memcpy of the same bytes in one block, per-row `cudaMemcpyAsync` captured from a
host-known list, and the engine's Triton copy. Copied rows are checked bitwise. Not an edgemoe dependency.

`--contend`: after the timed replays, one more replay while the main thread blocks inside the driver (a pageable
`.tolist()`, or a launch flood). The engine integration (branch wip/copy-service) hung in exactly such places, with
a list posted and its service thread stuck inside a driver call; this checks that explanation in isolation.
"""

from __future__ import annotations

import argparse
import ctypes
import faulthandler
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from types import SimpleNamespace

import torch
import triton
import triton.language as tl

from edgemoe.bench import timed
from edgemoe.kernels.miss_copy import chunks_per_entry, copy_rows_pair
from edgemoe.moe.banks import allocate_bank

C_SOURCE = r"""
#include <stdint.h>
#include <pthread.h>
#include <sched.h>
typedef int (*memcpy_fn)(unsigned long long dst, const void *src, size_t n, void *stream);
typedef int (*write_fn)(void *stream, unsigned long long addr, uint64_t value, unsigned flags);
typedef int (*ctx_fn)(void *ctx);
typedef struct {
  volatile int64_t *mailbox; int64_t rows, width, M;
  const char *bank_a, *bank_b; unsigned long long pool_a, pool_b; int64_t row_a, row_b;
  unsigned long long counters; uint64_t chunks; void *stream; void *ctx;
  memcpy_fn cpy; write_fn write; ctx_fn setctx;
  volatile int stop; volatile int64_t served; volatile int error; pthread_t thread;
} service_t;
static void *run(void *arg) {
  service_t *s = (service_t *)arg;
  if (s->setctx(s->ctx)) { s->error = 1; return 0; }
  int64_t expected = 1;
  while (!s->stop) {
    volatile int64_t *box = s->mailbox + ((expected - 1) % s->rows) * s->width;
    if (box[0] != expected) continue;
    __sync_synchronize();
    int64_t n = box[1];
    for (int64_t i = 0; i < n; ++i) {
      int64_t src = box[2 + i], dst = box[2 + s->M + i];
      int e = s->cpy(s->pool_a + dst * s->row_a, s->bank_a + src * s->row_a, s->row_a, s->stream);
      e |= s->cpy(s->pool_b + dst * s->row_b, s->bank_b + src * s->row_b, s->row_b, s->stream);
      e |= s->write(s->stream, s->counters + 8 * i, s->chunks, 0);
      if (e) { s->error = e; return 0; }
    }
    s->served = expected++;
  }
  return 0;
}
int service_start(service_t *s) { return pthread_create(&s->thread, 0, run, s); }
int service_stop(service_t *s) { s->stop = 1; return pthread_join(s->thread, 0); }
"""


class Service(ctypes.Structure):
    _fields_ = [
        ("mailbox", ctypes.c_void_p), ("rows", ctypes.c_int64), ("width", ctypes.c_int64), ("M", ctypes.c_int64),
        ("bank_a", ctypes.c_void_p), ("bank_b", ctypes.c_void_p), ("pool_a", ctypes.c_uint64),
        ("pool_b", ctypes.c_uint64), ("row_a", ctypes.c_int64), ("row_b", ctypes.c_int64),
        ("counters", ctypes.c_uint64), ("chunks", ctypes.c_uint64), ("stream", ctypes.c_void_p),
        ("ctx", ctypes.c_void_p), ("cpy", ctypes.c_void_p), ("write", ctypes.c_void_p), ("setctx", ctypes.c_void_p),
        ("stop", ctypes.c_int), ("served", ctypes.c_int64), ("error", ctypes.c_int), ("thread", ctypes.c_uint64),
    ]  # fmt: skip


def build_library() -> ctypes.CDLL:
    folder = tempfile.mkdtemp(prefix="edgemoe_copy_service_")
    src, lib = os.path.join(folder, "service.c"), os.path.join(folder, "service.so")
    with open(src, "w") as f:
        f.write(C_SOURCE)
    cc = os.environ.get("CC", "cc")
    subprocess.run([cc, "-O2", "-shared", "-fPIC", "-pthread", src, "-o", lib], check=True)
    return ctypes.CDLL(lib)


@triton.jit
def _post(src, dst, count, tick, arrived, mailbox, ROWS: tl.constexpr, WIDTH: tl.constexpr, M: tl.constexpr):
    seq = tl.load(tick) + 1
    tl.store(tick, seq)
    r = tl.arange(0, M)
    tl.store(arrived + r, tl.zeros([M], tl.int64))
    box = mailbox + ((seq - 1) % ROWS) * WIDTH
    tl.store(box + 1, tl.load(count))
    tl.store(box + 2 + r, tl.load(src + r))
    tl.store(box + 2 + M + r, tl.load(dst + r))
    tl.debug_barrier()  # every thread's stores of the list, then a fence at system scope, then the sequence number
    seq = tl.inline_asm_elementwise(
        "fence.sc.sys; mov.b64 $0, $1;", "=l,l", [seq], dtype=tl.int64, is_pure=False, pack=1
    )
    tl.store(box, seq)


@triton.jit
def _wait(count, arrived, CHUNKS: tl.constexpr, LIMIT: tl.constexpr):
    n = tl.load(count)
    for i in range(n):
        k = 0
        while (tl.atomic_add(arrived + i, 0, sem="acquire", scope="gpu") < CHUNKS) & (k < LIMIT):
            k += 1


def libcuda_addresses():
    cuda = ctypes.CDLL("libcuda.so.1")
    ctx = ctypes.c_void_p()
    assert cuda.cuCtxGetCurrent(ctypes.byref(ctx)) == 0 and ctx.value, "no current CUDA context"
    addr = {n: ctypes.cast(getattr(cuda, n), ctypes.c_void_p).value for n in
            ("cuMemcpyHtoDAsync_v2", "cuStreamWriteValue64_v2", "cuCtxSetCurrent")}  # fmt: skip
    return cuda, ctx, addr


def python_service(state: dict, cuda, ctx, stop: threading.Event) -> None:
    """The C loop in Python: ctypes calls release the GIL; `time.sleep(0)` lets the main thread take it."""
    cuda.cuCtxSetCurrent(ctx)
    box_all, M, rows = state["mailbox_np"], state["M"], state["rows_ring"]
    cpy, write = cuda.cuMemcpyHtoDAsync_v2, cuda.cuStreamWriteValue64_v2
    cpy.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    write.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint]
    a, b, pa, pb, ra, rb = (state[k] for k in ("bank_a", "bank_b", "pool_a", "pool_b", "row_a", "row_b"))
    stream, counters, chunks = state["stream"], state["counters"], state["chunks"]
    expected = 1
    while not stop.is_set():
        box = box_all[(expected - 1) % rows]
        if box[0] != expected:
            time.sleep(0)
            continue
        n = int(box[1])
        for i in range(n):
            s, d = int(box[2 + i]), int(box[2 + M + i])
            e = cpy(pa + d * ra, a + s * ra, ra, stream) | cpy(pb + d * rb, b + s * rb, rb, stream)
            e |= write(stream, counters + 8 * i, chunks, 0)
            if e:
                state["error"] = e
                return
        expected += 1


def check_rows(k, src: torch.Tensor, dst: torch.Tensor, n: int) -> bool:
    """Every listed row of every layer, bitwise in its slot (the slots of one replay are distinct)."""
    for layer in range(k.L):
        for i in range(n):
            s, d = int(src[layer, i]), int(dst[layer, i])
            for pool, bank in ((k.pool_a, k.bank_a), (k.pool_b, k.bank_b)):
                if not torch.equal(pool[d].view(torch.int16).cpu(), bank[s].view(torch.int16)):
                    return False
    return True


def serve(k, host: str, graph: torch.cuda.CUDAGraph, reps: int) -> tuple[float, int]:
    """Seconds per replay of `graph` while `host` ("c" or "python") serves its posts; the thread's error code."""
    k.tick.zero_(), k.mailbox.zero_(), k.pool_a.zero_(), k.pool_b.zero_()
    torch.cuda.synchronize()
    if host == "c":
        svc = Service(
            k.mailbox.data_ptr(), k.ROWS, k.WIDTH, k.M, k.bank_a.data_ptr(), k.bank_b.data_ptr(),
            k.pool_a.data_ptr(), k.pool_b.data_ptr(), k.row_a, k.row_b, k.arrived.data_ptr(), k.chunks,
            k.stream.cuda_stream, k.ctx.value, k.addr["cuMemcpyHtoDAsync_v2"], k.addr["cuStreamWriteValue64_v2"],
            k.addr["cuCtxSetCurrent"],
        )  # fmt: skip
        assert k.lib.service_start(ctypes.byref(svc)) == 0
    else:
        state = {
            "mailbox_np": k.mailbox.numpy(), "M": k.M, "rows_ring": k.ROWS, "bank_a": k.bank_a.data_ptr(),
            "bank_b": k.bank_b.data_ptr(), "pool_a": k.pool_a.data_ptr(), "pool_b": k.pool_b.data_ptr(),
            "row_a": k.row_a, "row_b": k.row_b, "stream": k.stream.cuda_stream, "counters": k.arrived.data_ptr(),
            "chunks": k.chunks,
        }  # fmt: skip
        stop = threading.Event()
        t = threading.Thread(target=python_service, args=(state, k.cuda, k.ctx, stop), daemon=True)
        t.start()
    try:
        seconds = timed(graph.replay, k.dev, reps)
        torch.cuda.synchronize()  # the stream settled: reads below do not block in the driver
        if k.contend != "none" and host == "c":
            contend(k, graph)
    finally:
        if host == "c":
            k.lib.service_stop(ctypes.byref(svc))
            err = svc.error
        else:
            stop.set()
            t.join()
            err = state.get("error", 0)
    return seconds, err


def contend(k, graph: torch.cuda.CUDAGraph) -> None:
    """While the GPU waits on the service, the main thread blocks inside the driver: `tolist`, a pageable
    device-to-host copy; `launches`, more kernel launches than the launch queue holds. Does the service's thread
    still get through? A hang is turned into a traceback and exit code 1 by faulthandler (--contend-timeout)."""
    start = time.perf_counter()
    graph.replay()
    if k.contend == "tolist":
        k.arrived.tolist()
    else:
        x = torch.zeros(1, device=k.dev)
        for _ in range(20000):
            x.add_(1)
    torch.cuda.synchronize()
    print(f"contention {k.contend}: served, {time.perf_counter() - start:.3f} s")


def run_rows(k, n: int, gen: torch.Generator, reps: int) -> dict:
    """Every variant for `n` rows a layer (see the module docstring)."""
    L, M, S = k.L, k.M, k.S
    src = torch.zeros((L, M), dtype=torch.int64)
    dst = torch.full((L, M), S, dtype=torch.int64)
    slots = torch.randperm(S, generator=gen)[: L * n].view(L, n)  # distinct: the check sees every copy
    for layer in range(L):
        src[layer, :n] = torch.randperm(k.E, generator=gen)[:n]
        dst[layer, :n] = slots[layer]
    d_src, d_dst, d_count = src.to(k.dev), dst.to(k.dev), torch.full((L,), n, dtype=torch.int64, device=k.dev)
    out = {}
    if n:
        block = torch.empty(L * n * (k.row_a + k.row_b), dtype=torch.uint8, pin_memory=True)
        dblock = torch.empty_like(block, device=k.dev)
        out["memcpy_s"] = timed(lambda: dblock.copy_(block, non_blocking=True), k.dev, reps)
        del block, dblock

    def capture(body) -> torch.cuda.CUDAGraph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for layer in range(L):
                body(layer)
        return g

    def host_rows(layer: int) -> None:
        for i in range(n):
            s, d = int(src[layer, i]), int(dst[layer, i])
            k.pool_a[d].copy_(k.bank_a[s], non_blocking=True)
            k.pool_b[d].copy_(k.bank_b[s], non_blocking=True)

    def triton_rows(layer: int) -> None:
        copy_rows_pair((k.pool_a, k.pool_b), (k.bank_a, k.bank_b), d_src[layer], d_dst[layer], d_count[layer])

    def serviced(layer: int) -> None:
        _post[(1,)](d_src[layer], d_dst[layer], d_count[layer], k.tick, k.arrived, k.mailbox, k.ROWS, k.WIDTH, M)
        _wait[(1,)](d_count[layer], k.arrived, k.chunks, 1 << 21)

    if n:
        out["host_rows_s"] = timed(capture(host_rows).replay, k.dev, reps)
    out["triton_s"] = timed(capture(triton_rows).replay, k.dev, reps)
    graph = capture(serviced)  # no upload needed: the service thread never waits for the main thread
    for host in ["python"] + (["c"] if k.lib is not None else []):
        out[f"service_{host}_s"], err = serve(k, host, graph, reps)
        out[f"service_{host}_check"] = {"error": err, "posted": int(k.tick), "rows_equal": check_rows(k, src, dst, n)}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--rows", default="0,1,2,3")
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--contend", choices=["none", "tolist", "launches"], default="none")
    p.add_argument("--contend-timeout", type=float, default=60.0)
    p.add_argument("--json")
    args = p.parse_args()
    if args.contend != "none":
        faulthandler.dump_traceback_later(args.contend_timeout, exit=True)
    rows = [int(x) for x in args.rows.split(",")]
    k = SimpleNamespace(dev=torch.device("cuda"), L=args.layers, E=args.experts, M=8, ROWS=64, contend=args.contend)
    torch.cuda.init()
    H, inter, gen = 2048, 768, torch.Generator().manual_seed(0)
    k.S, k.WIDTH = max(64, k.L * max(rows)), 2 + 2 * k.M  # slots: every row of a replay its own
    k.bank_a = allocate_bank((k.E, 2 * inter, H), torch.bfloat16, pin=True)
    k.bank_b = allocate_bank((k.E, H, inter), torch.bfloat16, pin=True)
    for bank in (k.bank_a, k.bank_b):
        bank.view(torch.int16).copy_(torch.randint(-(2**15), 2**15, bank.shape, dtype=torch.int16, generator=gen))
    k.pool_a = torch.empty((k.S + 1, 2 * inter, H), dtype=torch.bfloat16, device=k.dev)
    k.pool_b = torch.empty((k.S + 1, H, inter), dtype=torch.bfloat16, device=k.dev)
    k.row_a, k.row_b = k.bank_a[0].nbytes, k.bank_b[0].nbytes
    k.chunks = chunks_per_entry((k.pool_a, k.pool_b))
    k.mailbox = torch.zeros((k.ROWS, k.WIDTH), dtype=torch.int64, pin_memory=True)
    k.tick = torch.zeros((), dtype=torch.int64, device=k.dev)
    k.arrived = torch.zeros(k.M, dtype=torch.int64, device=k.dev)
    k.cuda, k.ctx, k.addr = libcuda_addresses()
    k.stream = torch.cuda.Stream(device=k.dev)
    try:
        k.lib = build_library()
    except (OSError, subprocess.CalledProcessError) as e:
        k.lib = None
        print(f"no C service: {e}")
    results = {"layers": k.L, "row_bytes": k.row_a + k.row_b, "rows": {}}
    for n in rows:
        out = results["rows"][n] = run_rows(k, n, gen, args.reps)
        line = [f"rows/layer {n}:"]
        for name, v in out.items():
            if name.endswith("_s"):
                gbs = k.L * n * (k.row_a + k.row_b) / v / 1e9
                frac = out["memcpy_s"] / v if n else 0.0
                line.append(f"{name[:-2]} {v * 1e3:.3f} ms ({gbs:.1f} GB/s, {frac:.3f} of memcpy)")
        print("\n  ".join(line))
        print("  checks:", {name: v for name, v in out.items() if name.endswith("check")})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
