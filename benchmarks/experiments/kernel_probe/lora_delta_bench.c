/* SmolLM2-135M's 210 all-linear rank-8 LoRA deltas of a single-row decode step (q/k/v/o,
 * gate/up/down of 30 layers) through lora_delta.c's two passes alone, 1 thread, random factors
 * (9.8 MB in float32): ms per step over all of them, the best and the mean of REPS steps, with
 * the factors hot (read again at once) or cold (FLUSH_MB of other memory read between two
 * layers, as a step's weights pass through the caches between two deltas).
 *
 *   cc -O3 -fno-math-errno -mavx2 -mfma -mf16c -DKERNEL="\"$PWD/runtime/executor/kernels/lora_delta.c\"" \
 *       benchmarks/experiments/kernel_probe/lora_delta_bench.c -o /tmp/lora_delta_bench -lm
 *   /tmp/lora_delta_bench REPS FLUSH_MB     # e.g. 20 0 (hot), then 20 8 (cold)
 *
 * Build a second copy from another version of the source to compare, and run the two in
 * alternating rounds. The flush's own time is not counted. */
#include KERNEL
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double now_ms(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

int main(int argc, char **argv) {
  if (argc != 3 || atoi(argv[1]) < 1 || atoi(argv[2]) < 0) {
    fprintf(stderr, "usage: %s REPS FLUSH_MB\n", argv[0]);
    return 2;
  }
  const int reps = atoi(argv[1]), r = 8;
  const size_t flush_bytes = (size_t)atoi(argv[2]) << 20;
  enum { LAYERS = 30, PER = 7 };
  const int fan[PER][2] = {{576, 576}, {576, 192}, {576, 192}, {576, 576}, {576, 1536}, {576, 1536}, {1536, 576}};
  float *a[LAYERS][PER], *b[LAYERS][PER];
  srand(1);
  for (int l = 0; l < LAYERS; l++)
    for (int p = 0; p < PER; p++) {
      a[l][p] = aligned_alloc(64, sizeof(float) * fan[p][0] * r);
      b[l][p] = aligned_alloc(64, sizeof(float) * fan[p][1] * r);
      for (int e = 0; e < fan[p][0] * r; e++) a[l][p][e] = (float)rand() / RAND_MAX - 0.5f;
      for (int e = 0; e < fan[p][1] * r; e++) b[l][p][e] = (float)rand() / RAND_MAX - 0.5f;
    }
  float *x = aligned_alloc(64, sizeof(float) * 1536), *o = aligned_alloc(64, sizeof(float) * 1536), h[8];
  for (int e = 0; e < 1536; e++) x[e] = (float)rand() / RAND_MAX;
  char *flush = flush_bytes ? malloc(flush_bytes) : NULL;
  for (size_t e = 0; e < flush_bytes; e++) flush[e] = (char)e;
  volatile long sink = 0;
  double best = 1e30, total = 0;
  for (int rep = 0; rep < reps; rep++) {
    double took = 0;
    for (int l = 0; l < LAYERS; l++) {
      long s = 0;
      for (size_t e = 0; e < flush_bytes; e += 64) s += flush[e];
      sink += s;
      const double start = now_ms();
      for (int p = 0; p < PER; p++) {
        down_f32(x, a[l][p], fan[p][0], r, h);
        up_f32(h, b[l][p], r, fan[p][1], o);
      }
      took += now_ms() - start;
    }
    best = took < best ? took : best;
    total += took;
  }
  printf("flush %zu MB: best %.3f ms, mean %.3f ms (o[0] %g)\n", flush_bytes >> 20, best, total / reps, o[0]);
  return 0;
}
