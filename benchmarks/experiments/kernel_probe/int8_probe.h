/* What the int8 probes (int8_*_bench.c) share: a clock, an int32 vector's sum, and SmolLM2-135M's
 * int8 decode linears as random weights. */
#ifndef INT8_PROBE_H
#define INT8_PROBE_H
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

static inline int32_t hsum(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

/* SmolLM2-135M's 121 int8 decode linears: 30 layers of q/k/v fused [960, 576], o [576, 576],
 * gate/up fused [3072, 576], down [576, 1536], then the head [49152, 576] (134.5 MB). */
enum { SMOLLM2_LINEARS = 30 * 4 + 1 };

/* Fills n[i], k[i] and w[i] (random int8 in [-127, 127], 64-byte aligned, with `slack` bytes
 * more past each end for reads ahead) for the SMOLLM2_LINEARS; returns the weights' bytes. */
static inline size_t smollm2_int8_linears(int8_t **w, int *n, int *k, size_t slack) {
  static const int shapes[5][2] = {{960, 576}, {576, 576}, {3072, 576}, {576, 1536}, {49152, 576}};
  size_t total = 0;
  srand(1);
  for (int i = 0; i < SMOLLM2_LINEARS; i++) {
    const int s = i == SMOLLM2_LINEARS - 1 ? 4 : i % 4;
    n[i] = shapes[s][0], k[i] = shapes[s][1];
    const size_t bytes = (size_t)n[i] * k[i];
    w[i] = aligned_alloc(64, (bytes + slack + 63) / 64 * 64);
    for (size_t j = 0; j < bytes + slack; j++) w[i][j] = (int8_t)(rand() % 255 - 127);
    total += bytes;
  }
  return total;
}
#endif
