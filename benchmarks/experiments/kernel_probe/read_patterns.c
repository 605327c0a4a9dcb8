/* What reading an 8-row decode step's caches costs by layout alone, at short spans: 240 ops'
 * caches (30 layers x 8 rows, SmolLM2-135M's 3 KV groups x 64, float32, T positions each), each
 * op's K and V in their own slot of one pool asked for 2 MB pages, positions 0..n-1 read after
 * 512 MB read (the weights between two steps leave the caches cold). No arithmetic but adds.
 *
 *   cc -O3 -march=native benchmarks/experiments/kernel_probe/read_patterns.c -o /tmp/read_patterns
 *   /tmp/read_patterns T N [ROUNDS]          (AVX-512; e.g. 1024 128 9)
 *
 * Layouts: "transposed" (the runtime's: K [G, T, D], V [G, D, T]: K's span contiguous per group,
 * V's 192 rows of n floats T floats apart) and "positions-outer" (V [G, T, D] too: both spans
 * contiguous per group, 2 x 3 stretches of n x 256 bytes) and "[T,G,D]" (litert-torch's default
 * layout, K and V [T, G, D]: each cache's open span one stretch of n x 768 bytes). Ways of reading each: plain loops in
 * order; every line of the op asked for first (prefetcht1 or prefetcht0) then read; the next
 * op's lines asked for (prefetcht1) while this op is read. Prints the median ms per 240 ops and
 * the GB/s it makes over the bytes of the open spans. */
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

enum { OPS = 240, G = 3, D = 64, WAYS = 4 };
static int T, n;
static size_t one; /* bytes of one cache */

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}
/* In an asm: GCC -O3 deletes a loop of nothing but prefetch builtins (kernel_api.h). */
static inline void ask(const char *p, int into_l2) {
  if (into_l2) __asm__ volatile("prefetcht1 %0" : : "m"(*p));
  else __asm__ volatile("prefetcht0 %0" : : "m"(*p));
}
/* Every line of an op's open spans. */
static void ask_op(const float *K, const float *V, int outer, int into_l2) {
  if (outer == 2) { /* [T, G, D]: each cache's open span one stretch */
    for (size_t b = 0; b < (size_t)n * G * D * 4; b += 64) ask((const char *)K + b, into_l2), ask((const char *)V + b, into_l2);
    return;
  }
  for (int g = 0; g < G; g++) {
    const char *k = (const char *)(K + (size_t)g * T * D);
    for (size_t b = 0; b < (size_t)n * D * 4; b += 64) ask(k + b, into_l2);
    if (outer) {
      const char *v = (const char *)(V + (size_t)g * T * D);
      for (size_t b = 0; b < (size_t)n * D * 4; b += 64) ask(v + b, into_l2);
    } else
      for (int d = 0; d < D; d++) {
        const char *v = (const char *)(V + ((size_t)g * D + d) * T);
        for (size_t b = 0; b < (size_t)n * 4; b += 64) ask(v + b, into_l2);
      }
  }
}
static float read_op(const float *K, const float *V, int outer) {
  __m512 a = _mm512_setzero_ps(), b = _mm512_setzero_ps();
  if (outer == 2) {
    for (size_t i = 0; i < (size_t)n * G * D; i += 16)
      a = _mm512_add_ps(a, _mm512_load_ps(K + i)), b = _mm512_add_ps(b, _mm512_load_ps(V + i));
    return _mm512_reduce_add_ps(_mm512_add_ps(a, b));
  }
  for (int g = 0; g < G; g++) {
    const float *k = K + (size_t)g * T * D;
    for (size_t i = 0; i < (size_t)n * D; i += 16) a = _mm512_add_ps(a, _mm512_load_ps(k + i));
    if (outer) {
      const float *v = V + (size_t)g * T * D;
      for (size_t i = 0; i < (size_t)n * D; i += 16) b = _mm512_add_ps(b, _mm512_load_ps(v + i));
    } else
      for (int d = 0; d < D; d++) {
        const float *v = V + ((size_t)g * D + d) * T;
        for (int i = 0; i + 16 <= n; i += 16) b = _mm512_add_ps(b, _mm512_loadu_ps(v + i));
      }
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(a, b));
}
static int compare(const void *x, const void *y) { double a = *(double *)x, b = *(double *)y; return (a > b) - (a < b); }

int main(int argc, char **argv) {
  if (argc < 3) return fprintf(stderr, "usage: %s T N [ROUNDS]\n", argv[0]), 2;
  T = atoi(argv[1]), n = atoi(argv[2]);
  const int rounds = argc > 3 ? atoi(argv[3]) : 9;
  if (T < 16 || T > 4096 || n < 16 || n > T || n % 16 || rounds < 1 || rounds > 64)
    return fprintf(stderr, "T 16..4096, N a multiple of 16 up to T, ROUNDS 1..64\n"), 2;
  one = (size_t)G * T * D * 4;
  const size_t slot = 2 * one, total = OPS * slot, huge = 2 << 20;
  char *pool = aligned_alloc(huge, (total + huge - 1) / huge * huge);
  if (!pool) return fprintf(stderr, "no memory\n"), 1;
  madvise(pool, total, MADV_HUGEPAGE);
  memset(pool, 0, total);
  const size_t flush_n = (size_t)1 << 27;
  float *flush = malloc(flush_n * 4), sink = 0;
  for (size_t i = 0; i < flush_n; i++) flush[i] = 1;
  static const char *ways[WAYS] = {"plain", "all lines first, into L2", "all lines first, into L1",
                                   "next op's lines into L2"};
  double t[3][WAYS][64];
  for (int r = 0; r < rounds; r++)
    for (int k = 0; k < 3 * WAYS; k++) {
      const int outer = (k + r) % 3, way = k / 3; /* the layouts rotate, each way in turn */
      for (size_t i = 0; i < flush_n; i += 16) sink += flush[i];
      const double t0 = now();
      for (int c = 0; c < OPS; c++) {
        const float *K = (float *)(pool + c * slot), *V = (float *)(pool + c * slot + one);
        if (way == 1 || way == 2) ask_op(K, V, outer, way == 1);
        if (way == 3) {
          if (c == 0) ask_op(K, V, outer, 1);
          if (c + 1 < OPS) ask_op((float *)(pool + (c + 1) * slot), (float *)(pool + (c + 1) * slot + one), outer, 1);
        }
        sink += read_op(K, V, outer);
      }
      t[outer][way][r] = (now() - t0) * 1e3;
    }
  const double bytes = (double)OPS * 2 * G * D * n * 4;
  printf("T=%d, %d open positions, %.1f MB a pass, median of %d rounds, ms per 240 ops (GB/s)\n", T, n, bytes / 1e6,
         rounds);
  for (int way = 0; way < WAYS; way++) {
    printf("%-26s", ways[way]);
    for (int outer = 0; outer < 3; outer++) {
      qsort(t[outer][way], rounds, sizeof(double), compare);
      const double ms = t[outer][way][rounds / 2];
      printf("  %s %.3f (%.1f)", (const char *[]){"transposed", "outer", "[T,G,D]"}[outer], ms, bytes / ms / 1e6);
    }
    printf("\n");
  }
  fprintf(stderr, "(%g)\n", sink);
  return 0;
}
