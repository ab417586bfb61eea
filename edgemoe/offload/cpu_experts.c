/* The CPU expert executor: the host computes routed experts of (token, expert) pairs straight from a host bank.
 *
 * For the P pairs of one MoE layer, y_p = down_e @ (act(gate_e @ x_t) * (up_e @ x_t)): fp32 [P, H], unweighted (the
 * GPU applies the routing weights and sums in its own fixed order). Weights are dequantized to fp32 as they are read,
 * to the values of gguf's numpy dequantization (built with -ffp-contract=off, so the code's roundings are the ones
 * computed), and multiplied with fp32 activations, which are never quantized: the result is the fp32 reference's
 * within the rounding of a different summation order.
 *
 * Work split: pairs are grouped by expert, up to MAXX pairs a group, which share each read of a weight row. Phase 1
 * hands out items of whole gate/up rows of every group (a dot product is never split along K, so each output is one
 * thread's sum in an order the ISA alone fixes: bitwise the same at any thread count); phase 2 hands out the down
 * rows once every phase-1 item is done. A persistent pool: `threads - 1` pthreads (not OpenMP: torch ships its own
 * libgomp) and the calling thread, which works too. Between jobs a worker spins for SPIN_NS (the next layer's job
 * comes soon), then sleeps. `edgemoe_cpu_experts_run` needs no Python, so a C loop (copy_service.c's) can call it;
 * calls on one pool are serialised.
 *
 * The ISA layer (vf: W fp32 lanes, vb: W bytes) is chosen by the compiler's macros: AVX-512 F + BW, else AVX2 + FMA
 * + F16C, else plain C. Each format's dot kernel is written once over that layer, so there is one kernel per format
 * per ISA. Built and loaded by edgemoe/offload/cpu_experts.py (-O3 -march=native: on the machine that runs it).
 */
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* formats: GGML type ids (edgemoe.layers.quant.QuantType.ggml_type) */
enum { F32 = 0, F16 = 1, Q4_0 = 2, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14, BF16 = 30, MXFP4 = 39 };
enum { ACT_SILU = 0, ACT_GELU_TANH = 1 };
enum { BAD_FORMAT = 1, BAD_SHAPE = 2, BAD_INDEX = 3, NO_MEMORY = 4, BAD_ACT = 5 }; /* run's errors (0: none) */

#define MAXX 4                  /* pairs of one expert that share each read of a weight row */
#define NACC 4                  /* independent accumulators a pair: hide the FMA latency */
#define ITEM_BYTES (64 << 10)   /* weight bytes of one work item: enough to amortise claiming it */
#define SPIN_NS 100000          /* a worker's spin before it sleeps */
#define INLINE static inline __attribute__((always_inline))

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define ISA "avx512"
#define W 16
typedef __m512 vf;
typedef __m128i vb;
INLINE vf vzero(void) { return _mm512_setzero_ps(); }
INLINE vf vset(float a) { return _mm512_set1_ps(a); }
INLINE vf vload(const float *p) { return _mm512_loadu_ps(p); }
INLINE vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
INLINE vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
INLINE vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
INLINE vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
INLINE float vsum(vf a) { return _mm512_reduce_add_ps(a); }
INLINE vb vb_load(const uint8_t *p) { return _mm_loadu_si128((const __m128i *)p); }
INLINE vf vb_u8(vb b) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b)); }
INLINE vf vb_i8(vb b) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)); }
INLINE vf vb_e2m1(vb b) { /* nibbles -> doubled E2M1 values, gguf's table (its -0 is +0) */
  return _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(b),
                               _mm512_setr_ps(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12));
}
INLINE vf v_f32(const uint8_t *p) { return _mm512_loadu_ps((const float *)p); }
INLINE vf v_f16(const uint8_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
INLINE vf v_bf16(const uint8_t *p) { /* bf16 is fp32's top half (AVX512_BF16 only helps bf16 x bf16) */
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define ISA "avx2"
#define W 8
typedef __m256 vf;
typedef __m128i vb; /* the low W bytes */
INLINE vf vzero(void) { return _mm256_setzero_ps(); }
INLINE vf vset(float a) { return _mm256_set1_ps(a); }
INLINE vf vload(const float *p) { return _mm256_loadu_ps(p); }
INLINE vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
INLINE vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
INLINE vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
INLINE vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
INLINE float vsum(vf a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
INLINE vb vb_load(const uint8_t *p) { return _mm_loadl_epi64((const __m128i *)p); }
INLINE vf vb_u8(vb b) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)); }
INLINE vf vb_i8(vb b) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)); }
INLINE vf vb_e2m1(vb b) { /* a permute reads 8 entries: look up both halves, pick by the sign bit (bit 3) */
  __m256i q = _mm256_cvtepu8_epi32(b);
  __m256 pos = _mm256_permutevar8x32_ps(_mm256_setr_ps(0, 1, 2, 3, 4, 6, 8, 12), q);
  __m256 neg = _mm256_permutevar8x32_ps(_mm256_setr_ps(0, -1, -2, -3, -4, -6, -8, -12), q);
  return _mm256_blendv_ps(pos, neg, _mm256_castsi256_ps(_mm256_slli_epi32(q, 28)));
}
INLINE vf v_f32(const uint8_t *p) { return _mm256_loadu_ps((const float *)p); }
INLINE vf v_f16(const uint8_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
INLINE vf v_bf16(const uint8_t *p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
#else
#define ISA "scalar"
#define W 1
typedef float vf;
typedef uint32_t vb;
static const float E2M1[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
INLINE vf vzero(void) { return 0.0f; }
INLINE vf vset(float a) { return a; }
INLINE vf vload(const float *p) { return *p; }
INLINE vf vadd(vf a, vf b) { return a + b; }
INLINE vf vsub(vf a, vf b) { return a - b; }
INLINE vf vmul(vf a, vf b) { return a * b; }
INLINE vf vfma(vf a, vf b, vf c) { return a * b + c; }
INLINE float vsum(vf a) { return a; }
INLINE vb vb_load(const uint8_t *p) { return *p; }
INLINE vf vb_u8(vb b) { return (float)b; }
INLINE vf vb_i8(vb b) { return (float)(int8_t)b; }
INLINE vf vb_e2m1(vb b) { return E2M1[b]; }
INLINE vb vb_and(vb a, int m) { return a & (vb)m; }
INLINE vb vb_shr(vb a, int n) { return a >> n; }
INLINE vb vb_shl(vb a, int n) { return a << n; }
INLINE vb vb_or(vb a, vb b) { return a | b; }
INLINE float half(const uint8_t *p) { /* IEEE half -> float, without F16C */
  uint32_t h = (uint32_t)p[0] | (uint32_t)p[1] << 8, sign = (h & 0x8000u) << 16, e = (h >> 10) & 31, m = h & 1023;
  uint32_t bits = e == 31 ? sign | 0x7f800000u | m << 13 : sign | (e + 112) << 23 | m << 13;
  float f;
  if (e == 0) { /* zero or subnormal: m 2^-24, exact */
    f = (float)m * 0x1p-24f;
    return sign ? -f : f;
  }
  memcpy(&f, &bits, 4);
  return f;
}
#define v_f32 e_f32 /* one weight is a vector */
#define v_f16 e_f16
#define v_bf16 e_bf16
#endif

#if W > 1 /* byte ops of the two x86 layers: shifts act on 16-bit lanes, so a shift right is always masked after */
INLINE vb vb_and(vb a, int m) { return _mm_and_si128(a, _mm_set1_epi8((char)m)); }
INLINE vb vb_shr(vb a, int n) { return _mm_srl_epi16(a, _mm_cvtsi32_si128(n)); }
INLINE vb vb_shl(vb a, int n) { return _mm_sll_epi16(a, _mm_cvtsi32_si128(n)); } /* of values that fit their byte */
INLINE vb vb_or(vb a, vb b) { return _mm_or_si128(a, b); }
INLINE float half(const uint8_t *p) { return _cvtsh_ss((unsigned short)(p[0] | p[1] << 8)); }
#endif

/* one dense weight (the tails of rows whose length is no multiple of W) */
INLINE float e_f32(const uint8_t *p) {
  float f;
  memcpy(&f, p, 4);
  return f;
}
INLINE float e_f16(const uint8_t *p) { return half(p); }
INLINE float e_bf16(const uint8_t *p) {
  uint32_t bits = ((uint32_t)p[0] | (uint32_t)p[1] << 8) << 16;
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

INLINE void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

/* ---- dot kernels: one weight row against the nx (<= MAXX) activation rows xs, out[x] = sum_k w[k] xs[x][k] ---- */

typedef void (*dot_fn)(const uint8_t *row, int64_t K, const float *const *xs, int nx, float *out);
#define BLOCK_ARGS const float *const *xs, int64_t k, int nx, vf acc[][NACC], int slot

/* acc[x][slot] += w * xs[x][k .. k + W) */
INLINE void accumulate(vf acc[][NACC], const float *const *xs, int nx, vf w, int64_t k, int slot) {
  for (int x = 0; x < nx; ++x) acc[x][slot % NACC] = vfma(w, vload(xs[x] + k), acc[x][slot % NACC]);
}
INLINE void start(vf acc[][NACC], int nx) {
  for (int x = 0; x < nx; ++x)
    for (int a = 0; a < NACC; ++a) acc[x][a] = vzero();
}
INLINE void finish(vf acc[][NACC], int nx, float *out) {
  for (int x = 0; x < nx; ++x) out[x] = vsum(vadd(vadd(acc[x][0], acc[x][1]), vadd(acc[x][2], acc[x][3])));
}

/* Block decoders: one block of a row (its weights from x index k) accumulated. The layouts are edgemoe/layers/quant.py's
 * docstring's; each weight is computed as its `dequantize` computes it. */
INLINE void q8_0_block(const uint8_t *b, BLOCK_ARGS) { /* d q */
  vf d = vset(half(b));
  for (int i = 0; i < 32 / W; ++i) accumulate(acc, xs, nx, vmul(d, vb_i8(vb_load(b + 2 + i * W))), k + i * W, slot + i);
}
INLINE void q4_0_block(const uint8_t *b, BLOCK_ARGS) { /* d (q - 8); byte j: weights j (low nibble), j + 16 */
  vf d = vset(half(b)), eight = vset(8.0f);
  for (int i = 0; i < 16 / W; ++i) {
    vb q = vb_load(b + 2 + i * W);
    accumulate(acc, xs, nx, vmul(d, vsub(vb_u8(vb_and(q, 15)), eight)), k + i * W, slot + i);
    accumulate(acc, xs, nx, vmul(d, vsub(vb_u8(vb_and(vb_shr(q, 4), 15)), eight)), k + 16 + i * W, slot + 16 / W + i);
  }
}
INLINE void mxfp4_block(const uint8_t *b, BLOCK_ARGS) { /* 2^(e - 128) doubled-e2m1(q), nibbles as Q4_0 */
  uint32_t e = b[0], bits = e < 2 ? 0x00200000u << e : (e - 1) << 23; /* e < 2: a subnormal */
  float s;
  memcpy(&s, &bits, 4);
  vf scale = vset(s);
  for (int i = 0; i < 16 / W; ++i) {
    vb q = vb_load(b + 1 + i * W);
    accumulate(acc, xs, nx, vmul(scale, vb_e2m1(vb_and(q, 15))), k + i * W, slot + i);
    accumulate(acc, xs, nx, vmul(scale, vb_e2m1(vb_and(vb_shr(q, 4), 15))), k + 16 + i * W, slot + 16 / W + i);
  }
}
/* Q4_K / Q5_K: sub-block j's 6-bit scale and min from the 12 scale bytes s (quant.py's _k_scales) */
INLINE void k_scale(const uint8_t *s, int j, float d, float dmin, vf *ds, vf *dm) {
  int sc = j < 4 ? s[j] & 63 : (s[j + 4] & 15) | (s[j - 4] >> 6) << 4;
  int m = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | (s[j] >> 6) << 4;
  *ds = vset(d * (float)sc), *dm = vset(dmin * (float)m);
}
/* (d sc) q - (dmin m) for the quants of sub-blocks 2g (lo) and 2g + 1 (hi), W weights from l */
INLINE void k_pair(BLOCK_ARGS, const uint8_t *b, int g, int l, vb lo, vb hi, float d, float dmin) {
  vf ds, dm;
  k_scale(b + 4, 2 * g, d, dmin, &ds, &dm);
  accumulate(acc, xs, nx, vsub(vmul(ds, vb_u8(lo)), dm), k + 64 * g + l, slot + (64 * g + l) / W);
  k_scale(b + 4, 2 * g + 1, d, dmin, &ds, &dm);
  accumulate(acc, xs, nx, vsub(vmul(ds, vb_u8(hi)), dm), k + 64 * g + 32 + l, slot + (64 * g + 32 + l) / W);
}
INLINE void q4_k_block(const uint8_t *b, BLOCK_ARGS) { /* byte 16 + 32 g + l: weights 64 g + l (lo), + 32 (hi) */
  float d = half(b), dmin = half(b + 2);
  for (int g = 0; g < 4; ++g)
    for (int l = 0; l < 32; l += W) {
      vb q = vb_load(b + 16 + 32 * g + l);
      k_pair(xs, k, nx, acc, slot, b, g, l, vb_and(q, 15), vb_and(vb_shr(q, 4), 15), d, dmin);
    }
}
INLINE void q5_k_block(const uint8_t *b, BLOCK_ARGS) { /* Q4_K's nibbles at 48, fifth bits: bit j of byte 16 + l */
  float d = half(b), dmin = half(b + 2);
  for (int g = 0; g < 4; ++g)
    for (int l = 0; l < 32; l += W) {
      vb q = vb_load(b + 48 + 32 * g + l), h = vb_load(b + 16 + l);
      vb lo = vb_or(vb_and(q, 15), vb_shl(vb_and(vb_shr(h, 2 * g), 1), 4));
      vb hi = vb_or(vb_and(vb_shr(q, 4), 15), vb_shl(vb_and(vb_shr(h, 2 * g + 1), 1), 4));
      k_pair(xs, k, nx, acc, slot, b, g, l, lo, hi, d, dmin);
    }
}
INLINE void q6_k_block(const uint8_t *b, BLOCK_ARGS) { /* weight n = 128 h + 32 c + l: (d sc[n / 16]) (q - 32) */
  float d = half(b + 208);
  const int8_t *sc = (const int8_t *)(b + 192);
  vf bias = vset(32.0f);
  for (int h = 0; h < 2; ++h)
    for (int c = 0; c < 4; ++c)
      for (int l = 0; l < 32; l += W) {
        int n = 128 * h + 32 * c + l;
        vb lo = vb_load(b + 64 * h + 32 * (c & 1) + l); /* c < 2: low nibbles, else high */
        lo = vb_and(c < 2 ? lo : vb_shr(lo, 4), 15);
        vb hi = vb_shl(vb_and(vb_shr(vb_load(b + 128 + 32 * h + l), 2 * c), 3), 4);
        vf q = vsub(vb_u8(vb_or(lo, hi)), bias);
        accumulate(acc, xs, nx, vmul(vset(d * (float)sc[n / 16]), q), k + n, slot + n / W);
      }
}

/* The switch makes nx a constant in each copy of name##_n, so that its accumulators stay in registers. */
#define DOT_SWITCH(name)                                                                                 \
  static void name(const uint8_t *row, int64_t K, const float *const *xs, int nx, float *out) {           \
    switch (nx) {                                                                                         \
    case 1: name##_n(row, K, xs, 1, out); break;                                                          \
    case 2: name##_n(row, K, xs, 2, out); break;                                                          \
    case 3: name##_n(row, K, xs, 3, out); break;                                                          \
    default: name##_n(row, K, xs, MAXX, out);                                                             \
    }                                                                                                     \
  }

/* A row of blocks, two a step (a 32-weight block fills only 2 of the accumulators with AVX-512). */
#define BLOCK_DOT(name, BW, BB, block)                                                                    \
  INLINE void name##_n(const uint8_t *row, int64_t K, const float *const *xs, int nx, float *out) {       \
    vf acc[MAXX][NACC];                                                                                   \
    start(acc, nx);                                                                                       \
    int64_t blocks = K / (BW), i = 0;                                                                     \
    for (; i + 1 < blocks; i += 2) {                                                                      \
      block(row + i * (BB), xs, i * (BW), nx, acc, 0);                                                    \
      block(row + (i + 1) * (BB), xs, (i + 1) * (BW), nx, acc, (BW) / W);                                 \
    }                                                                                                     \
    if (i < blocks) block(row + i * (BB), xs, i * (BW), nx, acc, 0);                                      \
    finish(acc, nx, out);                                                                                 \
  }                                                                                                       \
  DOT_SWITCH(name)

/* A dense row of any length: NACC vectors a step, then single vectors, then a scalar tail (added last). */
#define DENSE_DOT(name, SIZE, vec, one)                                                                   \
  INLINE void name##_n(const uint8_t *row, int64_t K, const float *const *xs, int nx, float *out) {       \
    vf acc[MAXX][NACC];                                                                                   \
    start(acc, nx);                                                                                       \
    int64_t k = 0;                                                                                        \
    for (; k + NACC * W <= K; k += NACC * W)                                                              \
      for (int a = 0; a < NACC; ++a) accumulate(acc, xs, nx, vec(row + (k + a * W) * (SIZE)), k + a * W, a); \
    for (; k + W <= K; k += W) accumulate(acc, xs, nx, vec(row + k * (SIZE)), k, 0);                      \
    finish(acc, nx, out);                                                                                 \
    for (; k < K; ++k) {                                                                                  \
      float w = one(row + k * (SIZE));                                                                    \
      for (int x = 0; x < nx; ++x) out[x] += w * xs[x][k];                                                \
    }                                                                                                     \
  }                                                                                                       \
  DOT_SWITCH(name)

DENSE_DOT(dot_f32, 4, v_f32, e_f32)
DENSE_DOT(dot_f16, 2, v_f16, e_f16)
DENSE_DOT(dot_bf16, 2, v_bf16, e_bf16)
BLOCK_DOT(dot_q8_0, 32, 34, q8_0_block)
BLOCK_DOT(dot_q4_0, 32, 18, q4_0_block)
BLOCK_DOT(dot_mxfp4, 32, 17, mxfp4_block)
BLOCK_DOT(dot_q4_k, 256, 144, q4_k_block)
BLOCK_DOT(dot_q5_k, 256, 176, q5_k_block)
BLOCK_DOT(dot_q6_k, 256, 210, q6_k_block)

typedef struct {
  int id, block_weights, block_bytes;
  dot_fn dot;
} format;

static const format FORMATS[] = {
    {F32, 1, 4, dot_f32},       {F16, 1, 2, dot_f16},       {BF16, 1, 2, dot_bf16},
    {Q8_0, 32, 34, dot_q8_0},   {Q4_0, 32, 18, dot_q4_0},   {MXFP4, 32, 17, dot_mxfp4},
    {Q4_K, 256, 144, dot_q4_k}, {Q5_K, 256, 176, dot_q5_k}, {Q6_K, 256, 210, dot_q6_k},
};

static const format *find_format(int id) {
  for (size_t i = 0; i < sizeof(FORMATS) / sizeof(FORMATS[0]); ++i)
    if (FORMATS[i].id == id) return &FORMATS[i];
  return NULL;
}

/* ---- the job and the pool ---- */

/* One layer's pairs (edgemoe.offload.cpu_experts.Job mirrors it). A C caller fills one per call; the pool keeps no
 * pointer into it after `edgemoe_cpu_experts_run` returns. */
typedef struct {
  const float *x;              /* [tokens, hidden] fp32, contiguous */
  int64_t tokens;              /* rows of x: token ids must be below */
  const uint8_t *bank;         /* expert e's row at bank + e * row_stride: gate_up [2 inter rows], then down */
  int64_t experts;             /* rows of the bank: expert ids must be below */
  int64_t row_stride;          /* bytes */
  int64_t down_offset;         /* bytes from a row's start to its down weights */
  int32_t gate_up_format;      /* a GGML type id (F32 ... MXFP4 above) */
  int32_t down_format;
  int32_t act;                 /* ACT_SILU or ACT_GELU_TANH */
  int32_t reserved;
  int64_t hidden, inter;
  int64_t pairs;
  const int64_t *token_ids;    /* [pairs]: the pair's row of x */
  const int64_t *expert_ids;   /* [pairs]: the pair's expert */
  float *out;                  /* [pairs, hidden] fp32, contiguous: each pair's unweighted output */
} edgemoe_cpu_job;

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

static float activate(int act, float g) {
  if (act == ACT_SILU) return g / (1.0f + expf(-g));
  return 0.5f * g * (1.0f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g))); /* torch's tanh GELU */
}

static void gate_up_item(const run_state *s, int64_t item) {
  const edgemoe_cpu_job *j = s->job;
  const group *g = &s->groups[item / s->per1];
  int64_t r0 = item % s->per1 * s->rows1, r1 = r0 + s->rows1 < j->inter ? r0 + s->rows1 : j->inter;
  const uint8_t *rows = j->bank + g->expert * j->row_stride;
  const float *xs[MAXX];
  for (int k = 0; k < g->n; ++k) xs[k] = j->x + j->token_ids[g->pairs[k]] * j->hidden;
  for (int64_t r = r0; r < r1; ++r) {
    float gate[MAXX], up[MAXX];
    s->gu->dot(rows + r * s->gu_bytes, j->hidden, xs, (int)g->n, gate);
    s->gu->dot(rows + (j->inter + r) * s->gu_bytes, j->hidden, xs, (int)g->n, up);
    for (int k = 0; k < g->n; ++k) s->h[g->pairs[k] * j->inter + r] = activate(j->act, gate[k]) * up[k];
  }
}

static void down_item(const run_state *s, int64_t item) {
  const edgemoe_cpu_job *j = s->job;
  const group *g = &s->groups[item / s->per2];
  int64_t r0 = item % s->per2 * s->rows2, r1 = r0 + s->rows2 < j->hidden ? r0 + s->rows2 : j->hidden;
  const uint8_t *rows = j->bank + g->expert * j->row_stride + j->down_offset;
  const float *hs[MAXX];
  for (int k = 0; k < g->n; ++k) hs[k] = s->h + g->pairs[k] * j->inter;
  for (int64_t r = r0; r < r1; ++r) {
    float y[MAXX];
    s->down->dot(rows + r * s->down_bytes, j->inter, hs, (int)g->n, y);
    for (int k = 0; k < g->n; ++k) j->out[g->pairs[k] * j->hidden + r] = y[k];
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
  if (j->act != ACT_SILU && j->act != ACT_GELU_TANH) return BAD_ACT;
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
  return u->expert != v->expert ? (u->expert > v->expert) - (u->expert < v->expert) : (u->pair > v->pair) - (u->pair < v->pair);
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
static int64_t plan(edgemoe_cpu_pool *p, const edgemoe_cpu_job *j, const format *gu, const format *down) {
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
  return n;
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
