/* odml_runtime.lora_delta: one projection's LoRA delta, x . A . B, a LiteRT custom op
 * (ai-edge-litert 2.3's C API), compiled into the same library as decode_attention.c
 * (runtime/executor/kernels/__init__.py builds both sources into one file).
 *
 * Why an op: the graph computes the delta as BATCH_MATMUL(x, A) -> BATCH_MATMUL(h, B)
 * whose right operands are signature inputs (the adapter's weights), so XNNPACK packs both
 * of them again at every step; a rank-r delta is only r * (in + out) multiply-adds a row.
 *
 * Inputs: x f32, A and B both f32 or both f16 (read as f32); output f32. Either
 *   A [in, r], B [r, out]: x any rank, its last axis `in`, every row by the same A and B
 *     (a single-row decode's x [1, in]); the output x's shape with `out` last;
 *   or A [N, in, r], B [N, r, out], x [N, M, in]: row n by its own A and B (a batched
 *     decode's stacked adapters); the output [N, M, out].
 * Per row: h = x . A (r sums over in, float32), then out = h . B. A batch's rows (rank a
 * multiple of 8) go four at a time through the down pass and two at a time through the up
 * pass: more of their factors in flight, each row's sums in the same order as alone, so a
 * row's output does not depend on its batch (8 SmolLM2 rows' attention deltas, factors from
 * memory: 0.77x the time of one row after another on an AMD EPYC with AVX2).
 *
 * The LiteRT types, the context and the failure protocol are kernel_api.h's. */
#include "kernel_api.h"

Status lora_init(void *user, const void *data, size_t size) { return 0; }
Status lora_destroy(void *user) { return 0; }
/* The output: x's layout with B's last axis in place of x's. */
Status lora_layouts(void *user, size_t n_in, const Layout *in, size_t n_out, Layout *out) {
  if (n_in != 3 || n_out != 1 || layout_rank(&in[0]) < 1 || layout_rank(&in[2]) < 2) {
    if (user) ((Context *)user)->error = E_ARGUMENTS;
    return 1;
  }
  out[0] = in[0];
  out[0].dims[layout_rank(&in[0]) - 1] = in[2].dims[layout_rank(&in[2]) - 1];
  return 0;
}

/* 8 factors as 8 floats: float32 as they lie; float16 by one vcvtph2ps (F16C; a build
 * without it converts lane by lane, correct and slow: the runtime builds with it). */
static inline v8 load8f(const float *p) { return *(const v8 *)p; }
#if F16_TENSORS
typedef _Float16 h8 __attribute__((vector_size(16), aligned(2)));
static inline v8 load8h(const _Float16 *p) {
#if defined(__F16C__)
  return (v8)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
  return __builtin_convertvector(*(const h8 *)p, v8);
#endif
}
#endif

/* The two products over factors of element type ET (float32, or float16 read as float32:
 * half the bytes of a batch's stacked adapters; every sum is float32), LOAD8 reading 8 of
 * them as a v8, LOADW W of them as a vf.
 *
 * down: h[0..r) = x . A for A [in, r] row-major: each x[i] scales A's row i. Where r is a
 * multiple of 8, 8 lanes of h at a time (one AVX register; r is 4-64 in practice, under one
 * AVX-512 register's 16 floats at 8), four rows of A in flight so the adds do not wait on
 * each other; other ranks sum each lane's way, so a row's h does not depend on its slot.
 * up: o[0..out) = h . B for B [r, out] row-major: W outputs at a time, the r rows of B each
 * scaled by its h[k]. */
#define LORA_PASSES(SUF, ET, LOAD8, LOADW)                                                     \
  static void down_##SUF(const float *x, const ET *A, int in, int r, float *h) {               \
    if (r % 8 == 0) {                                                                         \
      for (int k = 0; k < r; k += 8) {                                                        \
        v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};                                            \
        int i = 0;                                                                            \
        for (; i + 4 <= in; i += 4) {                                                         \
          const ET *row = A + (size_t)i * r + k;                                              \
          a0 += x[i] * LOAD8(row);                                                            \
          a1 += x[i + 1] * LOAD8(row + r);                                                    \
          a2 += x[i + 2] * LOAD8(row + 2 * r);                                                \
          a3 += x[i + 3] * LOAD8(row + 3 * r);                                                \
        }                                                                                     \
        for (; i < in; i++) a0 += x[i] * LOAD8(A + (size_t)i * r + k);                        \
        *(v8 *)(h + k) = (a0 + a1) + (a2 + a3);                                               \
      }                                                                                       \
      return;                                                                                 \
    }                                                                                         \
    /* The same sums in the same order, a column at a time: a rank padded with zeros into  \
     * a multiple of 8 (a batch's larger slot) gives the same h as the rank alone. */        \
    for (int k = 0; k < r; k++) {                                                             \
      float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;                                           \
      int i = 0;                                                                              \
      for (; i + 4 <= in; i += 4) {                                                           \
        const ET *column = A + (size_t)i * r + k;                                             \
        s0 += x[i] * (float)column[0];                                                        \
        s1 += x[i + 1] * (float)column[r];                                                    \
        s2 += x[i + 2] * (float)column[2 * r];                                                \
        s3 += x[i + 3] * (float)column[3 * r];                                                \
      }                                                                                       \
      for (; i < in; i++) s0 += x[i] * (float)A[(size_t)i * r + k];                          \
      h[k] = (s0 + s1) + (s2 + s3);                                                           \
    }                                                                                         \
  }                                                                                           \
  static void up_tail_##SUF(const float *h, const ET *B, int r, int out, int j, float *o) {   \
    for (; j < out; j++) {                                                                    \
      float s = 0.f;                                                                          \
      for (int k = 0; k < r; k++) s += h[k] * (float)B[(size_t)k * out + j];                  \
      o[j] = s;                                                                               \
    }                                                                                         \
  }                                                                                           \
  static void up_##SUF(const float *h, const ET *B, int r, int out, float *o) {               \
    int j = 0;                                                                                \
    for (; j + W <= out; j += W) {                                                            \
      vf acc = h[0] * LOADW(B + j);                                                           \
      for (int k = 1; k < r; k++) acc += h[k] * LOADW(B + (size_t)k * out + j);               \
      *(vf *)(o + j) = acc;                                                                   \
    }                                                                                         \
    up_tail_##SUF(h, B, r, out, j, o);                                                        \
  }                                                                                           \
  /* Four rows' downs in one pass (rank a multiple of 8; row g's x, A and h a step of in,    \
   * a_step and r further): four streams of factors in flight where one row's pass reads    \
   * one, and each row's sums in down's order, so its h is down's bit for bit. */            \
  static void down4_##SUF(const float *x, const ET *A, int in, int r, size_t a_step, float *h) { \
    for (int k = 0; k < r; k += 8) {                                                          \
      v8 acc[4][4] = {{{0}}}; /* acc[g][u]: row g's a_u of down */                            \
      int i = 0;                                                                              \
      for (; i + 4 <= in; i += 4)                                                             \
        for (int g = 0; g < 4; g++)                                                           \
          for (int u = 0; u < 4; u++)                                                         \
            acc[g][u] += x[g * in + i + u] * LOAD8(A + g * a_step + (size_t)(i + u) * r + k); \
      for (; i < in; i++)                                                                     \
        for (int g = 0; g < 4; g++) acc[g][0] += x[g * in + i] * LOAD8(A + g * a_step + (size_t)i * r + k); \
      for (int g = 0; g < 4; g++)                                                             \
        *(v8 *)(h + g * r + k) = (acc[g][0] + acc[g][1]) + (acc[g][2] + acc[g][3]);           \
    }                                                                                         \
  }                                                                                           \
  /* Two rows' ups in one pass (row 1's h, B and o r, b_step and out further), each row's    \
   * sums in up's order. */                                                                   \
  static void up2_##SUF(const float *h, const ET *B, int r, int out, size_t b_step, float *o) { \
    const ET *B1 = B + b_step;                                                                \
    const float *h1 = h + r;                                                                  \
    int j = 0;                                                                                \
    for (; j + W <= out; j += W) {                                                            \
      vf acc = h[0] * LOADW(B + j), acc1 = h1[0] * LOADW(B1 + j);                             \
      for (int k = 1; k < r; k++) {                                                           \
        acc += h[k] * LOADW(B + (size_t)k * out + j);                                         \
        acc1 += h1[k] * LOADW(B1 + (size_t)k * out + j);                                      \
      }                                                                                       \
      *(vf *)(o + j) = acc;                                                                   \
      *(vf *)(o + out + j) = acc1;                                                            \
    }                                                                                         \
    up_tail_##SUF(h, B, r, out, j, o);                                                        \
    up_tail_##SUF(h1, B1, r, out, j, o + out);                                                \
  }

LORA_PASSES(f32, float, load8f, loadv)
#if F16_TENSORS
LORA_PASSES(f16, _Float16, load8h, loadh)
#endif

#define MAX_RANK 1024
static int delta(Context *c, size_t n_in, const Buffer *in, size_t n_out, Buffer *out) {
  if (n_in != 3 || n_out != 1) return E_ARGUMENTS;
  TensorType xt, at, bt, ot;
  float *x, *o;
  void *A, *B;
  if (c->tensor_type(in[0], &xt) || c->tensor_type(in[1], &at) || c->tensor_type(in[2], &bt) ||
      c->tensor_type(out[0], &ot) || c->host_memory(in[0], (void **)&x) || c->host_memory(in[1], &A) ||
      c->host_memory(in[2], &B) || c->host_memory(out[0], (void **)&o))
    return E_BUFFER;
  if (xt.element != 1 || ot.element != 1 || at.element != bt.element ||
      (at.element != 1 && !(F16_TENSORS && at.element == 10)))
    return E_TYPES;
  const int xr = layout_rank(&xt.layout), ar = layout_rank(&at.layout);
  if (xr < 1 || (ar != 2 && ar != 3) || layout_rank(&bt.layout) != ar || layout_rank(&ot.layout) != xr) return E_SHAPES;
  const int *xd = xt.layout.dims, *ad = at.layout.dims, *bd = bt.layout.dims, *od = ot.layout.dims;
  const int n_in_ = xd[xr - 1], r = ad[ar - 1], n_out_ = bd[ar - 1];
  int64_t rows = 1;
  for (int i = 0; i < xr - 1; i++) {
    if (od[i] != xd[i]) return E_SHAPES;
    rows *= xd[i];
  }
  const int N = ar == 3 ? ad[0] : 1;
  if (N < 1) return E_SHAPES;
  if (ad[ar - 2] != n_in_ || bd[ar - 2] != r || od[xr - 1] != n_out_ || r < 1 || r > MAX_RANK || n_in_ < 1 ||
      n_out_ < 1 || (ar == 3 && (xr != 3 || xd[0] != N || bd[0] != N)))
    return E_SHAPES;
  const int64_t per = rows / N; /* rows of x by each adapter */
  float h[4 * MAX_RANK] __attribute__((aligned(32)));
  int n = 0;
  if (per == 1 && r % 8 == 0) { /* a batched decode's rows, each its own factors: four, then two, at a time */
    const size_t a_step = (size_t)n_in_ * r, b_step = (size_t)r * n_out_;
    for (; n + 4 <= N; n += 4) {
#if F16_TENSORS
      if (at.element == 10) {
        down4_f16(x + n * n_in_, (const _Float16 *)A + n * a_step, n_in_, r, a_step, h);
        up2_f16(h, (const _Float16 *)B + n * b_step, r, n_out_, b_step, o + n * n_out_);
        up2_f16(h + 2 * r, (const _Float16 *)B + (n + 2) * b_step, r, n_out_, b_step, o + (n + 2) * n_out_);
        continue;
      }
#endif
      down4_f32(x + n * n_in_, (const float *)A + n * a_step, n_in_, r, a_step, h);
      up2_f32(h, (const float *)B + n * b_step, r, n_out_, b_step, o + n * n_out_);
      up2_f32(h + 2 * r, (const float *)B + (n + 2) * b_step, r, n_out_, b_step, o + (n + 2) * n_out_);
    }
  }
  for (; n < N; n++) {
    const size_t a_at = (size_t)n * n_in_ * r, b_at = (size_t)n * r * n_out_;
    for (int64_t m = 0; m < per; m++) {
      const int64_t row = n * per + m;
#if F16_TENSORS
      if (at.element == 10) {
        down_f16(x + row * n_in_, (const _Float16 *)A + a_at, n_in_, r, h);
        up_f16(h, (const _Float16 *)B + b_at, r, n_out_, o + row * n_out_);
        continue;
      }
#endif
      down_f32(x + row * n_in_, (const float *)A + a_at, n_in_, r, h);
      up_f32(h, (const float *)B + b_at, r, n_out_, o + row * n_out_);
    }
  }
  return 0;
}

/* Run: a failure goes to the error word, the output to NaN (kernel_api.h's failed). */
Status lora_run(void *user, size_t n_in, const Buffer *in, size_t n_out, Buffer *out) {
  int code = delta((Context *)user, n_in, in, n_out, out);
  return code ? failed((Context *)user, code, n_out, out) : 0;
}
