"""CUDA C++ candidates for the miss copy's PCIe read rate, against a pinned memcpy and the engine's Triton kernel in
the same run. Compiled at run time by NVRTC through CuPy (on the GPU machine's image; not an edgemoe dependency).

    python benchmarks/miss_copy_cuda.py [--rows 8] [--json OUT]

Why: the Triton kernel (`edgemoe.kernels.miss_copy`) reads pinned host rows at 0.89-0.91 of a pinned memcpy on an
H200 whatever its grid, block and warps, and a TMA variant was slower (benchmarks/RESULTS.md); the goal is 0.95.
SM-issued loads of host memory reach PCIe as small read requests; these candidates try what a Triton load cannot
say: the same persistent loop with 16-byte loads that are plain, non-coherent (`__ldg`), or carry PTX's
`L2::256B` prefetch-size hint (so that L2 asks the host for 256-byte sectors), unrolled so several loads per
thread are in flight; and a bulk-copy variant (`cp.async.bulk`, Hopper's 1D TMA: host -> shared memory -> pool,
one 8 KiB chunk per block in flight). Each copies the same rows of one layer's gate_up bank (qwen3-30b-a3b and
qwen1.5-moe-a2.7b experts) to random slots; the bytes are checked against the bank. A candidate that fails to
compile or run is reported, not fatal. A winner would move into `edgemoe/kernels/` (as Triton inline assembly or
otherwise) only after this shows it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from edgemoe.bench import timed
from edgemoe.models.random_checkpoint import PRESETS
from edgemoe.moe.banks import allocate_bank

from edgemoe.kernels.miss_copy import _sm_count, copy_rows

CHUNK = 8192  # bytes a block copies per work item (the Triton kernel's default block of bf16)
SOURCE = r"""
__device__ __forceinline__ int4 load_plain(const int4* p) { return *p; }
__device__ __forceinline__ int4 load_nc(const int4* p) { return __ldg(p); }
__device__ __forceinline__ int4 load_l2_256(const int4* p) {
    int4 v;
    asm volatile("ld.global.nc.L2::256B.v4.s32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
__device__ __forceinline__ int4 load_na_l2_256(const int4* p) {
    int4 v;
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.s32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

// pool[dst[r]] = bank[src[r]] for r < count: work item i is chunk i % chunks of entry i / chunks
extern "C" __global__ void copy_rows(const long long* __restrict__ src_ids, const long long* __restrict__ dst_ids,
                                     const long long* __restrict__ count, const int4* __restrict__ bank,
                                     int4* __restrict__ pool, long long row_vec, long long chunk_vec) {
    const long long chunks = (row_vec + chunk_vec - 1) / chunk_vec;
    const long long items = count[0] * chunks;
    for (long long i = blockIdx.x; i < items; i += gridDim.x) {
        const long long r = i / chunks, c = i % chunks;
        const int4* s = bank + src_ids[r] * row_vec + c * chunk_vec;
        int4* d = pool + dst_ids[r] * row_vec + c * chunk_vec;
        const long long left = row_vec - c * chunk_vec;
        const long long n = left < chunk_vec ? left : chunk_vec;
        long long j = threadIdx.x;
        for (; j + (UNROLL - 1) * (long long)blockDim.x < n; j += UNROLL * (long long)blockDim.x) {
            int4 v[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) v[u] = LOAD(s + j + u * blockDim.x);
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) d[j + u * blockDim.x] = v[u];
        }
        for (; j < n; j += blockDim.x) d[j] = LOAD(s + j);
    }
}

// the same items by bulk copies: host -> shared memory (completion on an mbarrier) -> pool, one chunk per block
extern "C" __global__ void copy_rows_bulk(const long long* __restrict__ src_ids,
                                          const long long* __restrict__ dst_ids, const long long* __restrict__ count,
                                          const char* __restrict__ bank, char* __restrict__ pool, long long row_bytes,
                                          long long chunk_bytes) {
    extern __shared__ __align__(128) char buf[];
    __shared__ __align__(8) unsigned long long bar;
    const unsigned buf_s = (unsigned)__cvta_generic_to_shared(buf);
    const unsigned bar_s = (unsigned)__cvta_generic_to_shared(&bar);
    if (threadIdx.x == 0) {
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar_s));
        asm volatile("fence.mbarrier_init.release.cluster;");
    }
    __syncthreads();
    const long long chunks = (row_bytes + chunk_bytes - 1) / chunk_bytes;
    const long long items = count[0] * chunks;
    unsigned phase = 0;
    for (long long i = blockIdx.x; i < items; i += gridDim.x) {
        const long long r = i / chunks, c = i % chunks;
        const long long left = row_bytes - c * chunk_bytes;
        const unsigned n = (unsigned)(left < chunk_bytes ? left : chunk_bytes);
        if (threadIdx.x == 0) {
            const char* s = bank + src_ids[r] * row_bytes + c * chunk_bytes;
            char* d = pool + dst_ids[r] * row_bytes + c * chunk_bytes;
            asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar_s), "r"(n) : "memory");
            asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                         ::"r"(buf_s), "l"(s), "r"(n), "r"(bar_s) : "memory");
            unsigned done = 0;
            while (!done) {
                asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                             " selp.u32 %0, 1, 0, p;\n}" : "=r"(done) : "r"(bar_s), "r"(phase) : "memory");
            }
            asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(d), "r"(buf_s), "r"(n)
                         : "memory");
            asm volatile("cp.async.bulk.commit_group;" ::: "memory");
            asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
        }
        phase ^= 1;
    }
    if (threadIdx.x == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}
"""
LOADS = ("load_plain", "load_nc", "load_l2_256", "load_na_l2_256")


def seconds(fn, reps: int = 20) -> float:
    return timed(fn, torch.device("cuda"), reps)


def launcher(cp, name: str, options: tuple[str, ...], grid: int, threads: int, shared: int = 0):
    kernel = cp.RawKernel(SOURCE, name, options=("--std=c++17", *options))

    def launch(*args) -> None:
        with cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
            kernel((grid,), (threads,), args, shared_mem=shared)

    return launch


def measure(cp, experts: int, row_shape: tuple[int, int], rows: int, slots: int = 64) -> dict:
    bank = allocate_bank((experts, *row_shape), torch.bfloat16, pin=True)
    pool = torch.empty(slots + 1, *row_shape, dtype=torch.bfloat16, device="cuda")
    src, dst = torch.randperm(experts)[:rows], torch.randperm(slots)[:rows]
    for s in src.tolist():
        bank[s].view(torch.int16).random_()
    row_bytes = bank[0].numel() * 2
    nbytes = rows * row_bytes
    count = torch.tensor(rows, device="cuda")
    src_d, dst_d = src.cuda(), dst.cuda()
    staged = bank[src].flatten().pin_memory()
    target = torch.empty_like(staged, device="cuda")
    out = {"row_bytes": row_bytes, "rows": rows}
    out["memcpy"] = nbytes / seconds(lambda: target.copy_(staged, non_blocking=True))
    out["triton"] = nbytes / seconds(lambda: copy_rows(pool, bank, src_d, dst_d, count))
    sms = _sm_count(torch.cuda.current_device())
    ptrs = [np.uint64(t.data_ptr()) for t in (src_d, dst_d, count, bank, pool)]
    want = bank[src].view(torch.int16)
    out["candidates"] = {}

    def run(key: str, fn) -> None:
        try:
            pool.zero_()
            fn()
            torch.cuda.synchronize()
            ok = torch.equal(pool[dst_d].cpu().view(torch.int16), want)
            out["candidates"][key] = nbytes / seconds(fn) / out["memcpy"] if ok else "wrong bytes"
        except Exception as exc:  # a candidate that fails to compile or launch is reported, not fatal
            out["candidates"][key] = f"{type(exc).__name__}: {str(exc)[-300:]}"

    for load in LOADS:
        for unroll in (1, 4):
            for per_sm, threads in ((8, 128), (4, 256), (2, 512)):
                key = f"{load}_unroll{unroll}_{per_sm}x{threads}"
                try:
                    fn = launcher(cp, "copy_rows", (f"-DLOAD={load}", f"-DUNROLL={unroll}"), per_sm * sms, threads)
                except Exception as exc:
                    out["candidates"][key] = f"{type(exc).__name__}: {str(exc)[-300:]}"
                    continue
                args = (*ptrs, np.int64(row_bytes // 16), np.int64(CHUNK // 16))
                run(key, lambda fn=fn, args=args: fn(*args))
    for per_sm in (4, 8, 16):
        for chunk in (CHUNK, 4 * CHUNK):
            key = f"bulk_{per_sm}xSM_chunk{chunk}"
            try:
                fn = launcher(cp, "copy_rows_bulk", ("-DLOAD=load_plain", "-DUNROLL=1"), per_sm * sms, 32, chunk)
            except Exception as exc:
                out["candidates"][key] = f"{type(exc).__name__}: {str(exc)[-300:]}"
                continue
            args = (*ptrs, np.int64(row_bytes), np.int64(chunk))
            run(key, lambda fn=fn, args=args: fn(*args))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=8, help="experts per copy list (default: 8)")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/miss_copy_cuda.py needs a CUDA GPU")
    try:
        import cupy as cp
    except ImportError:
        raise SystemExit("benchmarks/miss_copy_cuda.py needs CuPy (NVRTC) for its candidates") from None
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    for name in ("qwen3-30b-a3b", "qwen1.5-moe-a2.7b"):
        g = PRESETS[name]
        r = results[name] = measure(cp, g["num_experts"], (2 * g["moe_intermediate_size"], g["hidden_size"]), a.rows)
        ranked = sorted(((v, k) for k, v in r["candidates"].items() if isinstance(v, float)), reverse=True)
        failed = {k: v for k, v in r["candidates"].items() if not isinstance(v, float)}
        print(
            f"{name} gate_up rows x {a.rows}: memcpy {r['memcpy'] / 1e9:.1f} GB/s, "
            f"Triton {r['triton'] / r['memcpy']:.3f} of it; best: " + ", ".join(f"{k} {v:.3f}" for v, k in ranked[:5])
        )
        for k, v in list(failed.items())[:4]:
            print(f"  {k}: {v}")
        torch.cuda.empty_cache()
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
