/* Feasibility probe, not in the runtime: what an int8 kernel of ours on AVX-512 VNNI could take
 * off an 8-row batch step's linears on Zen 4, where XNNPACK's int8 GEMM takes 8 rows for ~1.7x one
 * row (LiteRT's op profile of SmolLM2-135M's 8-row int8 step: 8.2 ms against 4.8).
 *
 * The arithmetic is XNNPACK's QD8 x QC8W integer part: rows of x as bytes 0..255 (each row
 * quantized with its own zero point), W int8 [N, K] as the model stores it (unpacked), int32 sums
 * by vpdpbusd (64 multiply-adds an instruction). Two rows of W a pass, their 64 bytes at a time
 * against every row of x (16 accumulators for 8 rows), prefetching W 64 KB ahead into L2. The
 * sums per (row of W, row of x) reduced two ways:
 *   scalar: _mm512_reduce_add_epi32 per accumulator;
 *   tree:   the 16 accumulators folded into one vector of 16 sums (4 levels of unpack / shuffle
 *           and add), stored at once.
 * Over SmolLM2-135M's 121 int8 decode linears (q/k/v fused [960, 576], o [576, 576], gate/up fused
 * [3072, 576], down [576, 1536] x 30, the head [49152, 576]: 134.5 MB of random W), W from memory
 * (64 MB written between passes) and again with one layer's W in cache (the multiply rate alone), beside
 * a plain read of the same bytes; every loop's sums checked against a scalar loop first; rounds
 * alternate the loops.
 *
 *   cc -O3 -march=native benchmarks/experiments/kernel_probe/int8_vnni_bench.c -o /tmp/int8_vnni && /tmp/int8_vnni [ROUNDS]
 *
 * Results: RESULTS.md section 14. */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "int8_probe.h"

#define ROWS 8
#define AHEAD 65536

static inline __m512i fold32(__m512i a, __m512i b) { return _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b)); }
static inline __m512i fold64(__m512i a, __m512i b) { return _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b)); }
static inline __m512i fold128(__m512i a, __m512i b) {
  return _mm512_add_epi32(_mm512_shuffle_i32x4(a, b, 0x88), _mm512_shuffle_i32x4(a, b, 0xdd));
}
/* Lane i of the result: the sum of acc[i]'s 16 lanes (checked in main). */
static inline __m512i tree16(const __m512i *acc) {
  __m512i a[8], b[4], c[2];
  for (int i = 0; i < 8; i++) a[i] = fold32(acc[2 * i], acc[2 * i + 1]);
  for (int i = 0; i < 4; i++) b[i] = fold64(a[2 * i], a[2 * i + 1]);
  for (int i = 0; i < 2; i++) c[i] = fold128(b[2 * i], b[2 * i + 1]);
  return fold128(c[0], c[1]);
}

/* y[m, n] = sum_k x[m, k] W[n, k] for R rows of x (R a constant where inlined), N even. acc[2m]
 * holds row m of x against W's row n, acc[2m + 1] against row n + 1. */
static inline __attribute__((always_inline)) void rows_dot(const uint8_t *x, int R, const int8_t *w, int N, int K,
                                                           int tree, int32_t *y) {
  for (int n = 0; n < N; n += 2) {
    const int8_t *w0 = w + (size_t)n * K, *w1 = w0 + K;
    __m512i acc[2 * ROWS];
    for (int i = 0; i < 2 * ROWS; i++) acc[i] = _mm512_setzero_si512();
    for (int k = 0; k < K; k += 64) {
      _mm_prefetch((const char *)(w0 + AHEAD + k), _MM_HINT_T1);
      _mm_prefetch((const char *)(w1 + AHEAD + k), _MM_HINT_T1);
      const __m512i v0 = _mm512_loadu_si512(w0 + k), v1 = _mm512_loadu_si512(w1 + k);
      for (int m = 0; m < R; m++) {
        const __m512i xm = _mm512_loadu_si512(x + (size_t)m * K + k);
        acc[2 * m] = _mm512_dpbusd_epi32(acc[2 * m], xm, v0);
        acc[2 * m + 1] = _mm512_dpbusd_epi32(acc[2 * m + 1], xm, v1);
      }
    }
    if (tree && R == ROWS) {
      int32_t sums[2 * ROWS];
      _mm512_storeu_si512(sums, tree16(acc));
      for (int m = 0; m < R; m++) y[(size_t)m * N + n] = sums[2 * m], y[(size_t)m * N + n + 1] = sums[2 * m + 1];
    } else {
      for (int m = 0; m < R; m++) {
        y[(size_t)m * N + n] = _mm512_reduce_add_epi32(acc[2 * m]);
        y[(size_t)m * N + n + 1] = _mm512_reduce_add_epi32(acc[2 * m + 1]);
      }
    }
  }
}

enum { ONE_ROW, EIGHT_SCALAR, EIGHT_TREE, READ, LOOPS };
static const char *const NAMES[LOOPS] = {"1 row", "8 rows, scalar sums", "8 rows, tree sums", "plain read"};

static void run(int loop, const uint8_t *x, int8_t *const *w, const int *n, const int *k, int linears, int32_t *y) {
  __m512i sink = _mm512_setzero_si512();
  for (int i = 0; i < linears; i++) {
    if (loop == ONE_ROW) rows_dot(x, 1, w[i], n[i], k[i], 0, y);
    else if (loop == EIGHT_SCALAR) rows_dot(x, ROWS, w[i], n[i], k[i], 0, y);
    else if (loop == EIGHT_TREE) rows_dot(x, ROWS, w[i], n[i], k[i], 1, y);
    else
      for (size_t j = 0; j < (size_t)n[i] * k[i]; j += 64) sink = _mm512_add_epi32(sink, _mm512_loadu_si512(w[i] + j));
  }
  static volatile int32_t kept __attribute__((unused));
  kept = _mm512_reduce_add_epi32(sink); /* keeps the read */
}

int main(int argc, char **argv) {
  const int rounds = argc > 1 ? atoi(argv[1]) : 7;
  int8_t *w[SMOLLM2_LINEARS];
  int n[SMOLLM2_LINEARS], k[SMOLLM2_LINEARS];
  const size_t total = smollm2_int8_linears(w, n, k, AHEAD + 64); /* the prefetches run past the end */
  uint8_t *x = aligned_alloc(64, ROWS * 1536);
  for (int i = 0; i < ROWS * 1536; i++) x[i] = (uint8_t)(rand() & 255);
  x[0] = 255, w[0][0] = -127; /* the extremes */
  int32_t *y = malloc(sizeof(int32_t) * ROWS * 49152);
  { /* the tree's lanes */
    __m512i acc[16];
    int32_t lanes[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm512_set1_epi32(1 << i);
    _mm512_storeu_si512(lanes, tree16(acc));
    for (int i = 0; i < 16; i++)
      if (lanes[i] != 16 << i) return printf("tree lane %d: %d\n", i, lanes[i]), 1;
  }
  for (int loop = 0; loop < READ; loop++) /* every loop's sums against a scalar loop's, on a layer's 4 linears */
    for (int i = 0; i < 4; i++) {
      run(loop, x, &w[i], &n[i], &k[i], 1, y);
      for (int m = 0; m < (loop == ONE_ROW ? 1 : ROWS); m++)
        for (int o = 0; o < n[i]; o++) {
          int32_t s = 0;
          for (int j = 0; j < k[i]; j++) s += (int32_t)x[(size_t)m * k[i] + j] * w[i][(size_t)o * k[i] + j];
          if (s != y[(size_t)m * n[i] + o]) return printf("%s: linear %d, y[%d, %d] %d, expected %d\n", NAMES[loop], i, m, o, y[(size_t)m * n[i] + o], s), 1;
        }
    }
  char *junk = malloc(64 << 20);
  double from_memory[LOOPS][64], in_l2[LOOPS][64];
  const int R = rounds < 64 ? rounds : 64;
  for (int r = 0; r < R; r++)
    for (int j = 0; j < LOOPS; j++) {
      const int loop = r % 2 ? LOOPS - 1 - j : j;
      memset(junk, r + j, 64 << 20);
      double t = now();
      run(loop, x, w, n, k, SMOLLM2_LINEARS, y);
      from_memory[loop][r] = (now() - t) * 1e3;
      /* one layer's 4 linears (3.5 MB, in the last-level cache after a first pass): 32 passes, scaled to the whole */
      run(loop, x, w, n, k, 4, y);
      t = now();
      for (int p = 0; p < 32; p++) run(loop, x, w, n, k, 4, y);
      size_t layer = 0;
      for (int i = 0; i < 4; i++) layer += (size_t)n[i] * k[i];
      in_l2[loop][r] = (now() - t) * 1e3 / 32 * (double)total / (double)layer;
    }
  printf("%.1f MB of int8 W, %d rounds, ms per pass over it: median [min-max]\n", total / 1e6, R);
  for (int loop = 0; loop < LOOPS; loop++) {
    double *s[2] = {from_memory[loop], in_l2[loop]};
    printf("%-22s", NAMES[loop]);
    for (int h = 0; h < 2; h++) {
      for (int a = 0; a < R; a++) /* sort */
        for (int b = a + 1; b < R; b++)
          if (s[h][b] < s[h][a]) { const double t = s[h][a]; s[h][a] = s[h][b]; s[h][b] = t; }
      printf("  %s %6.2f [%.2f-%.2f]", h ? "layer in cache" : "from memory", s[h][R / 2], s[h][0], s[h][R - 1]);
    }
    printf("\n");
  }
  return 0;
}
