/* SmolLM2-135M's 151 decode linears (q/k/v fused, o, gate, up, down per layer; lm_head) through
 * linear_rows.c's product() alone, 1 thread, random weights (538 MB, more than any cache):
 * ms per pass over all of them for ROWS rows of x, the best and the mean of REPS passes.
 *
 *   cc -O3 -fno-math-errno -mavx2 -mfma -mf16c -DKERNEL="\"$PWD/runtime/executor/kernels/linear_rows.c\"" \
 *       benchmarks/experiments/kernel_probe/linear_rows_bench.c -o /tmp/linear_rows_bench -lm
 *   /tmp/linear_rows_bench ROWS REPS      # e.g. 1 5, then 8 3
 *
 * (the runtime's flags for this CPU: python3 -c "from runtime.executor import kernels;
 * print(*kernels.isa_flags())"). Build a second copy from another version of the source to
 * compare, and run the two in alternating rounds. */
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
  if (argc != 3 || atoi(argv[1]) < 1 || atoi(argv[1]) > 8 || atoi(argv[2]) < 1) {
    fprintf(stderr, "usage: %s ROWS(1-8) REPS\n", argv[0]);
    return 2;
  }
  const int rows = atoi(argv[1]), reps = atoi(argv[2]);
  enum { LINEARS = 151 };
  const int layer[5][2] = {{960, 576}, {576, 576}, {1536, 576}, {1536, 576}, {576, 1536}}; /* N, K */
  float *w[LINEARS];
  int N[LINEARS], K[LINEARS];
  for (int i = 0; i < LINEARS - 1; i++) N[i] = layer[i % 5][0], K[i] = layer[i % 5][1];
  N[LINEARS - 1] = 49152, K[LINEARS - 1] = 576; /* lm_head */
  srand(1);
  for (int i = 0; i < LINEARS; i++) {
    w[i] = aligned_alloc(64, sizeof(float) * N[i] * K[i]);
    for (size_t e = 0; e < (size_t)N[i] * K[i]; e++) w[i][e] = (float)rand() / RAND_MAX - 0.5f;
  }
  float *x = aligned_alloc(64, sizeof(float) * 8 * 1536), *y = aligned_alloc(64, sizeof(float) * 8 * 49152);
  for (int e = 0; e < 8 * 1536; e++) x[e] = (float)rand() / RAND_MAX;
  double best = 1e30, total = 0;
  for (int r = 0; r < reps; r++) {
    const double start = now_ms();
    for (int i = 0; i < LINEARS; i++) product(x, rows, K[i], w[i], 0, N[i], N[i], y);
    const double took = now_ms() - start;
    best = took < best ? took : best;
    total += took;
  }
  printf("%d rows: best %.2f ms, mean %.2f ms (y[0] %g)\n", rows, best, total / reps, y[0]);
  return 0;
}
