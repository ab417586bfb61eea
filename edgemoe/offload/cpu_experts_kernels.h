/* The CPU expert executor's dot kernels (included by cpu_experts.c): one weight row, dequantized to fp32 as it is
 * read, against up to MAXX fp32 activation rows.
 *
 * The ISA layer (vf: W fp32 lanes; vb: W bytes) is chosen by the compiler's macros: AVX-512 F + BW, else AVX2 + FMA +
 * F16C, else plain C. Each format's kernel is written once over that layer: one kernel per format per ISA. Weights are
 * gguf's dequantized values (`edgemoe.quant.dequantize`): built with -ffp-contract=off, the roundings are the
 * ones written; where a fused multiply-add computes d q + c (or d q - c), c is exact and gguf rounds once (Q4_0, Q5_0,
 * Q6_K: the same single rounding as gguf's) or gguf rounds twice (Q4_1, Q5_1: d q, then + m; Q4_K, Q5_K: c rounded
 * too): once here, within an ulp, and faster (Q4_K 14 %, Q4_1 and Q5_1 12 %).
 *
 * Why the shapes below: a vector of 16 weights costs at least a byte-to-lane conversion (the shuffle port), an int to
 * float conversion, the scale and the FMA; everything else is overhead to amortise, so quants are unpacked a block
 * at a time with byte loops the compiler vectorises, scales are converted 16 at a time, and accumulators stay in
 * registers (fully unrolled loops with constant indices).
 */
#include <stdint.h>
#include <string.h>

#define MAXX 4 /* pairs of one expert that share each read of a weight row */
#define NACC 4 /* independent accumulators a pair: hide the FMA latency */
#define INLINE static inline __attribute__((always_inline))
/* Scales stay in memory: broadcast from there, a scale is a load; from a register, a shuffle on the port that the
 * byte conversions need (Q4_K ran 12 % slower) */
#define SPILL() __asm__ volatile("" ::: "memory")

/* formats: GGML type ids (edgemoe.quant.QuantType.ggml_type) */
enum { F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14, BF16 = 30,
       MXFP4 = 39 };
static const float E2M1[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12}; /* doubled, gguf's */

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define ISA "avx512" /* (AVX512_BF16 and AMX multiply bf16 by bf16: x would be rounded) */
#define W 16
typedef __m512 vf;
typedef __m128i vb;
INLINE vf vzero(void) { return _mm512_setzero_ps(); }
INLINE vf vset(float a) { return _mm512_set1_ps(a); }
INLINE vf vload(const float *p) { return _mm512_loadu_ps(p); }
INLINE void vstore(float *p, vf a) { _mm512_storeu_ps(p, a); }
INLINE vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
INLINE vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
INLINE vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
INLINE vf vfms(vf a, vf b, vf c) { return _mm512_fmsub_ps(a, b, c); }
INLINE float vsum(vf a) { return _mm512_reduce_add_ps(a); }
INLINE vb vb_load(const uint8_t *p) { return _mm_loadu_si128((const __m128i *)p); }
INLINE vb vb_low(vb b) { return _mm_and_si128(b, _mm_set1_epi8(15)); }                       /* low nibbles */
INLINE vb vb_high(vb b) { return _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(15)); } /* high nibbles */
INLINE vf vb_u8(vb b) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b)); }
INLINE vf vb_i8(vb b) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)); }
INLINE vf vb_u5(vb b, uint32_t fifth) { /* b + 16 where bit i of fifth is set: 5-bit quants */
  __m512i q = _mm512_cvtepu8_epi32(b);
  return _mm512_cvtepi32_ps(_mm512_mask_or_epi32(q, (__mmask16)fifth, q, _mm512_set1_epi32(16)));
}
INLINE vf vb_e2m1(vb b) { return _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(b), _mm512_loadu_ps(E2M1)); }
INLINE vf v_f32(const uint8_t *p) { return _mm512_loadu_ps((const float *)p); }
INLINE vf v_f16(const uint8_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
INLINE vf v_bf16(const uint8_t *p) { /* bf16: fp32's top half */
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
INLINE void vstore(float *p, vf a) { _mm256_storeu_ps(p, a); }
INLINE vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
INLINE vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
INLINE vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
INLINE vf vfms(vf a, vf b, vf c) { return _mm256_fmsub_ps(a, b, c); }
INLINE float vsum(vf a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
INLINE vb vb_load(const uint8_t *p) { return _mm_loadl_epi64((const __m128i *)p); }
INLINE vb vb_low(vb b) { return _mm_and_si128(b, _mm_set1_epi8(15)); }
INLINE vb vb_high(vb b) { return _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(15)); }
INLINE vf vb_u8(vb b) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)); }
INLINE vf vb_i8(vb b) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)); }
INLINE vf vb_u5(vb b, uint32_t fifth) { /* bit i of fifth, shifted to lane i's bit 4 */
  __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256i bits = _mm256_srlv_epi32(_mm256_set1_epi32((int)((fifth & 255) << 4)), lanes);
  return _mm256_cvtepi32_ps(_mm256_or_si256(_mm256_cvtepu8_epi32(b), _mm256_and_si256(bits, _mm256_set1_epi32(16))));
}
INLINE vf vb_e2m1(vb b) { /* a permute reads 8 entries: look up both halves, pick by the sign bit (bit 3) */
  __m256i q = _mm256_cvtepu8_epi32(b);
  __m256 pos = _mm256_permutevar8x32_ps(_mm256_loadu_ps(E2M1), q);
  __m256 neg = _mm256_permutevar8x32_ps(_mm256_loadu_ps(E2M1 + 8), q);
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
typedef uint8_t vb;
INLINE vf vzero(void) { return 0.0f; }
INLINE vf vset(float a) { return a; }
INLINE vf vload(const float *p) { return *p; }
INLINE void vstore(float *p, vf a) { *p = a; }
INLINE vf vadd(vf a, vf b) { return a + b; }
INLINE vf vmul(vf a, vf b) { return a * b; }
INLINE vf vfma(vf a, vf b, vf c) { return a * b + c; }
INLINE vf vfms(vf a, vf b, vf c) { return a * b - c; }
INLINE float vsum(vf a) { return a; }
INLINE vb vb_load(const uint8_t *p) { return *p; }
INLINE vb vb_low(vb b) { return b & 15; }
INLINE vb vb_high(vb b) { return b >> 4; }
INLINE vf vb_u8(vb b) { return (float)b; }
INLINE vf vb_i8(vb b) { return (float)(int8_t)b; }
INLINE vf vb_u5(vb b, uint32_t fifth) { return (float)(b | (fifth & 1) << 4); }
INLINE vf vb_e2m1(vb b) { return E2M1[b]; }
#define v_f32 e_f32 /* (below) one weight is a vector */
#define v_f16 e_f16
#define v_bf16 e_bf16
#endif

#if W > 1
#define UNROLL _Pragma("GCC unroll 64") /* constant accumulator indices: registers, not the stack */
INLINE float half(const uint8_t *p) { return _cvtsh_ss((unsigned short)(p[0] | p[1] << 8)); }
/* The 12 scale bytes of Q4_K / Q5_K at s -> the 8 sub-blocks' 6-bit scales, then their mins (quant.py's _k_scales):
 * in 32-bit lanes a (bytes 0-3), m (4-7), c (8-11), scales 0-3 are a & 63, 4-7 (c & 15) | (a >> 6) << 4, the mins
 * likewise of m and c >> 4. One 16-byte store, which the loads after it forward from (four word stores would not). */
INLINE void k_scale_bytes(const uint8_t *s, uint8_t *out) {
  __m128i v = _mm_loadu_si128((const __m128i *)s); /* 4 bytes past the scales: the block's quants, unused */
  __m128i low = _mm_shuffle_epi32(v, _MM_SHUFFLE(2, 1, 2, 0)), high = _mm_shuffle_epi32(v, _MM_SHUFFLE(1, 1, 0, 0));
  low = _mm_and_si128(_mm_srlv_epi32(low, _mm_setr_epi32(0, 0, 0, 4)),
                      _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f));
  high = _mm_and_si128(_mm_srli_epi32(high, 2), _mm_setr_epi32(0, 0x30303030, 0, 0x30303030));
  _mm_storeu_si128((__m128i *)out, _mm_or_si128(low, high));
}
#else
#define UNROLL /* plain C unrolled took minutes to compile */
INLINE float half(const uint8_t *p) { /* IEEE half -> float, without F16C */
  uint32_t h = (uint32_t)p[0] | (uint32_t)p[1] << 8, sign = (h & 0x8000u) << 16, e = (h >> 10) & 31, m = h & 1023;
  uint32_t bits = e == 31 ? sign | 0x7f800000u | m << 13 : sign | (e + 112) << 23 | m << 13;
  float f = (float)m * 0x1p-24f; /* e == 0: zero or subnormal, m 2^-24 exactly */
  if (e == 0) return sign ? -f : f;
  memcpy(&f, &bits, 4);
  return f;
}
INLINE void k_scale_bytes(const uint8_t *s, uint8_t *out) { /* as the x86 one, in 32-bit words */
  uint32_t a, m, c;
  memcpy(&a, s, 4), memcpy(&m, s + 4, 4), memcpy(&c, s + 8, 4);
  uint32_t six[4] = {a & 0x3f3f3f3f, (c & 0x0f0f0f0f) | ((a >> 2) & 0x30303030), m & 0x3f3f3f3f,
                     ((c >> 4) & 0x0f0f0f0f) | ((m >> 2) & 0x30303030)};
  memcpy(out, six, 16);
}
#endif

/* one dense weight: the tails of rows whose length is no multiple of W */
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

/* ---- accumulators: acc[x][slot] for the nx (<= MAXX) activation rows xs ---- */

#define BLOCK_ARGS const float *const *xs, int64_t k, int nx, vf acc[][NACC], int slot

/* acc[x][slot] += w * xs[x][k .. k + W) */
INLINE void accumulate(vf acc[][NACC], const float *const *xs, int nx, vf w, int64_t k, int slot) {
  UNROLL for (int x = 0; x < nx; ++x) acc[x][slot % NACC] = vfma(w, vload(xs[x] + k), acc[x][slot % NACC]);
}
INLINE void start(vf acc[][NACC], int nx) {
  UNROLL for (int x = 0; x < nx; ++x)
    UNROLL for (int a = 0; a < NACC; ++a) acc[x][a] = vzero();
}
INLINE void finish(vf acc[][NACC], int nx, float *out) {
  UNROLL for (int x = 0; x < nx; ++x) out[x] = vsum(vadd(vadd(acc[x][0], acc[x][1]), vadd(acc[x][2], acc[x][3])));
}

/* ---- block decoders: a block's weights (from x index k) accumulated ---- */

/* The K formats in two steps: the block's quants unpacked to a byte each (byte loops the compiler vectorises a
 * register at a time) and its scales to floats, then only conversions and FMAs: unpacking W bytes at a time inside
 * that loop cost Q4_K and Q6_K a third of their speed. (For 32-weight blocks, unpacking through memory cost more.) */
typedef struct {
  uint8_t q[256];  /* the quants, unsigned */
  float scale[16]; /* K: [0, 8) the sub-blocks' d sc; Q6_K: d sc of each 16 weights */
  float mins[16];  /* K: [8, 16) the sub-blocks' dmin m; Q6_K: 32 d sc (exact) */
} unpacked;

/* out[i] = m * convert(bytes + i) for 16 bytes: vector conversions, not 16 scalar ones */
#define TIMES_BYTES(m, convert, bytes, out)                                                                     \
  do {                                                                                                          \
    vf m_ = vset(m);                                                                                            \
    UNROLL for (int i_ = 0; i_ < 16; i_ += W) vstore((out) + i_, vmul(m_, convert(vb_load((bytes) + i_))));    \
  } while (0)

INLINE void q8_0_block(const uint8_t *b, BLOCK_ARGS) { /* d q */
  vf d = vset(half(b));
  UNROLL for (int i = 0; i < 32 / W; ++i)
    accumulate(acc, xs, nx, vmul(d, vb_i8(vb_load(b + 2 + i * W))), k + i * W, slot + i);
}
/* Q4_0, Q4_1, Q5_0, Q5_1: d q + c of the 16 nibble bytes at qs (byte j: weights j (low nibble), j + 16), with the
 * fifth bits at fifth (a little-endian word, bit j: weight j's) or none (NULL) */
INLINE void nibble_block(const uint8_t *qs, const uint8_t *fifth, float d_, float c_, BLOCK_ARGS) {
  vf d = vset(d_), c = vset(c_);
  uint32_t h = 0;
  if (fifth) memcpy(&h, fifth, 4);
  UNROLL for (int i = 0; i < 16 / W; ++i) {
    vb q = vb_load(qs + i * W);
    vf low = fifth ? vb_u5(vb_low(q), h >> i * W) : vb_u8(vb_low(q));
    vf high = fifth ? vb_u5(vb_high(q), h >> (16 + i * W)) : vb_u8(vb_high(q));
    accumulate(acc, xs, nx, vfma(d, low, c), k + i * W, slot + i);
    accumulate(acc, xs, nx, vfma(d, high, c), k + 16 + i * W, slot + 16 / W + i);
  }
}
INLINE void q4_0_block(const uint8_t *b, BLOCK_ARGS) { /* d q - 8 d: d (q - 8), one rounding as gguf's */
  nibble_block(b + 2, NULL, half(b), -8 * half(b), xs, k, nx, acc, slot);
}
INLINE void q4_1_block(const uint8_t *b, BLOCK_ARGS) { /* d q + m: one rounding, gguf's two */
  nibble_block(b + 4, NULL, half(b), half(b + 2), xs, k, nx, acc, slot);
}
INLINE void q5_0_block(const uint8_t *b, BLOCK_ARGS) { /* d q - 16 d: d (q - 16), one rounding as gguf's */
  nibble_block(b + 6, b + 2, half(b), -16 * half(b), xs, k, nx, acc, slot);
}
INLINE void q5_1_block(const uint8_t *b, BLOCK_ARGS) { /* d q + m: one rounding, gguf's two */
  nibble_block(b + 8, b + 4, half(b), half(b + 2), xs, k, nx, acc, slot);
}
INLINE void mxfp4_block(const uint8_t *b, BLOCK_ARGS) { /* 2^(e - 128) doubled-e2m1(q), nibbles as Q4_0's */
  uint32_t e = b[0], bits = e < 2 ? 0x00200000u << e : (e - 1) << 23; /* e < 2: a subnormal */
  float s;
  memcpy(&s, &bits, 4);
  vf scale = vset(s);
  UNROLL for (int i = 0; i < 16 / W; ++i) {
    vb q = vb_load(b + 1 + i * W);
    accumulate(acc, xs, nx, vmul(scale, vb_e2m1(vb_low(q))), k + i * W, slot + i);
    accumulate(acc, xs, nx, vmul(scale, vb_e2m1(vb_high(q))), k + 16 + i * W, slot + 16 / W + i);
  }
}

INLINE void unpack_k_scales(const uint8_t *b, unpacked *u) { /* Q4_K, Q5_K: d sc_j and dmin m_j */
  uint8_t bytes[16];
  k_scale_bytes(b + 4, bytes);
  TIMES_BYTES(half(b), vb_u8, bytes, u->scale);
  TIMES_BYTES(half(b + 2), vb_u8, bytes, u->mins);
  SPILL();
}
INLINE void unpack_q4_k(const uint8_t *b, unpacked *u) { /* byte 16 + 32 g + l: weights 64 g + l (low), + 32 */
  unpack_k_scales(b, u);
  UNROLL for (int g = 0; g < 4; ++g)
    for (int l = 0; l < 32; ++l) {
      uint8_t q = b[16 + 32 * g + l];
      u->q[64 * g + l] = q & 15, u->q[64 * g + 32 + l] = q >> 4;
    }
}
INLINE void unpack_q5_k(const uint8_t *b, unpacked *u) { /* Q4_K's nibbles from 48; fifth bits: bit j of byte 16 + l */
  unpack_k_scales(b, u);
  UNROLL for (int g = 0; g < 4; ++g)
    for (int l = 0; l < 32; ++l) {
      uint8_t q = b[48 + 32 * g + l], h = b[16 + l];
      u->q[64 * g + l] = (q & 15) | ((h >> 2 * g) & 1) << 4;
      u->q[64 * g + 32 + l] = (q >> 4) | ((h >> (2 * g + 1)) & 1) << 4;
    }
}
INLINE void unpack_q6_k(const uint8_t *b, unpacked *u) { /* weight 128 h + 32 c + l, of scale d sc[its index / 16] */
  float d = half(b + 208);
  TIMES_BYTES(d, vb_i8, b + 192, u->scale);
  TIMES_BYTES(32 * d, vb_i8, b + 192, u->mins);
  SPILL();
  UNROLL for (int h = 0; h < 2; ++h)
    for (int l = 0; l < 32; l += 4) { /* four bytes a word: byte shifts as word shifts and masks */
      uint32_t lo0, lo1, hi, q[4];
      memcpy(&lo0, b + 64 * h + l, 4), memcpy(&lo1, b + 64 * h + 32 + l, 4), memcpy(&hi, b + 128 + 32 * h + l, 4);
      q[0] = (lo0 & 0x0f0f0f0f) | ((hi << 4) & 0x30303030), q[1] = (lo1 & 0x0f0f0f0f) | ((hi << 2) & 0x30303030);
      q[2] = ((lo0 >> 4) & 0x0f0f0f0f) | (hi & 0x30303030), q[3] = ((lo1 >> 4) & 0x0f0f0f0f) | ((hi >> 2) & 0x30303030);
      UNROLL for (int c = 0; c < 4; ++c) memcpy(u->q + 128 * h + 32 * c + l, &q[c], 4);
    }
}
INLINE void k_block(const unpacked *u, BLOCK_ARGS) { /* Q4_K, Q5_K: (d sc_j) q - dmin m_j, sub-blocks of 32 */
  UNROLL for (int j = 0; j < 8; ++j) {
    vf ds = vset(u->scale[j]), dm = vset(u->mins[8 + j]);
    UNROLL for (int i = 0; i < 32 / W; ++i)
      accumulate(acc, xs, nx, vfms(ds, vb_u8(vb_load(u->q + 32 * j + i * W)), dm), k + 32 * j + i * W,
                 slot + 32 * j / W + i);
  }
}
INLINE void q4_k_block(const uint8_t *b, BLOCK_ARGS) {
  unpacked u;
  unpack_q4_k(b, &u);
  k_block(&u, xs, k, nx, acc, slot);
}
INLINE void q5_k_block(const uint8_t *b, BLOCK_ARGS) {
  unpacked u;
  unpack_q5_k(b, &u);
  k_block(&u, xs, k, nx, acc, slot);
}
INLINE void q6_k_block(const uint8_t *b, BLOCK_ARGS) { /* (d sc) q - 32 d sc: (d sc) (q - 32), one rounding as gguf's */
  unpacked u;
  unpack_q6_k(b, &u);
  UNROLL for (int j = 0; j < 16; ++j) {
    vf ds = vset(u.scale[j]), ds32 = vset(u.mins[j]);
    UNROLL for (int i = 0; i < 16 / W; ++i)
      accumulate(acc, xs, nx, vfms(ds, vb_u8(vb_load(u.q + 16 * j + i * W)), ds32), k + 16 * j + i * W,
                 slot + 16 * j / W + i);
  }
}

/* ---- row kernels: out[x] = sum_k w[k] xs[x][k] over a row of K weights ---- */

typedef void (*dot_fn)(const uint8_t *row, int64_t K, const float *const *xs, int nx, float *out);

/* The switch makes nx a constant in each copy of name##_n, so that its accumulators stay in registers. */
#define DOT_SWITCH(name)                                                                                  \
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
      UNROLL for (int a = 0; a < NACC; ++a)                                                               \
        accumulate(acc, xs, nx, vec(row + (k + a * W) * (SIZE)), k + a * W, a);                          \
    for (; k + W <= K; k += W) accumulate(acc, xs, nx, vec(row + k * (SIZE)), k, 0);                      \
    finish(acc, nx, out);                                                                                 \
    for (; k < K; ++k) {                                                                                  \
      float w = one(row + k * (SIZE));                                                                    \
      UNROLL for (int x = 0; x < nx; ++x) out[x] += w * xs[x][k];                                         \
    }                                                                                                     \
  }                                                                                                       \
  DOT_SWITCH(name)

DENSE_DOT(dot_f32, 4, v_f32, e_f32)
DENSE_DOT(dot_f16, 2, v_f16, e_f16)
DENSE_DOT(dot_bf16, 2, v_bf16, e_bf16)
BLOCK_DOT(dot_q8_0, 32, 34, q8_0_block)
BLOCK_DOT(dot_q4_0, 32, 18, q4_0_block)
BLOCK_DOT(dot_q4_1, 32, 20, q4_1_block)
BLOCK_DOT(dot_q5_0, 32, 22, q5_0_block)
BLOCK_DOT(dot_q5_1, 32, 24, q5_1_block)
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
    {Q8_0, 32, 34, dot_q8_0},   {Q4_0, 32, 18, dot_q4_0},   {Q4_1, 32, 20, dot_q4_1},
    {Q5_0, 32, 22, dot_q5_0},   {Q5_1, 32, 24, dot_q5_1},   {MXFP4, 32, 17, dot_mxfp4},
    {Q4_K, 256, 144, dot_q4_k}, {Q5_K, 256, 176, dot_q5_k}, {Q6_K, 256, 210, dot_q6_k},
};

static const format *find_format(int id) {
  for (size_t i = 0; i < sizeof(FORMATS) / sizeof(FORMATS[0]); ++i)
    if (FORMATS[i].id == id) return &FORMATS[i];
  return NULL;
}
