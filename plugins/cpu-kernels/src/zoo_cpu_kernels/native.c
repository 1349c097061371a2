/* zoo's C kernels for the CPU (zoo.native compiles this file for the machine it runs on).

   zoo_transpose: dst[b][j][i] = src[b][i][j], converting between bf16 and float32 on the way or
   not at all. A matrix product on a CPU reads its left operand along the reduction, and a linear
   layer's weight gradient (tokens the reduction) has both operands the other way round: oneDNN's
   AMX bf16 GEMM then transposes one itself and takes 1.6-2x the time of the same product with a
   dense operand, and torch's strided copy (or inductor's tiled one) is slower still. These tiles
   transpose in registers (16 x 16 two-byte or 8 x 8 four-byte elements: unpack and permute
   instructions), at 2-4x the speed of either.

   Conversions are exact (bf16 -> float32) or round to nearest even with every NaN as 0xFFFF
   (float32 -> bf16), as torch's CPU conversion does, so a result equals torch's
   `t.transpose(-1, -2).to(dtype)` bit for bit. Without AVX2 every element goes through the scalar loop, which is still blocked. */

#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

enum { T16 = 0, T32 = 1, BF16_TO_F32 = 2, F32_TO_BF16 = 3 };

static inline uint16_t f32_to_bf16(uint32_t u) {
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0xffff; /* NaN, as torch's CPU conversion writes it */
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* One element of src (row i, column j) to dst (row j, column i). */
static inline void element(int kind, const char* s, int64_t si, char* d, int64_t di) {
  switch (kind) {
    case T16: ((uint16_t*)d)[di] = ((const uint16_t*)s)[si]; break;
    case T32: ((uint32_t*)d)[di] = ((const uint32_t*)s)[si]; break;
    case BF16_TO_F32: ((uint32_t*)d)[di] = (uint32_t)((const uint16_t*)s)[si] << 16; break;
    default: ((uint16_t*)d)[di] = f32_to_bf16(((const uint32_t*)s)[si]); break;
  }
}

/* src rows [i0, i1) x columns [j0, j1), one element at a time (the tiles' edges; every element
   without AVX2), in blocks of 16 so that a line read or written is used while it is in cache. */
static void scalar_block(int kind, const char* s, int64_t srs, char* d, int64_t drs, int64_t i0, int64_t i1,
                         int64_t j0, int64_t j1) {
  for (int64_t ib = i0; ib < i1; ib += 16)
    for (int64_t jb = j0; jb < j1; jb += 16)
      for (int64_t j = jb; j < (jb + 16 < j1 ? jb + 16 : j1); j++)
        for (int64_t i = ib; i < (ib + 16 < i1 ? ib + 16 : i1); i++) element(kind, s, i * srs + j, d, j * drs + i);
}

#if defined(__AVX2__)
/* 16 x 16 two-byte elements: rows of s (stride ss) to columns of d (stride ds). Three rounds of
   unpacks transpose the 8 x 8 blocks inside each 128-bit lane, a lane permute swaps the blocks. */
static inline void tile16(const uint16_t* s, int64_t ss, __m256i out[16]) {
  __m256i a[16], t[16], u[16];
  for (int k = 0; k < 16; k++) a[k] = _mm256_loadu_si256((const __m256i*)(s + k * ss));
  for (int k = 0; k < 8; k++) {
    t[2 * k] = _mm256_unpacklo_epi16(a[2 * k], a[2 * k + 1]);
    t[2 * k + 1] = _mm256_unpackhi_epi16(a[2 * k], a[2 * k + 1]);
  }
  for (int g = 0; g < 4; g++) {  /* rows 4g .. 4g + 3 */
    u[4 * g] = _mm256_unpacklo_epi32(t[4 * g], t[4 * g + 2]);
    u[4 * g + 1] = _mm256_unpackhi_epi32(t[4 * g], t[4 * g + 2]);
    u[4 * g + 2] = _mm256_unpacklo_epi32(t[4 * g + 1], t[4 * g + 3]);
    u[4 * g + 3] = _mm256_unpackhi_epi32(t[4 * g + 1], t[4 * g + 3]);
  }
  for (int c = 0; c < 4; c++) {  /* v: rows 0-7, w: rows 8-15; columns 2c, 2c + 1 (and + 8 in the high lane) */
    __m256i v0 = _mm256_unpacklo_epi64(u[c], u[4 + c]), v1 = _mm256_unpackhi_epi64(u[c], u[4 + c]);
    __m256i w0 = _mm256_unpacklo_epi64(u[8 + c], u[12 + c]), w1 = _mm256_unpackhi_epi64(u[8 + c], u[12 + c]);
    out[2 * c] = _mm256_permute2x128_si256(v0, w0, 0x20);
    out[2 * c + 8] = _mm256_permute2x128_si256(v0, w0, 0x31);
    out[2 * c + 1] = _mm256_permute2x128_si256(v1, w1, 0x20);
    out[2 * c + 9] = _mm256_permute2x128_si256(v1, w1, 0x31);
  }
}

/* 8 x 8 four-byte elements. */
static inline void tile32(const uint32_t* s, int64_t ss, __m256 out[8]) {
  __m256 r[8], t[8], q[8];
  for (int k = 0; k < 8; k++) r[k] = _mm256_loadu_ps((const float*)(s + k * ss));
  for (int k = 0; k < 4; k++) {
    t[2 * k] = _mm256_unpacklo_ps(r[2 * k], r[2 * k + 1]);
    t[2 * k + 1] = _mm256_unpackhi_ps(r[2 * k], r[2 * k + 1]);
  }
  for (int g = 0; g < 2; g++) {
    q[4 * g] = _mm256_shuffle_ps(t[4 * g], t[4 * g + 2], _MM_SHUFFLE(1, 0, 1, 0));
    q[4 * g + 1] = _mm256_shuffle_ps(t[4 * g], t[4 * g + 2], _MM_SHUFFLE(3, 2, 3, 2));
    q[4 * g + 2] = _mm256_shuffle_ps(t[4 * g + 1], t[4 * g + 3], _MM_SHUFFLE(1, 0, 1, 0));
    q[4 * g + 3] = _mm256_shuffle_ps(t[4 * g + 1], t[4 * g + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int c = 0; c < 4; c++) {
    out[c] = _mm256_permute2f128_ps(q[c], q[4 + c], 0x20);
    out[c + 4] = _mm256_permute2f128_ps(q[c], q[4 + c], 0x31);
  }
}

/* float32 -> bf16, round to nearest even, NaN -> 0xFFFF: 8 lanes into the low 128 bits. */
static inline __m128i to_bf16(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0xffff), _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xd8));
}

/* The tile of src rows i.., columns j.. (16 x 16 for two-byte sources, 8 x 8 for four-byte). */
static inline void tile(int kind, const char* s, int64_t srs, char* d, int64_t drs, int64_t i, int64_t j) {
  if (kind == T16 || kind == BF16_TO_F32) {
    __m256i o[16];
    tile16((const uint16_t*)s + i * srs + j, srs, o);
    if (kind == T16) {
      for (int c = 0; c < 16; c++) _mm256_storeu_si256((__m256i*)((uint16_t*)d + (j + c) * drs + i), o[c]);
    } else {
      for (int c = 0; c < 16; c++) {
        uint32_t* row = (uint32_t*)d + (j + c) * drs + i;
        __m256i lo = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(o[c])), 16);
        __m256i hi = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(o[c], 1)), 16);
        _mm256_storeu_si256((__m256i*)row, lo);
        _mm256_storeu_si256((__m256i*)(row + 8), hi);
      }
    }
  } else {
    __m256 o[8];
    tile32((const uint32_t*)s + i * srs + j, srs, o);
    if (kind == T32) {
      for (int c = 0; c < 8; c++) _mm256_storeu_ps((float*)((uint32_t*)d + (j + c) * drs + i), o[c]);
    } else {
      for (int c = 0; c < 8; c++) _mm_storeu_si128((__m128i*)((uint16_t*)d + (j + c) * drs + i), to_bf16(o[c]));
    }
  }
}
#endif

static int source_bytes(int kind) { return kind == T16 || kind == BF16_TO_F32 ? 2 : 4; }
static int dest_bytes(int kind) { return kind == T16 || kind == F32_TO_BF16 ? 2 : 4; }

/* dst[b][j][i] = src[b][i][j] for b < batch, i < rows, j < cols; strides in elements (columns of
   both are contiguous). Work is split over blocks of 2 x 2 tiles (32 x 32 two-byte or 16 x 16
   four-byte source elements: every line read and written is a whole 64-byte line) of all matrices
   on nthreads threads. */
void zoo_transpose(int kind, const void* src, void* dst, int64_t batch, int64_t rows, int64_t cols,
                   int64_t src_batch, int64_t src_row, int64_t dst_batch, int64_t dst_row, int nthreads) {
  const int sb = source_bytes(kind), db = dest_bytes(kind);
#if defined(__AVX2__)
  const int64_t ts = sb == 2 ? 16 : 8;
#else
  const int64_t ts = 16;
#endif
  const int64_t bs = 2 * ts, bi = rows / bs, bj = cols / bs, per = bi * bj;
  (void)nthreads;
#pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int64_t n = 0; n < batch * per; n++) {
    const int64_t b = n / per, r = n % per, i = (r % bi) * bs, j = (r / bi) * bs;
    const char* s = (const char*)src + b * src_batch * sb;
    char* d = (char*)dst + b * dst_batch * db;
#if defined(__AVX2__)
    tile(kind, s, src_row, d, dst_row, i, j);
    tile(kind, s, src_row, d, dst_row, i + ts, j);
    tile(kind, s, src_row, d, dst_row, i, j + ts);
    tile(kind, s, src_row, d, dst_row, i + ts, j + ts);
#else
    scalar_block(kind, s, src_row, d, dst_row, i, i + bs, j, j + bs);
#endif
  }
  if (bi * bs == rows && bj * bs == cols) return;
#pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int64_t b = 0; b < batch; b++) {  /* the edges: the last columns of every row, the last rows */
    const char* s = (const char*)src + b * src_batch * sb;
    char* d = (char*)dst + b * dst_batch * db;
    scalar_block(kind, s, src_row, d, dst_row, 0, rows, bj * bs, cols);
    scalar_block(kind, s, src_row, d, dst_row, bi * bs, rows, 0, bj * bs);
  }
}

/* ------------------------------------------------------------------------------------------ GELU

   tanh-GELU and its derivative, as zoo.fused's compiled kernels write them: GELU(x) = x s with
   s = sigmoid(2u) = 1 / (1 + 2^(-2u log2 e)), u = K (x + A x^3); dGELU/dx = s + 2 K x s (1 - s)
   (1 + 3 A x^2). Computed in float32 whatever the storage (bf16 or float32), one exponential an
   element: 2^t as a degree-7 polynomial on the fraction (relative error 5e-9) scaled by 2^round(t)
   (vscalefps: overflow to inf, underflow to 0), 1 / (1 + 2^t) as a reciprocal estimate refined by
   one Newton step (2^-28). Each element's result depends on its input alone (no reduction), so a
   recomputed output equals the forward's bit for bit whatever the threads or the tensor's size.
   AVX-512 only (zoo_avx512() says whether it was compiled in; zoo.native's callers keep
   inductor's kernel otherwise). */

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define ZOO_AVX512 1
#define GELU_K 0.7978845608028654f
#define GELU_A 0.044715f
#define GELU_K2 (-2.0f * 0.7978845608028654f * 1.4426950408889634f)

static inline __m512 exp2_ps(__m512 t) {
  t = _mm512_min_ps(_mm512_max_ps(t, _mm512_set1_ps(-160.0f)), _mm512_set1_ps(160.0f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n); /* [-0.5, 0.5] */
  __m512 p = _mm512_set1_ps(1.5252733804059841e-05f);         /* ln2^7 / 7! */
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.5403530393381609e-04f)); /* ln2^6 / 6! */
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-02f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

static inline __m512 sigmoid2u(__m512 x) { /* 1 / (1 + 2^(K2 x (1 + A x^2))) */
  const __m512 x2 = _mm512_mul_ps(x, x);
  const __m512 t = _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(GELU_K2), x),
                                 _mm512_fmadd_ps(_mm512_set1_ps(GELU_A), x2, _mm512_set1_ps(1.0f)));
  const __m512 d = _mm512_add_ps(_mm512_set1_ps(1.0f), exp2_ps(t));
  const __m512 r = _mm512_rcp14_ps(d);
  /* r (2 - d r); where d is inf, rcp14 gives 0 and the step keeps it (0 * (2 - inf * 0) would be
     NaN: masked) */
  const __m512 refined = _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.0f)));
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(r, _mm512_setzero_ps(), _CMP_EQ_OQ), refined, r);
}

static inline __m512 load16(int bf16, const void* p, int64_t i, __mmask16 m) {
  if (bf16) {
    const __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t*)p + i);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  return _mm512_maskz_loadu_ps(m, (const float*)p + i);
}

static inline void store16(int bf16, void* p, int64_t i, __m512 v, __mmask16 m) {
  if (bf16) {
#if defined(__AVX512BF16__)
    /* round to nearest even in one instruction (a NaN stays a NaN, quiet, its sign kept) */
    _mm256_mask_storeu_epi16((uint16_t*)p + i, m, (__m256i)_mm512_cvtneps_pbh(v));
#else
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), r, _mm512_set1_epi32(0xffff));
    _mm256_mask_storeu_epi16((uint16_t*)p + i, m, _mm512_cvtepi32_epi16(r));
#endif
  } else {
    _mm512_mask_storeu_ps((float*)p + i, m, v);
  }
}

#define GELU_CHUNK 4096

/* The lanes of a vector of 16 that hold elements when ``left`` remain. */
static inline __mmask16 lanes(int64_t left) {
  return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
}
#endif

int zoo_avx512(void) {
#ifdef ZOO_AVX512
  return 1;
#else
  return 0;
#endif
}

#ifdef ZOO_AVX512
/* GELU(x) into y, or with g, g * GELU'(x): n elements, chunks of them to the threads. Inlined into
   each caller, so that the test of g is the compiler's and each loop is straight. */
static inline __attribute__((always_inline)) void gelu(int bf16, const void* g, const void* x, void* y, int64_t n,
                                                       int nthreads) {
  const int64_t chunks = (n + GELU_CHUNK - 1) / GELU_CHUNK;
  (void)nthreads;
#pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int64_t c = 0; c < chunks; c++) {
    const int64_t end = (c + 1) * GELU_CHUNK < n ? (c + 1) * GELU_CHUNK : n;
    for (int64_t i = c * GELU_CHUNK; i < end; i += 16) {
      const __mmask16 m = lanes(end - i);
      const __m512 v = load16(bf16, x, i, m), s = sigmoid2u(v);
      if (!g) {
        store16(bf16, y, i, _mm512_mul_ps(v, s), m);
        continue;
      }
      /* s + 2K x s (1 - s) (1 + 3A x^2) */
      const __m512 poly = _mm512_fmadd_ps(_mm512_set1_ps(3.0f * GELU_A), _mm512_mul_ps(v, v), _mm512_set1_ps(1.0f));
      const __m512 w = _mm512_mul_ps(_mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(2.0f * GELU_K), v), s),
                                     _mm512_sub_ps(_mm512_set1_ps(1.0f), s));
      store16(bf16, y, i, _mm512_mul_ps(load16(bf16, g, i, m), _mm512_fmadd_ps(w, poly, s)), m);
    }
  }
}
#endif

/* y = GELU_tanh(x), n elements of float32 (bf16 = 0) or bf16 (bf16 = 1), contiguous. */
void zoo_gelu_tanh(int bf16, const void* x, void* y, int64_t n, int nthreads) {
#ifdef ZOO_AVX512
  gelu(bf16, 0, x, y, n, nthreads);
#else
  (void)bf16; (void)x; (void)y; (void)n; (void)nthreads;
#endif
}

/* out = g * GELU_tanh'(x), g, x and out all float32 or all bf16, contiguous. */
void zoo_gelu_tanh_backward(int bf16, const void* g, const void* x, void* out, int64_t n, int nthreads) {
#ifdef ZOO_AVX512
  gelu(bf16, g, x, out, n, nthreads);
#else
  (void)bf16; (void)g; (void)x; (void)out; (void)n; (void)nthreads;
#endif
}

/* --------------------------------------------------------------------------------------- softmax

   Attention's softmax over the last dimension of bf16 scores, in float32, with the softmax scale
   applied inside (zoo.nn.attention_ops then forms the scores with a plain product: a product
   scaled by its alpha took 10-40% longer in oneDNN than the plain one). Forward: p = exp(c (x -
   max)) / sum, c = scale (an all -inf row gives NaNs, as torch's softmax). Backward: ds = scale p
   (dp - sum(p dp)), the next two products' scale folded in. Rows of at most 16,384 elements. */

#if defined(ZOO_AVX512)
#define SOFTMAX_MAX 16384

static inline float hmax(__m512 v) { return _mm512_reduce_max_ps(v); }
static inline float hsum(__m512 v) { return _mm512_reduce_add_ps(v); }

static void softmax_row(const uint16_t* x, uint16_t* y, int64_t n, float scale, float* e) {
  __m512 mv = _mm512_set1_ps(-INFINITY);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = lanes(n - i);
    mv = _mm512_mask_max_ps(mv, m, mv, load16(1, x, i, m));
  }
  const float mx = hmax(mv);
  const __m512 c = _mm512_set1_ps(scale * 1.4426950408889634f), mxv = _mm512_set1_ps(mx);
  __m512 sv = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = lanes(n - i);
    const __m512 v = exp2_ps(_mm512_mul_ps(_mm512_sub_ps(load16(1, x, i, m), mxv), c));
    _mm512_mask_storeu_ps(e + i, m, v);
    sv = _mm512_mask_add_ps(sv, m, sv, v);
  }
  const __m512 inv = _mm512_set1_ps(1.0f / hsum(sv));
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = lanes(n - i);
    store16(1, y, i, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, e + i), inv), m);
  }
}

static void softmax_backward_row(const uint16_t* dp, const uint16_t* p, uint16_t* ds, int64_t n, float scale) {
  __m512 dot = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = lanes(n - i);
    dot = _mm512_fmadd_ps(load16(1, p, i, m), load16(1, dp, i, m), dot);
  }
  const __m512 d = _mm512_set1_ps(hsum(dot)), sc = _mm512_set1_ps(scale);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = lanes(n - i);
    const __m512 pv = load16(1, p, i, m);
    store16(1, ds, i, _mm512_mul_ps(_mm512_mul_ps(pv, sc), _mm512_sub_ps(load16(1, dp, i, m), d)), m);
  }
}
#endif

/* y = softmax(scale x) over rows of n bf16 elements (rows x n, contiguous). Returns 0 when not
   compiled (no AVX-512) or n is too long: the caller then takes torch's. */
int zoo_softmax_bf16(const void* x, void* y, int64_t rows, int64_t n, float scale, int nthreads) {
#if defined(ZOO_AVX512)
  if (n > SOFTMAX_MAX) return 0;
  (void)nthreads;
#pragma omp parallel num_threads(nthreads)
  {
    float e[SOFTMAX_MAX] __attribute__((aligned(64)));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) softmax_row((const uint16_t*)x + r * n, (uint16_t*)y + r * n, n, scale, e);
  }
  return 1;
#else
  (void)x; (void)y; (void)rows; (void)n; (void)scale; (void)nthreads;
  return 0;
#endif
}

/* ds = scale p (dp - rowsum(p dp)), all bf16, rows x n contiguous. Returns 0 when not compiled. */
int zoo_softmax_backward_bf16(const void* dp, const void* p, void* ds, int64_t rows, int64_t n, float scale,
                              int nthreads) {
#if defined(ZOO_AVX512)
  (void)nthreads;
#pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int64_t r = 0; r < rows; r++)
    softmax_backward_row((const uint16_t*)dp + r * n, (const uint16_t*)p + r * n, (uint16_t*)ds + r * n, n, scale);
  return 1;
#else
  (void)dp; (void)p; (void)ds; (void)rows; (void)n; (void)scale; (void)nthreads;
  return 0;
#endif
}
