/* The expert cache's copy service: the host carries out the copy lists a replayed decode graph posts.
 *
 * A decode step cannot tell the host which experts missed without synchronising, and the copy engine only copies
 * what the host asks. So the GPU posts each non-empty copy list to a mailbox in pinned host memory (the Triton
 * kernel `edgemoe.kernels.miss_copy.post_copy_list`: the row's fields, a system-scope fence, then its sequence
 * number) and the thread that replayed the graph, polling the mailbox until the step's event completes
 * (`edgemoe_copy_service_serve`), issues the listed rows' copies on the service's stream, each entry's
 * two rows followed by a stream write of `chunks` into the entry's arrival counter, which the expert GEMV waits
 * on (edgemoe.kernels.miss_copy.Arrivals). The GPU waits for every list it posts before posting the next, so
 * posts are served strictly in order and a ring of two mailbox rows never overflows.
 *
 * Why the replaying thread and not a thread of its own: a second thread's driver calls stall while the first
 * blocks inside the driver (a pageable device-to-host copy, a full launch queue) waiting for a GPU that waits for
 * the second: the engine deadlocked that way (benchmarks/RESULTS.md). One thread never contends with itself.
 *
 * Mailbox row (int64): seq, count, bank_a, bank_b, src[max_entries], dst[max_entries]. CUDA is reached through
 * driver entry points the Python side passes in (libcuda's own), so this file needs no CUDA headers.
 * Built and loaded by edgemoe/moe/copy_service.py.
 */
#include <stddef.h>
#include <stdint.h>

typedef int (*memcpy_fn)(uint64_t dst, const void *src, size_t bytes, void *stream);  /* cuMemcpyHtoDAsync */
typedef int (*write_fn)(void *stream, uint64_t addr, uint64_t value, unsigned flags); /* cuStreamWriteValue64 */
typedef int (*query_fn)(void *event);                                                 /* cuEventQuery */

#define CUDA_ERROR_NOT_READY 600

typedef struct {
  volatile int64_t *mailbox;
  int64_t ring, width, max_entries;
  uint64_t pool_a, pool_b; /* device addresses of the slot pools */
  int64_t row_a, row_b;    /* bytes per row */
  uint64_t counters;       /* device address: int64 arrival counter per list entry */
  uint64_t chunks;         /* the value that marks an entry as arrived */
  void *stream;
  memcpy_fn copy;
  write_fn write;
  query_fn query;
  int64_t served; /* lists served so far */
  int error;      /* first CUDA error code, 0 if none */
} edgemoe_copy_service;

static void serve_list(edgemoe_copy_service *s, volatile int64_t *row) {
  int64_t n = row[1];
  const char *bank_a = (const char *)(intptr_t)row[2], *bank_b = (const char *)(intptr_t)row[3];
  for (int64_t i = 0; i < n && i < s->max_entries; ++i) {
    int64_t src = row[4 + i], dst = row[4 + s->max_entries + i];
    if (!s->error) {
      int err = s->copy(s->pool_a + dst * s->row_a, bank_a + src * s->row_a, s->row_a, s->stream);
      if (!err) err = s->copy(s->pool_b + dst * s->row_b, bank_b + src * s->row_b, s->row_b, s->stream);
      if (err) s->error = err;
    }
    /* even after an error: the GPU must never wait forever (the Python side raises on `error`) */
    int err = s->write(s->stream, s->counters + 8 * (uint64_t)i, s->chunks, 0);
    if (err && !s->error) s->error = err;
  }
}

/* Serve posted lists in order until `event` (recorded after the replay) has completed. Returns the first CUDA
 * error (of a copy, a counter write or the event query), 0 if none. */
int edgemoe_copy_service_serve(edgemoe_copy_service *s, void *event) {
  for (;;) {
    volatile int64_t *row = s->mailbox + (s->served % s->ring) * s->width;
    if (row[0] == s->served + 1) {
      __sync_synchronize(); /* the row's fields after its sequence number */
      serve_list(s, row);
      s->served += 1;
      continue;
    }
    int done = s->query(event);
    if (done == 0) return s->error; /* every posted list was waited for, so served, before the event */
    if (done != CUDA_ERROR_NOT_READY) return s->error ? s->error : done;
  }
}
