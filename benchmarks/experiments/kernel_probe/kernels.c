/* Custom-op kernels for LiteRT's C API (ai-edge-litert 2.3), compiled at run time by
 * c_kernels.py with the system's gcc and linked against the wheel's libLiteRt.so.
 * The LiteRT types are declared here from their documented layout (no LiteRT header is
 * shipped in the wheel): a tensor type is an int32 element type, then a layout of a
 * 32-bit word whose low 7 bits are the rank, 8 int32 dimensions and 8 strides. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int Status; /* LiteRtStatus: 0 ok, 1 invalid argument */
typedef void *Buffer; /* LiteRtTensorBuffer */
typedef struct { uint32_t bits; int32_t dims[8]; uint32_t strides[8]; } Layout;
typedef struct { int32_t element; Layout layout; } TensorType;

extern Status LiteRtGetTensorBufferHostMemory(Buffer, void **);
extern Status LiteRtLockTensorBuffer(Buffer, void **);
extern Status LiteRtUnlockTensorBuffer(Buffer);
extern Status LiteRtGetTensorBufferTensorType(Buffer, TensorType *);
extern Status LiteRtGetTensorBufferSize(Buffer, size_t *);

/* user_data of the probes: counters the Python side reads. */
typedef struct { int64_t inits, layouts, runs, destroys; } Counters;

Status probe_init(void *user, const void *data, size_t size) {
  if (user) ((Counters *)user)->inits++;
  return 0;
}
/* Every output takes the layout of input 0. */
Status probe_layouts(void *user, size_t n_in, const Layout *in, size_t n_out, Layout *out) {
  if (user) ((Counters *)user)->layouts++;
  if (n_in < 1) return 1;
  for (size_t i = 0; i < n_out; i++) out[i] = in[0];
  return 0;
}
Status probe_destroy(void *user) {
  if (user) ((Counters *)user)->destroys++;
  return 0;
}
/* out = in0 + in1, float32, reading the addresses through Lock (the documented way). */
Status add_run(void *user, size_t n_in, const Buffer *in, size_t n_out, Buffer *out) {
  if (n_in != 2 || n_out != 1) return 1;
  float *a, *b, *c;
  size_t bytes;
  if (LiteRtLockTensorBuffer(in[0], (void **)&a) || LiteRtLockTensorBuffer(in[1], (void **)&b) ||
      LiteRtLockTensorBuffer(out[0], (void **)&c) || LiteRtGetTensorBufferSize(out[0], &bytes))
    return 3;
  for (size_t i = 0; i < bytes / 4; i++) c[i] = a[i] + b[i];
  LiteRtUnlockTensorBuffer(in[0]);
  LiteRtUnlockTensorBuffer(in[1]);
  LiteRtUnlockTensorBuffer(out[0]);
  if (user) ((Counters *)user)->runs++;
  return 0;
}
Status plain_init(void *user, const void *data, size_t size) { return 0; }
Status plain_destroy(void *user) { return 0; }
Status empty_run(void *user, size_t n_in, const Buffer *in, size_t n_out, Buffer *out) { return 0; }
Status fail_run(void *user, size_t n_in, const Buffer *in, size_t n_out, Buffer *out) { return 3; }
/* Copies input 0 to output 0, after spinning in[1][0] milliseconds (a long kernel, to
 * see whether other Python threads run meanwhile). */
Status spin_run(void *user, size_t n_in, const Buffer *in, size_t n_out, Buffer *out) {
  float *a, *ms, *c;
  size_t bytes;
  if (LiteRtGetTensorBufferHostMemory(in[0], (void **)&a) || LiteRtGetTensorBufferHostMemory(in[1], (void **)&ms) ||
      LiteRtGetTensorBufferHostMemory(out[0], (void **)&c) || LiteRtGetTensorBufferSize(out[0], &bytes))
    return 3;
  struct timespec t0, t;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  do clock_gettime(CLOCK_MONOTONIC, &t);
  while ((t.tv_sec - t0.tv_sec) * 1e3 + (t.tv_nsec - t0.tv_nsec) / 1e6 < ms[0]);
  memcpy(c, a, bytes);
  if (user) ((Counters *)user)->runs++;
  return 0;
}

/* Decode attention over per-row caches in the exports' transposed layout.
 * Inputs: q [B, G, H, D] f32 (H query heads per KV group), pos int32 [B] (the position
 * each row's token was written at: it attends over positions lo..pos), params f32 [4]
 * (scale, logit soft-cap or 0, sliding window or 0, unused), then per row r:
 * K_r [1, G, T, D] and V_r [1, G, D, T]. Output: [B, G, H, D].
 * Each K row and V row up to pos is read once for the H heads of its group. */
#define MAX_STACK_SCORES 16384
Status attention_run(void *user, size_t n_in, const Buffer *in, size_t n_out, Buffer *out) {
  if (n_in < 5 || (n_in - 3) % 2 || n_out != 1) return 1;
  TensorType qt, kt;
  float *q, *params, *o;
  int32_t *pos;
  if (LiteRtGetTensorBufferTensorType(in[0], &qt) || LiteRtGetTensorBufferTensorType(in[3], &kt) ||
      LiteRtGetTensorBufferHostMemory(in[0], (void **)&q) || LiteRtGetTensorBufferHostMemory(in[1], (void **)&pos) ||
      LiteRtGetTensorBufferHostMemory(in[2], (void **)&params) || LiteRtGetTensorBufferHostMemory(out[0], (void **)&o))
    return 3;
  const int B = qt.layout.dims[0], G = qt.layout.dims[1], H = qt.layout.dims[2], D = qt.layout.dims[3];
  const int T = kt.layout.dims[2];
  if ((size_t)B * 2 + 3 != n_in || kt.layout.dims[1] != G || kt.layout.dims[3] != D) return 1;
  const float scale = params[0], cap = params[1];
  const int window = (int)params[2];
  float stack_scores[MAX_STACK_SCORES];
  float *scores = H * T <= MAX_STACK_SCORES ? stack_scores : malloc(sizeof(float) * H * T);
  for (int r = 0; r < B; r++) {
    const float *K, *V;
    TensorType krt, vrt;
    if (LiteRtGetTensorBufferHostMemory(in[3 + 2 * r], (void **)&K) ||
        LiteRtGetTensorBufferHostMemory(in[4 + 2 * r], (void **)&V) ||
        LiteRtGetTensorBufferTensorType(in[3 + 2 * r], &krt) || LiteRtGetTensorBufferTensorType(in[4 + 2 * r], &vrt))
      return 3;
    if (krt.layout.dims[1] != G || krt.layout.dims[2] != T || krt.layout.dims[3] != D || vrt.layout.dims[1] != G ||
        vrt.layout.dims[2] != D || vrt.layout.dims[3] != T)
      return 1; /* this row's caches are not [1, G, T, D] and [1, G, D, T] */
    int hi = pos[r];
    if (hi < 0 || hi >= T) hi = T - 1; /* the graph would clamp too: never read past the cache */
    int lo = window > 0 && hi - window + 1 > 0 ? hi - window + 1 : 0;
    int n = hi - lo + 1;
    for (int g = 0; g < G; g++) {
      const float *qg = q + ((size_t)(r * G + g) * H) * D;
      const float *Kg = K + (size_t)g * T * D, *Vg = V + (size_t)g * D * T;
      float *og = o + ((size_t)(r * G + g) * H) * D;
      for (int t = lo; t <= hi; t++) {
        const float *k = Kg + (size_t)t * D;
        for (int h = 0; h < H; h++) {
          const float *qh = qg + h * D;
          float acc = 0.f;
#pragma omp simd reduction(+ : acc)
          for (int d = 0; d < D; d++) acc += qh[d] * k[d];
          acc *= scale;
          if (cap > 0.f) acc = tanhf(acc / cap) * cap;
          scores[h * T + t] = acc;
        }
      }
      for (int h = 0; h < H; h++) {
        float *s = scores + h * T + lo, m = s[0], sum = 0.f;
        for (int i = 1; i < n; i++) m = s[i] > m ? s[i] : m;
        for (int i = 0; i < n; i++) { s[i] = expf(s[i] - m); sum += s[i]; }
        float inv = 1.f / sum;
        for (int i = 0; i < n; i++) s[i] *= inv;
      }
      for (int d = 0; d < D; d++) {
        const float *v = Vg + (size_t)d * T + lo;
        for (int h = 0; h < H; h++) {
          const float *p = scores + h * T + lo;
          float acc = 0.f;
#pragma omp simd reduction(+ : acc)
          for (int i = 0; i < n; i++) acc += p[i] * v[i];
          og[h * D + d] = acc;
        }
      }
    }
  }
  if (scores != stack_scores) free(scores);
  return 0;
}

/* ---- The same op, vectorized: GCC vector types (16 floats: AVX-512 registers, or pairs
 * of AVX2 ones where -march=native has no AVX-512), exp as a polynomial (no libm call per
 * score), and the heads of a group sharing each load of K and V. */
typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef int32_t i16v __attribute__((vector_size(64), aligned(4)));

static inline v16 load16(const float *p) { return *(const v16 *)p; }
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));
/* A tree of halvings (4 shuffles and adds), not 16 dependent scalar adds. */
static inline float hsum16(v16 a) {
  v8 b = __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
  v4 c = __builtin_shufflevector(b, b, 0, 1, 2, 3) + __builtin_shufflevector(b, b, 4, 5, 6, 7);
  return (c[0] + c[2]) + (c[1] + c[3]);
}
static inline float hmax16(v16 a) {
  float m = a[0];
  for (int i = 1; i < 16; i++) m = a[i] > m ? a[i] : m;
  return m;
}
/* exp(x) for x <= 0 (scores less their maximum): 2^n * p(r), r = x - n ln2 in
 * [-ln2/2, ln2/2], p a degree-6 Taylor polynomial (relative error < 2e-7); below -87 it is 0. */
static inline v16 exp16(v16 x) {
  const i16v below = x < -87.0f; /* all ones where exp underflows: the result is 0 there */
  const v16 xc = (v16)(((i16v)x & ~below) | ((i16v)((v16){0} - 87.0f) & below));
  const v16 shift = (v16){0} + 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
  v16 n = (xc * 1.44269504f + shift) - shift;
  v16 r = xc - n * 0.693145752f - n * 1.42860677e-6f;
  v16 p = (v16){0} + 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const i16v bits = (__builtin_convertvector(n, i16v) + 127) << 23;
  return (v16)((i16v)(p * (v16)bits) & ~below);
}

#define VPASS(HC)                                                                              \
  static void vpass_##HC(const float *Vg, const float *scores, int T, int S, int D, int lo,     \
                         int n, float *og) {                                                   \
    int d = 0;                                                                                 \
    for (; d + 4 <= D; d += 4) { /* 4 rows of V share each load of the scores */               \
      const float *v0 = Vg + (size_t)d * T + lo, *v1 = v0 + T, *v2 = v1 + T, *v3 = v2 + T;     \
      v16 a0[HC], a1[HC], a2[HC], a3[HC];                                                      \
      for (int h = 0; h < HC; h++) a0[h] = a1[h] = a2[h] = a3[h] = (v16){0};                   \
      int i = 0;                                                                               \
      for (; i + 16 <= n; i += 16) {                                                           \
        v16 x0 = load16(v0 + i), x1 = load16(v1 + i), x2 = load16(v2 + i), x3 = load16(v3 + i); \
        for (int h = 0; h < HC; h++) {                                                         \
          v16 p = load16(scores + h * S + lo + i);                                             \
          a0[h] += p * x0; a1[h] += p * x1; a2[h] += p * x2; a3[h] += p * x3;                  \
        }                                                                                      \
      }                                                                                        \
      for (int h = 0; h < HC; h++) {                                                           \
        float s0 = hsum16(a0[h]), s1 = hsum16(a1[h]), s2 = hsum16(a2[h]), s3 = hsum16(a3[h]);  \
        for (int j = i; j < n; j++) {                                                          \
          float p = scores[h * S + lo + j];                                                    \
          s0 += p * v0[j]; s1 += p * v1[j]; s2 += p * v2[j]; s3 += p * v3[j];                  \
        }                                                                                      \
        og[h * D + d] = s0; og[h * D + d + 1] = s1; og[h * D + d + 2] = s2; og[h * D + d + 3] = s3; \
      }                                                                                        \
    }                                                                                          \
    for (; d < D; d++) {                                                                       \
      const float *v = Vg + (size_t)d * T + lo;                                                \
      for (int h = 0; h < HC; h++) {                                                           \
        float s = 0.f;                                                                         \
        for (int j = 0; j < n; j++) s += scores[h * S + lo + j] * v[j];                        \
        og[h * D + d] = s;                                                                     \
      }                                                                                        \
    }                                                                                          \
  }
VPASS(1) VPASS(2) VPASS(3) VPASS(4) VPASS(5) VPASS(6) VPASS(7) VPASS(8)
typedef void (*vpass_fn)(const float *, const float *, int, int, int, int, int, float *);
static const vpass_fn VPASSES[9] = {0, vpass_1, vpass_2, vpass_3, vpass_4, vpass_5, vpass_6, vpass_7, vpass_8};

#define KPASS(DC)                                                                              \
  static void kpass_##DC(const float *qg, const float *Kg, int H, int lo, int hi, float scale, \
                         float *scores, int S) {                                               \
    enum { C = DC / 16 };                                                                      \
    for (int t = lo; t <= hi; t++) { /* each K row read once, for all the group's heads */     \
      const float *k0 = Kg + (size_t)t * DC;                                                   \
      v16 kv[C];                                                                               \
      for (int c = 0; c < C; c++) kv[c] = load16(k0 + 16 * c);                                 \
      for (int h = 0; h < H; h++) {                                                            \
        const float *qh = qg + h * DC;                                                         \
        v16 e = load16(qh) * kv[0], f = load16(qh + 16) * kv[1];                               \
        for (int c = 2; c < C; c += 2) {                                                       \
          e += load16(qh + 16 * c) * kv[c];                                                    \
          f += load16(qh + 16 * c + 16) * kv[c + 1];                                           \
        }                                                                                      \
        scores[h * S + t] = hsum16(e + f) * scale;                                             \
      }                                                                                        \
    }                                                                                          \
  }
KPASS(64) KPASS(128) KPASS(256)

Status attention_fast_run(void *user, size_t n_in, const Buffer *in, size_t n_out, Buffer *out) {
  if (n_in < 5 || (n_in - 3) % 2 || n_out != 1) return 1;
  TensorType qt, kt;
  float *q, *params, *o;
  int32_t *pos;
  if (LiteRtGetTensorBufferTensorType(in[0], &qt) || LiteRtGetTensorBufferTensorType(in[3], &kt) ||
      LiteRtGetTensorBufferHostMemory(in[0], (void **)&q) || LiteRtGetTensorBufferHostMemory(in[1], (void **)&pos) ||
      LiteRtGetTensorBufferHostMemory(in[2], (void **)&params) || LiteRtGetTensorBufferHostMemory(out[0], (void **)&o))
    return 3;
  const int B = qt.layout.dims[0], G = qt.layout.dims[1], H = qt.layout.dims[2], D = qt.layout.dims[3];
  const int T = kt.layout.dims[2];
  if ((size_t)B * 2 + 3 != n_in || kt.layout.dims[1] != G || kt.layout.dims[3] != D) return 1;
  if (D % 16 || H > 8) return attention_run(user, n_in, in, n_out, out);
  const float scale = params[0], cap = params[1];
  const int window = (int)params[2];
  const int S = T + 16 + ((T % 1024) < 16 ? 16 : 0); /* rows of scores off the 4 KB period (no aliasing) */
  float stack_scores[MAX_STACK_SCORES + 64];
  float *scores = H * S <= MAX_STACK_SCORES + 64 ? stack_scores : malloc(sizeof(float) * H * S);
  for (int r = 0; r < B; r++) {
    const float *K, *V;
    TensorType krt, vrt;
    if (LiteRtGetTensorBufferHostMemory(in[3 + 2 * r], (void **)&K) ||
        LiteRtGetTensorBufferHostMemory(in[4 + 2 * r], (void **)&V) ||
        LiteRtGetTensorBufferTensorType(in[3 + 2 * r], &krt) || LiteRtGetTensorBufferTensorType(in[4 + 2 * r], &vrt))
      return 3;
    if (krt.layout.dims[1] != G || krt.layout.dims[2] != T || krt.layout.dims[3] != D || vrt.layout.dims[1] != G ||
        vrt.layout.dims[2] != D || vrt.layout.dims[3] != T)
      return 1; /* this row's caches are not [1, G, T, D] and [1, G, D, T] */
    int hi = pos[r];
    if (hi < 0 || hi >= T) hi = T - 1;
    int lo = window > 0 && hi - window + 1 > 0 ? hi - window + 1 : 0;
    int n = hi - lo + 1;
    for (int g = 0; g < G; g++) {
      const float *qg = q + ((size_t)(r * G + g) * H) * D;
      const float *Kg = K + (size_t)g * T * D, *Vg = V + (size_t)g * D * T;
      float *og = o + ((size_t)(r * G + g) * H) * D;
      if (D == 64) kpass_64(qg, Kg, H, lo, hi, scale, scores, S);
      else if (D == 128) kpass_128(qg, Kg, H, lo, hi, scale, scores, S);
      else if (D == 256) kpass_256(qg, Kg, H, lo, hi, scale, scores, S);
      else
        for (int t = lo; t <= hi; t++) {
          const float *k = Kg + (size_t)t * D;
          for (int h = 0; h < H; h++) {
            const float *qh = qg + h * D;
            v16 acc = load16(qh) * load16(k);
            for (int c = 16; c < D; c += 16) acc += load16(qh + c) * load16(k + c);
            scores[h * S + t] = hsum16(acc) * scale;
          }
        }
      for (int h = 0; h < H; h++) {
        float *s = scores + h * S + lo;
        if (cap > 0.f)
          for (int i = 0; i < n; i++) s[i] = tanhf(s[i] / cap) * cap;
        float m = s[0];
        int i = 0;
        if (n >= 16) {
          v16 mv = load16(s);
          for (i = 16; i + 16 <= n; i += 16) {
            v16 x = load16(s + i);
            mv = (v16)(((i16v)x & (x > mv)) | ((i16v)mv & ~(x > mv)));
          }
          m = hmax16(mv);
        }
        for (; i < n; i++) m = s[i] > m ? s[i] : m;
        v16 total = (v16){0};
        i = 0;
        for (; i + 16 <= n; i += 16) {
          v16 e = exp16(load16(s + i) - m);
          *(v16 *)(s + i) = e;
          total += e;
        }
        float sum = hsum16(total);
        for (; i < n; i++) { s[i] = expf(s[i] - m); sum += s[i]; }
        float inv = 1.f / sum;
        for (i = 0; i < n; i++) s[i] *= inv;
      }
      VPASSES[H](Vg, scores, T, S, D, lo, n, og);
    }
  }
  if (scores != stack_scores) free(scores);
  return 0;
}

/* The attention op with its failures made visible: the library ignores the status Run
 * returns, so a failure is written to the int64 user_data points to (the runtime reads it
 * after the run and raises, naming the op), and the output is filled with NaN. */
Status attention_checked_run(void *user, size_t n_in, const Buffer *in, size_t n_out, Buffer *out) {
  Status status = attention_fast_run(user, n_in, in, n_out, out);
  if (status) {
    if (user) *(volatile int64_t *)user = status;
    float *o;
    size_t bytes;
    if (n_out >= 1 && !LiteRtGetTensorBufferHostMemory(out[0], (void **)&o) && !LiteRtGetTensorBufferSize(out[0], &bytes))
      for (size_t i = 0; i < bytes / 4; i++) o[i] = __builtin_nanf("");
  }
  return status;
}
