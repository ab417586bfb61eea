/* The expert cache's copy service: a host thread that carries out copy lists the GPU posts.
 *
 * A decode step cannot tell the host which experts missed without synchronising, and the copy engine only copies
 * what the host asks. So the GPU posts each non-empty copy list to a mailbox in pinned host memory (the Triton
 * kernel `edgemoe.kernels.miss_copy.post_copy_list`: the row's fields, a system-scope fence, then its sequence
 * number) and this thread, polling the mailbox, issues the listed rows' copies on its own stream, each entry's
 * two rows followed by a stream write of `chunks` into the entry's arrival counter, which the expert GEMV waits
 * on (edgemoe.kernels.miss_copy.Arrivals). The GPU waits for every list it posts before posting the next, so
 * posts are served strictly in order and a ring of two mailbox rows never overflows.
 *
 * Mailbox row (int64): seq, count, bank_a, bank_b, src[max_entries], dst[max_entries]. CUDA is reached through
 * driver entry points the Python side passes in (libcuda's own), so this file needs no CUDA headers.
 * Built and loaded by edgemoe/moe/copy_service.py.
 */
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <time.h>

typedef int (*memcpy_fn)(uint64_t dst, const void *src, size_t bytes, void *stream);  /* cuMemcpyHtoDAsync */
typedef int (*write_fn)(void *stream, uint64_t addr, uint64_t value, unsigned flags); /* cuStreamWriteValue64 */
typedef int (*context_fn)(void *context);                                             /* cuCtxSetCurrent */

typedef struct {
  volatile int64_t *mailbox;
  int64_t ring, width, max_entries;
  uint64_t pool_a, pool_b; /* device addresses of the slot pools */
  int64_t row_a, row_b;    /* bytes per row */
  uint64_t counters;       /* device address: int64 arrival counter per list entry */
  uint64_t chunks;         /* the value that marks an entry as arrived */
  void *stream, *context;
  memcpy_fn copy;
  write_fn write;
  context_fn set_context;
  int64_t spin_ns; /* busy-poll this long after the last post, then nap */
  int64_t nap_ns;
  volatile int stop;
  volatile int error; /* first CUDA error code, 0 if none */
  volatile int64_t served;
  uint64_t thread;
} edgemoe_copy_service;

static int64_t now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void serve(edgemoe_copy_service *s, volatile int64_t *row) {
  int64_t n = row[1];
  const char *bank_a = (const char *)(intptr_t)row[2], *bank_b = (const char *)(intptr_t)row[3];
  for (int64_t i = 0; i < n && i < s->max_entries; ++i) {
    int64_t src = row[4 + i], dst = row[4 + s->max_entries + i];
    int err = 0;
    if (!s->error) {
      err = s->copy(s->pool_a + dst * s->row_a, bank_a + src * s->row_a, s->row_a, s->stream);
      if (!err) err = s->copy(s->pool_b + dst * s->row_b, bank_b + src * s->row_b, s->row_b, s->stream);
      if (err) {
        s->error = err;
        fprintf(stderr, "edgemoe copy service: cuMemcpyHtoDAsync failed (CUDA error %d)\n", err);
      }
    }
    /* even after an error: the GPU must never wait forever (the Python side raises on `error`) */
    err = s->write(s->stream, s->counters + 8 * (uint64_t)i, s->chunks, 0);
    if (err && !s->error) s->error = err;
  }
}

static void *run(void *arg) {
  edgemoe_copy_service *s = (edgemoe_copy_service *)arg;
  int err = s->set_context(s->context);
  if (err) {
    s->error = err;
    return 0;
  }
  int64_t expected = s->served + 1, last = now_ns();
  while (!s->stop) {
    volatile int64_t *row = s->mailbox + ((expected - 1) % s->ring) * s->width;
    if (row[0] != expected) {
      if (now_ns() - last > s->spin_ns) {
        struct timespec nap = {0, s->nap_ns};
        nanosleep(&nap, 0);
      }
      continue;
    }
    __sync_synchronize(); /* the row's fields after its sequence number */
    serve(s, row);
    s->served = expected++;
    last = now_ns();
  }
  return 0;
}

int edgemoe_copy_service_start(edgemoe_copy_service *s) {
  pthread_t t;
  int err = pthread_create(&t, 0, run, s);
  s->thread = (uint64_t)t;
  return err;
}

int edgemoe_copy_service_stop(edgemoe_copy_service *s) {
  s->stop = 1;
  return pthread_join((pthread_t)s->thread, 0);
}
