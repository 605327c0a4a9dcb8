/* The decode-attention kernel alone, on cold caches, against a plain read of the bytes it reads.
 *
 * Built and run by kernel_bench.py (the runtime's compiler and flags, or --flags); by hand:
 *   cc -O3 -mavx512f -mavx2 -mfma -DKERNEL="\"$PWD/runtime/executor/kernels/decode_attention.c\"" \
 *      benchmarks/experiments/kernel_probe/kernel_bench.c -o /tmp/kernel_bench -lm
 *   /tmp/kernel_bench SPAN POSITION [ROUNDS [f32|f16]]   -> "kernel_ms read_ms read4_ms" (best of ROUNDS)
 *
 * 30 layers at SmolLM2-135M's shapes (3 KV groups x 3 query heads x 64), each its own K and V
 * cache of SPAN positions in the transposed layout, float32 or float16 (f16), the mask open up
 * to POSITION. Before
 * every timed round 1 GiB is read, so that the caches come from memory as they do in a decode
 * step (the weights pass through the CPU's caches between two steps' attention). The read
 * loop reads exactly the bytes the kernel reads (positions 0..POSITION of every K and V row). */
#include <float.h>
#include <stdio.h>
#include <time.h>
#include KERNEL

/* The read loop's vectors are the build's register width (16 floats with AVX-512, 8 with
 * AVX2, else 4), its own and not the kernel's: a vector wider than the registers is split by
 * GCC at a cost that would make the loop, and so the share column, lie. Integer adds: the
 * halves of f16 caches read as floats would be denormals or NaN as often as not. */
#if defined(__AVX512F__)
#define RW 16
#elif defined(__AVX__)
#define RW 8
#else
#define RW 4
#endif
typedef int32_t rv __attribute__((vector_size(RW * 4), aligned(4)));

typedef struct { void *data; TensorType type; size_t bytes; } Fake; /* a LiteRT tensor buffer's stand-in */
static Status host_memory(Buffer b, void **p) { *p = ((Fake *)b)->data; return 0; }
static Status tensor_type(Buffer b, TensorType *t) { *t = ((Fake *)b)->type; return 0; }
static Status size(Buffer b, size_t *s) { *s = ((Fake *)b)->bytes; return 0; }

/* A tensor of float32 (element 1) or float16 (10) numbers in [-0.5, 0.5). */
static Fake *tensor(int rank, const int *dims, int element) {
  Fake *f = calloc(1, sizeof(Fake));
  size_t n = 1;
  const size_t es = element == 10 ? 2 : 4; /* bytes an element */
  f->type.element = element;
  f->type.layout.bits = rank;
  for (int i = 0; i < rank; i++) n *= (size_t)(f->type.layout.dims[i] = dims[i]);
  f->bytes = n * es;
  f->data = aligned_alloc(64, (n * es + 63) / 64 * 64);
  for (size_t i = 0; i < n; i++) {
    const float x = (float)((i * 2654435761u) % 1000) / 1000.f - 0.5f;
    if (element == 10) ((_Float16 *)f->data)[i] = (_Float16)x;
    else ((float *)f->data)[i] = x;
  }
  return f;
}

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
  if (argc < 3) { fprintf(stderr, "usage: %s SPAN POSITION [ROUNDS [f32|f16]]\n", argv[0]); return 2; }
  enum { L = 30, G = 3, H = 3, D = 64 };
  const int T = atoi(argv[1]), pos = atoi(argv[2]), rounds = argc > 3 ? atoi(argv[3]) : 15;
  const int caches = argc > 4 && !strcmp(argv[4], "f16") ? 10 : 1;
  const size_t es = caches == 10 ? 2 : 4; /* bytes a cache element */
  Context context = {0, host_memory, tensor_type, size};
  const int qd[4] = {1, G, H, D}, kd[4] = {1, G, T, D}, vd[4] = {1, G, D, T}, md[1] = {T}, pd[1] = {4};
  Fake *q = tensor(4, qd, 1), *mask = tensor(1, md, 1), *params = tensor(1, pd, 1), *out = tensor(4, qd, 1);
  for (int i = 0; i < T; i++) ((float *)mask->data)[i] = i <= pos ? 0.f : -FLT_MAX;
  ((float *)params->data)[0] = 0.125f, ((float *)params->data)[1] = 0.f;
  Buffer in[L][5], outs[1] = {out};
  for (int l = 0; l < L; l++) {
    in[l][0] = q, in[l][1] = mask, in[l][2] = params, in[l][3] = tensor(4, kd, caches), in[l][4] = tensor(4, vd, caches);
  }
  const size_t flush_n = (size_t)1 << 28;
  float *flush = malloc(flush_n * 4), sink = 0;
  for (size_t i = 0; i < flush_n; i++) flush[i] = 1;
  double kernel = 1e9, read = 1e9, read4 = 1e9;
  for (int r = 0; r < rounds; r++) {
    for (size_t i = 0; i < flush_n; i += 16) sink += flush[i];
    double t0 = now();
    for (int l = 0; l < L; l++) {
      if (attention_run(&context, 5, in[l], 1, outs)) { fprintf(stderr, "kernel failed: %lld\n", (long long)context.error); return 1; }
      sink += ((float *)out->data)[0];
    }
    double t = now() - t0;
    kernel = t < kernel ? t : kernel;
    for (size_t i = 0; i < flush_n; i += 16) sink += flush[i];
    t0 = now();
    for (int l = 0; l < L; l++) {
      const char *K = ((Fake *)in[l][3])->data, *V = ((Fake *)in[l][4])->data; /* addressed in bytes */
      const size_t step = 2 * sizeof(rv), group = (size_t)T * D * es, open = (size_t)(pos + 1) * es;
      rv a = {0}, b = {0};
      for (int g = 0; g < G; g++)
        for (size_t i = g * group; i + step <= g * group + open * D; i += step)
          a += *(const rv *)(K + i), b += *(const rv *)(K + i + sizeof(rv));
      for (int row = 0; row < G * D; row++)
        for (size_t i = 0; i + step <= open; i += step)
          a += *(const rv *)(V + row * (size_t)T * es + i), b += *(const rv *)(V + row * (size_t)T * es + i + sizeof(rv));
      a += b;
      for (int i = 0; i < RW; i++) sink += a[i];
    }
    t = now() - t0;
    read = t < read ? t : read;
    /* The same bytes as four interleaved streams (the most one core reads here: its prefetchers
     * follow several streams at once): each group's K span in four stretches, V four rows at once. */
    for (size_t i = 0; i < flush_n; i += 16) sink += flush[i];
    t0 = now();
    for (int l = 0; l < L; l++) {
      const char *K = ((Fake *)in[l][3])->data, *V = ((Fake *)in[l][4])->data;
      const size_t step = sizeof(rv), group = (size_t)T * D * es, open = (size_t)(pos + 1) * es;
      const size_t quarter = open * D / 4 / step * step;
      rv a = {0}, b = {0}, c = {0}, d = {0};
      for (int g = 0; g < G; g++) {
        const char *k = K + g * group;
        for (size_t i = 0; i + step <= quarter; i += step)
          a += *(const rv *)(k + i), b += *(const rv *)(k + quarter + i), c += *(const rv *)(k + 2 * quarter + i),
              d += *(const rv *)(k + 3 * quarter + i);
        for (size_t i = 4 * quarter; i + step <= open * D; i += step) a += *(const rv *)(k + i);
      }
      int row = 0;
      for (; row + 4 <= G * D; row += 4) {
        const char *v = V + row * (size_t)T * es;
        for (size_t i = 0; i + step <= open; i += step)
          a += *(const rv *)(v + i), b += *(const rv *)(v + (size_t)T * es + i),
              c += *(const rv *)(v + 2 * (size_t)T * es + i), d += *(const rv *)(v + 3 * (size_t)T * es + i);
      }
      for (; row < G * D; row++)
        for (size_t i = 0; i + step <= open; i += step) a += *(const rv *)(V + row * (size_t)T * es + i);
      a += b + c + d;
      for (int i = 0; i < RW; i++) sink += a[i];
    }
    t = now() - t0;
    read4 = t < read4 ? t : read4;
  }
  printf("%.4f %.4f %.4f\n", kernel * 1e3, read * 1e3, read4 * 1e3);
  fprintf(stderr, "(%g)\n", sink);
  return 0;
}
