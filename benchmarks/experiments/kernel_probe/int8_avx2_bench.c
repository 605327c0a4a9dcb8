/* Feasibility probe, not in the runtime: int8 linear layers for a batch's rows on AVX2 (no
 * AVX-512, no VNNI), the arithmetic XNNPACK's QD8 x QC8W GEMM does (each row of x quantized to
 * 8 bits with its own scale and zero point; W int8 per-channel; sums in int32, corrected by the
 * zero point times W's row sum), reading each block of W once for up to 8 rows. Over
 * SmolLM2-135M's int8 decode linears (30 layers of q/k/v fused [960, 576], o [576, 576],
 * gate/up fused [3072, 576], down [576, 1536]; the head [49152, 576]: 134.5 MB of random int8
 * weights), 1, 2, 4 and 8 rows, beside a plain read of the same bytes, alternating rounds,
 * 64 MB written between rounds so W comes from memory.
 *
 *   cc -O3 -mavx2 -mfma benchmarks/experiments/kernel_probe/int8_avx2_bench.c -o /tmp/int8_avx2 -lm && /tmp/int8_avx2
 *
 * The products: W's 16 bytes widened to int16 (vpmovsxbw), one vpmaddwd per row of x (x's
 * bytes widened once per call); 16 multiply-adds a vpmaddwd. W's row sums (for the zero
 * points) are computed once, as a rewrite could store them beside the scales; -DROW_SUMS_IN_LOOP
 * computes them in the loop instead (one more vpmaddwd, by ones, per 16 bytes of W).
 * Results: RESULTS.md section 9. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "int8_probe.h"

#define MAX_ROWS 8
#ifdef ROW_SUMS_IN_LOOP
#define ROW_SUMS 1
#else
#define ROW_SUMS 0
#endif

/* A row of x to 0..255 with a scale and zero point (its range with 0 in it), widened to int16. */
static void quantize_row(const float *x, int K, int16_t *q, float *scale, int32_t *zero) {
  float lo = 0.f, hi = 0.f;
  for (int k = 0; k < K; k++) {
    lo = x[k] < lo ? x[k] : lo;
    hi = x[k] > hi ? x[k] : hi;
  }
  float s = (hi - lo) / 255.f;
  if (!(s > 0.f)) s = 1.f;
  const float inv = 1.f / s;
  int z = (int)lrintf(-lo * inv);
  z = z < 0 ? 0 : z > 255 ? 255 : z;
  for (int k = 0; k < K; k++) {
    const int v = (int)lrintf(x[k] * inv) + z;
    q[k] = (int16_t)(v < 0 ? 0 : v > 255 ? 255 : v);
  }
  *scale = s;
  *zero = z;
}

/* y[m, n] = (sum_k q[m, k] w[n, k] - zero[m] sum_k w[n, k]) scale[m] ws[n], R rows at once. */
#define PRODUCT(R)                                                                                        \
  static void product##R(const int16_t *q, const float *scale, const int32_t *zero, const int8_t *W,      \
                         const float *ws, const int32_t *sums, int N, int K, float *y) {                  \
    const __m256i ones = _mm256_set1_epi16(1);                                                            \
    for (int n = 0; n < N; n++) {                                                                         \
      const int8_t *w = W + (size_t)n * K;                                                                \
      __m256i acc[R], wsum = _mm256_setzero_si256();                                                      \
      (void)ones;                                                                                         \
      for (int m = 0; m < R; m++) acc[m] = _mm256_setzero_si256();                                        \
      for (int k = 0; k < K; k += 16) {                                                                   \
        if ((k & 63) == 0) _mm_prefetch((const char *)(w + 8192 + k), _MM_HINT_T0);                       \
        const __m256i w16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + k)));             \
        if (ROW_SUMS) wsum = _mm256_add_epi32(wsum, _mm256_madd_epi16(w16, ones));                        \
        for (int m = 0; m < R; m++)                                                                       \
          acc[m] = _mm256_add_epi32(acc[m],                                                               \
                                    _mm256_madd_epi16(w16, _mm256_loadu_si256((const __m256i *)(q + (size_t)m * K + k)))); \
      }                                                                                                   \
      const int32_t s = ROW_SUMS ? hsum(wsum) : sums[n];                                                  \
      for (int m = 0; m < R; m++) y[(size_t)m * N + n] = (float)(hsum(acc[m]) - zero[m] * s) * scale[m] * ws[n]; \
    }                                                                                                     \
  }
PRODUCT(1)
PRODUCT(2)
PRODUCT(4)
PRODUCT(8)

static void linear(int R, const float *x, int16_t *q, const int8_t *W, const float *ws, const int32_t *sums, int N,
                   int K, float *y) {
  float scale[MAX_ROWS];
  int32_t zero[MAX_ROWS];
  for (int m = 0; m < R; m++) quantize_row(x + (size_t)m * K, K, q + (size_t)m * K, &scale[m], &zero[m]);
  if (R == 1) product1(q, scale, zero, W, ws, sums, N, K, y);
  else if (R == 2) product2(q, scale, zero, W, ws, sums, N, K, y);
  else if (R == 4) product4(q, scale, zero, W, ws, sums, N, K, y);
  else product8(q, scale, zero, W, ws, sums, N, K, y);
}

int main(void) {
  const int shapes[4][2] = {{960, 576}, {576, 576}, {3072, 576}, {576, 1536}};
  size_t total = 0;
  for (int i = 0; i < 4; i++) total += (size_t)30 * shapes[i][0] * shapes[i][1];
  total += (size_t)49152 * 576;
  int8_t *W = aligned_alloc(64, total);
  srand(1);
  for (size_t i = 0; i < total; i++) W[i] = (int8_t)((rand() % 255) - 127);
  const size_t outputs = total / 576; /* an upper bound on the rows of W, every K >= 576 */
  int32_t *sums = malloc(outputs * sizeof(int32_t)), *sums_at[4 * 30 + 1];
  {
    size_t at = 0, n_at = 0;
    for (int l = 0; l <= 4 * 30; l++) {
      const int N = l < 4 * 30 ? shapes[l % 4][0] : 49152, K = l < 4 * 30 ? shapes[l % 4][1] : 576;
      sums_at[l] = sums + n_at;
      for (int n = 0; n < N; n++) {
        int32_t s = 0;
        for (int k = 0; k < K; k++) s += W[at + (size_t)n * K + k];
        sums[n_at + n] = s;
      }
      at += (size_t)N * K, n_at += N;
    }
  }
  float *ws = malloc(49152 * sizeof(float)), *x = malloc(MAX_ROWS * 1536 * sizeof(float));
  for (int i = 0; i < 49152; i++) ws[i] = 0.01f;
  for (int i = 0; i < MAX_ROWS * 1536; i++) x[i] = (float)rand() / RAND_MAX - 0.3f;
  int16_t *q = aligned_alloc(64, MAX_ROWS * 1536 * sizeof(int16_t));
  float *y = malloc((size_t)MAX_ROWS * 49152 * sizeof(float));
  const size_t flush_bytes = 64 << 20;
  char *flush = malloc(flush_bytes);
  /* the same integers as a scalar loop, on one layer's q/k/v, 8 rows */
  {
    float scale[MAX_ROWS];
    int32_t zero[MAX_ROWS];
    for (int m = 0; m < 8; m++) quantize_row(x + m * 576, 576, q + m * 576, &scale[m], &zero[m]);
    product8(q, scale, zero, W, ws, sums_at[0], 960, 576, y);
    for (int m = 0; m < 8; m++)
      for (int n = 0; n < 960; n++) {
        int32_t sum = 0, s = 0;
        for (int k = 0; k < 576; k++) sum += q[m * 576 + k] * W[(size_t)n * 576 + k], s += W[(size_t)n * 576 + k];
        if (y[m * 960 + n] != (float)(sum - zero[m] * s) * scale[m] * ws[n]) { printf("mismatch %d %d\n", m, n); return 1; }
      }
  }
  const int rows[] = {0, 1, 2, 4, 8}; /* 0: a plain read of W */
  double best[5] = {1e9, 1e9, 1e9, 1e9, 1e9}, sum_ms[5] = {0};
  const int rounds = 9;
  volatile int64_t sink = 0;
  for (int round = 0; round < rounds + 1; round++)
    for (int i = 0; i < 5; i++) {
      memset(flush, round + i, flush_bytes);
      const double t = now();
      if (rows[i] == 0) {
        __m256i a = _mm256_setzero_si256();
        for (size_t j = 0; j < total; j += 32) a = _mm256_add_epi8(a, _mm256_load_si256((const __m256i *)(W + j)));
        sink += hsum(a);
      } else {
        size_t at = 0;
        for (int l = 0; l < 30; l++)
          for (int s = 0; s < 4; s++) {
            linear(rows[i], x, q, W + at, ws, sums_at[4 * l + s], shapes[s][0], shapes[s][1], y);
            at += (size_t)shapes[s][0] * shapes[s][1];
          }
        linear(rows[i], x, q, W + at, ws, sums_at[4 * 30], 49152, 576, y);
      }
      const double ms = (now() - t) * 1e3;
      if (round == 0) continue;
      sum_ms[i] += ms;
      best[i] = ms < best[i] ? ms : best[i];
    }
  for (int i = 0; i < 5; i++)
    printf("%s: mean %.2f ms, best %.2f ms (%.1f GB/s of W at the mean)\n",
           rows[i] ? (rows[i] == 1 ? "1 row " : rows[i] == 2 ? "2 rows" : rows[i] == 4 ? "4 rows" : "8 rows") : "read  ",
           sum_ms[i] / rounds, best[i], total / (sum_ms[i] / rounds) / 1e6);
  return (int)(sink & 0);
}
