// Memory-model helpers shared by the CUDA C++ probes in benchmarks/ (tile_prefetch_chain.cu, handoff_latency.cu):
// GPU-scope loads and stores that bypass L1, a release increment, and the global nanosecond timer.
#pragma once
#include <cstdint>

__device__ __forceinline__ uint64_t load_relaxed(const uint64_t *p) {  // from L2, never a stale L1 line
    uint64_t v;
    asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void store_relaxed(uint64_t *p, uint64_t v) {
    asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ uint32_t load_acquire(const uint32_t *p) {
    uint32_t v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void release_add(uint32_t *p) {  // the stores before it are visible to an acquire of p
    asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(p) : "memory");
}

__device__ __forceinline__ uint64_t now_ns() {  // %globaltimer: comparable across SMs
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
