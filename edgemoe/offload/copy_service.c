/* The expert cache's copy service: the host carries out the copy lists a replayed decode graph posts.
 *
 * A decode step cannot tell the host which experts missed without synchronising, and the copy engine only copies
 * what the host asks. So the GPU posts each non-empty copy list to a mailbox in pinned host memory
 * (`edgemoe.kernels.miss_copy.post_list`, inside the fused `ensure` or a post kernel: the row's fields, a
 * system-scope fence, then its sequence number) and the thread that replayed the graph, polling the mailbox until the step's event completes
 * (`edgemoe_copy_service_serve`), issues the listed rows' copies on the service's stream (two rows an entry), each
 * group of entries followed by stream writes of `chunks` into their arrival counters, on which the expert GEMV
 * waits (edgemoe.kernels.miss_copy.Arrivals). The GPU waits for every list it posts before posting the next, so
 * posts are served strictly in order and a ring of two mailbox rows never overflows.
 *
 * Why the replaying thread and not a thread of its own: a second thread's driver calls stall while the first
 * blocks inside the driver (a pageable device-to-host copy, a full launch queue) waiting for a GPU that waits for
 * the second: the engine deadlocked that way (benchmarks/RESULTS.md). One thread never contends with itself.
 *
 * Where the driver has `cuMemcpyBatchAsync` (CUDA 12.8 and later), the rows of `group` entries go in one call of it
 * and their counters are written after it; otherwise each row is one `cuMemcpyHtoDAsync`.
 *
 * A bank row is laid out as a slot (the same bytes from one row to the next). Where an expert's down row follows its
 * gate_up row in memory, in the banks and in the slots (`joined`: edgemoe.offload.layout.split_rows, the engine's
 * layout), an entry is one copy of both; otherwise two (what a copy costs the copy engine besides its bytes:
 * benchmarks/copy_service.py, host_joined against host_rows).
 *
 * The CPU split (edgemoe.offload.cpu_split): a list may also name pairs (token, expert) that the host computes. Once
 * its copies are queued (they cross PCIe meanwhile), the serving thread runs the CPU expert executor on them
 * (cpu_experts.c, through its C entry point: a pool of threads that does no driver calls, so the one-thread rule
 * above holds), over the x rows the posting kernel wrote beside the mailbox; it puts each pair's output at its pair's
 * row of a pinned buffer, queues one copy of those rows to the device buffer the expert kernels read, and then a
 * stream write of the list's sequence number into a device flag on which they wait (the same stream order as the
 * arrival counters). A list with CPU pairs is posted even when it copies nothing.
 *
 * Mailbox row (int64): seq, count, bank_a, bank_b, src[max_entries], dst[max_entries], then the CPU section: layer,
 * cpu_count, pairs, top_k, cpu[max_entries] (the experts the CPU computes), ids[max_pairs] (the step's routed ids,
 * pair p = token p / top_k). CUDA is reached through driver entry points the Python side passes in (libcuda's own),
 * so this file needs no CUDA headers. Built and loaded by edgemoe/offload/copy_service.py.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "cpu_experts_job.h"

typedef int (*memcpy_fn)(uint64_t dst, const void *src, size_t bytes, void *stream);  /* cuMemcpyHtoDAsync */
typedef int (*write_fn)(void *stream, uint64_t addr, uint64_t value, unsigned flags); /* cuStreamWriteValue64 */
typedef int (*query_fn)(void *event);                                                 /* cuEventQuery */
typedef int (*tier_fn)(void *tier, int64_t layer, const int64_t *experts, int64_t n, uint64_t *addrs);
typedef int (*batch_fn)(uint64_t *dsts, uint64_t *srcs, size_t *sizes, size_t count, void *attrs, size_t *attr_idxs,
                        size_t num_attrs, void *stream); /* cuMemcpyBatchAsync (the _v2 entry point of CUDA 13) */

typedef struct { /* CUmemcpyAttributes */
  int src_access_order; /* CU_MEMCPY_SRC_ACCESS_ORDER_STREAM */
  int src_hint_type, src_hint_id, dst_hint_type, dst_hint_id; /* location hints: managed memory only */
  unsigned flags;
} copy_attributes;

#define CUDA_ERROR_NOT_READY 600
#define MAX_GROUP 64
#define CPU_BAD_LIST 100 /* a CPU section the service cannot serve: no executor attached, or fields out of range */

typedef struct {
  volatile int64_t *mailbox;
  int64_t ring, width, max_entries;
  uint64_t pool_a, pool_b; /* device addresses of the slot pools */
  int64_t row_a, row_b;    /* bytes per row */
  int64_t stride_a, stride_b; /* bytes from one slot (or bank row) to the next */
  int64_t joined;          /* pool_b = pool_a + row_a, both strides row_a + row_b: one copy an entry where the
                              banks are laid out so too */
  uint64_t counters;       /* device address: int64 arrival counter per list entry */
  uint64_t chunks;         /* the value that marks an entry as arrived */
  void *stream;
  memcpy_fn copy;
  write_fn write;
  query_fn query;
  batch_fn batch;  /* NULL: one cuMemcpyHtoDAsync a row */
  int64_t group;   /* entries a batch call copies, 1..MAX_GROUP */
  int64_t served; /* lists served so far */
  int error;      /* first CUDA error code, 0 if none */
  /* host-side timings, summed over the lists served (CLOCK_MONOTONIC ns): from seeing a list's sequence number to
   * the return of its first copy call (the first copy is queued), and to the end of its last counter write (all
   * queued); and the event queries of the poll loop */
  int64_t first_ns, issue_ns, queries;
  /* the CPU split (see above); cpu_run NULL: none attached */
  edgemoe_cpu_run_fn cpu_run;
  void *cpu_pool;
  const edgemoe_cpu_job *cpu_jobs; /* [cpu_layers] each MoE layer's bank and formats; x, pairs, ids, out set here */
  int64_t cpu_layers, max_pairs, max_tokens, hidden;
  const float *cpu_x;   /* pinned [ring, max_tokens, hidden]: each mailbox row's x, written by the posting kernel */
  float *cpu_rows;      /* pinned [max_pairs, hidden]: each CPU pair's output at its pair's row */
  float *cpu_scratch;   /* [max_pairs, hidden]: the executor's outputs, one row a CPU pair */
  int64_t *cpu_pairs;   /* [3, max_pairs]: each CPU pair's index, token and expert */
  uint64_t cpu_out;     /* device address [max_pairs, hidden] fp32: where cpu_rows are copied */
  uint64_t cpu_done;    /* device address, int64: the sequence number of the last list whose CPU rows are in */
  int cpu_error;        /* the executor's first error code (or CPU_BAD_LIST), 0 if none */
  int64_t cpu_lists, cpu_ns; /* lists with CPU pairs served; host time from seeing each to its flag's write queued */
  /* the RAM tier (edgemoe/offload/ram_tier.c); tier NULL: none, the lists' rows are in the banks. With one, a list's
   * bank_a is its MoE layer and its sources are experts, fetched into RAM rows (read from disk where absent) before
   * their copies are queued; tier_b: where the second part starts in a RAM row */
  tier_fn tier_fetch;
  void *tier;
  int64_t tier_b;
  int tier_error; /* the tier's first error (an errno), 0 if none: nothing is copied from a failed fetch */
} edgemoe_copy_service;

static int64_t now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* Copy entries [first, first + n) of the list in `row`: their rows, bank -> slot, or with the RAM tier from the
 * rows at `addrs` (one an entry of the list). Returns a CUDA error or 0. */
static int copy_entries(edgemoe_copy_service *s, volatile int64_t *row, int64_t first, int64_t n,
                        const uint64_t *addrs) {
  uint64_t bank_a = (uint64_t)row[2], bank_b = (uint64_t)row[3];
  uint64_t dsts[2 * MAX_GROUP], srcs[2 * MAX_GROUP];
  size_t sizes[2 * MAX_GROUP], count = 0;
  int joined = s->joined && (addrs ? s->tier_b == s->row_a : bank_b == bank_a + (uint64_t)s->row_a);
  for (int64_t j = 0; j < n; ++j) {
    uint64_t src = (uint64_t)row[4 + first + j], dst = (uint64_t)row[4 + s->max_entries + first + j];
    uint64_t src_a = addrs ? addrs[first + j] : bank_a + src * s->stride_a;
    uint64_t src_b = addrs ? addrs[first + j] + (uint64_t)s->tier_b : bank_b + src * s->stride_b;
    dsts[count] = s->pool_a + dst * s->stride_a, srcs[count] = src_a;
    sizes[count++] = joined ? (size_t)(s->row_a + s->row_b) : (size_t)s->row_a;
    if (!joined) {
      dsts[count] = s->pool_b + dst * s->stride_b, srcs[count] = src_b;
      sizes[count++] = s->row_b;
    }
  }
  if (s->batch) {
    copy_attributes in_order = {1, 0, 0, 0, 0, 0};
    size_t all = 0; /* the attributes apply from copy 0 on */
    return s->batch(dsts, srcs, sizes, count, &in_order, &all, 1, s->stream);
  }
  for (size_t k = 0; k < count; ++k) {
    int err = s->copy(dsts[k], (const void *)(uintptr_t)srcs[k], sizes[k], s->stream);
    if (err) return err;
  }
  return 0;
}

static void serve_list(edgemoe_copy_service *s, volatile int64_t *row, int64_t seen) {
  int64_t n = row[1] < s->max_entries ? row[1] : s->max_entries;
  int64_t group = s->batch ? (s->group < 1 ? 1 : s->group > MAX_GROUP ? MAX_GROUP : s->group) : 1;
  uint64_t addrs[n > 0 ? n : 1];
  int fetched = 1;
  if (s->tier && n > 0) { /* the list's experts in RAM first: a failed fetch copies nothing */
    int64_t experts[n];
    for (int64_t j = 0; j < n; ++j) experts[j] = row[4 + j];
    int err = s->tier_fetch(s->tier, row[2], experts, n, addrs);
    if (err && !s->tier_error) s->tier_error = err;
    fetched = !err;
  }
  for (int64_t first = 0; first < n; first += group) {
    int64_t m = n - first < group ? n - first : group;
    if (!s->error && fetched) s->error = copy_entries(s, row, first, m, s->tier ? addrs : NULL);
    if (first == 0) s->first_ns += now_ns() - seen;
    for (int64_t i = first; i < first + m; ++i) {
      /* even after an error: the GPU must never wait forever (the Python side raises on `error`) */
      int err = s->write(s->stream, s->counters + 8 * (uint64_t)i, s->chunks, 0);
      if (err && !s->error) s->error = err;
    }
  }
}

/* The CPU section of the list in `row` (ring row `at`, sequence number `seq`): its pairs computed, their rows copied
 * to the device, then the flag. The flag is written even after an error, so the GPU never waits forever. */
static void serve_cpu(edgemoe_copy_service *s, volatile int64_t *row, int64_t at, int64_t seq) {
  volatile int64_t *c = row + 4 + 2 * s->max_entries, *cpu = c + 4, *ids = c + 4 + s->max_entries;
  int64_t layer = c[0], n = c[1], pairs = c[2], top_k = c[3], found = 0, H = s->hidden;
  int fits = s->cpu_run && layer >= 0 && layer < s->cpu_layers && n >= 0 && n <= s->max_entries && pairs >= 0 &&
             pairs <= s->max_pairs && top_k >= 1 && pairs % top_k == 0 && pairs / top_k <= s->max_tokens;
  if (!fits && !s->cpu_error) s->cpu_error = CPU_BAD_LIST;
  int64_t *index = s->cpu_pairs, *tokens = index + s->max_pairs, *experts = tokens + s->max_pairs;
  for (int64_t p = 0; fits && p < pairs; ++p) {
    int64_t e = ids[p];
    for (int64_t j = 0; j < n; ++j)
      if (cpu[j] == e) {
        index[found] = p, tokens[found] = p / top_k, experts[found++] = e;
        break;
      }
  }
  if (found) {
    edgemoe_cpu_job job = s->cpu_jobs[layer];
    job.x = s->cpu_x + at * s->max_tokens * H, job.tokens = pairs / top_k, job.pairs = found;
    job.token_ids = tokens, job.expert_ids = experts, job.out = s->cpu_scratch;
    int err = s->cpu_run(s->cpu_pool, &job);
    if (err && !s->cpu_error) s->cpu_error = err;
    for (int64_t k = 0; k < found; ++k) /* each output to its pair's row (garbage after an error: flagged above) */
      memcpy(s->cpu_rows + index[k] * H, s->cpu_scratch + k * H, (size_t)H * sizeof(float));
    int64_t lo = index[0], bytes = (index[found - 1] - lo + 1) * H * (int64_t)sizeof(float);
    if (!s->error) /* one copy from the first pair's row to the last: the rows between are never read */
      s->error = s->copy(s->cpu_out + (uint64_t)(lo * H * (int64_t)sizeof(float)), s->cpu_rows + lo * H,
                         (size_t)bytes, s->stream);
  }
  int err = s->cpu_done ? s->write(s->stream, s->cpu_done, (uint64_t)seq, 0) : 0; /* 0: never attached, none wait */
  if (err && !s->error) s->error = err;
}

/* Serve posted lists in order until `event` (recorded after the replay) has completed. Returns the first CUDA
 * error (of a copy, a counter or flag write, or the event query), 0 if none; the executor's are in `cpu_error`. */
int edgemoe_copy_service_serve(edgemoe_copy_service *s, void *event) {
  for (;;) {
    volatile int64_t *row = s->mailbox + (s->served % s->ring) * s->width;
    if (row[0] == s->served + 1) {
      int64_t seen = now_ns();
      __sync_synchronize(); /* the row's fields after its sequence number */
      serve_list(s, row, seen);
      s->issue_ns += now_ns() - seen;
      if (row[4 + 2 * s->max_entries + 1]) { /* CPU pairs, after the copies are queued */
        serve_cpu(s, row, s->served % s->ring, s->served + 1);
        s->cpu_lists += 1, s->cpu_ns += now_ns() - seen;
      }
      s->served += 1;
      continue;
    }
    s->queries += 1;
    int done = s->query(event);
    if (done == 0) return s->error; /* every posted list was waited for, so served, before the event */
    if (done != CUDA_ERROR_NOT_READY) return s->error ? s->error : done;
  }
}
