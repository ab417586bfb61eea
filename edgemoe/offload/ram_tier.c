/* The RAM tier of the routed experts: a fixed number of host rows (pinned on CUDA) caching experts of the store on
 * disk (edgemoe/offload/expert_store.py writes it: a 4 KiB header, then expert (layer, e) at data_offset +
 * (layer * experts + e) * stride), least recently used evicted first.
 *
 * `edgemoe_ram_tier_fetch` makes a list of one layer's experts resident in RAM and returns their rows' addresses:
 * hits are touched, each miss takes the least recently used row not touched by this call and is read into it, the
 * reads of one call in flight at once on a pool of reader threads (a deep queue: one read an expert, each split by the
 * kernel into requests of the drive's size), with O_DIRECT where the file system allows it (no second copy of the
 * experts in the page cache; otherwise buffered reads, each range dropped from the page cache after it is read).
 *
 * Why no locking against a row being overwritten while the copy engine still reads it: its callers (the copy
 * service's serve loop, `edgemoe.offload.ram_tier.RamTier.fetch` in eager steps) only fetch once every copy from an
 * earlier fetch has landed: the GPU waits for each posted list's copies before it posts the next, and an eager step
 * synchronises before each fetch. One thread calls at a time.
 *
 * A read that fails or comes back short (the file truncated), or a store whose size or modification time changed
 * since it was opened, is an error code (errno); the rows whose reads failed are freed, so nothing is served from
 * them, and the error is sticky (every later call returns it).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define ALIGN 4096

typedef struct {
  uint8_t *dst;
  int64_t offset, bytes, row, key;
  int err;
} read_job;

typedef struct {
  int fd, direct;
  int64_t layers, experts, rows;
  int64_t row_bytes, read_bytes, stride, data_offset;
  uint8_t *pool;      /* [rows, stride] */
  int64_t *row_of;    /* [layers * experts]: the RAM row of each expert, -1 absent */
  int64_t *key_of;    /* [rows]: layer * experts + expert held, -1 free */
  int64_t *prev, *next; /* the LRU list over rows: head most recent, tail least */
  int64_t head, tail;
  int64_t *touched;   /* [rows]: the fetch call that last touched each row */
  int64_t calls;
  int64_t accesses, hits, reads, bytes_read, read_ns;
  int error;
  struct stat opened; /* the store as it was opened: size and modification time, checked before each read */
  /* the readers */
  int threads, stop;
  pthread_t *workers;
  pthread_mutex_t lock;
  pthread_cond_t work, done;
  read_job *jobs;
  int64_t queued, taken, finished;
} ram_tier;

static int64_t now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void read_one(ram_tier *t, read_job *j) {
  int64_t got = 0;
  while (got < j->bytes) {
    ssize_t r = pread(t->fd, j->dst + got, (size_t)(j->bytes - got), (off_t)(j->offset + got));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      j->err = r < 0 ? errno : EIO; /* 0: past the end of a truncated file */
      return;
    }
    got += r;
  }
  if (!t->direct) posix_fadvise(t->fd, (off_t)j->offset, (off_t)j->bytes, POSIX_FADV_DONTNEED);
  j->err = 0;
}

static void *reader(void *arg) {
  ram_tier *t = arg;
  pthread_mutex_lock(&t->lock);
  for (;;) {
    while (!t->stop && t->taken == t->queued) pthread_cond_wait(&t->work, &t->lock);
    if (t->stop) break;
    read_job *j = &t->jobs[t->taken++];
    pthread_mutex_unlock(&t->lock);
    read_one(t, j);
    pthread_mutex_lock(&t->lock);
    if (++t->finished == t->queued) pthread_cond_signal(&t->done);
  }
  pthread_mutex_unlock(&t->lock);
  return NULL;
}

static void unlink_row(ram_tier *t, int64_t r) {
  if (t->prev[r] >= 0) t->next[t->prev[r]] = t->next[r]; else t->head = t->next[r];
  if (t->next[r] >= 0) t->prev[t->next[r]] = t->prev[r]; else t->tail = t->prev[r];
}

static void push_front(ram_tier *t, int64_t r) {
  t->prev[r] = -1, t->next[r] = t->head;
  if (t->head >= 0) t->prev[t->head] = r; else t->tail = r;
  t->head = r;
}

static void push_back(ram_tier *t, int64_t r) {
  t->next[r] = -1, t->prev[r] = t->tail;
  if (t->tail >= 0) t->next[t->tail] = r; else t->head = r;
  t->tail = r;
}

void edgemoe_ram_tier_close(ram_tier *t) {
  if (!t) return;
  if (t->workers) {
    pthread_mutex_lock(&t->lock);
    t->stop = 1;
    pthread_cond_broadcast(&t->work);
    pthread_mutex_unlock(&t->lock);
    for (int i = 0; i < t->threads; ++i) pthread_join(t->workers[i], NULL);
  }
  if (t->fd >= 0) close(t->fd);
  free(t->workers), free(t->jobs), free(t->row_of), free(t->key_of), free(t->prev), free(t->next), free(t->touched);
  free(t);
}

/* The tier over `path`'s experts, in `rows` rows of `pool` (stride bytes apart, aligned to 4 KiB); `threads`
 * readers. NULL with *err set (errno) when the file cannot be opened or the arguments do not fit. */
ram_tier *edgemoe_ram_tier_open(const char *path, int64_t layers, int64_t experts, int64_t row_bytes, int64_t stride,
                                int64_t data_offset, uint8_t *pool, int64_t rows, int threads, int *err) {
  *err = EINVAL;
  if (layers < 1 || experts < 1 || rows < 1 || row_bytes < 1 || stride % ALIGN || data_offset % ALIGN ||
      (uintptr_t)pool % ALIGN || threads < 1)
    return NULL;
  int64_t read_bytes = (row_bytes + ALIGN - 1) / ALIGN * ALIGN;
  if (read_bytes > stride) return NULL;
  ram_tier *t = calloc(1, sizeof(ram_tier));
  if (!t) return *err = ENOMEM, NULL;
  t->fd = open(path, O_RDONLY | O_DIRECT | O_CLOEXEC);
  t->direct = t->fd >= 0;
  if (t->fd < 0) t->fd = open(path, O_RDONLY | O_CLOEXEC); /* a file system without O_DIRECT (tmpfs) */
  if (t->fd < 0 || fstat(t->fd, &t->opened)) {
    *err = errno, t->fd = t->fd < 0 ? -1 : t->fd;
    edgemoe_ram_tier_close(t);
    return NULL;
  }
  if (!t->direct) posix_fadvise(t->fd, 0, 0, POSIX_FADV_RANDOM);
  t->layers = layers, t->experts = experts, t->rows = rows, t->row_bytes = row_bytes, t->read_bytes = read_bytes;
  t->stride = stride, t->data_offset = data_offset, t->pool = pool, t->threads = threads;
  t->row_of = malloc(sizeof(int64_t) * layers * experts), t->key_of = malloc(sizeof(int64_t) * rows);
  t->prev = malloc(sizeof(int64_t) * rows), t->next = malloc(sizeof(int64_t) * rows);
  t->touched = calloc(rows, sizeof(int64_t)), t->jobs = malloc(sizeof(read_job) * experts);
  t->workers = calloc(threads, sizeof(pthread_t));
  if (!t->row_of || !t->key_of || !t->prev || !t->next || !t->touched || !t->jobs || !t->workers) {
    t->threads = 0, *err = ENOMEM;
    edgemoe_ram_tier_close(t);
    return NULL;
  }
  for (int64_t k = 0; k < layers * experts; ++k) t->row_of[k] = -1;
  t->head = t->tail = -1;
  for (int64_t r = 0; r < rows; ++r) t->key_of[r] = -1, push_back(t, r);
  pthread_mutex_init(&t->lock, NULL), pthread_cond_init(&t->work, NULL), pthread_cond_init(&t->done, NULL);
  for (int i = 0; i < threads; ++i)
    if (pthread_create(&t->workers[i], NULL, reader, t)) {
      t->threads = i, *err = EAGAIN;
      edgemoe_ram_tier_close(t);
      return NULL;
    }
  *err = 0;
  return t;
}

static int store_changed(ram_tier *t) {
  struct stat now;
  if (fstat(t->fd, &now)) return errno;
  if (now.st_size != t->opened.st_size || now.st_mtim.tv_sec != t->opened.st_mtim.tv_sec ||
      now.st_mtim.tv_nsec != t->opened.st_mtim.tv_nsec)
    return ESTALE;
  return 0;
}

/* Experts `experts[0..n)` of `layer` made resident: addrs[j] the address of experts[j]'s row. Returns 0 or an errno
 * (EINVAL: a layer, an expert or more experts than rows out of range; else a read's), then also sticky. */
int edgemoe_ram_tier_fetch(ram_tier *t, int64_t layer, const int64_t *experts, int64_t n, uint64_t *addrs) {
  if (t->error) return t->error;
  if (layer < 0 || layer >= t->layers || n < 0 || n > t->rows || n > t->experts) return EINVAL;
  for (int64_t j = 0; j < n; ++j)
    if (experts[j] < 0 || experts[j] >= t->experts) return EINVAL;
  int64_t call = ++t->calls, queued = 0;
  for (int64_t j = 0; j < n; ++j) { /* hits first: touched, so no miss of this call evicts them */
    int64_t r = t->row_of[layer * t->experts + experts[j]];
    if (r >= 0) unlink_row(t, r), push_front(t, r), t->touched[r] = call;
  }
  for (int64_t j = 0; j < n; ++j) {
    int64_t key = layer * t->experts + experts[j], r = t->row_of[key];
    t->accesses += 1;
    if (r >= 0) {
      t->hits += 1;
      addrs[j] = (uint64_t)(uintptr_t)(t->pool + r * t->stride);
      continue;
    }
    r = t->tail; /* untouched by this call: n <= rows, and every row this call touched went to the front */
    if (t->key_of[r] >= 0) t->row_of[t->key_of[r]] = -1;
    t->key_of[r] = key, t->row_of[key] = r, t->touched[r] = call;
    unlink_row(t, r), push_front(t, r);
    read_job *job = &t->jobs[queued++];
    job->dst = t->pool + r * t->stride, job->bytes = t->read_bytes, job->row = r, job->key = key;
    job->offset = t->data_offset + key * t->stride;
    addrs[j] = (uint64_t)(uintptr_t)job->dst;
  }
  if (!queued) return 0;
  int64_t start = now_ns();
  int err = store_changed(t);
  if (!err) {
    if (queued == 1) {
      read_one(t, &t->jobs[0]);
    } else {
      pthread_mutex_lock(&t->lock);
      t->queued = queued, t->taken = t->finished = 0;
      pthread_cond_broadcast(&t->work);
      while (t->finished < queued) pthread_cond_wait(&t->done, &t->lock);
      t->queued = t->taken = t->finished = 0;
      pthread_mutex_unlock(&t->lock);
    }
  }
  for (int64_t q = 0; q < queued; ++q) {
    read_job *job = &t->jobs[q];
    if (err || job->err) { /* nothing is served from this row: it is freed, to the back */
      err = err ? err : job->err;
      t->row_of[job->key] = -1, t->key_of[job->row] = -1;
      unlink_row(t, job->row), push_back(t, job->row);
    } else {
      t->reads += 1, t->bytes_read += t->row_bytes;
    }
  }
  t->read_ns += now_ns() - start;
  if (err) t->error = err;
  return err;
}

/* accesses, hits, reads, bytes read, ns spent reading, whether reads bypass the page cache, the sticky error */
void edgemoe_ram_tier_stats(const ram_tier *t, int64_t *out) {
  out[0] = t->accesses, out[1] = t->hits, out[2] = t->reads, out[3] = t->bytes_read, out[4] = t->read_ns;
  out[5] = t->direct, out[6] = t->error;
}

/* Forget every resident expert (rows kept), and the counters. */
void edgemoe_ram_tier_reset(ram_tier *t) {
  for (int64_t k = 0; k < t->layers * t->experts; ++k) t->row_of[k] = -1;
  t->head = t->tail = -1;
  for (int64_t r = 0; r < t->rows; ++r) t->key_of[r] = -1, t->touched[r] = 0, push_back(t, r);
  t->accesses = t->hits = t->reads = t->bytes_read = t->read_ns = 0;
}

/* The RAM row of (layer, expert), -1 absent: what the tests compare with a reference. */
int64_t edgemoe_ram_tier_row(const ram_tier *t, int64_t layer, int64_t expert) {
  if (layer < 0 || layer >= t->layers || expert < 0 || expert >= t->experts) return -1;
  return t->row_of[layer * t->experts + expert];
}
