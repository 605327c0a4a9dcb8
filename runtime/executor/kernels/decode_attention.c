/* odml_runtime.decode_attention: one layer's decode attention over its KV caches in the
 * transposed or the grouped layout, a LiteRT custom op (ai-edge-litert 2.3's C API).
 *
 * Shipped as source and compiled on the user's machine at first use
 * (runtime/executor/kernels/__init__.py); it links against nothing: the LiteRT functions it
 * calls come as pointers in the context user_data points to, with the error word the
 * runtime reads after each run (LiteRT ignores the status a kernel returns).
 *
 * Inputs: q [1, G, H, D] f32 (H query heads per KV group, already scaled), mask f32 of
 * T elements (the graph's additive mask for this step: 0 where attended, -FLT_MAX where
 * not), params f32 [4] (scale on q.k, logit soft-cap or 0, V's layout: 0 transposed, 1
 * grouped, unused), K [1, G, T, D] and V [1, G, D, T] (transposed) or [1, G, T, D] (grouped:
 * V lies as K does), the caches after this step's update, both f32 or both f16 (read as f32:
 * f16 caches halve the bytes read at long contexts; every sum is f32). Output [1, G, H, D]:
 * softmax(q.K^T * scale + mask) . V, as the graph's BATCH_MATMUL -> ADD -> SOFTMAX ->
 * BATCH_MATMUL computes it. V's layout is a parameter, not told by its shape: at T == D the
 * two are the same shape.
 *
 * Only the positions from the first to the last one the mask leaves open are read (a
 * masked position contributes exp(-FLT_MAX) = 0 to the graph's softmax too), each K row
 * and V row once for the H heads of its group. Where the mask leaves none open the graph's
 * answer is every position with the mask added, which is what is computed then.
 *
 * The LiteRT types, the context and the failure protocol are kernel_api.h's. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "kernel_api.h"

Status attention_init(void *user, const void *data, size_t size) { return 0; }
Status attention_destroy(void *user) { return 0; }
/* The output has q's layout. */
Status attention_layouts(void *user, size_t n_in, const Layout *in, size_t n_out, Layout *out) {
  if (n_in < 1 || n_out != 1) {
    if (user) ((Context *)user)->error = E_ARGUMENTS;
    return 1;
  }
  out[0] = in[0];
  return 0;
}

static int rank(const TensorType *t) { return layout_rank(&t->layout); }
static int64_t elements(const TensorType *t) {
  int64_t n = 1;
  for (int i = 0; i < rank(t); i++) n *= t->layout.dims[i];
  return n;
}

#define MAX_STACK_SCORES 16384
/* Vectorized with kernel_api.h's W-float vectors: exp is a polynomial (no libm call per
 * score), and the heads of a group share each load of K and V. */
typedef float v4 __attribute__((vector_size(16), aligned(4)));
/* A tree of halvings, not W dependent scalar adds. */
static inline float hsumv(vf a) {
#if W == 16
  v8 b = __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
#elif W == 8
  v8 b = a;
#endif
#if W >= 8
  v4 c = __builtin_shufflevector(b, b, 0, 1, 2, 3) + __builtin_shufflevector(b, b, 4, 5, 6, 7);
#else
  v4 c = a;
#endif
  return (c[0] + c[2]) + (c[1] + c[3]);
}
static inline float hmaxv(vf a) {
  float m = a[0];
  for (int i = 1; i < W; i++) m = a[i] > m ? a[i] : m;
  return m;
}
/* exp(x) for x <= 0 (scores less their maximum): 2^n * p(r), r = x - n ln2 in
 * [-ln2/2, ln2/2], p a degree-6 Taylor polynomial (relative error < 2e-7); below -87 it is 0. */
static inline vf expv(vf x) {
  const vi below = x < -87.0f; /* all ones where exp underflows: the result is 0 there */
  const vf xc = (vf)(((vi)x & ~below) | ((vi)((vf){0} - 87.0f) & below));
  const vf shift = (vf){0} + 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
  vf n = (xc * 1.44269504f + shift) - shift;
  vf r = xc - n * 0.693145752f - n * 1.42860677e-6f;
  vf p = (vf){0} + 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
  return (vf)((vi)(p * (vf)bits) & ~below);
}

/* How far ahead the passes ask for cache lines, in bytes (the same bytes, so the same time,
 * ahead for f16 caches where memory sets the pace): the hardware's prefetcher stops at each
 * 4 KB page, 16 K rows of 64 floats. Measured at SmolLM2's shapes
 * (benchmarks/experiments/kernel_probe/kernel_bench.c, AVX-512 build): the cold caches read at
 * 60% of a plain read loop's rate without, 80-90% with (f32; 2048 and 256 floats ahead). With
 * f16 caches K_AHEAD 4096 or 16384 and V_AHEAD 512 or 2048 changed nothing beyond the noise. */
#ifndef K_AHEAD
#define K_AHEAD 8192
#endif
/* How many stretches of a span the K pass reads at once, by cache element type; which count is
 * faster depends on the core, so the runtime passes -DK_STREAMS_f32 by CPU (tuning_flags() in
 * kernels/__init__.py, where the measurements are) and this default is the rest's. A core of the
 * AVX2 box (AMD EPYC, Zen 2) reads one stream of lines at ~14 GB/s and four interleaved ones at
 * ~27 (the V pass reads 4 rows at once already): four, f32 caches 0.91-0.93x the time of one.
 * On a Zen 4, with the passes' lines asked into the second-level cache (kernel_api.h's
 * AHEAD_INTO_L2), one is the fastest: two took 1.06-1.14x its time at 128-4,095 positions, four
 * (asked into the first level) 1.28-1.35x. f16 caches, whose K pass converts each row,
 * 1.05-1.09x with four on Zen 2, the same with two on Zen 4, keep one. */
#ifndef K_STREAMS_f32
#define K_STREAMS_f32 1
#endif
#ifndef K_STREAMS_f16
#define K_STREAMS_f16 1
#endif
#ifndef V_AHEAD
#define V_AHEAD 1024
#endif
/* Where the V pass asks for the line of row v at position i. f32: V_AHEAD bytes on along the
 * open spans of the block's rows taken one after another, so that near a row's end it asks for
 * the start of the span of the row 4 on (the next block's, or the next group's first block),
 * ahead_blocks blocks and ahead_at positions on (v_ahead). Asking simply V_AHEAD bytes on in
 * the row, as before, fetched masked positions past a short span and never the next rows'
 * first lines (kernel_bench, SmolLM2's shapes, with the K pass asking only for its span's
 * rows: span 1,024 at positions 40 / 128 / 500 / 1,000 0.59 / 1.07 / 2.50 / 4.22 -> 0.52 /
 * 0.73 / 2.12 / 3.76 ms; span 4,096 at 128 / 3,000 1.13 / 11.5 -> 0.81 / 10.6). f16: the same
 * position in the row 4 on: each row's open span is half as long, so the first V_AHEAD bytes
 * of each are twice the share (AVX-512 build: 2.85 -> 2.25 ms at position 1000, 8.35 -> 7.95
 * at 4095). */
static inline size_t v_ahead(int i, int n, int T, int ahead_blocks, int ahead_at) {
  const int at = i + ahead_at;
  return at < n ? (size_t)ahead_blocks * 4 * T + at : (size_t)(ahead_blocks + 1) * 4 * T + at - n;
}
#define V_PREFETCH_f32(v, i, T, n) PREFETCH_AHEAD((v) + v_ahead(i, n, T, ahead_blocks, ahead_at))
#define V_PREFETCH_f16(v, i, T, n) PREFETCH_AHEAD((v) + (i) + 4 * (size_t)(T))
/* The passes over one cache element type ET, read W at a time as floats by LOAD (KPASS,
 * VPASS, PASSES); the scores and q stay float. */
#define VPASS(HC, E, ET, LOAD)                                                                 \
  static void vpass_##E##_##HC(const ET *Vg, const float *scores, int T, int S, int D, int lo,  \
                               int n, float *og) {                                             \
    const int ahead_blocks = V_AHEAD / 4 / n, ahead_at = V_AHEAD / 4 % n; /* f32's (v_ahead) */ \
    (void)ahead_blocks, (void)ahead_at;                                                        \
    int d = 0;                                                                                 \
    for (; d + 4 <= D; d += 4) { /* 4 rows of V share each load of the scores */               \
      const ET *v0 = Vg + (size_t)d * T + lo, *v1 = v0 + T, *v2 = v1 + T, *v3 = v2 + T;        \
      vf a0[HC], a1[HC], a2[HC], a3[HC];                                                       \
      for (int h = 0; h < HC; h++) a0[h] = a1[h] = a2[h] = a3[h] = (vf){0};                    \
      int i = 0;                                                                               \
      for (; i + W <= n; i += W) {                                                             \
        V_PREFETCH_##E(v0, i, T, n); V_PREFETCH_##E(v1, i, T, n);                             \
        V_PREFETCH_##E(v2, i, T, n); V_PREFETCH_##E(v3, i, T, n);                             \
        vf x0 = LOAD(v0 + i), x1 = LOAD(v1 + i), x2 = LOAD(v2 + i), x3 = LOAD(v3 + i);         \
        for (int h = 0; h < HC; h++) {                                                         \
          vf p = loadv(scores + h * S + lo + i);                                               \
          a0[h] += p * x0; a1[h] += p * x1; a2[h] += p * x2; a3[h] += p * x3;                  \
        }                                                                                      \
      }                                                                                        \
      for (int h = 0; h < HC; h++) {                                                           \
        float s0 = hsumv(a0[h]), s1 = hsumv(a1[h]), s2 = hsumv(a2[h]), s3 = hsumv(a3[h]);      \
        for (int j = i; j < n; j++) {                                                          \
          float p = scores[h * S + lo + j];                                                    \
          s0 += p * v0[j]; s1 += p * v1[j]; s2 += p * v2[j]; s3 += p * v3[j];                  \
        }                                                                                      \
        og[h * D + d] = s0; og[h * D + d + 1] = s1; og[h * D + d + 2] = s2; og[h * D + d + 3] = s3; \
      }                                                                                        \
    }                                                                                          \
    for (; d < D; d++) {                                                                       \
      const ET *v = Vg + (size_t)d * T + lo;                                                   \
      for (int h = 0; h < HC; h++) {                                                           \
        float s = 0.f;                                                                         \
        for (int j = 0; j < n; j++) s += scores[h * S + lo + j] * v[j];                        \
        og[h * D + d] = s;                                                                     \
      }                                                                                        \
    }                                                                                          \
  }

/* The sums of W vectors' lanes as one vector (lane j: the sum of a[j]'s lanes), by a tree
 * of interleaving halvings: 2(W-1) shuffles and W-1 adds for W sums, where W separate
 * reductions take 4W of each (at 16) and W scalar stores. Below 16 the shuffles within
 * 128-bit lanes come first and the one crossing them (AVX2's slow kind) last. */
static inline vf sumsv(const vf *a) {
#if W == 16
  vf b[8], c[4], d[2];
  for (int i = 0; i < 8; i++)
    b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; i++)
    c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(b[2 * i], b[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; i++)
    d[i] = __builtin_shufflevector(c[2 * i], c[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(c[2 * i], c[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(d[0], d[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(d[0], d[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
#elif W == 8
  vf b[4], c[2]; /* b[i]: a[2i]'s partial sums in the even lanes, a[2i+1]'s in the odd ones */
  for (int i = 0; i < 4; i++)
    b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 8, 1, 9, 4, 12, 5, 13) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 2, 10, 3, 11, 6, 14, 7, 15);
  for (int i = 0; i < 2; i++) /* c[i]: a[4i..4i+3]'s sums over each 128-bit half */
    c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
           __builtin_shufflevector(b[2 * i], b[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
  return __builtin_shufflevector(c[0], c[1], 0, 1, 2, 3, 8, 9, 10, 11) +
         __builtin_shufflevector(c[0], c[1], 4, 5, 6, 7, 12, 13, 14, 15);
#else
  vf b[2];
  for (int i = 0; i < 2; i++)
    b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 4, 1, 5) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 2, 6, 3, 7);
  return __builtin_shufflevector(b[0], b[1], 0, 1, 4, 5) + __builtin_shufflevector(b[0], b[1], 2, 3, 6, 7);
#endif
}
/* The K pass loads (and converts) each block's rows once for all the heads, not once per head:
 * f16 at SmolLM2's shapes, position 1000: 8.4 -> 5.1 ms in the AVX2 build without F16C, 5%
 * less with AVX-512, no change with AVX2 and F16C; f32, whose rows are in L1 after the first
 * head, 0.91-0.94x from 1,000 to 4,095 positions on the AVX2 box (kernel_bench, span 4,096; at 40
 * positions 1.04x, 0.03 ms a step). */
#define KPASS(DC, E, ET, LOAD)                                                                 \
  static void kpass_##E##_##DC(const float *qg, const ET *Kg, int H, int lo, int hi,           \
                               float scale, float *scores, int S) {                            \
    enum { C = DC / W };                                                                       \
    /* W positions at a time: their K rows (loaded once, kept) dotted with each             \
     * head, the W sums reduced together and stored as one vector; the blocks taken from     \
     * K_STREAMS_E stretches of the span in turn */                                           \
    enum { STREAMS = K_STREAMS_##E };                                                          \
    const int blocks = (hi + 1 - lo) / W, per = (blocks + STREAMS - 1) / STREAMS;             \
    for (int i = 0; i < per; i++)                                                              \
      for (int s = 0; s < STREAMS && s * per + i < blocks; s++) {                              \
      const int t = lo + (s * per + i) * W;                                                    \
      const ET *kb = Kg + (size_t)t * DC;                                                      \
      vf kept[W][C];                                                                           \
      for (int h = 0; h < H; h++) {                                                            \
        const float *qh = qg + h * DC;                                                         \
        vf acc[W];                                                                             \
        for (int j = 0; j < W; j++) {                                                          \
          const ET *k0 = kb + (size_t)j * DC;                                                  \
          if (h == 0) { /* one per 64-byte line, of the span's rows only */                    \
            if (t + j + K_AHEAD / (DC * (int)sizeof(ET)) <= hi)                                \
              for (int l = 0; l < DC * (int)sizeof(ET) / 64; l++)                              \
                PREFETCH_AHEAD((const char *)k0 + K_AHEAD + 64 * l);                           \
            for (int c = 0; c < C; c++) kept[j][c] = LOAD(k0 + W * c);                         \
          }                                                                                    \
          vf e = loadv(qh) * kept[j][0];                                                       \
          for (int c = 1; c < C; c++) e += loadv(qh + W * c) * kept[j][c];                     \
          acc[j] = e;                                                                          \
        }                                                                                      \
        *(vf *)(scores + h * S + t) = sumsv(acc) * scale;                                      \
      }                                                                                        \
    }                                                                                          \
    for (int t = lo + blocks * W; t <= hi; t++) { /* the last positions: each K row once for all the heads */ \
      const ET *k0 = Kg + (size_t)t * DC;                                                      \
      vf kv[C];                                                                                \
      for (int c = 0; c < C; c++) kv[c] = LOAD(k0 + W * c);                                    \
      for (int h = 0; h < H; h++) {                                                            \
        const float *qh = qg + h * DC;                                                         \
        vf e = loadv(qh) * kv[0], f = loadv(qh + W) * kv[1];                                   \
        for (int c = 2; c < C; c += 2) {                                                       \
          e += loadv(qh + W * c) * kv[c];                                                      \
          f += loadv(qh + W * c + W) * kv[c + 1];                                              \
        }                                                                                      \
        scores[h * S + t] = hsumv(e + f) * scale;                                              \
      }                                                                                        \
    }                                                                                          \
  }
/* The grouped layout's V pass: og[h*D + d] = sum_i p[h][lo+i] * V[lo+i][d], V's rows read in
 * order, the H heads sharing each load; D in halves of 32 floats over blocks of 32 positions
 * (the block's other halves in the first-level cache when their turn comes), each row's
 * other half asked for with its first, so that memory sees whole rows in order: the form
 * kernel_probe/layout_bench.c measured (RESULTS.md section 20). Each row's lines are also asked
 * for GROUPED_AHEAD bytes ahead, as the K pass asks K_AHEAD (the hardware's prefetcher stops
 * at each 4 KB page): an int8 SmolLM2's 8-row step at 900 positions 36.0 -> 33.4 ms, one
 * session's 9.6 -> 9.3 (batch_cost, alternating processes, RESULTS.md section 21). */
#define GROUPED_HALF 32
#define GROUPED_BLOCK 32
#ifndef GROUPED_AHEAD
#define GROUPED_AHEAD 8192
#endif
#define VROWS(HC, E, ET, LOAD)                                                                 \
  static void vrows_##E##_##HC(const ET *Vg, const float *scores, int S, int D, int lo, int n,  \
                               float *og) {                                                    \
    enum { C = GROUPED_HALF / W };                                                             \
    for (int b = 0; b < n; b += GROUPED_BLOCK) {                                               \
      const int e = b + GROUPED_BLOCK < n ? b + GROUPED_BLOCK : n;                             \
      for (int half = 0; half < D / GROUPED_HALF; half++) {                                    \
        vf a[HC][C];                                                                           \
        for (int h = 0; h < HC; h++)                                                           \
          for (int c = 0; c < C; c++)                                                          \
            a[h][c] = b ? loadv(og + h * D + half * GROUPED_HALF + W * c) : (vf){0};           \
        for (int i = b; i < e; i++) {                                                          \
          const ET *v = Vg + (size_t)(lo + i) * D;                                             \
          if (half == 0) {                                                                     \
            for (int l = GROUPED_HALF * (int)sizeof(ET) / 64; l < D * (int)sizeof(ET) / 64; l++) \
              PREFETCH_NOW((const char *)v + 64 * l);                                          \
            if ((i + GROUPED_AHEAD / (D * (int)sizeof(ET))) < n)                               \
              for (int l = 0; l < D * (int)sizeof(ET) / 64; l++)                               \
                PREFETCH_AHEAD((const char *)v + GROUPED_AHEAD + 64 * l);                      \
          }                                                                                    \
          v += half * GROUPED_HALF;                                                            \
          vf x[C];                                                                             \
          for (int c = 0; c < C; c++) x[c] = LOAD(v + W * c);                                  \
          for (int h = 0; h < HC; h++) {                                                       \
            const vf p = (vf){0} + scores[h * S + lo + i];                                     \
            for (int c = 0; c < C; c++) a[h][c] += p * x[c];                                   \
          }                                                                                    \
        }                                                                                      \
        for (int h = 0; h < HC; h++)                                                           \
          for (int c = 0; c < C; c++) *(vf *)(og + h * D + half * GROUPED_HALF + W * c) = a[h][c]; \
      }                                                                                        \
    }                                                                                          \
  }
/* Dot products of the group's H heads with K rows lo..hi, any D; probabilities times V rows,
 * any H and D, in either layout. Then the K pass and the V pass of one group, the fast ones
 * where D and H allow. */
#define PASSES(E, ET, LOAD)                                                                    \
  KPASS(64, E, ET, LOAD) KPASS(128, E, ET, LOAD) KPASS(256, E, ET, LOAD)                       \
  VPASS(1, E, ET, LOAD) VPASS(2, E, ET, LOAD) VPASS(3, E, ET, LOAD) VPASS(4, E, ET, LOAD)      \
  VPASS(5, E, ET, LOAD) VPASS(6, E, ET, LOAD) VPASS(7, E, ET, LOAD) VPASS(8, E, ET, LOAD)      \
  static void (*const vpasses_##E[9])(const ET *, const float *, int, int, int, int, int, float *) = { \
      0, vpass_##E##_1, vpass_##E##_2, vpass_##E##_3, vpass_##E##_4, vpass_##E##_5, vpass_##E##_6, \
      vpass_##E##_7, vpass_##E##_8};                                                           \
  VROWS(1, E, ET, LOAD) VROWS(2, E, ET, LOAD) VROWS(3, E, ET, LOAD) VROWS(4, E, ET, LOAD)      \
  VROWS(5, E, ET, LOAD) VROWS(6, E, ET, LOAD) VROWS(7, E, ET, LOAD) VROWS(8, E, ET, LOAD)      \
  static void (*const vrowses_##E[9])(const ET *, const float *, int, int, int, int, float *) = { \
      0, vrows_##E##_1, vrows_##E##_2, vrows_##E##_3, vrows_##E##_4, vrows_##E##_5, vrows_##E##_6, \
      vrows_##E##_7, vrows_##E##_8};                                                           \
  static void kpass_##E##_any(const float *qg, const ET *Kg, int H, int D, int lo, int hi,     \
                              float scale, float *scores, int S) {                             \
    for (int t = lo; t <= hi; t++) {                                                           \
      const ET *k = Kg + (size_t)t * D;                                                        \
      for (int h = 0; h < H; h++) {                                                            \
        const float *qh = qg + (size_t)h * D;                                                  \
        float acc = 0.f;                                                                       \
        for (int d = 0; d < D; d++) acc += qh[d] * k[d];                                       \
        scores[h * S + t] = acc * scale;                                                       \
      }                                                                                        \
    }                                                                                          \
  }                                                                                            \
  static void vpass_##E##_any(const ET *Vg, const float *scores, int T, int S, int H, int D,   \
                              int lo, int n, float *og) {                                      \
    for (int d = 0; d < D; d++) {                                                              \
      const ET *v = Vg + (size_t)d * T + lo;                                                   \
      for (int h = 0; h < H; h++) {                                                            \
        const float *p = scores + h * S + lo;                                                  \
        float acc = 0.f;                                                                       \
        for (int i = 0; i < n; i++) acc += p[i] * v[i];                                        \
        og[h * D + d] = acc;                                                                   \
      }                                                                                        \
    }                                                                                          \
  }                                                                                            \
  static inline void kpass_##E(int fast, const float *qg, const ET *Kg, int H, int D, int lo,  \
                               int hi, float scale, float *scores, int S) {                    \
    if (fast && D == 64) kpass_##E##_64(qg, Kg, H, lo, hi, scale, scores, S);                  \
    else if (fast && D == 128) kpass_##E##_128(qg, Kg, H, lo, hi, scale, scores, S);           \
    else if (fast && D == 256) kpass_##E##_256(qg, Kg, H, lo, hi, scale, scores, S);           \
    else kpass_##E##_any(qg, Kg, H, D, lo, hi, scale, scores, S);                              \
  }                                                                                            \
  static void vrows_##E##_any(const ET *Vg, const float *scores, int S, int H, int D, int lo,  \
                              int n, float *og) {                                              \
    for (int h = 0; h < H; h++)                                                                \
      for (int d = 0; d < D; d++) {                                                            \
        const float *p = scores + h * S + lo;                                                  \
        float acc = 0.f;                                                                       \
        for (int i = 0; i < n; i++) acc += p[i] * Vg[(size_t)(lo + i) * D + d];                \
        og[h * D + d] = acc;                                                                   \
      }                                                                                        \
  }                                                                                            \
  static inline void vpass_##E(int fast, int grouped, const ET *Vg, const float *scores, int T, \
                               int S, int H, int D, int lo, int n, float *og) {                \
    if (grouped && fast && D % GROUPED_HALF == 0) vrowses_##E[H](Vg, scores, S, D, lo, n, og); \
    else if (grouped) vrows_##E##_any(Vg, scores, S, H, D, lo, n, og);                         \
    else if (fast) vpasses_##E[H](Vg, scores, T, S, D, lo, n, og);                             \
    else vpass_##E##_any(Vg, scores, T, S, H, D, lo, n, og);                                   \
  }
PASSES(f32, float, loadv)
#if F16_TENSORS
PASSES(f16, _Float16, loadh)
#endif

/* A short open span (a session's first tokens, or a batch's rows early on) is read in latency,
 * not bandwidth: V's rows lie T apart, so n positions touch a line in each of G * D rows (192
 * lines on distinct pages for SmolLM2, however small n is), and the passes miss on them one
 * after the other. Asking for every line the passes will read, all groups at once, before the
 * first, lets the misses overlap. Kernel alone, SmolLM2's shapes, cold caches, span 1,024, 30
 * layers (kernel_bench --positions 4,8,16,32,64,128,1000 --rounds 7): positions 4 / 8 / 32
 * 0.26 / 0.29 / 0.38 -> 0.17 / 0.22 / 0.33 ms (f32), 0.36 / 0.40 / 0.24 -> 0.18 / 0.21 / 0.18
 * (f16); unchanged from 128 on, where the passes' own prefetching takes over. Asked into the
 * second-level cache where the passes ask there (AHEAD_INTO_L2, the Zen 4 box): 4 / 8 / 16 / 32 /
 * 64 positions 0.24 / 0.30 / 0.35 / 0.40 / 0.46 -> 0.22 / 0.27 / 0.30 / 0.32 / 0.44 ms (f32), 0.20
 * / 0.26 / 0.23 / 0.29 / 0.42 -> 0.17 / 0.21 / 0.18 / 0.23 / 0.31 (f16), the same at 128 (9
 * rounds); asking so for spans up to 512, 1,024 or 2,048 bytes moved 128 to 1,000 positions
 * only within the rounds' spread. */
#define SHORT_SPAN 256 /* bytes of a row's open span */
/* The grouped layout's spans are contiguous in both caches (n rows of D per group), so that
 * asking for all of them costs no page walks of their own: up to 1,024 bytes of a position's
 * span (256 f32 positions) they are asked for at once (layout_bench's -DOUTER_SPAN=1024, into the
 * second-level cache on Zen 4: 0.43 / 0.72 / 0.89 / 0.99x the transposed kernel's time at 8 /
 * 128 / 512 / 1,000 positions, RESULTS.md section 20). */
#define GROUPED_SHORT_SPAN 1024
#if AHEAD_INTO_L2 && (defined(__x86_64__) || defined(__i386__))
#define PREFETCH_SPAN(p) __asm__ volatile("prefetcht1 %0" : : "m"(*(const char *)(p)))
#else
#define PREFETCH_SPAN(p) PREFETCH_NOW(p)
#endif
static void prefetch_short_span(const void *K, const void *V, size_t bytes, int G, int T, int D, int lo, int n,
                                int grouped) {
  const size_t span = (size_t)n * bytes;
  if (grouped) {
    if (span > GROUPED_SHORT_SPAN) return;
    for (int g = 0; g < G; g++)
      for (size_t b = 0; b < span * D; b += 64) {
        PREFETCH_SPAN((const char *)K + ((size_t)g * T + lo) * D * bytes + b);
        PREFETCH_SPAN((const char *)V + ((size_t)g * T + lo) * D * bytes + b);
      }
    return;
  }
  if (span > SHORT_SPAN) return;
  for (int g = 0; g < G; g++) {
    const char *kg = (const char *)K + ((size_t)g * T + lo) * D * bytes; /* n rows of D, contiguous */
    for (size_t b = 0; b < span * D; b += 64) PREFETCH_SPAN(kg + b);
    for (int d = 0; d < D; d++) {
      const char *row = (const char *)V + (((size_t)g * D + d) * T + lo) * bytes;
      for (size_t b = 0; b < span; b += 64) PREFETCH_SPAN(row + b);
      PREFETCH_SPAN(row + span - 1); /* the span's last line, where it crosses one */
    }
  }
}

/* One head's n scores s (q.k times the scale) in place: soft-capped by cap (none at 0), the
 * mask added, then softmax as the graph's SOFTMAX computes it. */
static inline void softmax(float *s, const float *mask, int n, float cap) {
  if (cap > 0.f)
    for (int i = 0; i < n; i++) s[i] = tanhf(s[i] / cap) * cap;
  for (int i = 0; i < n; i++) s[i] += mask[i];
  float m = s[0];
  int i = 0;
  if (n >= W) {
    vf mv = loadv(s);
    for (i = W; i + W <= n; i += W) {
      vf x = loadv(s + i);
      mv = (vf)(((vi)x & (x > mv)) | ((vi)mv & ~(x > mv)));
    }
    m = hmaxv(mv);
  }
  for (; i < n; i++) m = s[i] > m ? s[i] : m;
  vf total = (vf){0};
  i = 0;
  for (; i + W <= n; i += W) {
    vf e = expv(loadv(s + i) - m);
    *(vf *)(s + i) = e;
    total += e;
  }
  float sum = hsumv(total);
  for (; i < n; i++) { s[i] = expf(s[i] - m); sum += s[i]; }
  float inv = 1.f / sum;
  for (i = 0; i < n; i++) s[i] *= inv;
}

static int attend(Context *c, size_t n_in, const Buffer *in, size_t n_out, Buffer *out) {
  if (n_in != 5 || n_out != 1) return E_ARGUMENTS;
  TensorType qt, mt, pt, kt, vt, ot;
  float *q, *mask, *params, *o;
  void *K, *V;
  if (c->tensor_type(in[0], &qt) || c->tensor_type(in[1], &mt) || c->tensor_type(in[2], &pt) ||
      c->tensor_type(in[3], &kt) || c->tensor_type(in[4], &vt) || c->tensor_type(out[0], &ot) ||
      c->host_memory(in[0], (void **)&q) || c->host_memory(in[1], (void **)&mask) ||
      c->host_memory(in[2], (void **)&params) || c->host_memory(in[3], (void **)&K) ||
      c->host_memory(in[4], (void **)&V) || c->host_memory(out[0], (void **)&o))
    return E_BUFFER;
  /* float32 (kLiteRtElementTypeFloat32 = 1) but for the caches, float32 or float16 (10) both */
  if (qt.element != 1 || mt.element != 1 || pt.element != 1 || ot.element != 1 || kt.element != vt.element ||
      (kt.element != 1 && !(F16_TENSORS && kt.element == 10)))
    return E_TYPES;
#if F16_TENSORS
  const int half = kt.element == 10;
#endif
  if (rank(&qt) != 4 || rank(&kt) != 4 || rank(&vt) != 4 || qt.layout.dims[0] != 1) return E_SHAPES;
  const int G = qt.layout.dims[1], H = qt.layout.dims[2], D = qt.layout.dims[3], T = kt.layout.dims[2];
  if (elements(&pt) != 4 || !(params[2] == 0.f || params[2] == 1.f)) return E_SHAPES;
  const int grouped = params[2] == 1.f;
  if (kt.layout.dims[0] != 1 || kt.layout.dims[1] != G || kt.layout.dims[3] != D || vt.layout.dims[0] != 1 ||
      vt.layout.dims[1] != G || vt.layout.dims[2] != (grouped ? T : D) || vt.layout.dims[3] != (grouped ? D : T) ||
      elements(&mt) != T || elements(&ot) != (int64_t)G * H * D || G < 1 || H < 1 || D < 1 || T < 1)
    return E_SHAPES;
  const float scale = params[0], cap = params[1];
  int lo = 0, hi = T - 1;
  while (lo < T && !(mask[lo] > -1e30f)) lo++;
  if (lo == T) lo = 0; /* nothing open: every position, the mask added (the graph's answer) */
  else
    while (!(mask[hi] > -1e30f)) hi--;
  const int n = hi - lo + 1;
  const int S = T + 16 + ((T % 1024) < 16 ? 16 : 0); /* rows of scores off the 4 KB period (no aliasing) */
  float stack_scores[MAX_STACK_SCORES + 64];
  float *scores = (size_t)H * S <= MAX_STACK_SCORES + 64 ? stack_scores : malloc(sizeof(float) * H * S);
  if (!scores) return E_MEMORY;
  const int fast = D % 16 == 0 && H <= 8;
  prefetch_short_span(K, V, kt.element == 10 ? 2 : 4, G, T, D, lo, n, grouped);
  for (int g = 0; g < G; g++) {
    const float *qg = q + (size_t)g * H * D;
    const size_t at = (size_t)g * T * D; /* the group's first element of K and of V */
    float *og = o + (size_t)g * H * D;
#if F16_TENSORS
    if (half) kpass_f16(fast, qg, (const _Float16 *)K + at, H, D, lo, hi, scale, scores, S);
    else
#endif
      kpass_f32(fast, qg, (const float *)K + at, H, D, lo, hi, scale, scores, S);
    for (int h = 0; h < H; h++) softmax(scores + h * S + lo, mask + lo, n, cap);
#if F16_TENSORS
    if (half) vpass_f16(fast, grouped, (const _Float16 *)V + at, scores, T, S, H, D, lo, n, og);
    else
#endif
      vpass_f32(fast, grouped, (const float *)V + at, scores, T, S, H, D, lo, n, og);
  }
  if (scores != stack_scores) free(scores);
  return 0;
}

/* Run: a failure goes to the error word, the output to NaN (kernel_api.h's failed). */
Status attention_run(void *user, size_t n_in, const Buffer *in, size_t n_out, Buffer *out) {
  int code = attend((Context *)user, n_in, in, n_out, out);
  return code ? failed((Context *)user, code, n_out, out) : 0;
}
