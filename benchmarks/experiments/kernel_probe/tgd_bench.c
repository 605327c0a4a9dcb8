/* A decode-attention pass over litert-torch's default KV layout, K and V [1, T, G, D] (a
 * position's G groups one row of G x D floats), against the runtime's kernel over its transposed
 * layout (K [1, G, T, D], V [1, G, D, T]), for a whole 8-row step: 30 layers x 8 rows = 240 ops,
 * each after its cache writes, on cold caches (RESULTS.md section 20).
 *
 *   cc -O3 -fno-math-errno -mavx512f -mavx2 -mfma -mf16c $(the CPU's tuning) -DHUGE_PAGES \
 *      benchmarks/experiments/kernel_probe/tgd_bench.c -o /tmp/tgd_bench -lm
 *   /tmp/tgd_bench T [ROUNDS [P,P,...]]        (defaults: 9 rounds, 32,128,512,1000)
 *
 * SmolLM2-135M's shapes (3 groups x 3 query heads x 64), float32 caches, each (layer, row) its own
 * K and V in one pool asked for 2 MB pages (the runtime's PageBlock) or, without -DHUGE_PAGES,
 * aligned_alloc. The [T, G, D] side (attend_tgd) reads the open span once, in order, all groups
 * a block of positions at a time: the K pass is the kernel's (W positions' rows dotted with each
 * head, the W sums reduced together) with rows G x D apart, the V pass takes BLOCK positions at a
 * time and sums each group's rows into its three heads' outputs (the heads share each load); spans up to TGD_SPAN bytes of a
 * position's row (K and V alike) are asked into the second-level cache first, longer ones 8 KB
 * ahead as the passes go (-DTGD_AHEAD=BYTES), each pass taking its blocks from -DTGD_STREAMS=N
 * stretches of the span in turn. Both sides' outputs are compared op by op before timing; layouts
 * alternate A,B / B,A round by round; medians [min-max] in ms per 240-op pass, writes included. */
#include <float.h>
#include <stdio.h>
#include <sys/mman.h>
#include <time.h>
#ifndef KERNEL
#define KERNEL "../../../runtime/executor/kernels/decode_attention.c"
#endif
#include KERNEL

enum { L = 30, R = 8, G = 3, H = 3, D = 64, ROW = G * D, C = D / W, BLOCK = 32 };
#ifndef TGD_SPAN
#define TGD_SPAN 1024 /* positions x 4 bytes: 256 positions */
#endif
#ifndef TGD_AHEAD
#define TGD_AHEAD 8192 /* bytes ahead the passes ask for lines, past TGD_SPAN */
#endif
#ifndef TGD_STREAMS
#define TGD_STREAMS 1 /* stretches of the span each pass reads in turn */
#endif
#define ASK_L2(p) __asm__ volatile("prefetcht1 %0" : : "m"(*(const char *)(p)))

typedef struct { void *data; TensorType type; size_t bytes; } Fake; /* a LiteRT tensor buffer's stand-in */
static Status host_memory(Buffer b, void **p) { *p = ((Fake *)b)->data; return 0; }
static Status tensor_type(Buffer b, TensorType *t) { *t = ((Fake *)b)->type; return 0; }
static Status size(Buffer b, size_t *s) { *s = ((Fake *)b)->bytes; return 0; }
static Fake *tensor(int rank, const int *dims) { /* f32, zeroed */
  Fake *f = calloc(1, sizeof(Fake));
  size_t n = 1;
  f->type.element = 1;
  f->type.layout.bits = rank;
  for (int i = 0; i < rank; i++) n *= (size_t)(f->type.layout.dims[i] = dims[i]);
  f->bytes = n * 4;
#ifdef HUGE_PAGES
  enum { POOL = 1800 << 20 };
  static char *pool;
  static size_t used;
  if (!pool && (pool = aligned_alloc(2 << 20, POOL))) madvise(pool, POOL, MADV_HUGEPAGE);
  if (!pool || used + n * 4 > POOL) exit(fprintf(stderr, "no room for the tensors in the pool\n"));
  f->data = pool + used;
  used += (n * 4 + 4095) / 4096 * 4096;
#else
  f->data = aligned_alloc(64, (n * 4 + 63) / 64 * 64);
#endif
  memset(f->data, 0, f->bytes);
  return f;
}
static float value(size_t i) { return (float)((i * 2654435761u) % 1000) / 1000.f - 0.5f; }
static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

/* scores[(g*H + h)*S + t] = q[g][h] . K[t][g] * scale, t = lo..hi. */
static void kpass_tgd(const float *q, const float *K, int lo, int hi, float scale, float *scores, int S, int ahead) {
  const int blocks = (hi + 1 - lo) / W, per = (blocks + TGD_STREAMS - 1) / TGD_STREAMS;
  for (int k = 0; k < per * TGD_STREAMS; k++) { /* blocks from TGD_STREAMS stretches of the span in turn */
    const int b = k % TGD_STREAMS * per + k / TGD_STREAMS;
    if (b >= blocks) continue;
    const int t = lo + b * W;
    const float *kb = K + (size_t)t * ROW;
    if (ahead)
      for (int l = 0; l < W * ROW * 4 / 64; l++) ASK_L2((const char *)kb + TGD_AHEAD + 64 * l);
    for (int g = 0; g < G; g++) {
      vf kept[W][C];
      for (int j = 0; j < W; j++)
        for (int c = 0; c < C; c++) kept[j][c] = loadv(kb + (size_t)j * ROW + g * D + W * c);
      for (int h = 0; h < H; h++) {
        const float *qh = q + (g * H + h) * D;
        vf acc[W];
        for (int j = 0; j < W; j++) {
          vf e = loadv(qh) * kept[j][0];
          for (int c = 1; c < C; c++) e += loadv(qh + W * c) * kept[j][c];
          acc[j] = e;
        }
        *(vf *)(scores + (g * H + h) * S + t) = sumsv(acc) * scale;
      }
    }
  }
  for (int t = lo + blocks * W; t <= hi; t++)
    for (int g = 0; g < G; g++)
      for (int h = 0; h < H; h++) {
        const float *qh = q + (g * H + h) * D, *k = K + (size_t)t * ROW + g * D;
        vf e = loadv(qh) * loadv(k);
        for (int c = 1; c < C; c++) e += loadv(qh + W * c) * loadv(k + W * c);
        scores[(g * H + h) * S + t] = hsumv(e) * scale;
      }
}
/* o[g][h] = sum_t p[g*H + h][t] * V[t][g], t = lo..lo+n-1: BLOCK positions at a time (their rows
 * stay in the first-level cache), each group's three heads over the block with 12 accumulators. */
static void vpass_tgd(const float *V, const float *scores, int S, int lo, int n, float *o, int ahead) {
  const int blocks = (n + BLOCK - 1) / BLOCK, per = (blocks + TGD_STREAMS - 1) / TGD_STREAMS;
  for (int k = 0; k < per * TGD_STREAMS; k++) { /* blocks from TGD_STREAMS stretches in turn */
    const int kb = k % TGD_STREAMS * per + k / TGD_STREAMS;
    if (kb >= blocks) continue;
    const int b = kb * BLOCK, e = b + BLOCK < n ? b + BLOCK : n;
    if (ahead)
      for (int l = 0; l < (e - b) * ROW * 4 / 64; l++)
        ASK_L2((const char *)(V + (size_t)(lo + b) * ROW) + TGD_AHEAD + 64 * l);
    for (int g = 0; g < G; g++) {
      vf a[H][C];
      for (int h = 0; h < H; h++)
        for (int c = 0; c < C; c++) a[h][c] = k ? loadv(o + (g * H + h) * D + W * c) : (vf){0};
      for (int i = b; i < e; i++) {
        const float *v = V + (size_t)(lo + i) * ROW + g * D;
        vf x[C];
        for (int c = 0; c < C; c++) x[c] = loadv(v + W * c);
        for (int h = 0; h < H; h++) {
          const vf p = (vf){0} + scores[(g * H + h) * S + lo + i];
          for (int c = 0; c < C; c++) a[h][c] += p * x[c];
        }
      }
      for (int h = 0; h < H; h++)
        for (int c = 0; c < C; c++) *(vf *)(o + (g * H + h) * D + W * c) = a[h][c];
    }
  }
}
static void attend_tgd(const float *q, const float *mask, float scale, const float *K, const float *V, int T, float *o) {
  int lo = 0, hi = T - 1;
  while (lo < T && !(mask[lo] > -1e30f)) lo++;
  if (lo == T) lo = 0;
  else
    while (!(mask[hi] > -1e30f)) hi--;
  const int n = hi - lo + 1, S = T + 16 + ((T % 1024) < 16 ? 16 : 0);
  static float scores[G * H * (4096 + 32)] __attribute__((aligned(64)));
  const int ahead = (size_t)n * 4 > TGD_SPAN;
  if (!ahead) /* the whole open span of both caches, asked for at once */
    for (size_t b = 0; b < (size_t)n * ROW * 4; b += 64) {
      ASK_L2((const char *)(K + (size_t)lo * ROW) + b);
      ASK_L2((const char *)(V + (size_t)lo * ROW) + b);
    }
  kpass_tgd(q, K, lo, hi, scale, scores, S, ahead);
  for (int gh = 0; gh < G * H; gh++) softmax(scores + gh * S + lo, mask + lo, n, 0.f); /* the kernel's */
  vpass_tgd(V, scores, S, lo, n, o, ahead);
}

static int T;
static Context context = {0, host_memory, tensor_type, size};
static Fake *Kc[2][L][R], *Vc[2][L][R], *qs[R], *masks[R], *params, *outs[R];
static float knew[R][G * D], vnew[R][G * D];

static void write_step(int layout, int l, int r, int P) {
  float *K = Kc[layout][l][r]->data, *V = Vc[layout][l][r]->data;
  if (layout == 1) { /* one row of G x D each */
    memcpy(K + (size_t)P * ROW, knew[r], ROW * 4);
    memcpy(V + (size_t)P * ROW, vnew[r], ROW * 4);
    return;
  }
  for (int g = 0; g < G; g++) {
    memcpy(K + ((size_t)g * T + P) * D, knew[r] + g * D, D * 4);
    for (int d = 0; d < D; d++) V[((size_t)g * D + d) * T + P] = vnew[r][g * D + d];
  }
}
static void attend_step(int layout, int l, int r) {
  if (layout == 0) {
    Buffer in[5] = {qs[r], masks[r], params, Kc[0][l][r], Vc[0][l][r]}, out[1] = {outs[r]};
    if (attention_run(&context, 5, in, 1, out)) { fprintf(stderr, "kernel failed\n"); exit(1); }
  } else
    attend_tgd(qs[r]->data, masks[r]->data, 0.125f, Kc[1][l][r]->data, Vc[1][l][r]->data, T, outs[r]->data);
}
static double pass(int layout, int P) { /* ms for the 240 ops */
  const double t0 = now();
  for (int l = 0; l < L; l++)
    for (int r = 0; r < R; r++) {
      write_step(layout, l, r, P);
      attend_step(layout, l, r);
    }
  return (now() - t0) * 1e3;
}
static int compare(const void *a, const void *b) { double x = *(double *)a, y = *(double *)b; return (x > y) - (x < y); }
static double median(const double *x, int n, double *lo, double *hi) {
  double s[64];
  memcpy(s, x, n * sizeof(double));
  qsort(s, n, sizeof(double), compare);
  *lo = s[0], *hi = s[n - 1];
  return n % 2 ? s[n / 2] : (s[n / 2 - 1] + s[n / 2]) / 2;
}

int main(int argc, char **argv) {
  if (argc < 2) return fprintf(stderr, "usage: %s T [ROUNDS [P,P,...]]\n", argv[0]), 2;
  T = atoi(argv[1]);
  const int rounds = argc > 2 ? atoi(argv[2]) : 9;
  int positions[16] = {32, 128, 512, 1000}, np = 4;
  if (argc > 3) {
    np = 0;
    for (char *s = strtok(argv[3], ","); s && np < 16; s = strtok(0, ",")) positions[np++] = atoi(s);
  }
  if (T < 16 || T > 4096 || rounds < 1 || rounds > 64) return fprintf(stderr, "T 16..4096, ROUNDS 1..64\n"), 2;
  for (int i = 0; i < np; i++)
    if (positions[i] < 0 || positions[i] >= T) return fprintf(stderr, "position %d outside 0..T-1\n", positions[i]), 2;
  const int qd[4] = {1, G, H, D}, kd[2][4] = {{1, G, T, D}, {1, T, G, D}}, vd[2][4] = {{1, G, D, T}, {1, T, G, D}},
            md[1] = {T}, pd[1] = {4};
  params = tensor(1, pd);
  ((float *)params->data)[0] = 0.125f;
  for (int r = 0; r < R; r++) {
    qs[r] = tensor(4, qd), masks[r] = tensor(1, md), outs[r] = tensor(4, qd);
    for (int i = 0; i < G * H * D; i++) ((float *)qs[r]->data)[i] = 8 * value(i + 7919 * r);
    for (int i = 0; i < G * D; i++) knew[r][i] = value(i + 31 * r + 5), vnew[r][i] = value(i + 17 * r + 3);
  }
  for (int l = 0; l < L; l++) /* both layouts hold the same numbers: element (l, r, g, t, d) */
    for (int r = 0; r < R; r++)
      for (int y = 0; y < 2; y++) {
        Kc[y][l][r] = tensor(4, kd[y]), Vc[y][l][r] = tensor(4, vd[y]);
        float *K = Kc[y][l][r]->data, *V = Vc[y][l][r]->data;
        const size_t base = (size_t)(l * R + r) * G * T * D;
        for (int g = 0; g < G; g++)
          for (int t = 0; t < T; t++)
            for (int d = 0; d < D; d++) {
              const size_t i = ((size_t)g * T + t) * D + d, at = ((size_t)t * G + g) * D + d;
              K[y ? at : i] = value(base + i);
              V[y ? at : ((size_t)g * D + d) * T + t] = value(base + i + 12345);
            }
      }
  const size_t flush_n = (size_t)1 << 27; /* 512 MB */
  float *flush = malloc(flush_n * 4), sink = 0;
  for (size_t i = 0; i < flush_n; i++) flush[i] = 1;
  float *check = malloc(sizeof(float) * L * R * G * H * D);
  printf("T=%d, %s pages, %d rounds, ms per 240-op pass (30 layers x 8 rows, writes and attention), median [min-max]\n",
#ifdef HUGE_PAGES
         T, "2 MB",
#else
         T, "4 KB",
#endif
         rounds);
  printf("%5s %-26s %-26s %-6s %s\n", "P", "transposed (the kernel)", "[T, G, D]", "ratio", "maxdiff");
  for (int pi = 0; pi < np; pi++) {
    const int P = positions[pi];
    for (int r = 0; r < R; r++)
      for (int i = 0; i < T; i++) ((float *)masks[r]->data)[i] = i <= P ? 0.f : -FLT_MAX;
    float maxdiff = 0;
    for (int y = 0; y < 2; y++) /* the outputs, op by op */
      for (int l = 0; l < L; l++)
        for (int r = 0; r < R; r++) {
          write_step(y, l, r, P);
          attend_step(y, l, r);
          float *c = check + (size_t)(l * R + r) * G * H * D, *o = outs[r]->data;
          for (int i = 0; i < G * H * D; i++) {
            if (y == 0) c[i] = o[i];
            else {
              const float e = fabsf(c[i] - o[i]);
              maxdiff = e > maxdiff || e != e ? e : maxdiff;
            }
          }
        }
    double t[2][64], ratio[64];
    for (int round = 0; round < rounds; round++)
      for (int k = 0; k < 2; k++) {
        const int y = k ^ (round & 1); /* A,B then B,A */
        for (size_t i = 0; i < flush_n; i += 16) sink += flush[i];
        t[y][round] = pass(y, P);
        for (int r = 0; r < R; r++) sink += ((float *)outs[r]->data)[0];
      }
    for (int round = 0; round < rounds; round++) ratio[round] = t[1][round] / t[0][round];
    double lo0, hi0, lo1, hi1, lr, hr;
    const double m0 = median(t[0], rounds, &lo0, &hi0), m1 = median(t[1], rounds, &lo1, &hi1);
    printf("%5d %6.3f [%.3f-%.3f]      %6.3f [%.3f-%.3f]      %.3f  %.2g\n", P, m0, lo0, hi0, m1, lo1, hi1,
           median(ratio, rounds, &lr, &hr), maxdiff);
    fflush(stdout);
  }
  fprintf(stderr, "(%g)\n", sink);
  return 0;
}
