/* Feasibility probe, not in the runtime: can an int8 kernel for 8 rows pass one vpmaddwd a cycle
 * on Zen 2 (RESULTS.md section 9) by giving some rows to the float FMA pipe? x's rows hold
 * 8-bit values (XNNPACK's QD8: 0..255), W int8; a row's products summed as floats stay exact
 * (each lane sums K / 8 products of at most 255 x 127, below 2^24 for K <= 4,096), so a
 * mixed kernel gives the same integers as the int-only one (checked before timing). W's
 * block (32 rows x 576) lies in L1: this is the arithmetic's rate, not memory's.
 *
 *   for r in 4 5 6 7; do cc -O3 -mavx2 -mfma -DINT_ROWS=$r \
 *     benchmarks/experiments/kernel_probe/int8_pipes_bench.c -o /tmp/int8_pipes && /tmp/int8_pipes; done
 *
 * int-only: W's 16 bytes widened to int16 once, one vpmaddwd per row (16 multiply-adds).
 * mixed: INT_ROWS rows so, the other 8 - INT_ROWS rows as float FMAs on W widened to floats
 * (two accumulators a row, so no chain waits on the FMA's latency). */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "int8_probe.h"

#ifndef INT_ROWS
#define INT_ROWS 5
#endif
#define ROWS 8
#define FLOAT_ROWS (ROWS - INT_ROWS)
#define K 576
#define N 32

static inline float hsum_ps(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

__attribute__((noinline)) static void int_only(const int8_t *W, const int16_t *q, int32_t *y) {
  for (int n = 0; n < N; n++) {
    const int8_t *w = W + n * K;
    __m256i acc[ROWS];
    for (int m = 0; m < ROWS; m++) acc[m] = _mm256_setzero_si256();
    for (int k = 0; k < K; k += 16) {
      const __m256i w16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + k)));
      for (int m = 0; m < ROWS; m++)
        acc[m] = _mm256_add_epi32(acc[m], _mm256_madd_epi16(w16, _mm256_loadu_si256((const __m256i *)(q + m * K + k))));
    }
    for (int m = 0; m < ROWS; m++) y[m * N + n] = hsum(acc[m]);
  }
}

__attribute__((noinline)) static void mixed(const int8_t *W, const int16_t *q, const float *qf, int32_t *y) {
  for (int n = 0; n < N; n++) {
    const int8_t *w = W + n * K;
    __m256i acc[INT_ROWS];
    __m256 facc[2 * FLOAT_ROWS];
    for (int m = 0; m < INT_ROWS; m++) acc[m] = _mm256_setzero_si256();
    for (int m = 0; m < 2 * FLOAT_ROWS; m++) facc[m] = _mm256_setzero_ps();
    for (int k = 0; k < K; k += 16) {
      const __m128i w8 = _mm_loadu_si128((const __m128i *)(w + k));
      const __m256i w16 = _mm256_cvtepi8_epi16(w8);
      const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(w8));
      const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(w8, w8)));
      for (int m = 0; m < INT_ROWS; m++)
        acc[m] = _mm256_add_epi32(acc[m], _mm256_madd_epi16(w16, _mm256_loadu_si256((const __m256i *)(q + m * K + k))));
      for (int m = 0; m < FLOAT_ROWS; m++) {
        const float *x = qf + (INT_ROWS + m) * K + k;
        facc[2 * m] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(x), facc[2 * m]);
        facc[2 * m + 1] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(x + 8), facc[2 * m + 1]);
      }
    }
    for (int m = 0; m < INT_ROWS; m++) y[m * N + n] = hsum(acc[m]);
    for (int m = 0; m < FLOAT_ROWS; m++)
      y[(INT_ROWS + m) * N + n] = (int32_t)hsum_ps(_mm256_add_ps(facc[2 * m], facc[2 * m + 1]));
  }
}

int main(void) {
  int8_t *W = aligned_alloc(64, N * K);
  int16_t *q = aligned_alloc(64, ROWS * K * sizeof(int16_t));
  float *qf = aligned_alloc(64, ROWS * K * sizeof(float));
  int32_t expected[ROWS * N], got[ROWS * N];
  srand(1);
  for (int i = 0; i < N * K; i++) W[i] = (int8_t)(rand() % 255 - 127);
  for (int i = 0; i < ROWS * K; i++) qf[i] = q[i] = (int16_t)(rand() % 256);
  int_only(W, q, expected);
  mixed(W, q, qf, got);
  for (int i = 0; i < ROWS * N; i++)
    if (expected[i] != got[i]) {
      printf("mismatch at row %d, output %d: %d against %d\n", i / N, i % N, got[i], expected[i]);
      return 1;
    }
  const int reps = 20000;
  double best[2] = {1e9, 1e9};
  for (int round = 0; round < 11; round++)
    for (int kind = 0; kind < 2; kind++) {
      const double t = now();
      for (int i = 0; i < reps; i++) {
        if (kind) mixed(W, q, qf, got);
        else int_only(W, q, expected);
        __asm__ volatile("" ::"r"(expected), "r"(got) : "memory");
      }
      const double s = now() - t;
      best[kind] = s < best[kind] ? s : best[kind];
    }
  const double macs = (double)reps * N * K * ROWS;
  printf("%d int rows + %d float rows: int-only %.1f multiply-adds/ns, mixed %.1f (%.2fx the int-only rate)\n",
         INT_ROWS, FLOAT_ROWS, macs / best[0] / 1e9, macs / best[1] / 1e9, best[0] / best[1]);
  return 0;
}
