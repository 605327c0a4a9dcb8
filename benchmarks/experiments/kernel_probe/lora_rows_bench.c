/* 8 rows of a batched decode step through lora_delta.c's passes alone: SmolLM2-135M's attention
 * deltas (q/k/v/o of 30 layers, rank 8), each row its own random factors (29.5 MB in float32,
 * more than the caches hold, so every step reads them from memory), 1 thread. Three ways, in
 * alternating rounds, ms per step (best and mean of REPS):
 *   - row by row: down then up for each row in turn (the op before the batched passes);
 *   - downs 4, ups 1: down4 (four rows' factors in flight), then up row by row;
 *   - downs 4, ups 2: down4 and up2, as the op runs a batch's rows now.
 * FLUSH_MB of other memory is read between two layers, as a step's weights pass through the
 * caches between two deltas (its time not counted). Each way's outputs are checked against row
 * by row's first, bit for bit: the probe fails if one differs.
 *
 *   cc -O3 -fno-math-errno -mavx2 -mfma -mf16c -DKERNEL="\"$PWD/runtime/executor/kernels/lora_delta.c\"" \
 *       benchmarks/experiments/kernel_probe/lora_rows_bench.c -o /tmp/lora_rows_bench -lm
 *   /tmp/lora_rows_bench REPS FLUSH_MB     # e.g. 20 8
 */
#include KERNEL
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { LAYERS = 30, PER = 4, N = 8, R = 8, WAYS = 3 };
static const int fan[PER][2] = {{576, 576}, {576, 192}, {576, 192}, {576, 576}};
static const char *const NAMES[WAYS] = {"row by row", "downs 4, ups 1", "downs 4, ups 2"};

static double now_ms(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

static void deltas(int way, const float *x, const float *A, const float *B, int in, int out, float *o) {
  float h[N * R] __attribute__((aligned(32)));
  const size_t a_step = (size_t)in * R, b_step = (size_t)R * out;
  if (way == 0) {
    for (int n = 0; n < N; n++) {
      down_f32(x + n * in, A + n * a_step, in, R, h);
      up_f32(h, B + n * b_step, R, out, o + n * out);
    }
    return;
  }
  for (int n = 0; n < N; n += 4) down4_f32(x + n * in, A + n * a_step, in, R, a_step, h + n * R);
  if (way == 1)
    for (int n = 0; n < N; n++) up_f32(h + n * R, B + n * b_step, R, out, o + n * out);
  else
    for (int n = 0; n < N; n += 2) up2_f32(h + n * R, B + n * b_step, R, out, b_step, o + n * out);
}

int main(int argc, char **argv) {
  if (argc != 3 || atoi(argv[1]) < 1 || atoi(argv[2]) < 0) {
    fprintf(stderr, "usage: %s REPS FLUSH_MB\n", argv[0]);
    return 2;
  }
  const int reps = atoi(argv[1]);
  const size_t flush_bytes = (size_t)atoi(argv[2]) << 20;
  float *a[LAYERS][PER], *b[LAYERS][PER];
  srand(1);
  for (int l = 0; l < LAYERS; l++)
    for (int p = 0; p < PER; p++) {
      a[l][p] = aligned_alloc(64, sizeof(float) * N * fan[p][0] * R);
      b[l][p] = aligned_alloc(64, sizeof(float) * N * fan[p][1] * R);
      for (int e = 0; e < N * fan[p][0] * R; e++) a[l][p][e] = (float)rand() / RAND_MAX - 0.5f;
      for (int e = 0; e < N * fan[p][1] * R; e++) b[l][p][e] = (float)rand() / RAND_MAX - 0.5f;
    }
  float *x = aligned_alloc(64, sizeof(float) * N * 576), *o[WAYS];
  for (int e = 0; e < N * 576; e++) x[e] = (float)rand() / RAND_MAX;
  for (int w = 0; w < WAYS; w++) o[w] = aligned_alloc(64, sizeof(float) * N * 576);
  char *flush = malloc(flush_bytes + 1);
  for (size_t e = 0; e < flush_bytes; e++) flush[e] = (char)e;
  for (int l = 0; l < LAYERS; l++)  /* every way's outputs against row by row's, untimed */
    for (int p = 0; p < PER; p++)
      for (int w = 0; w < WAYS; w++) {
        deltas(w, x, a[l][p], b[l][p], fan[p][0], fan[p][1], o[w]);
        if (w && memcmp(o[w], o[0], sizeof(float) * N * fan[p][1])) {
          fprintf(stderr, "%s differs from row by row (layer %d, projection %d)\n", NAMES[w], l, p);
          return 1;
        }
      }
  volatile long sink = 0;
  double total[WAYS] = {0}, best[WAYS];
  for (int w = 0; w < WAYS; w++) best[w] = 1e30;
  for (int rep = 0; rep < reps; rep++)
    for (int w = 0; w < WAYS; w++) {
      double took = 0;
      for (int l = 0; l < LAYERS; l++) {
        long s = 0;
        for (size_t e = 0; e < flush_bytes; e += 64) s += flush[e];
        sink += s;
        const double start = now_ms();
        for (int p = 0; p < PER; p++) deltas(w, x, a[l][p], b[l][p], fan[p][0], fan[p][1], o[w]);
        took += now_ms() - start;
      }
      total[w] += took;
      best[w] = took < best[w] ? took : best[w];
    }
  for (int w = 0; w < WAYS; w++)
    printf("flush %zu MB, %s: best %.3f ms, mean %.3f ms (%.2fx row by row)\n", flush_bytes >> 20, NAMES[w], best[w],
           total[w] / reps, total[w] / total[0]);
  return 0;
}
