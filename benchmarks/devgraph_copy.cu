// Feasibility probe (H200 results: benchmarks/RESULTS.md, "The copy service in the engine, batched"; no better
// than the copy service, and limited to 120 pending launches, so not used): can the copy engine do the miss copy
// with rows chosen on the device, through device graph launch? One small device-launchable graph per (expert, list position): two memcpy nodes
// (gate_up row and down row, pinned host bank -> device staging row) and a kernel node that bumps the position's
// arrival counter. A launcher kernel inside a host-launched graph reads the copy list on the device and
// fire-and-forget launches the graphs of the listed experts; a waiter kernel spins on the counters. Compared with
// the same rows copied by cudaMemcpyAsync from a list the host knows (the copy engine's ceiling), timed by events
// over graph replays.
//
// Build (GPU machine, repo root): nvcc -O2 -arch=sm_90 -rdc=true benchmarks/devgraph_copy.cu -lcudadevrt -o /tmp/devgraph_copy
// Run:   /tmp/devgraph_copy [experts=16] [positions=8] [layers=1]
// `layers`: the parent graph holds that many launcher + waiter pairs in a row, as a decode step's MoE layers would
// (and so layers x rows device launches per parent run: CUDA allows a limited number of pending fire-and-forget
// launches, reported as launch errors). Rows 0 times a step's overhead when every expert hits.
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <cuda_runtime.h>

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { \
  std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); std::exit(1); } } while (0)

__global__ void bump(unsigned long long *counter) { atomicAdd(counter, 1ULL); }

// one thread: launch the listed experts' graphs (list[i] = expert, position i)
__global__ void launcher(const cudaGraphExec_t *execs, const int *list, const int *count, int positions) {
  int n = *count;
  for (int i = 0; i < n; ++i) {
    cudaError_t err = cudaGraphLaunch(execs[list[i] * positions + i], cudaStreamGraphFireAndForget);
    if (err != cudaSuccess) printf("device cudaGraphLaunch %d: error %d\n", i, (int)err);
  }
}

// one thread: wait until every listed position's counter reached its target, then raise the targets
__global__ void waiter(volatile unsigned long long *counters, unsigned long long *targets, const int *count) {
  int n = *count;
  for (int i = 0; i < n; ++i) {
    unsigned long long t = targets[i] + 1;
    long long start = clock64();
    while (counters[i] < t) {
      if (clock64() - start > 4000000000LL) {  // ~2 s: the graph never ran; give up instead of hanging
        printf("waiter: position %d never arrived\n", i);
        return;
      }
    }
    targets[i] = t;
  }
  __threadfence();
}

int main(int argc, char **argv) {
  int E = argc > 1 ? std::atoi(argv[1]) : 16, M = argc > 2 ? std::atoi(argv[2]) : 8;
  int L = argc > 3 ? std::atoi(argv[3]) : 1;
  const size_t row_a = 6u << 20, row_b = 3u << 20;  // qwen3-30b-a3b: gate_up 6 MiB, down 3 MiB (bf16)
  char *bank_a, *bank_b, *stage_a, *stage_b;
  CK(cudaHostAlloc(&bank_a, E * row_a, cudaHostAllocMapped));
  CK(cudaHostAlloc(&bank_b, E * row_b, cudaHostAllocMapped));
  for (size_t i = 0; i < E * row_a; i += 4096) bank_a[i] = (char)i;
  for (size_t i = 0; i < E * row_b; i += 4096) bank_b[i] = (char)i;
  CK(cudaMalloc(&stage_a, M * row_a));
  CK(cudaMalloc(&stage_b, M * row_b));
  unsigned long long *counters, *targets;
  CK(cudaMalloc(&counters, M * sizeof(unsigned long long)));
  CK(cudaMalloc(&targets, M * sizeof(unsigned long long)));
  CK(cudaMemset(counters, 0, M * sizeof(unsigned long long)));
  CK(cudaMemset(targets, 0, M * sizeof(unsigned long long)));

  // the per-(expert, position) device graphs
  std::vector<cudaGraphExec_t> execs(E * M);
  for (int e = 0; e < E; ++e)
    for (int j = 0; j < M; ++j) {
      cudaGraph_t g;
      CK(cudaGraphCreate(&g, 0));
      cudaGraphNode_t ca, cb, k;
      CK(cudaGraphAddMemcpyNode1D(&ca, g, nullptr, 0, stage_a + j * row_a, bank_a + e * row_a, row_a,
                                  cudaMemcpyDefault));
      CK(cudaGraphAddMemcpyNode1D(&cb, g, nullptr, 0, stage_b + j * row_b, bank_b + e * row_b, row_b,
                                  cudaMemcpyDefault));
      cudaKernelNodeParams kp = {};
      unsigned long long *ctr = counters + j;
      void *args[] = {&ctr};
      kp.func = (void *)bump;
      kp.gridDim = dim3(1);
      kp.blockDim = dim3(1);
      kp.kernelParams = args;
      cudaGraphNode_t deps[2] = {ca, cb};
      CK(cudaGraphAddKernelNode(&k, g, deps, 2, &kp));
      CK(cudaGraphInstantiate(&execs[e * M + j], g, cudaGraphInstantiateFlagDeviceLaunch));
      CK(cudaGraphUpload(execs[e * M + j], 0));
      CK(cudaGraphDestroy(g));
    }
  cudaGraphExec_t *d_execs;
  CK(cudaMalloc(&d_execs, execs.size() * sizeof(cudaGraphExec_t)));
  CK(cudaMemcpy(d_execs, execs.data(), execs.size() * sizeof(cudaGraphExec_t), cudaMemcpyHostToDevice));
  int *d_list, *d_count;
  CK(cudaMalloc(&d_list, M * sizeof(int)));
  CK(cudaMalloc(&d_count, sizeof(int)));

  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaEvent_t t0, t1;
  CK(cudaEventCreate(&t0));
  CK(cudaEventCreate(&t1));
  int last = 0;  // rows of the last round: what the check below expects in staging
  std::printf("experts %d, positions %d, layers %d, row %zu + %zu bytes\n", E, M, L, row_a, row_b);
  for (int n : {0, 1, 2, 3, 4, 8}) {
    if (n > M) break;
    std::vector<int> list(M);
    for (int i = 0; i < M; ++i) list[i] = (i * 5 + 3) % E;
    CK(cudaMemcpy(d_list, list.data(), M * sizeof(int), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d_count, &n, sizeof(int), cudaMemcpyHostToDevice));
    // the device-chosen copy: launcher + waiter, captured in a host-launched graph
    cudaGraph_t pg;
    cudaGraphExec_t pe;
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    for (int l = 0; l < L; ++l) {
      launcher<<<1, 1, 0, s>>>(d_execs, d_list, d_count, M);
      waiter<<<1, 1, 0, s>>>(counters, targets, d_count);
    }
    CK(cudaStreamEndCapture(s, &pg));
    CK(cudaGraphInstantiate(&pe, pg, 0));
    // the ceiling: the same rows by cudaMemcpyAsync from a list the host knows, also as a graph
    cudaGraph_t hg;
    cudaGraphExec_t he;
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    for (int l = 0; l < L; ++l)
      for (int i = 0; i < n; ++i) {
        CK(cudaMemcpyAsync(stage_a + i * row_a, bank_a + list[i] * row_a, row_a, cudaMemcpyDefault, s));
        CK(cudaMemcpyAsync(stage_b + i * row_b, bank_b + list[i] * row_b, row_b, cudaMemcpyDefault, s));
      }
    CK(cudaStreamEndCapture(s, &hg));
    CK(cudaGraphInstantiate(&he, hg, 0));
    const int reps = 20;
    float ms_dev = 0, ms_host = 0;
    for (int w = 0; w < 3; ++w) { CK(cudaGraphLaunch(he, s)); CK(cudaGraphLaunch(pe, s)); }
    CK(cudaStreamSynchronize(s));
    CK(cudaEventRecord(t0, s));
    for (int r = 0; r < reps; ++r) CK(cudaGraphLaunch(he, s));
    CK(cudaEventRecord(t1, s));
    CK(cudaEventSynchronize(t1));
    CK(cudaEventElapsedTime(&ms_host, t0, t1));
    CK(cudaMemsetAsync(stage_b, 0, M * row_b, s));  // the device-launched copies must refill it (checked below)
    CK(cudaEventRecord(t0, s));
    for (int r = 0; r < reps; ++r) CK(cudaGraphLaunch(pe, s));
    CK(cudaEventRecord(t1, s));
    CK(cudaEventSynchronize(t1));
    CK(cudaEventElapsedTime(&ms_dev, t0, t1));
    CK(cudaGetLastError());
    double bytes = double(L) * n * (row_a + row_b) * reps;
    std::printf("rows %d a layer: %.2f us a layer device-launched, %.2f us host-listed memcpy", n,
                1e3 * ms_dev / reps / L, 1e3 * ms_host / reps / L);
    if (n) std::printf("; %.1f vs %.1f GB/s, ratio %.3f", bytes / (ms_dev * 1e6), bytes / (ms_host * 1e6), ms_host / ms_dev);
    std::printf("\n");
    last = n;
    CK(cudaGraphExecDestroy(pe));
    CK(cudaGraphExecDestroy(he));
    CK(cudaGraphDestroy(pg));
    CK(cudaGraphDestroy(hg));
  }
  // check: staging rows equal their bank rows after the last device-launched round
  std::vector<char> got(row_b);
  std::vector<int> list(M);
  for (int i = 0; i < M; ++i) list[i] = (i * 5 + 3) % E;
  int bad = 0;
  for (int i = 0; i < last; ++i) {
    CK(cudaMemcpy(got.data(), stage_b + i * row_b, row_b, cudaMemcpyDeviceToHost));
    for (size_t b = 0; b < row_b; b += 4096) bad += got[b] != bank_b[list[i] * row_b + b];
  }
  std::printf("check: %s\n", bad ? "WRONG BYTES" : "staging rows equal their bank rows");
  return bad != 0;
}
