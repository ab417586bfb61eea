/* The RAM tier of the routed experts: a fixed number of host rows (pinned on CUDA) caching experts read from files on
 * disk, least recently used evicted first.
 *
 * Where each expert lies on disk is a table of segments, `per_row` an expert (edgemoe/offload/ram_tier.py builds it):
 * (file, offset, bytes, offset in the row), a segment of file -1 being zeros. The expert store
 * (edgemoe/offload/expert_store.py) is one segment a row: the whole row, 4 KiB-aligned. A GGUF file read in place
 * (edgemoe/offload/in_place.py) is one segment a weight (gate, up, down), each at whatever offset the file put it.
 *
 * `edgemoe_ram_tier_fetch` makes a list of one layer's experts resident in RAM and returns their rows' addresses:
 * hits are touched, each miss takes the least recently used row not touched by this call and is read into it, the
 * reads of one call in flight at once on a pool of reader threads (a deep queue: one job an expert, each read split by
 * the kernel into requests of the drive's size), with O_DIRECT where the file system allows it (no second copy of the
 * experts in the page cache; otherwise buffered reads, each range dropped from the page cache after it is read).
 * O_DIRECT needs 4 KiB-aligned offsets, lengths and buffers: a segment that is not aligned so is read as its aligned
 * superset, in pieces of at most BOUNCE bytes, into the reader's own bounce buffer, and its bytes moved into the row.
 *
 * Why no locking against a row being overwritten while the copy engine still reads it: its callers (the copy
 * service's serve loop, `edgemoe.offload.ram_tier.RamTier.fetch` in eager steps) only fetch once every copy from an
 * earlier fetch has landed: the GPU waits for each posted list's copies before it posts the next, and an eager step
 * synchronises before each fetch. One thread calls at a time.
 *
 * A read that fails or comes back short (a file truncated), or a file whose size or modification time changed since
 * it was opened, is an error code (errno); the rows whose reads failed are freed, so nothing is served from them, and
 * the error is sticky (every later call returns it).
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
#define BOUNCE (4 << 20) /* the most bytes of one unaligned read */

typedef struct {
  int64_t file, offset, bytes, at; /* file -1: `bytes` zeros at `at` */
} segment;

typedef struct {
  int fd, direct;
  struct stat opened; /* the file as it was opened: size and modification time, checked before each call's reads */
} source_file;

typedef struct {
  uint8_t *dst;
  int64_t row, key;
  int err;
} read_job;

typedef struct ram_tier ram_tier;

typedef struct {
  ram_tier *tier;
  uint8_t *bounce; /* [bounce_bytes], aligned */
} reader_state;

struct ram_tier {
  source_file *files;
  int64_t nfiles;
  segment *segments; /* [layers * experts, per_row] */
  int64_t per_row, bounce_bytes;
  int64_t layers, experts, rows;
  int64_t row_bytes, stride;
  uint8_t *pool;        /* [rows, stride] */
  int64_t *row_of;      /* [layers * experts]: the RAM row of each expert, -1 absent */
  int64_t *key_of;      /* [rows]: layer * experts + expert held, -1 free */
  int64_t *prev, *next; /* the LRU list over rows: head most recent, tail least */
  int64_t head, tail;
  int64_t *touched; /* [rows]: the fetch call that last touched each row */
  int64_t calls;
  int64_t accesses, hits, reads, bytes_read, read_ns;
  int error;
  /* the readers: `threads` workers, then the calling thread's own state (a call with one read reads it itself) */
  int threads, stop;
  pthread_t *workers;
  reader_state *states; /* [nstates]: threads + 1 */
  int nstates;
  pthread_mutex_t lock;
  pthread_cond_t work, done;
  read_job *jobs;
  int64_t queued, taken, finished;
};

static int64_t now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static int aligned(int64_t x) { return x % ALIGN == 0; }

/* `need` bytes (at least) of the `len` at `offset` into `dst`. A read that ends short of `need` is EIO (0: past the
 * end of a truncated file; with O_DIRECT, an unaligned count: the file ends there). */
static int read_range(const source_file *f, uint8_t *dst, int64_t len, int64_t offset, int64_t need) {
  int64_t got = 0;
  while (got < need) {
    ssize_t r = pread(f->fd, dst + got, (size_t)(len - got), (off_t)(offset + got));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return r < 0 ? errno : EIO;
    got += r;
    if (f->direct && got < need && !aligned(got)) return EIO;
  }
  if (!f->direct) posix_fadvise(f->fd, (off_t)offset, (off_t)len, POSIX_FADV_DONTNEED);
  return 0;
}

/* Whether segment `s` of a file is read through a bounce buffer: O_DIRECT, and not aligned where it is and goes. */
static int bounced(const ram_tier *t, const segment *s) {
  return t->files[s->file].direct && !(aligned(s->offset) && aligned(s->bytes) && aligned(s->at));
}

static int read_segment(ram_tier *t, const segment *s, uint8_t *row, uint8_t *bounce) {
  if (s->file < 0) {
    memset(row + s->at, 0, (size_t)s->bytes);
    return 0;
  }
  const source_file *f = &t->files[s->file];
  if (!bounced(t, s)) return read_range(f, row + s->at, s->bytes, s->offset, s->bytes);
  for (int64_t done = 0; done < s->bytes;) { /* O_DIRECT, unaligned: through the bounce buffer */
    int64_t from = s->offset + done, start = from / ALIGN * ALIGN, skip = from - start;
    int64_t take = s->bytes - done < t->bounce_bytes - skip ? s->bytes - done : t->bounce_bytes - skip;
    int64_t span = (skip + take + ALIGN - 1) / ALIGN * ALIGN;
    int err = read_range(f, bounce, span, start, skip + take);
    if (err) return err;
    memcpy(row + s->at + done, bounce + skip, (size_t)take);
    done += take;
  }
  return 0;
}

static void read_one(ram_tier *t, read_job *j, uint8_t *bounce) {
  const segment *s = t->segments + j->key * t->per_row;
  j->err = 0;
  for (int64_t i = 0; i < t->per_row && !j->err; ++i)
    if (s[i].bytes > 0) j->err = read_segment(t, &s[i], j->dst, bounce);
}

static void *reader(void *arg) {
  reader_state *me = arg;
  ram_tier *t = me->tier;
  pthread_mutex_lock(&t->lock);
  for (;;) {
    while (!t->stop && t->taken == t->queued) pthread_cond_wait(&t->work, &t->lock);
    if (t->stop) break;
    read_job *j = &t->jobs[t->taken++];
    pthread_mutex_unlock(&t->lock);
    read_one(t, j, me->bounce);
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
  for (int64_t i = 0; t->files && i < t->nfiles; ++i)
    if (t->files[i].fd >= 0) close(t->files[i].fd);
  for (int i = 0; t->states && i < t->nstates; ++i) free(t->states[i].bounce);
  free(t->files), free(t->segments), free(t->states);
  free(t->workers), free(t->jobs), free(t->row_of), free(t->key_of), free(t->prev), free(t->next), free(t->touched);
  free(t);
}

/* Opens `nfiles` files: each with O_DIRECT where its file system allows it. 0 or an errno. */
static int open_files(ram_tier *t, const char **paths) {
  for (int64_t i = 0; i < t->nfiles; ++i) {
    source_file *f = &t->files[i];
    f->fd = open(paths[i], O_RDONLY | O_DIRECT | O_CLOEXEC);
    f->direct = f->fd >= 0;
    if (f->fd < 0) f->fd = open(paths[i], O_RDONLY | O_CLOEXEC); /* a file system without O_DIRECT (tmpfs) */
    if (f->fd < 0 || fstat(f->fd, &f->opened)) return errno;
    if (!f->direct) posix_fadvise(f->fd, 0, 0, POSIX_FADV_RANDOM);
  }
  return 0;
}

/* The tier over the experts that `segments` ([layers * experts, per_row] of (file, offset, bytes, offset in the row))
 * place in `nfiles` files, in `rows` rows of `pool` (stride bytes apart, aligned to 4 KiB); `threads` readers. NULL
 * with *err set (errno) when a file cannot be opened or the arguments do not fit. */
ram_tier *edgemoe_ram_tier_open(const char **paths, int64_t nfiles, const int64_t *segments, int64_t per_row,
                                int64_t layers, int64_t experts, int64_t row_bytes, int64_t stride, uint8_t *pool,
                                int64_t rows, int threads, int *err) {
  *err = EINVAL;
  if (nfiles < 1 || per_row < 1 || layers < 1 || experts < 1 || rows < 1 || row_bytes < 1 || row_bytes > stride ||
      !aligned(stride) || (uintptr_t)pool % ALIGN || threads < 1)
    return NULL;
  int64_t keys = layers * experts, longest = 0;
  const segment *given = (const segment *)segments;
  for (int64_t i = 0; i < keys * per_row; ++i) {
    const segment *s = &given[i];
    if (s->file < -1 || s->file >= nfiles || s->bytes < 0 || s->at < 0 || s->at + s->bytes > stride ||
        (s->file >= 0 && s->offset < 0))
      return NULL;
  }
  ram_tier *t = calloc(1, sizeof(ram_tier));
  if (!t) return *err = ENOMEM, NULL;
  t->nfiles = nfiles, t->files = calloc(nfiles, sizeof(source_file));
  if (t->files)
    for (int64_t i = 0; i < nfiles; ++i) t->files[i].fd = -1;
  int opened = t->files ? open_files(t, paths) : ENOMEM;
  if (opened) {
    *err = opened;
    edgemoe_ram_tier_close(t);
    return NULL;
  }
  t->layers = layers, t->experts = experts, t->rows = rows, t->row_bytes = row_bytes, t->stride = stride;
  t->pool = pool, t->threads = threads, t->per_row = per_row;
  for (int64_t i = 0; i < keys * per_row; ++i)
    if (given[i].file >= 0 && given[i].bytes > longest && bounced(t, &given[i])) longest = given[i].bytes;
  /* the longest bounced segment's aligned superset, at most BOUNCE; none where no segment is bounced (the store) */
  t->bounce_bytes = longest ? (longest + 2 * ALIGN - 1) / ALIGN * ALIGN : 0;
  if (t->bounce_bytes > BOUNCE) t->bounce_bytes = BOUNCE;
  t->segments = malloc(sizeof(segment) * keys * per_row);
  t->row_of = malloc(sizeof(int64_t) * keys), t->key_of = malloc(sizeof(int64_t) * rows);
  t->prev = malloc(sizeof(int64_t) * rows), t->next = malloc(sizeof(int64_t) * rows);
  t->touched = calloc(rows, sizeof(int64_t)), t->jobs = malloc(sizeof(read_job) * experts);
  t->workers = calloc(threads, sizeof(pthread_t)), t->states = calloc(threads + 1, sizeof(reader_state));
  t->nstates = t->states ? threads + 1 : 0;
  int ok = t->segments && t->row_of && t->key_of && t->prev && t->next && t->touched && t->jobs && t->workers &&
           t->states;
  for (int i = 0; ok && i <= threads; ++i) {
    t->states[i].tier = t;
    ok = !t->bounce_bytes || !posix_memalign((void **)&t->states[i].bounce, ALIGN, (size_t)t->bounce_bytes);
  }
  if (!ok) {
    t->threads = 0, *err = ENOMEM;
    edgemoe_ram_tier_close(t);
    return NULL;
  }
  memcpy(t->segments, given, sizeof(segment) * keys * per_row);
  for (int64_t k = 0; k < keys; ++k) t->row_of[k] = -1;
  t->head = t->tail = -1;
  for (int64_t r = 0; r < rows; ++r) t->key_of[r] = -1, push_back(t, r);
  pthread_mutex_init(&t->lock, NULL), pthread_cond_init(&t->work, NULL), pthread_cond_init(&t->done, NULL);
  for (int i = 0; i < threads; ++i)
    if (pthread_create(&t->workers[i], NULL, reader, &t->states[i])) {
      t->threads = i, *err = EAGAIN;
      edgemoe_ram_tier_close(t);
      return NULL;
    }
  *err = 0;
  return t;
}

static int files_changed(ram_tier *t) {
  for (int64_t i = 0; i < t->nfiles; ++i) {
    struct stat now, *was = &t->files[i].opened;
    if (fstat(t->files[i].fd, &now)) return errno;
    if (now.st_size != was->st_size || now.st_mtim.tv_sec != was->st_mtim.tv_sec ||
        now.st_mtim.tv_nsec != was->st_mtim.tv_nsec)
      return ESTALE;
  }
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
    job->dst = t->pool + r * t->stride, job->row = r, job->key = key;
    addrs[j] = (uint64_t)(uintptr_t)job->dst;
  }
  if (!queued) return 0;
  int64_t start = now_ns();
  int err = files_changed(t);
  if (!err) {
    if (queued == 1) {
      read_one(t, &t->jobs[0], t->states[t->threads].bounce);
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

/* accesses, hits, reads, bytes read (a row's each), ns spent reading, whether every read bypasses the page cache, the
 * sticky error */
void edgemoe_ram_tier_stats(const ram_tier *t, int64_t *out) {
  int direct = 1;
  for (int64_t i = 0; i < t->nfiles; ++i) direct &= t->files[i].direct;
  out[0] = t->accesses, out[1] = t->hits, out[2] = t->reads, out[3] = t->bytes_read, out[4] = t->read_ns;
  out[5] = direct, out[6] = t->error;
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
