/* A model's decode linears (q/k/v fused, o, gate, up, down per layer; lm_head) through
 * linear_rows.c's product() alone, 1 thread, random weights (more than any cache): ms per pass
 * over all of them for ROWS rows of x, the best and the mean of REPS passes, and a plain read
 * of the same bytes. MODEL: smollm2 (SmolLM2-135M: 30 layers, 151 linears, 538 MB; the
 * default) or gemma3 (Gemma 3 270M: 18 layers, 91 linears, 1.07 GB, 63% of it the lm_head).
 *
 *   cc -O3 -fno-math-errno -mavx2 -mfma -mf16c -DKERNEL="\"$PWD/runtime/executor/kernels/linear_rows.c\"" \
 *       benchmarks/experiments/kernel_probe/linear_rows_bench.c -o /tmp/linear_rows_bench -lm
 *   /tmp/linear_rows_bench ROWS REPS [MODEL]      # e.g. 1 5, then 8 3
 *
 * (the runtime's flags for this CPU: python3 -c "from runtime.executor import kernels;
 * print(*kernels.isa_flags())"). Build a second copy from another version of the source to
 * compare, and run the two in alternating rounds. */
#include KERNEL
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now_ms(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

int main(int argc, char **argv) {
  const int gemma = argc == 4 && !strcmp(argv[3], "gemma3");
  if (argc < 3 || argc > 4 || atoi(argv[1]) < 1 || atoi(argv[1]) > 8 || atoi(argv[2]) < 1 ||
      (argc == 4 && !gemma && strcmp(argv[3], "smollm2"))) {
    fprintf(stderr, "usage: %s ROWS(1-8) REPS [smollm2|gemma3]\n", argv[0]);
    return 2;
  }
  const int rows = atoi(argv[1]), reps = atoi(argv[2]);
  /* N, K of the five linears of a layer, the layers, the lm_head */
  const int smollm2[5][2] = {{960, 576}, {576, 576}, {1536, 576}, {1536, 576}, {576, 1536}};
  const int gemma3[5][2] = {{1536, 640}, {640, 1024}, {2048, 640}, {2048, 640}, {640, 2048}};
  const int(*layer)[2] = gemma ? gemma3 : smollm2;
  const int linears = (gemma ? 18 : 30) * 5 + 1, head_n = gemma ? 262144 : 49152, head_k = gemma ? 640 : 576;
  float **w = malloc(sizeof(float *) * linears);
  int *N = malloc(sizeof(int) * linears), *K = malloc(sizeof(int) * linears);
  for (int i = 0; i < linears - 1; i++) N[i] = layer[i % 5][0], K[i] = layer[i % 5][1];
  N[linears - 1] = head_n, K[linears - 1] = head_k;
  size_t bytes = 0;
  srand(1);
  for (int i = 0; i < linears; i++) {
    const size_t n = (size_t)N[i] * K[i];
    w[i] = aligned_alloc(64, sizeof(float) * n);
    for (size_t e = 0; e < n; e++) w[i][e] = (float)(e % 1000) / 1000.f - 0.5f;
    bytes += sizeof(float) * n;
  }
  float *x = aligned_alloc(64, sizeof(float) * 8 * 2048), *y = aligned_alloc(64, sizeof(float) * 8 * head_n);
  for (int e = 0; e < 8 * 2048; e++) x[e] = (float)rand() / RAND_MAX;
  double best = 1e30, total = 0, read_best = 1e30;
  vf sink = {0};
  for (int r = 0; r < reps; r++) {
    double start = now_ms();
    for (int i = 0; i < linears; i++) product(x, rows, K[i], w[i], 0, N[i], N[i], y);
    const double took = now_ms() - start;
    best = took < best ? took : best;
    total += took;
    start = now_ms(); /* the same bytes read, four vectors a step */
    for (int i = 0; i < linears; i++) {
      const vf *p = (const vf *)w[i];
      for (size_t e = 0; e + 4 <= (size_t)N[i] * K[i] / W; e += 4) sink += (p[e] + p[e + 1]) + (p[e + 2] + p[e + 3]);
    }
    const double read = now_ms() - start;
    read_best = read < read_best ? read : read_best;
  }
  printf("%s, %d rows: best %.2f ms, mean %.2f ms (%.1f GB/s at the best); a plain read %.2f ms (%.1f GB/s) (y[0] %g, %g)\n",
         gemma ? "gemma3" : "smollm2", rows, best, total / reps, bytes / best / 1e6, read_best, bytes / read_best / 1e6,
         y[0], sink[0]);
  return 0;
}
