// What does one hand-off of a 768-wide vector cost, when every block of a group needs all of it before its next
// step? benchmarks/handoff_latency.py builds, checks and times these (the docstring there says why). Builds with
//     nvcc -arch=sm_90 -cubin benchmarks/handoff_latency.cu -o handoff.cubin
//
// Each kernel runs `rounds` rounds. In round r every block writes its share of the vector (entry j holds
// r * 768 + j), the hand-off happens, then every block reads all 768 entries and checks their sum (a wrong or stale
// entry raises *failed). Thread 0 of each block stamps %globaltimer before the first round and after the last:
// stamps[block] = ns a round. Blocks from `handoff_blocks` on (a whole number of clusters) only load HBM until
// block 0 has finished its rounds (`stream_until_stop`): the hand-off measured beside streaming weights.
//   - cluster_rounds: clusters of 8 blocks; a block's 96 entries sit in its own shared memory; the hand-off is the
//     hardware cluster barrier (arrive.release / wait.acquire); the reads go through distributed shared memory.
//   - flag_rounds: all blocks of the grid; entries are 64-bit {tag, value} in global memory, written with one
//     relaxed store each and read (from L2) until they carry the round's tag: session 23's `flags` hand-off.
//   - counter_rounds: all blocks; plain entries, then a fence and one atomic a block on a counter that thread 0 of
//     every block polls (acquire): a grid barrier, session 23's `counter` hand-off.
#include <cooperative_groups.h>
#include <cstdint>

#include "gpu_sync.cuh"

namespace cg = cooperative_groups;

constexpr int WIDTH = 768;  // qwen3-30b-a3b's expert intermediate size
constexpr int THREADS = 256;
constexpr int CLUSTER = 8;
constexpr int MAX_SPINS = 1 << 22;  // a wait gives up (and the round's check fails) instead of hanging

// Blocks past the hand-off's read a large buffer (16-byte loads, 8 in flight a thread, from HBM: it is larger than
// L2) until the first hand-off block raises *stop: HBM busy, as it is while a megakernel's next weights stream.
// sink[1] counts the 16-byte loads made.
__device__ __forceinline__ void stream_until_stop(int handoff_blocks, const uint4 *load, uint64_t n,
                                                  const volatile uint32_t *stop, unsigned long long *sink) {
    const uint64_t loaders = static_cast<uint64_t>(gridDim.x - handoff_blocks) * blockDim.x;
    uint64_t i = static_cast<uint64_t>(blockIdx.x - handoff_blocks) * blockDim.x + threadIdx.x;
    uint32_t acc = 0;
    unsigned long long batches = 0;
    while (!*stop) {
        ++batches;
        uint4 v[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            v[u] = __ldcs(load + i);
            i += loaders;
            if (i >= n) i -= n;
        }
#pragma unroll
        for (int u = 0; u < 8; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    if (acc == 0x9e3779b9u) sink[0] = acc;  // keeps the loads
    atomicAdd(sink + 1, batches * 8);          // 16-byte loads made
}

// The block's sum of the round's 768 entries (as read by each thread, reduced in shared memory) against the
// expected one; thread 0 raises *failed on a mismatch.
__device__ __forceinline__ void check_sum(uint32_t part, uint32_t round, uint32_t *failed) {
    __shared__ uint32_t total;
    if (threadIdx.x == 0) total = 0;
    __syncthreads();
    atomicAdd(&total, part);
    __syncthreads();
    const uint32_t want = round * WIDTH * WIDTH + WIDTH * (WIDTH - 1) / 2;  // wraps alike on both sides
    if (threadIdx.x == 0 && total != want) atomicExch(failed, 1u);
    __syncthreads();
}

extern "C" __global__ void __cluster_dims__(CLUSTER, 1, 1) __launch_bounds__(THREADS)
cluster_rounds(int rounds, uint64_t *stamps, uint32_t *failed, int handoff_blocks, const uint4 *load, uint64_t n,
               volatile uint32_t *stop, unsigned long long *sink) {
    if (static_cast<int>(blockIdx.x) >= handoff_blocks) return stream_until_stop(handoff_blocks, load, n, stop, sink);
    __shared__ uint32_t share[2][WIDTH / CLUSTER];
    cg::cluster_group cluster = cg::this_cluster();
    const int rank = static_cast<int>(cluster.block_rank());
    cluster.sync();  // every block of the cluster has started
    const uint64_t t0 = now_ns();
    for (int r = 0; r < rounds; ++r) {
        uint32_t *mine = share[r & 1];  // two buffers: round r + 2 writes this one after round r + 1's barrier
        for (int j = threadIdx.x; j < WIDTH / CLUSTER; j += THREADS)
            mine[j] = static_cast<uint32_t>(r) * WIDTH + rank * (WIDTH / CLUSTER) + j;
        cluster.sync();  // barrier.cluster.arrive.release + wait.acquire
        uint32_t part = 0;
        for (int e = threadIdx.x; e < WIDTH; e += THREADS) {
            const uint32_t *theirs = cluster.map_shared_rank(share[r & 1], e / (WIDTH / CLUSTER));
            part += theirs[e % (WIDTH / CLUSTER)];
        }
        check_sum(part, r, failed);
    }
    cluster.sync();  // no block leaves while another may still read its shared memory
    if (threadIdx.x == 0) stamps[blockIdx.x] = (now_ns() - t0) / rounds;
    if (blockIdx.x == 0 && threadIdx.x == 0) *stop = 1;
}

extern "C" __global__ void __launch_bounds__(THREADS)
flag_rounds(int rounds, uint64_t *entries, uint32_t tag0, uint64_t *stamps, uint32_t *failed, int handoff_blocks,
            const uint4 *load, uint64_t n, volatile uint32_t *stop, unsigned long long *sink) {
    if (static_cast<int>(blockIdx.x) >= handoff_blocks) return stream_until_stop(handoff_blocks, load, n, stop, sink);
    const int g = handoff_blocks, c = blockIdx.x;
    const int first = c * WIDTH / g, last = (c + 1) * WIDTH / g;  // this block's entries
    const uint64_t t0 = now_ns();
    for (int r = 0; r < rounds; ++r) {
        const uint64_t tag = tag0 + r;
        uint64_t *round = entries + (r & 1) * WIDTH;  // two buffers: round r + 1's stores must not hide round r's
        for (int j = first + threadIdx.x; j < last; j += THREADS)
            store_relaxed(round + j, tag << 32 | (static_cast<uint32_t>(r) * WIDTH + j));
        uint32_t part = 0;
        for (int e = threadIdx.x; e < WIDTH; e += THREADS) {
            uint64_t v;
            int spins = 0;
            do {
                v = load_relaxed(round + e);
            } while (static_cast<uint32_t>(v >> 32) != static_cast<uint32_t>(tag) && ++spins < MAX_SPINS);
            part += static_cast<uint32_t>(v);
        }
        check_sum(part, r, failed);  // also: every thread has read round r before any writes round r + 1
    }
    if (threadIdx.x == 0) stamps[c] = (now_ns() - t0) / rounds;
    if (c == 0 && threadIdx.x == 0) *stop = 1;
}

extern "C" __global__ void __launch_bounds__(THREADS)
counter_rounds(int rounds, uint32_t *entries, uint32_t *counter, uint32_t base, uint64_t *stamps,
               uint32_t *failed, int handoff_blocks, const uint4 *load, uint64_t n, volatile uint32_t *stop,
               unsigned long long *sink) {
    if (static_cast<int>(blockIdx.x) >= handoff_blocks) return stream_until_stop(handoff_blocks, load, n, stop, sink);
    const int g = handoff_blocks, c = blockIdx.x;
    const int first = c * WIDTH / g, last = (c + 1) * WIDTH / g;
    const uint64_t t0 = now_ns();
    for (int r = 0; r < rounds; ++r) {
        uint32_t *round = entries + (r & 1) * WIDTH;  // two buffers, as cluster_rounds'
        for (int j = first + threadIdx.x; j < last; j += THREADS) round[j] = static_cast<uint32_t>(r) * WIDTH + j;
        __syncthreads();
        if (threadIdx.x == 0) {
            __threadfence();
            atomicAdd(counter, 1u);
            const uint32_t want = base + static_cast<uint32_t>(r + 1) * g;
            for (int spins = 0; load_acquire(counter) < want && spins < MAX_SPINS; ++spins) {
            }
        }
        __syncthreads();
        uint32_t part = 0;
        for (int e = threadIdx.x; e < WIDTH; e += THREADS) part += __ldcg(round + e);
        check_sum(part, r, failed);
    }
    if (threadIdx.x == 0) stamps[c] = (now_ns() - t0) / rounds;
    if (c == 0 && threadIdx.x == 0) *stop = 1;
}
