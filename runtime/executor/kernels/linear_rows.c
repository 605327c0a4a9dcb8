/* odml_runtime.linear_rows: a float32 linear layer over a few rows at once, y = x . W^T, a
 * LiteRT custom op (ai-edge-litert 2.3's C API), compiled into the same library as
 * decode_attention.c (runtime/executor/kernels/__init__.py builds the sources into one file).
 *
 * Why an op: a batched decode step multiplies a handful of rows (one per session) by every
 * weight of the model, and XNNPACK's float32 GEMM takes at most 7 rows per pass over the
 * weights on AVX-512 (its 7x16 tile): 8 rows read all 538 MB of SmolLM2-135M's weights twice,
 * the second pass for one row. Here each pass over W serves up to 8 rows (MAX_ROWS), and a row
 * is computed the same way whatever rows are beside it (a batch's rows equal them alone).
 *
 * Inputs: x f32 [..., K], W f32 [N, K] (a FULLY_CONNECTED's weights as the file stores them,
 * no bias, no activation); output f32 [..., N]. The rows of x are taken MAX_ROWS at a time.
 *
 * Per pass: a few rows of W at once (OUTS_FOR), each multiplied into every row of x (that many
 * times rows vector accumulators: 24 of AVX-512's 32 registers at 3 and 8), summed across lanes
 * at the end. The rows of W lie one after the other, so the pass reads one contiguous stream,
 * which the hardware prefetchers follow poorly in rows of 2-6 KB while the arithmetic keeps the
 * core busy: the stream is asked for W_AHEAD bytes in advance. On the shared AVX-512 Xeon, 1 thread, the 151
 * linears of SmolLM2-135M's batched step (538 MB) over 8 rows: alone, 68 ms without asking
 * ahead and 45 with; in LiteRT's op profile of a batch of 8, 43.7 ms against XNNPACK's 75.6
 * (benchmarks.experiments.op_profile), where one row takes XNNPACK 33.4 ms.
 *
 * The LiteRT types, the context and the failure protocol are kernel_api.h's. */
#include "kernel_api.h"
#ifdef _OPENMP
#include <omp.h>
#endif

#define MAX_ROWS 8
/* How far ahead (bytes) the stream of W is asked for. AVX2: 64 KB, with 8 rows of W a block for
 * one row of x (OUTS_FOR). One row alone on the AVX2 box (Zen 2), 1 thread, best of 4, three
 * alternating runs (benchmarks/experiments/kernel_probe/linear_rows_bench.c): Gemma 3 270M's
 * 91 linears (1.07 GB) 63.2-63.8 ms at 8 KB and 4 rows of W, 56.2-56.5 ms at 64 KB and 8 (19.0
 * GB/s, level with a plain read of the bytes); SmolLM2-135M's 151 (538 MB) 31.7-32.9 -> 28.8-29.5
 * ms. Either change alone gave 2-4%, 128 KB no more than 64; 2 to 8 rows of x run the same at 8
 * and 64 KB (+-2%). AVX-512: 8 KB, measured on the Xeon below. */
#if W == 8
#define W_AHEAD 65536
#else
#define W_AHEAD 8192
#endif
/* A pass over several rows of x where the streams ask into the second-level cache
 * (kernel_api.h's AHEAD_INTO_L2) asks ROWS_L2_AHEAD bytes ahead (Zen 4: 64 KB the same within
 * the rounds); one row's pass keeps the first level and W_AHEAD: in the runtime's one-session
 * step (runtime bench, SmolLM2 f32, 1 thread, three alternating rounds) the second level took
 * 1.01-1.08x the time, where linear_rows_bench over anonymous memory had 0.73-1.01x. */
#define ROWS_L2_AHEAD 32768
/* How many rows of W a block takes at once for R rows of x (a pass's rows): O * R vector
 * accumulators, the O rows of W and x's row in registers. AVX-512 (32 registers): 3 at any R.
 * AVX2 (16): 1 from 5 rows on; below, more, because a row of x against one row of W is a chain
 * of dependent multiply-adds (one vector each, 4-5 cycles apart), which at R = 1 reads W no
 * faster than 8 floats per FMA latency, about the memory's own rate on a 2-3 GHz core: several
 * rows of W interleave their chains (SmolLM2-135M's 151 linears alone, one row, the AVX2 box,
 * Zen 2 at 2.25 GHz: 39.5 ms at 1, 37.5 at 2, 34.3 at 4; 2 rows 41.1 -> 37.5 ms at 4), and at
 * R = 1 eight, with W_AHEAD's 64 KB (above). The numbers do not depend on it: every output is
 * summed alone, in the same order, whatever O. */
#if W == 16
/* One row of x on AVX-512: 3 unless given. On a Zen 4 four rows of W took 0.87-0.99x the time
 * of three in six alternating rounds (linear_rows_bench 1 5; six and eight 1.0-1.1x, one and
 * two between), so the runtime passes -DONE_ROW_OUTS_16=4 there (kernels.tuning_flags()); the
 * Xeon's figures were measured with three. */
#ifndef ONE_ROW_OUTS_16
#define ONE_ROW_OUTS_16 3
#endif
#if ONE_ROW_OUTS_16 < 1 || ONE_ROW_OUTS_16 > 4
#error "ONE_ROW_OUTS_16: 1 to 4 rows of W"
#endif
#define MAX_OUTS 4
#define OUTS_FOR(R) ((R) <= 1 ? ONE_ROW_OUTS_16 : 3)
#else
#if W == 8
#define ONE_ROW_OUTS 8
#else /* the plain build, not measured with 8 */
#define ONE_ROW_OUTS 4
#endif
#define MAX_OUTS ONE_ROW_OUTS
#define OUTS_FOR(R) ((R) <= 1 ? ONE_ROW_OUTS : (R) <= 2 ? 4 : (R) <= 4 ? 2 : 1)
#endif

Status linear_init(void *user, const void *data, size_t size) { return 0; }
Status linear_destroy(void *user) { return 0; }
/* The output: x's layout with W's first axis in place of x's last. */
Status linear_layouts(void *user, size_t n_in, const Layout *in, size_t n_out, Layout *out) {
  if (n_in != 2 || n_out != 1 || layout_rank(&in[0]) < 1 || layout_rank(&in[1]) != 2) {
    if (user) ((Context *)user)->error = E_ARGUMENTS;
    return 1;
  }
  out[0] = in[0];
  out[0].dims[layout_rank(&in[0]) - 1] = in[1].dims[0];
  return 0;
}

typedef float v4 __attribute__((vector_size(16), aligned(4)));

/* The sum of a vector's lanes, halving (a tree: a chain of W adds would be W latencies long). */
static inline float lanes_sum(vf v) {
#if W == 16
  v8 h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
         __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  v4 q = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
#elif W == 8
  v4 q = __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
#else
  v4 q = v;
#endif
  return (q[0] + q[2]) + (q[1] + q[3]);
}

/* y[m, n .. n + outs) = x[m, :] . w[n + j, :] for R rows of x (R a constant where inlined: the
 * accumulators stay in registers), y's rows N apart. */
static inline __attribute__((always_inline)) void block(const float *x, int R, int K, const float *w, int n, int N,
                                                        float *y, int outs) {
  const int body = K - K % W;
  const float *wn = w + (size_t)n * K;
  const int into_l2 = AHEAD_INTO_L2 && R > 1; /* a constant where inlined */
  vf acc[MAX_OUTS][MAX_ROWS];
#pragma GCC unroll 8
  for (int j = 0; j < outs; j++)
#pragma GCC unroll 8
    for (int m = 0; m < R; m++) acc[j][m] = (vf){0};
  for (int k = 0; k < body; k += W) {
    /* the block reads outs * W floats a step, from outs places of one contiguous stretch */
    const char *ahead = (const char *)wn + (into_l2 ? ROWS_L2_AHEAD : W_AHEAD) + (size_t)outs * 4 * k;
#pragma GCC unroll 8
    for (int j = 0; j < outs; j++) {
      if (into_l2)
        PREFETCH_AHEAD(ahead + j * 4 * W);
      else
        PREFETCH_NOW(ahead + j * 4 * W);
    }
    vf b[MAX_OUTS];
#pragma GCC unroll 8
    for (int j = 0; j < outs; j++) b[j] = *(const vf *)(wn + (size_t)j * K + k);
#pragma GCC unroll 8
    for (int m = 0; m < R; m++) {
      const vf xm = *(const vf *)(x + (size_t)m * K + k);
#pragma GCC unroll 8
      for (int j = 0; j < outs; j++) acc[j][m] += xm * b[j];
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < R; m++)
#pragma GCC unroll 8
    for (int j = 0; j < outs; j++) {
      float s = lanes_sum(acc[j][m]);
      for (int k = body; k < K; k++) s += x[(size_t)m * K + k] * wn[(size_t)j * K + k];
      y[(size_t)m * N + n + j] = s;
    }
}

/* The same for one row of W (the last N % outs). */
static void single(const float *x, int64_t rows, int K, const float *w, int n, int N, float *y) {
  const int body = K - K % W;
  const float *wn = w + (size_t)n * K;
  for (int64_t m = 0; m < rows; m++) {
    vf acc = {0};
    for (int k = 0; k < body; k += W) acc += *(const vf *)(x + (size_t)m * K + k) * *(const vf *)(wn + k);
    float s = lanes_sum(acc);
    for (int k = body; k < K; k++) s += x[(size_t)m * K + k] * wn[k];
    y[(size_t)m * N + n] = s;
  }
}

/* The rows of W a block takes in a product over rows of x: OUTS_FOR its first pass's rows. */
static inline int outs_for(int64_t rows) { return OUTS_FOR(rows < MAX_ROWS ? (int)rows : MAX_ROWS); }

/* y = x . W^T for rows of x, rows n0 .. n1 of W: outs rows of W at a time (outs_for), each
 * taken by every MAX_ROWS rows of x in turn (past 8 rows the block is read again from L1, not
 * from memory). R and outs are constants in each block inlined here. */
#define BLOCK(R, O) case (R) * 16 + (O): block(xm, R, K, w, n, N, ym, O); break;
static void product(const float *x, int64_t rows, int K, const float *w, int n0, int n1, int N, float *y) {
  const int outs = outs_for(rows);
  int n = n0;
  for (; n + outs <= n1; n += outs)
    for (int64_t m = 0; m < rows; m += MAX_ROWS) {
      const float *xm = x + m * K;
      float *ym = y + m * N;
      const int R = rows - m < MAX_ROWS ? (int)(rows - m) : MAX_ROWS;
      switch (R * 16 + outs) {
#if W == 16
        BLOCK(1, ONE_ROW_OUTS_16) BLOCK(2, 3) BLOCK(3, 3) BLOCK(4, 3) BLOCK(5, 3) BLOCK(6, 3) BLOCK(7, 3) BLOCK(8, 3)
#else
        BLOCK(1, ONE_ROW_OUTS) BLOCK(2, 4) BLOCK(3, 2) BLOCK(4, 2)
        BLOCK(1, 1) BLOCK(2, 1) BLOCK(3, 1) BLOCK(4, 1) BLOCK(5, 1) BLOCK(6, 1) BLOCK(7, 1) BLOCK(8, 1)
#endif
        default: /* a pair OUTS_FOR does not give: the same numbers, a row of W at a time */
          for (int j = 0; j < outs; j++) single(xm, R, K, w, n + j, N, ym);
      }
    }
  for (; n < n1; n++) single(x, rows, K, w, n, N, y);
}

/* The product on the engine's threads (Context's threads, its num_threads), each taking a
 * contiguous share of W's rows: every output is computed as on one thread, so the numbers do
 * not depend on the count. Why threads here: LiteRT gives a custom op none, and with 2 XNNPACK
 * threads its second thread spins while the op runs on the first, so a one-thread op took
 * SmolLM2 f32's step from 23 to 44 ms (2 threads, the shared AVX-512 Xeon). On both threads
 * (OpenMP, libgomp's defaults) the step is 0.94-0.98x XNNPACK's in three runs of 9 alternating
 * rounds (a thread pool of ours beside XNNPACK's on 2 cores: each wakes or spins while the other
 * works; OMP_WAIT_POLICY=passive measured the same there, and better on the AVX2 box, and
 * spinning 1,000 times before sleeping better still, so the runtime loads this library with
 * that: kernels/__init__.py). Matrices under PARALLEL_MIN floats stay on
 * one thread (waking the other costs more than it saves there). Built without OpenMP, one thread. */
#define PARALLEL_MIN (64 * 1024)
static void product_on_threads(const float *x, int64_t rows, int K, const float *w, int N, float *y, int threads) {
#ifdef _OPENMP
  const int outs = outs_for(rows);
  if (threads > 1 && (int64_t)N * K >= PARALLEL_MIN && N >= threads * outs) {
    const int blocks = N / outs;
#pragma omp parallel num_threads(threads)
    {
      const int t = omp_get_thread_num(), T = omp_get_num_threads();
      const int n0 = (int)((int64_t)blocks * t / T) * outs;
      const int n1 = t == T - 1 ? N : (int)((int64_t)blocks * (t + 1) / T) * outs;
      product(x, rows, K, w, n0, n1, N, y);
    }
    return;
  }
#endif
  product(x, rows, K, w, 0, N, N, y);
}

static int linear(Context *c, size_t n_in, const Buffer *in, size_t n_out, Buffer *out) {
  if (n_in != 2 || n_out != 1) return E_ARGUMENTS;
  TensorType xt, wt, yt;
  float *x, *w, *y;
  if (c->tensor_type(in[0], &xt) || c->tensor_type(in[1], &wt) || c->tensor_type(out[0], &yt) ||
      c->host_memory(in[0], (void **)&x) || c->host_memory(in[1], (void **)&w) || c->host_memory(out[0], (void **)&y))
    return E_BUFFER;
  if (xt.element != 1 || wt.element != 1 || yt.element != 1) return E_TYPES;
  const int xr = layout_rank(&xt.layout);
  if (xr < 1 || layout_rank(&wt.layout) != 2 || layout_rank(&yt.layout) != xr) return E_SHAPES;
  const int *xd = xt.layout.dims, *yd = yt.layout.dims;
  const int K = xd[xr - 1], N = wt.layout.dims[0];
  int64_t rows = 1;
  for (int i = 0; i < xr - 1; i++) {
    if (yd[i] != xd[i]) return E_SHAPES;
    rows *= xd[i];
  }
  if (K < 1 || N < 1 || wt.layout.dims[1] != K || yd[xr - 1] != N) return E_SHAPES;
  product_on_threads(x, rows, K, w, N, y, (int)c->threads);
  return 0;
}

/* Run: a failure goes to the error word, the output to NaN (kernel_api.h's failed). */
Status linear_run(void *user, size_t n_in, const Buffer *in, size_t n_out, Buffer *out) {
  int code = linear((Context *)user, n_in, in, n_out, out);
  return code ? failed((Context *)user, code, n_out, out) : 0;
}
