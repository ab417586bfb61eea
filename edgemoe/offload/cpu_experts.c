/* The CPU expert executor: the host computes routed experts of (token, expert) pairs straight from a host bank.
 *
 * For the P pairs of one MoE layer, y_p = down_e @ (act(gate_e @ x_t) * (up_e @ x_t)): fp32 [P, H], unweighted (the
 * GPU applies the routing weights and sums in its own fixed order). Weights are dequantized to fp32 as they are read
 * and activations are never quantized, so the result is the fp32 reference's but for the order of the sums
 * (cpu_experts_kernels.h: the dot kernels, one per format and ISA). Expert biases (gpt-oss), where the job has them,
 * are added to gate and up before the activation and to y_p.
 *
 * Work split: pairs are grouped by expert, up to MAXX pairs a group, which share each read of a weight row. Phase 1
 * hands out items of whole gate/up rows of every group (a dot product is never split along K, so each output is one
 * thread's sum in an order the ISA alone fixes: bitwise the same at any thread count); phase 2 hands out the down
 * rows once every phase-1 item is done. A persistent pool: `threads - 1` pthreads (not OpenMP: torch ships its own
 * libgomp) and the calling thread, which works too. Between jobs a worker spins for SPIN_NS (the next layer's job
 * comes soon), then sleeps. `edgemoe_cpu_experts_run` needs no Python, so a C loop (copy_service.c's) can call it;
 * calls on one pool take turns.
 *
 * Built and loaded by edgemoe/offload/cpu_experts.py (-O3 -march=native: on the machine that runs it).
 */
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

#include "cpu_experts_job.h"
#include "cpu_experts_kernels.h"

enum { ACT_SILU = 0, ACT_GELU_TANH = 1, ACT_SWIGLU_OAI = 2 };
enum { BAD_FORMAT = 1, BAD_SHAPE = 2, BAD_INDEX = 3, NO_MEMORY = 4, BAD_ACT = 5 }; /* run's errors (0: none) */

#define ITEM_BYTES (64 << 10) /* weight bytes of one work item: enough to amortise claiming it */
#define SPIN_NS 100000        /* a worker's spin before it sleeps */
#define PREFETCH_BYTES 2048   /* how far ahead of its row a thread prefetches, at least a row */

INLINE void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

/* ---- the job and the pool ---- */

typedef struct {
  int64_t expert, n, pairs[MAXX];
} group;

typedef struct {
  int64_t expert, pair;
} pair_key;

typedef struct { /* one run, as the threads share it */
  const edgemoe_cpu_job *job;
  const format *gu, *down;
  int64_t gu_bytes, down_bytes;  /* one gate (or up) row, one down row */
  int64_t rows1, rows2;          /* rows of an item: gate/up row pairs (phase 1), down rows (phase 2) */
  int64_t per1, per2;            /* items a group */
  int64_t items1, items2;
  const group *groups;
  float *h;                      /* [pairs, inter]: act(gate) * up */
  atomic_llong next1, next2, done1;
} run_state;

typedef struct {
  int threads; /* the caller included */
  pthread_t *workers;
  pthread_mutex_t lock, run_lock;
  pthread_cond_t wake;
  atomic_ullong generation; /* bumped (under lock) for each run and for the stop */
  atomic_llong checked_out; /* workers done with the current run */
  atomic_int stop;
  run_state state;
  pair_key *keys; /* scratch kept between runs */
  group *groups;
  float *h;
  int64_t pair_capacity, h_capacity;
} edgemoe_cpu_pool;

static int64_t now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* Spin until *value >= target, yielding once it takes long (more threads than cores: the tests use 3 on 2). */
static void await_count(atomic_llong *value, int64_t target) {
  for (int spins = 0; atomic_load_explicit(value, memory_order_acquire) < target; ++spins) {
    if (spins < 4096) cpu_relax();
    else sched_yield();
  }
}

/* The down projection's input from a pair's gate and up sums (biases added): act(gate) * up, or gpt-oss's clamped
 * SwiGLU (edgemoe.layers.mlp.swiglu_oai: gate clamped above at 7, up at +-7, (up + 1) gate sigmoid(1.702 gate)). */
static float glu(int act, float g, float u) {
  if (act == ACT_SILU) return g / (1.0f + expf(-g)) * u;
  if (act == ACT_SWIGLU_OAI) {
    g = g < 7.0f ? g : 7.0f;
    u = u < -7.0f ? -7.0f : (u > 7.0f ? 7.0f : u);
    return (u + 1.0f) * (g / (1.0f + expf(-1.702f * g)));
  }
  return 0.5f * g * (1.0f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g))) * u; /* torch's tanh GELU */
}

/* Rows are read a row or two ahead: a thread streams two rows at a time (gate and up) across many 4 KiB pages, which
 * the hardware prefetchers ramp up on too late (from DRAM: Q8_0 +40 %, Q4_K +20 %, bf16 +5 %; NTA hints lost half). */
static inline void prefetch_row(const uint8_t *row, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(row + o, 0, 3);
}
static inline int64_t ahead(int64_t row_bytes) { return (PREFETCH_BYTES + row_bytes - 1) / row_bytes; }

static void gate_up_item(const run_state *s, int64_t item) {
  const edgemoe_cpu_job *j = s->job;
  const group *g = &s->groups[item / s->per1];
  int64_t r0 = item % s->per1 * s->rows1, r1 = r0 + s->rows1 < j->inter ? r0 + s->rows1 : j->inter;
  const uint8_t *rows = j->bank + g->expert * j->row_stride;
  const float *xs[MAXX];
  for (int k = 0; k < g->n; ++k) xs[k] = j->x + j->token_ids[g->pairs[k]] * j->hidden;
  int64_t a = ahead(s->gu_bytes);
  for (int64_t r = r0; r < r1; ++r) {
    float gate[MAXX], up[MAXX];
    if (r + a < j->inter) /* within the expert's rows */
      prefetch_row(rows + (r + a) * s->gu_bytes, s->gu_bytes),
          prefetch_row(rows + (j->inter + r + a) * s->gu_bytes, s->gu_bytes);
    s->gu->dot(rows + r * s->gu_bytes, j->hidden, xs, (int)g->n, gate);
    s->gu->dot(rows + (j->inter + r) * s->gu_bytes, j->hidden, xs, (int)g->n, up);
    if (j->gate_up_bias) {
      const float *b = j->gate_up_bias + g->expert * 2 * j->inter;
      for (int k = 0; k < g->n; ++k) gate[k] += b[r], up[k] += b[j->inter + r];
    }
    for (int k = 0; k < g->n; ++k) s->h[g->pairs[k] * j->inter + r] = glu(j->act, gate[k], up[k]);
  }
}

static void down_item(const run_state *s, int64_t item) {
  const edgemoe_cpu_job *j = s->job;
  const group *g = &s->groups[item / s->per2];
  int64_t r0 = item % s->per2 * s->rows2, r1 = r0 + s->rows2 < j->hidden ? r0 + s->rows2 : j->hidden;
  const uint8_t *rows = j->bank + g->expert * j->row_stride + j->down_offset;
  const float *hs[MAXX];
  for (int k = 0; k < g->n; ++k) hs[k] = s->h + g->pairs[k] * j->inter;
  int64_t a = ahead(s->down_bytes);
  for (int64_t r = r0; r < r1; ++r) {
    float y[MAXX];
    if (r + a < j->hidden) prefetch_row(rows + (r + a) * s->down_bytes, s->down_bytes);
    s->down->dot(rows + r * s->down_bytes, j->inter, hs, (int)g->n, y);
    float b = j->down_bias ? j->down_bias[g->expert * j->hidden + r] : 0.0f;
    for (int k = 0; k < g->n; ++k) j->out[g->pairs[k] * j->hidden + r] = y[k] + b;
  }
}

/* What every thread does in a run: claim phase-1 items, wait until all are done (h complete), claim phase-2 items. */
static void work(run_state *s) {
  for (int64_t i; (i = atomic_fetch_add(&s->next1, 1)) < s->items1;) {
    gate_up_item(s, i);
    atomic_fetch_add_explicit(&s->done1, 1, memory_order_release);
  }
  await_count(&s->done1, s->items1);
  for (int64_t i; (i = atomic_fetch_add(&s->next2, 1)) < s->items2;) down_item(s, i);
}

/* The next generation after `seen`: spin for SPIN_NS, then sleep until the caller bumps it. */
static uint64_t await_run(edgemoe_cpu_pool *p, uint64_t seen) {
  int64_t until = now_ns() + SPIN_NS;
  for (int i = 1;; ++i) {
    uint64_t g = atomic_load_explicit(&p->generation, memory_order_acquire);
    if (g != seen) return g;
    if (i % 64 == 0 && now_ns() > until) break;
    cpu_relax();
  }
  pthread_mutex_lock(&p->lock);
  while (atomic_load(&p->generation) == seen) pthread_cond_wait(&p->wake, &p->lock);
  uint64_t g = atomic_load(&p->generation);
  pthread_mutex_unlock(&p->lock);
  return g;
}

static void *worker(void *arg) {
  edgemoe_cpu_pool *p = arg;
  for (uint64_t seen = 0;;) {
    seen = await_run(p, seen);
    if (atomic_load(&p->stop)) return NULL;
    work(&p->state);
    atomic_fetch_add_explicit(&p->checked_out, 1, memory_order_release);
  }
}

static void bump_generation(edgemoe_cpu_pool *p) {
  pthread_mutex_lock(&p->lock); /* a worker between its last check and its wait cannot miss the bump */
  atomic_fetch_add_explicit(&p->generation, 1, memory_order_release);
  pthread_cond_broadcast(&p->wake);
  pthread_mutex_unlock(&p->lock);
}

/* ---- the C API ---- */

const char *edgemoe_cpu_experts_isa(void) { return ISA; }

int edgemoe_cpu_experts_threads(const edgemoe_cpu_pool *p) { return p->threads; }

void edgemoe_cpu_experts_destroy(edgemoe_cpu_pool *p) {
  if (!p) return;
  atomic_store(&p->stop, 1);
  bump_generation(p);
  for (int i = 0; i < p->threads - 1; ++i) pthread_join(p->workers[i], NULL);
  pthread_cond_destroy(&p->wake);
  pthread_mutex_destroy(&p->lock);
  pthread_mutex_destroy(&p->run_lock);
  free(p->workers), free(p->keys), free(p->groups), free(p->h), free(p);
}

/* A pool of `threads` (>= 1, the caller included), or NULL. */
edgemoe_cpu_pool *edgemoe_cpu_experts_create(int threads) {
  if (threads < 1) return NULL;
  edgemoe_cpu_pool *p = calloc(1, sizeof(*p));
  if (!p) return NULL;
  p->workers = calloc((size_t)threads, sizeof(pthread_t));
  pthread_mutex_init(&p->lock, NULL);
  pthread_mutex_init(&p->run_lock, NULL);
  pthread_cond_init(&p->wake, NULL);
  if (!p->workers) {
    edgemoe_cpu_experts_destroy(p);
    return NULL;
  }
  for (p->threads = 1; p->threads < threads; ++p->threads)
    if (pthread_create(&p->workers[p->threads - 1], NULL, worker, p)) break;
  if (p->threads < threads) { /* no threads, or fewer than asked: give back what started */
    edgemoe_cpu_experts_destroy(p);
    return NULL;
  }
  return p;
}

static int check_job(const edgemoe_cpu_job *j, const format **gu, const format **down) {
  *gu = find_format(j->gate_up_format), *down = find_format(j->down_format);
  if (!*gu || !*down) return BAD_FORMAT;
  if (j->act != ACT_SILU && j->act != ACT_GELU_TANH && j->act != ACT_SWIGLU_OAI) return BAD_ACT;
  if (!j->gate_up_bias != !j->down_bias) return BAD_SHAPE;
  if (j->hidden <= 0 || j->inter <= 0 || j->pairs < 0 || j->hidden % (*gu)->block_weights ||
      j->inter % (*down)->block_weights)
    return BAD_SHAPE;
  int64_t gu_end = 2 * j->inter * (j->hidden / (*gu)->block_weights * (*gu)->block_bytes);
  int64_t down_end = j->down_offset + j->hidden * (j->inter / (*down)->block_weights * (*down)->block_bytes);
  if (j->down_offset < gu_end || down_end > j->row_stride) return BAD_SHAPE;
  if (j->pairs && (!j->x || !j->bank || !j->out || !j->token_ids || !j->expert_ids)) return BAD_SHAPE;
  for (int64_t i = 0; i < j->pairs; ++i)
    if (j->token_ids[i] < 0 || j->token_ids[i] >= j->tokens || j->expert_ids[i] < 0 || j->expert_ids[i] >= j->experts)
      return BAD_INDEX;
  return 0;
}

static int by_expert(const void *a, const void *b) {
  const pair_key *u = a, *v = b;
  if (u->expert != v->expert) return (u->expert > v->expert) - (u->expert < v->expert);
  return (u->pair > v->pair) - (u->pair < v->pair);
}

/* Scratch for `pairs` pairs of `inter`, kept for the next runs. */
static int reserve(edgemoe_cpu_pool *p, int64_t pairs, int64_t inter) {
  if (pairs > p->pair_capacity) {
    free(p->keys), free(p->groups);
    p->keys = malloc((size_t)pairs * sizeof(pair_key)), p->groups = malloc((size_t)pairs * sizeof(group));
    p->pair_capacity = p->keys && p->groups ? pairs : 0;
    if (!p->pair_capacity) return NO_MEMORY;
  }
  if (pairs * inter > p->h_capacity) {
    free(p->h);
    p->h = malloc((size_t)(pairs * inter) * sizeof(float));
    p->h_capacity = p->h ? pairs * inter : 0;
    if (!p->h) return NO_MEMORY;
  }
  return 0;
}

/* The run's state: pairs grouped by expert (sorted, at most MAXX a group), items of about ITEM_BYTES. */
static void plan(edgemoe_cpu_pool *p, const edgemoe_cpu_job *j, const format *gu, const format *down) {
  for (int64_t i = 0; i < j->pairs; ++i) p->keys[i] = (pair_key){j->expert_ids[i], i};
  qsort(p->keys, (size_t)j->pairs, sizeof(pair_key), by_expert);
  int64_t n = 0;
  for (int64_t i = 0; i < j->pairs; ++i) {
    if (i == 0 || p->keys[i].expert != p->groups[n - 1].expert || p->groups[n - 1].n == MAXX)
      p->groups[n++] = (group){.expert = p->keys[i].expert, .n = 0};
    p->groups[n - 1].pairs[p->groups[n - 1].n++] = p->keys[i].pair;
  }
  run_state *s = &p->state;
  s->job = j, s->gu = gu, s->down = down, s->groups = p->groups, s->h = p->h;
  s->gu_bytes = j->hidden / gu->block_weights * gu->block_bytes;
  s->down_bytes = j->inter / down->block_weights * down->block_bytes;
  s->rows1 = ITEM_BYTES / (2 * s->gu_bytes) > 1 ? ITEM_BYTES / (2 * s->gu_bytes) : 1;
  s->rows2 = ITEM_BYTES / s->down_bytes > 1 ? ITEM_BYTES / s->down_bytes : 1;
  s->per1 = (j->inter + s->rows1 - 1) / s->rows1, s->per2 = (j->hidden + s->rows2 - 1) / s->rows2;
  s->items1 = n * s->per1, s->items2 = n * s->per2;
  atomic_store(&s->next1, 0), atomic_store(&s->next2, 0), atomic_store(&s->done1, 0);
}

/* Compute job's pairs into job->out with the pool's threads and the caller's. Returns 0, or one of BAD_FORMAT,
 * BAD_SHAPE, BAD_INDEX, NO_MEMORY, BAD_ACT (nothing written then). Thread-safe: runs on one pool take turns. */
int edgemoe_cpu_experts_run(edgemoe_cpu_pool *p, const edgemoe_cpu_job *j) {
  const format *gu, *down;
  int err = check_job(j, &gu, &down);
  if (err || j->pairs == 0) return err;
  pthread_mutex_lock(&p->run_lock);
  err = reserve(p, j->pairs, j->inter);
  if (!err) {
    plan(p, j, gu, down);
    atomic_store(&p->checked_out, 0);
    if (p->threads > 1) bump_generation(p);
    work(&p->state);
    await_count(&p->checked_out, p->threads - 1); /* the workers read the state until they check out */
  }
  pthread_mutex_unlock(&p->run_lock);
  return err;
}
