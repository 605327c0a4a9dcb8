/* The int8 linear_rows kernel of int8_tiles.patch (AMX tiles; not in the runtime) alone, over
 * SmolLM2-135M's 121 int8 decode linears (30 layers of q/k/v fused [960, 576], o [576, 576],
 * gate/up fused [3072, 576], down [576, 1536]; the head [49152, 576]: 134.5 MB of random
 * int8 weights), 1 row and 8 rows, beside a plain read of the same bytes, alternating rounds.
 *
 *   git apply benchmarks/experiments/kernel_probe/int8_tiles.patch   # on the runtime of 8688e3c
 *   cc -O3 -fno-math-errno -mavx512f -mavx2 -mfma -mf16c -mavx512bw -mavx512vnni -mamx-tile \
 *      -mamx-int8 -DKERNEL="\"$PWD/runtime/executor/kernels/linear_rows.c\"" \
 *      benchmarks/experiments/kernel_probe/int8_tiles_bench.c -o /tmp/int8_tiles -lm && /tmp/int8_tiles
 *
 * Results: RESULTS.md section 7. */
#include KERNEL
#include <stdio.h>
#include <time.h>

#include "int8_probe.h"

int main(void) {
  enum { LINEARS = SMOLLM2_LINEARS };
  int8_t *w[LINEARS];
  float *scales[LINEARS];
  int n[LINEARS], k[LINEARS];
  const size_t total = smollm2_int8_linears(w, n, k, 0);
  for (int i = 0; i < LINEARS; i++) {
    scales[i] = malloc(sizeof(float) * n[i]);
    for (int j = 0; j < n[i]; j++) scales[i][j] = 0.01f;
  }
  float *x = malloc(sizeof(float) * 8 * 2048), *y = malloc(sizeof(float) * 8 * 49152);
  for (int i = 0; i < 8 * 2048; i++) x[i] = (rand() % 1000) / 500.f - 1;
#if AMX
  printf("AMX build, tiles usable: %d\n", amx_usable());
#endif
  printf("%.1f MB of weights; ms per pass over all of them\n", total / 1e6);
  volatile long sink = 0;
  for (int round = 0; round < 7; round++) {
    for (int rows = 1; rows <= 8; rows += 7) {
      const double t = now();
      for (int i = 0; i < LINEARS; i++) product_int8(x, rows, k[i], w[i], scales[i], n[i], y, 1);
      printf("rows %d: %6.2f ms   ", rows, (now() - t) * 1e3);
    }
    const double t = now();
    __m512i acc = _mm512_setzero_si512();
    for (int i = 0; i < LINEARS; i++)
      for (size_t j = 0; j < (size_t)n[i] * k[i]; j += 64) acc = _mm512_add_epi8(acc, _mm512_load_si512(w[i] + j));
    sink += _mm512_reduce_add_epi32(acc);
    printf("read: %6.2f ms\n", (now() - t) * 1e3);
  }
  return 0;
}
