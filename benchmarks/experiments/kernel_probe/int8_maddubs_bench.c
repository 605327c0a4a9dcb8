/* Feasibility probe, not in the runtime: can vpmaddubsw (32 multiply-adds an instruction) lift
 * Zen 2's int8 rate above one vpmaddwd (16) a cycle for a batch's 8 rows? Both run on the one
 * integer-multiply pipe, so it can only if the int16 pair sums are widened to int32 by ops of
 * the other pipes instead of a second vpmaddwd (by ones). Three loops over 8 rows of 8-bit x
 * (0..255, as XNNPACK's QD8 rows with their zero point) against int8 W ([-127, 127], QC8W):
 *
 * - vpmaddwd: W widened to int16 once, one vpmaddwd per row (int8_avx2_bench.c's loop);
 * - vpmaddubsw + vpmaddwd: llama.cpp's sign trick (x - 128 as |x - 128| unsigned, its sign
 *   moved onto W by vpsignb: pair sums stay within +-2 * 128 * 127), widened by vpmaddwd;
 * - vpmaddubsw + xor/shift: widened without a multiply: each int32 lane's two int16 sums are
 *   added up as the lane XOR 0x8000 (hi * 65536 + lo + 32768) and the lane shifted right by 16
 *   (hi), exact modulo 2^32; 4 rows a pass over a W row (16 accumulators, no spills).
 *
 * Every loop's int32 sums equal a scalar loop's (checked first, also at the extremes: x - 128 =
 * -128 and W = +-127). Over SmolLM2-135M's int8 decode linears (134.5 MB, W from memory, 64 MB
 * written between runs) and again with one layer's W in L2 (the multiply rate alone), 7
 * alternating rounds:
 *
 *   cc -O3 -mavx2 -mfma benchmarks/experiments/kernel_probe/int8_maddubs_bench.c -o /tmp/maddubs && /tmp/maddubs
 *
 * Results: RESULTS.md section 9. */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "int8_probe.h"

#define ROWS 8
enum { MADDWD, UBS_MADDWD, UBS_SHIFT, LOOPS };
static const char *const NAMES[LOOPS] = {"vpmaddwd", "vpmaddubsw + vpmaddwd", "vpmaddubsw + xor/shift"};


/* The rows of x three ways: q (0..255) as int16, x - 128 signed, |x - 128| unsigned. */
typedef struct {
  int16_t *q;
  int8_t *centred;
  uint8_t *magnitude;
} Rows;

/* out[m, n] = sum_k q[m, k] W[n, k] */
static void loop_maddwd(const Rows *x, const int8_t *W, int N, int K, int32_t *out) {
  for (int n = 0; n < N; n++) {
    const int8_t *w = W + (size_t)n * K;
    __m256i acc[ROWS];
    for (int m = 0; m < ROWS; m++) acc[m] = _mm256_setzero_si256();
    for (int k = 0; k < K; k += 16) {
      if ((k & 63) == 0) _mm_prefetch((const char *)(w + 8192 + k), _MM_HINT_T0);
      const __m256i w16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + k)));
      for (int m = 0; m < ROWS; m++)
        acc[m] = _mm256_add_epi32(acc[m], _mm256_madd_epi16(w16, _mm256_loadu_si256((const __m256i *)(x->q + (size_t)m * K + k))));
    }
    for (int m = 0; m < ROWS; m++) out[(size_t)m * N + n] = hsum(acc[m]);
  }
}

/* out[m, n] = sum_k (q[m, k] - 128) W[n, k]; the caller adds 128 times W's row sum. */
static void loop_maddubs_maddwd(const Rows *x, const int8_t *W, int N, int K, int32_t *out) {
  const __m256i ones = _mm256_set1_epi16(1);
  for (int n = 0; n < N; n++) {
    const int8_t *w = W + (size_t)n * K;
    __m256i acc[ROWS];
    for (int m = 0; m < ROWS; m++) acc[m] = _mm256_setzero_si256();
    for (int k = 0; k < K; k += 32) {
      if ((k & 63) == 0) _mm_prefetch((const char *)(w + 8192 + k), _MM_HINT_T0);
      const __m256i wv = _mm256_loadu_si256((const __m256i *)(w + k));
      for (int m = 0; m < ROWS; m++) {
        const size_t at = (size_t)m * K + k;
        const __m256i signed_w = _mm256_sign_epi8(wv, _mm256_loadu_si256((const __m256i *)(x->centred + at)));
        const __m256i pairs = _mm256_maddubs_epi16(_mm256_loadu_si256((const __m256i *)(x->magnitude + at)), signed_w);
        acc[m] = _mm256_add_epi32(acc[m], _mm256_madd_epi16(pairs, ones));
      }
    }
    for (int m = 0; m < ROWS; m++) out[(size_t)m * N + n] = hsum(acc[m]);
  }
}

/* The same sums, the pairs widened by xor and shift, 4 rows a pass over W's row. */
static void loop_maddubs_shift(const Rows *x, const int8_t *W, int N, int K, int32_t *out) {
  const __m256i low_sign = _mm256_set1_epi32(0x8000);
  const uint32_t steps = (uint32_t)(K / 32);
  for (int n = 0; n < N; n++) {
    const int8_t *w = W + (size_t)n * K;
    for (int first = 0; first < ROWS; first += 4) {
      __m256i lanes[4], highs[4];
      for (int m = 0; m < 4; m++) lanes[m] = highs[m] = _mm256_setzero_si256();
      for (int k = 0; k < K; k += 32) {
        if (first == 0 && (k & 63) == 0) _mm_prefetch((const char *)(w + 8192 + k), _MM_HINT_T0);
        const __m256i wv = _mm256_loadu_si256((const __m256i *)(w + k));
        for (int m = 0; m < 4; m++) {
          const size_t at = (size_t)(first + m) * K + k;
          const __m256i signed_w = _mm256_sign_epi8(wv, _mm256_loadu_si256((const __m256i *)(x->centred + at)));
          const __m256i pairs = _mm256_maddubs_epi16(_mm256_loadu_si256((const __m256i *)(x->magnitude + at)), signed_w);
          lanes[m] = _mm256_add_epi32(lanes[m], _mm256_xor_si256(pairs, low_sign));
          highs[m] = _mm256_add_epi32(highs[m], _mm256_srai_epi32(pairs, 16));
        }
      }
      for (int m = 0; m < 4; m++) { /* lanes = 65536 hi + lo + 32768 per step, summed over 8 lanes */
        const uint32_t lane_sum = (uint32_t)hsum(lanes[m]), high_sum = (uint32_t)hsum(highs[m]);
        out[(size_t)(first + m) * N + n] = (int32_t)(lane_sum - 65535u * high_sum - 32768u * 8u * steps);
      }
    }
  }
}

static void run(int loop, const Rows *x, const int8_t *W, int N, int K, int32_t *out) {
  if (loop == MADDWD) loop_maddwd(x, W, N, K, out);
  else if (loop == UBS_MADDWD) loop_maddubs_maddwd(x, W, N, K, out);
  else loop_maddubs_shift(x, W, N, K, out);
}

/* Each loop's sums against a scalar loop's, over N x K of W. */
static int exact(const Rows *x, const int8_t *W, int N, int K, int32_t *out) {
  for (int loop = 0; loop < LOOPS; loop++) {
    run(loop, x, W, N, K, out);
    for (int m = 0; m < ROWS; m++)
      for (int n = 0; n < N; n++) {
        int32_t sum = 0, row_sum = 0;
        for (int k = 0; k < K; k++) sum += x->q[(size_t)m * K + k] * W[(size_t)n * K + k], row_sum += W[(size_t)n * K + k];
        if (out[(size_t)m * N + n] + (loop == MADDWD ? 0 : 128 * row_sum) != sum) {
          printf("%s: row %d, output %d differs\n", NAMES[loop], m, n);
          return 0;
        }
      }
  }
  return 1;
}

static void fill_rows(Rows *x, int values_from_rand) {
  for (int i = 0; i < ROWS * 1536; i++) {
    const int v = values_from_rand ? rand() % 256 : 0;
    x->q[i] = (int16_t)v, x->centred[i] = (int8_t)(v - 128), x->magnitude[i] = (uint8_t)abs(v - 128);
  }
}

int main(void) {
  const int shapes[4][2] = {{960, 576}, {576, 576}, {3072, 576}, {576, 1536}}; /* q/k/v, o, gate/up, down */
  size_t total = (size_t)49152 * 576; /* and the head */
  for (int i = 0; i < 4; i++) total += (size_t)30 * shapes[i][0] * shapes[i][1];
  int8_t *W = aligned_alloc(64, total);
  srand(1);
  for (size_t i = 0; i < total; i++) W[i] = (int8_t)((rand() % 255) - 127);
  Rows x = {aligned_alloc(64, ROWS * 1536 * sizeof(int16_t)), aligned_alloc(64, ROWS * 1536), aligned_alloc(64, ROWS * 1536)};
  int32_t *out = malloc((size_t)ROWS * 49152 * sizeof(int32_t));
  int8_t extremes[32 * 64];
  for (int i = 0; i < 32 * 64; i++) extremes[i] = (i & 1) ? -127 : 127;
  fill_rows(&x, 0);
  if (!exact(&x, extremes, 32, 64, out)) return 1;
  fill_rows(&x, 1);
  if (!exact(&x, W, 960, 576, out)) return 1;
  printf("every loop's sums equal the scalar loop's\n");
  const size_t flush_bytes = 64 << 20;
  char *flush = malloc(flush_bytes);
  const int rounds = 7;
  for (int in_l2 = 0; in_l2 < 2; in_l2++) {
    double ms[LOOPS] = {0};
    for (int round = 0; round <= rounds; round++)
      for (int i = 0; i < LOOPS; i++) {
        const int loop = round & 1 ? LOOPS - 1 - i : i;
        if (!in_l2) memset(flush, round + i, flush_bytes);
        const double start = now();
        if (in_l2) { /* one layer's q/k/v, o and two 576-row blocks of gate/up, 30 times */
          for (int repeat = 0; repeat < 30; repeat++)
            for (int s = 0; s < 4; s++) run(loop, &x, W, s == 2 ? 576 : shapes[s][0], shapes[s][1], out);
        } else {
          size_t at = 0;
          for (int layer = 0; layer < 30; layer++)
            for (int s = 0; s < 4; s++) {
              run(loop, &x, W + at, shapes[s][0], shapes[s][1], out);
              at += (size_t)shapes[s][0] * shapes[s][1];
            }
          run(loop, &x, W + at, 49152, 576, out);
        }
        if (round) ms[loop] += (now() - start) * 1e3 / rounds;
      }
    printf("%s:\n", in_l2 ? "W in L2" : "W from memory (134.5 MB)");
    for (int loop = 0; loop < LOOPS; loop++)
      printf("  %-24s %6.2f ms  %.2fx vpmaddwd's time\n", NAMES[loop], ms[loop], ms[loop] / ms[MADDWD]);
  }
  return 0;
}
