// A chain of dependent GEMVs, y[i + 1] = W[i] @ y[i], in one persistent launch whose weights stream into shared
// memory ahead of the dependency: benchmarks/tile_prefetch_chain.py builds, checks and times it (the docstring there
// says why). Builds with
//     nvcc -arch=sm_90 -cubin --resource-usage [-DCHUNK_BYTES=8192] benchmarks/tile_prefetch_chain.cu -o chain.cubin
//
// One block an SM (the ring takes most of its shared memory), all resident at once. Block c owns a fixed slice of
// rows of every GEMV: rows [c * N / G, (c + 1) * N / G) of GEMV i's N, with G blocks. Its weights are contiguous
// (row-major), so the slice streams as chunks of whole rows, CHUNK_BYTES at most. K is 2048 or 4096 (a template
// argument, so that a lane keeps its steps of y in registers).
//   - Chunk ch of a GEMV belongs to consumer warp ch % CONSUMER_WARPS, which has its own `depth` ring slots, used in
//     turn: each slot has one reader that takes its fills in order, so an mbarrier's phase parity never aliases.
//   - Producer (the last warp): for every GEMV in order and every chunk of the block's slice, waits until the
//     owner's next slot is free, then loads the chunk into it: `loader` 0, one thread asks the copy engine
//     (cp.async.bulk, completing on the slot's mbarrier with a byte count); 1, the warp's 32 lanes each copy 16-byte
//     pieces (cp.async, then an arrival on the mbarrier once a lane's copies land). With `inflight` > 0 it also
//     waits until the request `inflight` back has landed: requests beyond what keeps HBM busy only queue, and the
//     hand-off's small reads wait behind them (call 4 of session 23). Weights do not depend on y, so
//     with `mode` 0 it runs ahead into GEMV i + 1 while GEMV i's dependency is still being resolved on other SMs:
//     the point of the probe. With `mode` 1 it first waits until its consumers have read GEMV i's input, stored
//     everywhere (the control: a grid-wide hand-off between GEMVs that HBM waits on). `mode` 2 skips every
//     dependency wait (wrong outputs): the kernel's streaming ceiling.
//   - Consumers (CONSUMER_WARPS warps): y travels with its own flags (as NCCL's LL protocol does): each entry is
//     64 bits, {tag << 32 | bf16 bits}, stored with one relaxed store, so no counter, fence or release is needed.
//     Per GEMV the consumer threads read y[i] until every entry carries this launch's tag for GEMV i, into shared
//     memory (one reader an SM, not one a warp: all SMs reading the same 8 KB is an L2 hot spot); then each warp
//     takes y into registers, and for each of its chunks waits for the slot, dots each row with y (fp32, fixed
//     order: deterministic), frees the slot and stores its rows with the tag of GEMV i + 1.
// `handoff` 1 instead: each warp makes one release increment of ready[i + 1] after its stores, and thread 0 of a
// reader waits (acquire) until ready[i] counts every warp of every block in this launch (ready[0] counts the
// launches with `handoff` 1, bumped by the last block), then the entries are read
// without checking their tags (calls 1-3's counters, with y still read once an SM).
// Tags: launch e's y[i] carries e * layers + i (i >= 1; y[0] is the input, read without waiting); `epoch` counts
// launches (the last block to finish bumps it, counted by `done`). A read gives up after `max_spins` rounds and
// raises `*failed` (wrong outputs that the caller's check reports, not a hang). With `trace` non-null, %globaltimer
// stamps (ns) go to trace[c][kind][event]: kind 0 the producer's request of each chunk, 1 a consumer's wait for it
// done, 2 the consumers' input of each GEMV read, 3 each warp's last store of each GEMV.
#include <cuda_bf16.h>
#include <cstdint>

#include "gpu_sync.cuh"

#ifndef CHUNK_BYTES
#define CHUNK_BYTES 16384
#endif
constexpr int CHUNK_ELEMS = CHUNK_BYTES / 2;
constexpr int CONSUMER_WARPS = 8;
constexpr int RING_BYTES = 196608;  // 192 KB of the 227 an H100 / H200 block may have
constexpr int MAX_SLOTS = RING_BYTES / CHUNK_BYTES;
constexpr int TRACE_EVENTS = 512;  // a kind's stamps a block
constexpr int MAX_INFLIGHT = 32;   // requests a block may have in flight, at most (`inflight`; 0: only the slots)

__device__ __forceinline__ uint32_t smem_addr(const void *p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void bar_init(uint64_t *bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}

__device__ __forceinline__ void bar_wait(uint64_t *bar, uint32_t parity) {
    uint32_t done = 0;
    while (!done) {
        asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     " selp.u32 %0, 1, 0, p;\n}"
                     : "=r"(done) : "r"(smem_addr(bar)), "r"(parity) : "memory");
    }
}

__device__ __forceinline__ void bar_arrive(uint64_t *bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}

__device__ __forceinline__ void bulk_load(void *dst, const void *src, uint32_t bytes, uint64_t *bar) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes)
                 : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)) : "memory");
}

// One lane's share of a chunk by 16-byte cp.async (pieces lane, lane + 32, ...), then an arrival on `bar` once they
// have landed (noinc: the barrier counts the 32 lanes' arrivals).
__device__ __forceinline__ void lanes_load(void *dst, const void *src, uint32_t bytes, uint64_t *bar, int lane) {
    const uint32_t d = smem_addr(dst);
    const char *s = static_cast<const char *>(src);
    for (uint32_t off = lane * 16; off < bytes; off += 32 * 16)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d + off), "l"(s + off) : "memory");
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(smem_addr(bar)) : "memory");
}

// y[i] (K entries of {tag << 32 | bf16 bits}) into shared memory as bf16, by the consumers' thread t. With `tag`
// non-zero, each entry is read until it carries that tag (the GEMV that stores it has run in this launch): a lane
// first waits on one entry, then reads all its entries at once, again until every one is current. False if
// max_spins rounds were not enough.
template <int K>
__device__ __forceinline__ bool read_y(const uint64_t *y, __nv_bfloat16 *y_s, uint32_t tag, int t, int max_spins) {
    constexpr int PER = K / (CONSUMER_WARPS * 32);
    uint64_t v[PER];
    bool ok = true;
    if (tag) {
        int spins = 0;
        while (static_cast<uint32_t>(load_relaxed(y + t) >> 32) != tag && ++spins < max_spins) {
        }
    }
    for (int round = 0; round < max_spins; ++round) {
#pragma unroll
        for (int j = 0; j < PER; ++j) v[j] = load_relaxed(y + j * CONSUMER_WARPS * 32 + t);
        ok = true;
#pragma unroll
        for (int j = 0; j < PER; ++j) ok &= !tag || static_cast<uint32_t>(v[j] >> 32) == tag;
        if (ok) break;
    }
#pragma unroll
    for (int j = 0; j < PER; ++j)
        y_s[j * CONSUMER_WARPS * 32 + t] = __ushort_as_bfloat16(static_cast<unsigned short>(v[j] & 0xffffu));
    return ok;
}

__device__ __forceinline__ void consumers_sync() {  // named barrier 1: the consumer warps only
    asm volatile("bar.sync 1, %0;" ::"n"(CONSUMER_WARPS * 32) : "memory");
}

struct Gemv {  // GEMV i of the chain, seen from block c of G
    int n, k, row0, rows, rows_per_chunk, chunks;
    const __nv_bfloat16 *w;  // this block's first row
};

__device__ __forceinline__ Gemv gemv_of(const __nv_bfloat16 *w, int i, int dim_a, int dim_b, int c, int g) {
    Gemv m;
    m.n = (i & 1) ? dim_b : dim_a;
    m.k = (i & 1) ? dim_a : dim_b;
    m.row0 = static_cast<int>(static_cast<int64_t>(c) * m.n / g);
    m.rows = static_cast<int>(static_cast<int64_t>(c + 1) * m.n / g) - m.row0;
    m.rows_per_chunk = CHUNK_ELEMS / m.k;
    m.chunks = (m.rows + m.rows_per_chunk - 1) / m.rows_per_chunk;
    m.w = w + static_cast<int64_t>(i) * dim_a * dim_b + static_cast<int64_t>(m.row0) * m.k;
    return m;
}

// Warp w's chunks of GEMV m (K columns): y[i] from shared memory into registers (8 columns a lane a step of 256),
// then for each chunk: wait for its slot, dot each of its rows with y, free the slot, lane 0 stores the rows with
// `tag`. `taken`: the chunks this warp has taken so far in the launch (its slots' fills, in order).
template <int K>
__device__ __forceinline__ void consume(const unsigned char *ring, uint64_t *full, uint64_t *empty, const Gemv &m,
                                        const __nv_bfloat16 *y_s, uint64_t *y_next, uint64_t tag, uint32_t &taken,
                                        int depth, int warp, int lane, uint64_t *trace, uint32_t seq0) {
    constexpr int STEPS = K / 256, ROWS = CHUNK_ELEMS / K;
    static_assert(ROWS >= 1, "a row must fit a chunk");
    if (warp >= m.chunks) return;
    uint4 yv[STEPS];
#pragma unroll
    for (int j = 0; j < STEPS; ++j) yv[j] = reinterpret_cast<const uint4 *>(y_s)[j * 32 + lane];
    for (int ch = warp; ch < m.chunks; ch += CONSUMER_WARPS, ++taken) {
        const int s = warp * depth + taken % depth;
        bar_wait(&full[s], (taken / depth) & 1);
        if (trace && lane == 0) trace[TRACE_EVENTS + seq0 + ch] = now_ns();
        const int rows = min(ROWS, m.rows - ch * ROWS);
        const uint4 *wv = reinterpret_cast<const uint4 *>(ring + s * CHUNK_BYTES);
        float acc[ROWS], odd[ROWS];  // two chains a row: the FMA latency halved
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            acc[r] = odd[r] = 0.f;
            if (r < rows) {
#pragma unroll
                for (int j = 0; j < STEPS; ++j) {
                    const uint4 a = wv[r * STEPS * 32 + j * 32 + lane];
                    const __nv_bfloat162 *a2 = reinterpret_cast<const __nv_bfloat162 *>(&a);
                    const __nv_bfloat162 *b2 = reinterpret_cast<const __nv_bfloat162 *>(&yv[j]);
#pragma unroll
                    for (int q = 0; q < 4; ++q) {
                        const float2 fa = __bfloat1622float2(a2[q]), fb = __bfloat1622float2(b2[q]);
                        acc[r] = fmaf(fa.x, fb.x, acc[r]);
                        odd[r] = fmaf(fa.y, fb.y, odd[r]);
                    }
                }
            }
            acc[r] += odd[r];
        }
        __syncwarp();
        if (lane == 0) bar_arrive(&empty[s]);  // the slot's weights are in registers now
#pragma unroll
        for (int r = 0; r < ROWS; ++r)
#pragma unroll
            for (int off = 16; off > 0; off /= 2) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], off);
        if (lane == 0)
            for (int r = 0; r < rows; ++r)
                store_relaxed(y_next + ch * ROWS + r, tag << 32 | __bfloat16_as_ushort(__float2bfloat16(acc[r])));
    }
}

extern "C" __global__ void __launch_bounds__((CONSUMER_WARPS + 1) * 32, 1)
chain(const __nv_bfloat16 *__restrict__ w, uint64_t *ys, uint32_t *ready, uint32_t *done, uint32_t *epoch,
      uint32_t *failed, uint64_t *trace, int layers, int dim_a, int dim_b, int stride_y, int depth, int mode,
      int loader, int inflight, int handoff, int max_spins) {
    extern __shared__ __align__(128) unsigned char smem[];
    unsigned char *ring = smem;                                               // MAX_SLOTS x CHUNK_BYTES
    uint64_t *full = reinterpret_cast<uint64_t *>(smem + MAX_SLOTS * CHUNK_BYTES);  // MAX_SLOTS
    uint64_t *empty = full + MAX_SLOTS;                                          // MAX_SLOTS
    __shared__ __align__(16) __nv_bfloat16 y_s[4096];
    __shared__ uint32_t launch, counted;  // launches so far; those of them with `handoff` 1 (ready[0])
    __shared__ volatile int seen;  // the last GEMV whose input the consumers have read (`mode` 1's producer waits)
    __shared__ uint32_t issued[MAX_INFLIGHT];  // the producer's last requests: slot << 16 | the slot's fill index
    __shared__ uint32_t fills[MAX_SLOTS];      // fills the producer has asked for, a slot

    const int c = blockIdx.x, g = gridDim.x;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (trace) trace += static_cast<int64_t>(c) * 4 * TRACE_EVENTS;
    if (threadIdx.x == 0) {
        for (int s = 0; s < CONSUMER_WARPS * depth; ++s) {
            bar_init(&full[s], loader == 0 ? 1 : 32);  // the expect_tx arrival (+ the bytes), or the 32 lanes'
            bar_init(&empty[s], 1);                     // the owner warp's arrival
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        launch = *reinterpret_cast<volatile uint32_t *>(epoch);
        counted = *reinterpret_cast<volatile uint32_t *>(ready);
        seen = 0;
        for (int s = 0; s < MAX_SLOTS; ++s) fills[s] = 0;
    }
    __syncthreads();
    const uint32_t blocks = (launch + 1) * static_cast<uint32_t>(g);  // `done` once every block has finished

    if (warp == CONSUMER_WARPS) {  // the producer
        if (loader == 0 && lane != 0) return;
        uint32_t given[CONSUMER_WARPS] = {};  // chunks handed to each warp so far
        uint32_t seq = 0;
        for (int i = 0; i < layers; ++i) {
            const Gemv m = gemv_of(w, i, dim_a, dim_b, c, g);
            if (mode == 1)
                while (seen < i) {
                }
            for (int ch = 0; ch < m.chunks; ++ch, ++seq) {
                const int owner = ch % CONSUMER_WARPS;
                uint32_t n = 0;
#pragma unroll
                for (int o = 0; o < CONSUMER_WARPS; ++o) n = o == owner ? given[o] : n;  // no local memory
                const int s = owner * depth + n % depth;
                if (n >= static_cast<uint32_t>(depth)) bar_wait(&empty[s], (n / depth - 1) & 1);
                if (inflight && seq >= static_cast<uint32_t>(inflight)) {  // the request `inflight` back has landed
                    const uint32_t r = issued[(seq - inflight) % MAX_INFLIGHT], rs = r >> 16, rf = r & 0xffffu;
                    if (fills[rs] == rf + 1) bar_wait(&full[rs], rf & 1);  // else its slot was refilled: it landed
                }
                issued[seq % MAX_INFLIGHT] = s << 16 | (n / depth);  // each lane reads back its own writes
                fills[s] = n / depth + 1;
#pragma unroll
                for (int o = 0; o < CONSUMER_WARPS; ++o) given[o] += o == owner;
                if (trace && lane == 0 && seq < TRACE_EVENTS) trace[seq] = now_ns();
                const int rows = min(m.rows_per_chunk, m.rows - ch * m.rows_per_chunk);
                const void *src = m.w + static_cast<int64_t>(ch) * m.rows_per_chunk * m.k;
                const uint32_t bytes = static_cast<uint32_t>(rows * m.k * 2);
                if (loader == 0)
                    bulk_load(ring + s * CHUNK_BYTES, src, bytes, &full[s]);
                else
                    lanes_load(ring + s * CHUNK_BYTES, src, bytes, &full[s], lane);
            }
        }
        return;
    }

    // the consumers
    uint32_t taken = 0, seq0 = 0;
    const uint64_t tag0 = static_cast<uint64_t>(launch) * layers;  // y[i] carries tag0 + i in this launch (i >= 1)
    for (int i = 0; i < layers; ++i) {
        const Gemv m = gemv_of(w, i, dim_a, dim_b, c, g);
        const uint64_t *y = ys + static_cast<int64_t>(i) * stride_y;
        const bool wait = mode != 2 && i > 0;
        if (wait && handoff == 1 && threadIdx.x == 0) {  // every warp of every block has released its rows
            int spins = 0;
            while (load_acquire(ready + i) < (counted + 1) * static_cast<uint32_t>(g) * CONSUMER_WARPS &&
                   ++spins < max_spins) {
            }
            if (spins == max_spins) atomicExch(failed, 1u);
        }
        if (handoff == 1) consumers_sync();  // thread 0's acquire, then the entries (their tags unchecked)
        const uint32_t tag = wait && handoff == 0 ? static_cast<uint32_t>(tag0 + i) : 0u;  // 0: read, no waiting
        const bool ok = m.k == 4096 ? read_y<4096>(y, y_s, tag, threadIdx.x, max_spins)
                                    : read_y<2048>(y, y_s, tag, threadIdx.x, max_spins);
        if (!ok) atomicExch(failed, 1u);
        consumers_sync();  // y[i] is in shared memory
        if (threadIdx.x == 0) {
            seen = i;
            if (trace && i < TRACE_EVENTS) trace[2 * TRACE_EVENTS + i] = now_ns();
        }
        uint64_t *y_next = ys + static_cast<int64_t>(i + 1) * stride_y + m.row0;
        uint64_t *stamps = trace && seq0 + m.chunks <= TRACE_EVENTS ? trace : nullptr;
        if (m.k == 4096)
            consume<4096>(ring, full, empty, m, y_s, y_next, tag0 + i + 1, taken, depth, warp, lane, stamps, seq0);
        else
            consume<2048>(ring, full, empty, m, y_s, y_next, tag0 + i + 1, taken, depth, warp, lane, stamps, seq0);
        seq0 += m.chunks;
        if (handoff == 1) {
            __syncwarp();
            if (lane == 0) release_add(ready + i + 1);  // lane 0 stored this warp's rows
        }
        const int e = i * CONSUMER_WARPS + warp;
        if (trace && lane == 0 && e < TRACE_EVENTS) trace[3 * TRACE_EVENTS + e] = now_ns();
        consumers_sync();  // every warp has read y_s before the next GEMV's input replaces it
    }
    if (threadIdx.x == 0 && atomicAdd(done, 1u) == blocks - 1) {
        __threadfence();
        *reinterpret_cast<volatile uint32_t *>(epoch) = launch + 1;  // the last block: every block has read it
        if (handoff == 1) *reinterpret_cast<volatile uint32_t *>(ready) = counted + 1;
    }
}
