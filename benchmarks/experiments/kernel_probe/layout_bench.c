/* The V cache's layout at short positions: the runtime's transposed V [1, G, D, T] against a
 * positions-outer V [1, G, T, D] (K's layout), on cold caches, for a whole 8-row decode step's
 * attention: 30 layers x 8 rows = 240 ops, each after its cache writes.
 *
 * Build and run (AVX2; T = the caches' length, 1024 or 4096):
 *   cc -O3 -mavx2 -mfma benchmarks/experiments/kernel_probe/layout_bench.c -o /tmp/layout_bench -lm
 *   /tmp/layout_bench T [ROUNDS [P,P,...]]          (defaults: 11 rounds, 8,32,128,512,1000)
 * (the real kernel is #included by its path relative to this file; -DKERNEL="\"path\"" for another).
 * On AVX-512: -mavx512f -mavx2 -mfma -mf16c and the CPU's tuning (kernels.tuning_flags()). With
 * -DOUTER_INTO_L2=1 -DOUTER_SPAN=BYTES the outer side asks for spans up to BYTES of a row into the
 * second-level cache before its passes (as the kernel does for its short spans on Zen 4). With
 * -DTGD the second side is litert-torch's default layout, K and V [1, T, G, D], instead (the passes
 * over it below; -DTGD_AHEAD=BYTES, -DTGD_STREAMS=N: how they ask ahead on long spans). With
 * -DHUGE_PAGES every tensor lies in one pool asked for 2 MB pages (the runtime's PageBlock gives V
 * caches of 1,024 positions huge pages from the start); without, each its own aligned_alloc.
 *
 * SmolLM2-135M's shapes (3 KV groups x 3 query heads x 64), f32 caches, each (layer, row) its
 * own aligned_alloc'd K and V, as the runtime's are separate tensors. A pass at position P,
 * layer-major (for layer: for row:) as a decode step runs: write the new K row (64 floats per
 * group) and V's new position (transposed: 64 floats on 64 rows T*4 bytes apart per group;
 * outer: one row of 64 floats), then attention over positions 0..P:
 *   transposed: the runtime's decode_attention.c (attention_run on stand-in tensors);
 *   outer: the same mask scan, K pass (its kpass_f32) and softmax, the short-span prefetch for
 *          contiguous spans, and a V pass over rows: out[h] += p[h][i] * V row i, the 3 heads
 *          sharing each load, D in two halves of 32 over blocks of 32 rows (in L1 for the 2nd).
 *          Tried and slower at P = 1000 (T 1024, 5 rounds): prefetching 8 KB ahead (+9%), 4
 *          chunks of the span read at once (+10%), whole rows with 24 accumulators (+2-10%).
 * Three passes are timed each round per layout: the whole (write + attention), the writes
 * alone, the attention alone; each after reading 512 MB (the weights between two steps leave
 * the caches cold). Layouts alternate A,B / B,A round by round; medians [min-max] in ms per
 * 240-op pass. Before timing, both layouts' outputs are compared op by op. */
#include <float.h>
#include <sys/mman.h>
#include <stdio.h>
#include <time.h>
#ifndef KERNEL
#define KERNEL "../../../runtime/executor/kernels/decode_attention.c"
#endif
#include KERNEL

enum { L = 30, R = 8, G = 3, H = 3, D = 64, HALF = 32, BLOCK = 32 };

typedef struct { void *data; TensorType type; size_t bytes; } Fake; /* a LiteRT tensor buffer's stand-in */
static Status host_memory(Buffer b, void **p) { *p = ((Fake *)b)->data; return 0; }
static Status tensor_type(Buffer b, TensorType *t) { *t = ((Fake *)b)->type; return 0; }
static Status size(Buffer b, size_t *s) { *s = ((Fake *)b)->bytes; return 0; }
static Fake *tensor(int rank, const int *dims) { /* f32, 64-byte aligned, zeroed */
  Fake *f = calloc(1, sizeof(Fake));
  size_t n = 1;
  f->type.element = 1;
  f->type.layout.bits = rank;
  for (int i = 0; i < rank; i++) n *= (size_t)(f->type.layout.dims[i] = dims[i]);
  f->bytes = n * 4;
#ifdef HUGE_PAGES /* every tensor page-aligned in one pool asked for 2 MB pages, as the runtime's V caches lie */
  enum { POOL = 1600 << 20 };
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

/* How the outer side asks for a short span's lines before its passes: up to OUTER_SPAN bytes of
 * a row (the kernel's SHORT_SPAN unless given), into the first-level cache unless OUTER_INTO_L2. */
#ifndef OUTER_SPAN
#define OUTER_SPAN SHORT_SPAN
#endif
#if OUTER_INTO_L2
#define OUTER_ASK(p) __asm__ volatile("prefetcht1 %0" : : "m"(*(const char *)(p)))
#else
#define OUTER_ASK(p) PREFETCH_NOW(p)
#endif
/* The outer layout's V pass: og[h*D + d] = sum_i p[h][lo+i] * V[lo+i][d]. */
static void vpass_outer(const float *Vg, const float *scores, int S, int lo, int n, float *og) {
  enum { C = HALF / W };
  for (int b = 0; b < n; b += BLOCK) {
    const int e = b + BLOCK < n ? b + BLOCK : n;
    for (int half = 0; half < D / HALF; half++) {
      vf a[H][C];
      for (int h = 0; h < H; h++)
        for (int c = 0; c < C; c++) a[h][c] = b ? loadv(og + h * D + half * HALF + W * c) : (vf){0};
      for (int i = b; i < e; i++) {
        const float *v = Vg + (size_t)(lo + i) * D;
        if (half == 0) /* the row's other half at once: the memory sees whole rows in order */
          for (int l = HALF * 4 / 64; l < D * 4 / 64; l++) PREFETCH_NOW((const char *)v + 64 * l);
        v += half * HALF;
        vf x[C];
        for (int c = 0; c < C; c++) x[c] = loadv(v + W * c);
        for (int h = 0; h < H; h++) {
          const vf p = (vf){0} + scores[h * S + lo + i];
          for (int c = 0; c < C; c++) a[h][c] += p * x[c];
        }
      }
      for (int h = 0; h < H; h++)
        for (int c = 0; c < C; c++) *(vf *)(og + h * D + half * HALF + W * c) = a[h][c];
    }
  }
}

/* The positions the mask leaves open, lo..hi, as attend() finds them (all of them where none is). */
static void open_span(const float *mask, int T, int *lo, int *hi) {
  *lo = 0, *hi = T - 1;
  while (*lo < T && !(mask[*lo] > -1e30f)) ++*lo;
  if (*lo == T) *lo = 0;
  else
    while (!(mask[*hi] > -1e30f)) --*hi;
}

/* The runtime's op with V [G, T, D]: the same steps as attend() but the V pass (no soft-cap). */
static void attend_outer(const float *q, const float *mask, float scale, const float *K, const float *V,
                         int T, float *o) {
  int lo, hi;
  open_span(mask, T, &lo, &hi);
  const int n = hi - lo + 1, S = T + 16 + ((T % 1024) < 16 ? 16 : 0);
  float scores[H * (4096 + 32)] __attribute__((aligned(64)));
  if ((size_t)n * 4 <= OUTER_SPAN) /* both spans contiguous, n rows of D per group */
    for (int g = 0; g < G; g++)
      for (size_t b = 0; b < (size_t)n * D * 4; b += 64) {
        OUTER_ASK((const char *)(K + ((size_t)g * T + lo) * D) + b);
        OUTER_ASK((const char *)(V + ((size_t)g * T + lo) * D) + b);
      }
  for (int g = 0; g < G; g++) {
    const size_t at = (size_t)g * T * D;
    kpass_f32(1, q + g * H * D, K + at, H, D, lo, hi, scale, scores, S);
    for (int h = 0; h < H; h++) softmax(scores + h * S + lo, mask + lo, n, 0.f); /* the kernel's */
    vpass_outer(V + at, scores, S, lo, n, o + g * H * D);
  }
}

/* -DTGD: the second side is litert-torch's default layout instead, K and V [1, T, G, D] (a
 * position's G groups one row of G x D floats), read once in order, all groups a block of
 * positions at a time: the kernel's K pass with rows G x D apart; a V pass over BLOCK positions
 * at a time, each group's three heads sharing each load; spans up to OUTER_SPAN bytes of a
 * position's row asked for first (OUTER_ASK), longer ones TGD_AHEAD bytes ahead into the
 * second-level cache as the passes go, each pass taking its blocks from TGD_STREAMS stretches of
 * the span in turn (RESULTS.md section 20). */
enum { ROW = G * D, CD = D / W };
#ifndef TGD_AHEAD
#define TGD_AHEAD 8192
#endif
#ifndef TGD_STREAMS
#define TGD_STREAMS 1
#endif
#define OUTER_ASK_L2(p) __asm__ volatile("prefetcht1 %0" : : "m"(*(const char *)(p)))
/* scores[(g*H + h)*S + t] = q[g][h] . K[t][g] * scale, t = lo..hi. */
static void kpass_tgd(const float *q, const float *K, int lo, int hi, float scale, float *scores, int S, int ahead) {
  const int blocks = (hi + 1 - lo) / W, per = (blocks + TGD_STREAMS - 1) / TGD_STREAMS;
  for (int k = 0; k < per * TGD_STREAMS; k++) { /* blocks from TGD_STREAMS stretches of the span in turn */
    const int b = k % TGD_STREAMS * per + k / TGD_STREAMS;
    if (b >= blocks) continue;
    const int t = lo + b * W;
    const float *kb = K + (size_t)t * ROW;
    if (ahead)
      for (int l = 0; l < W * ROW * 4 / 64; l++) OUTER_ASK_L2((const char *)kb + TGD_AHEAD + 64 * l);
    for (int g = 0; g < G; g++) {
      vf kept[W][CD];
      for (int j = 0; j < W; j++)
        for (int c = 0; c < CD; c++) kept[j][c] = loadv(kb + (size_t)j * ROW + g * D + W * c);
      for (int h = 0; h < H; h++) {
        const float *qh = q + (g * H + h) * D;
        vf acc[W];
        for (int j = 0; j < W; j++) {
          vf e = loadv(qh) * kept[j][0];
          for (int c = 1; c < CD; c++) e += loadv(qh + W * c) * kept[j][c];
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
        for (int c = 1; c < CD; c++) e += loadv(qh + W * c) * loadv(k + W * c);
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
        OUTER_ASK_L2((const char *)(V + (size_t)(lo + b) * ROW) + TGD_AHEAD + 64 * l);
    for (int g = 0; g < G; g++) {
      vf a[H][CD];
      for (int h = 0; h < H; h++)
        for (int c = 0; c < CD; c++) a[h][c] = k ? loadv(o + (g * H + h) * D + W * c) : (vf){0};
      for (int i = b; i < e; i++) {
        const float *v = V + (size_t)(lo + i) * ROW + g * D;
        vf x[CD];
        for (int c = 0; c < CD; c++) x[c] = loadv(v + W * c);
        for (int h = 0; h < H; h++) {
          const vf p = (vf){0} + scores[(g * H + h) * S + lo + i];
          for (int c = 0; c < CD; c++) a[h][c] += p * x[c];
        }
      }
      for (int h = 0; h < H; h++)
        for (int c = 0; c < CD; c++) *(vf *)(o + (g * H + h) * D + W * c) = a[h][c];
    }
  }
}
static void attend_tgd(const float *q, const float *mask, float scale, const float *K, const float *V, int T, float *o) {
  int lo, hi;
  open_span(mask, T, &lo, &hi);
  const int n = hi - lo + 1, S = T + 16 + ((T % 1024) < 16 ? 16 : 0);
  static float scores[G * H * (4096 + 32)] __attribute__((aligned(64)));
  const int ahead = (size_t)n * 4 > OUTER_SPAN;
  if (!ahead) /* the whole open span of both caches, asked for at once */
    for (size_t b = 0; b < (size_t)n * ROW * 4; b += 64) {
      OUTER_ASK((const char *)(K + (size_t)lo * ROW) + b);
      OUTER_ASK((const char *)(V + (size_t)lo * ROW) + b);
    }
  kpass_tgd(q, K, lo, hi, scale, scores, S, ahead);
  for (int gh = 0; gh < G * H; gh++) softmax(scores + gh * S + lo, mask + lo, n, 0.f); /* the kernel's */
  vpass_tgd(V, scores, S, lo, n, o, ahead);
}

static int T;
static Context context = {0, host_memory, tensor_type, size};
static Fake *Kc[2][L][R], *Vc[2][L][R], *qs[R], *masks[R], *params, *outs[R];
static float knew[R][G * D], vnew[R][G * D];

#ifdef TGD
#define SECOND "[T, G, D]"
static size_t at1(int g, int t, int d) { return ((size_t)t * G + g) * D + d; } /* K and V [T, G, D] */
#else
#define SECOND "outer"
static size_t at1(int g, int t, int d) { return ((size_t)g * T + t) * D + d; } /* K and V [G, T, D] */
#endif
static void write_step(int layout, int l, int r, int P) {
  float *K = Kc[layout][l][r]->data, *V = Vc[layout][l][r]->data;
  for (int g = 0; g < G; g++) {
    if (layout == 0) {
      memcpy(K + ((size_t)g * T + P) * D, knew[r] + g * D, D * 4);
      for (int d = 0; d < D; d++) V[((size_t)g * D + d) * T + P] = vnew[r][g * D + d];
    } else {
      memcpy(K + at1(g, P, 0), knew[r] + g * D, D * 4);
      memcpy(V + at1(g, P, 0), vnew[r] + g * D, D * 4);
    }
  }
}
static void attend_step(int layout, int l, int r) {
  if (layout == 0) {
    Buffer in[5] = {qs[r], masks[r], params, Kc[0][l][r], Vc[0][l][r]}, out[1] = {outs[r]};
    if (attention_run(&context, 5, in, 1, out)) { fprintf(stderr, "kernel failed\n"); exit(1); }
  } else
#ifdef TGD
    attend_tgd(qs[r]->data, masks[r]->data, 0.125f, Kc[1][l][r]->data, Vc[1][l][r]->data, T, outs[r]->data);
#else
    attend_outer(qs[r]->data, masks[r]->data, 0.125f, Kc[1][l][r]->data, Vc[1][l][r]->data, T, outs[r]->data);
#endif
}
enum { WHOLE, WRITES, ATTENTION };
static double pass(int layout, int part, int P) { /* ms for the 240 ops */
  const double t0 = now();
  for (int l = 0; l < L; l++)
    for (int r = 0; r < R; r++) {
      if (part != ATTENTION) write_step(layout, l, r, P);
      if (part != WRITES) attend_step(layout, l, r);
    }
  return (now() - t0) * 1e3;
}

static int compare(const void *a, const void *b) { double x = *(double *)a, y = *(double *)b; return (x > y) - (x < y); }
static void stats(double *x, int n, char *buf) { /* "median [min-max]" */
  double s[64];
  memcpy(s, x, n * sizeof(double));
  qsort(s, n, sizeof(double), compare);
  sprintf(buf, "%6.3f [%.3f-%.3f]", n % 2 ? s[n / 2] : (s[n / 2 - 1] + s[n / 2]) / 2, s[0], s[n - 1]);
}
static double median(double *x, int n) {
  double s[64];
  memcpy(s, x, n * sizeof(double));
  qsort(s, n, sizeof(double), compare);
  return n % 2 ? s[n / 2] : (s[n / 2 - 1] + s[n / 2]) / 2;
}

int main(int argc, char **argv) {
  if (argc < 2) { fprintf(stderr, "usage: %s T [ROUNDS [P,P,...]]\n", argv[0]); return 2; }
  T = atoi(argv[1]);
  const int rounds = argc > 2 ? atoi(argv[2]) : 11;
  int positions[16] = {8, 32, 128, 512, 1000}, np = 5;
  if (argc > 3) {
    np = 0;
    for (char *s = strtok(argv[3], ","); s && np < 16; s = strtok(0, ",")) positions[np++] = atoi(s);
  }
  if (T < 1 || T > 4096 || rounds < 1 || rounds > 64) { fprintf(stderr, "T 1..4096, ROUNDS 1..64\n"); return 2; }
  for (int i = 0; i < np; i++)
    if (positions[i] < 0 || positions[i] >= T) { fprintf(stderr, "position %d outside 0..T-1\n", positions[i]); return 2; }
  const int qd[4] = {1, G, H, D}, md[1] = {T}, pd[1] = {4};
  int kd[2][4] = {{1, G, T, D}, {1, G, T, D}}, vd[2][4] = {{1, G, D, T}, {1, G, T, D}};
#ifdef TGD
  for (int y = 0; y < 4; y++) kd[1][y] = vd[1][y] = (int[]){1, T, G, D}[y];
#endif
  params = tensor(1, pd);
  ((float *)params->data)[0] = 0.125f;
  for (int r = 0; r < R; r++) {
    qs[r] = tensor(4, qd), masks[r] = tensor(1, md), outs[r] = tensor(4, qd);
    for (int i = 0; i < G * H * D; i++) ((float *)qs[r]->data)[i] = 8 * value(i + 7919 * r);
    for (int i = 0; i < G * D; i++) knew[r][i] = value(i + 31 * r + 5), vnew[r][i] = value(i + 17 * r + 3);
  }
  /* Both layouts hold the same numbers: element (l, r, g, t, d) */
  for (int l = 0; l < L; l++)
    for (int r = 0; r < R; r++)
      for (int y = 0; y < 2; y++) {
        Kc[y][l][r] = tensor(4, kd[y]), Vc[y][l][r] = tensor(4, vd[y]);
        float *K = Kc[y][l][r]->data, *V = Vc[y][l][r]->data;
        const size_t base = (size_t)(l * R + r) * G * T * D;
        for (int g = 0; g < G; g++)
          for (int t = 0; t < T; t++)
            for (int d = 0; d < D; d++) {
              const size_t i = ((size_t)g * T + t) * D + d;
              K[y ? at1(g, t, d) : i] = value(base + i);
              V[y ? at1(g, t, d) : ((size_t)g * D + d) * T + t] = value(base + i + 12345);
            }
      }
  const size_t flush_n = (size_t)1 << 27; /* 512 MB */
  float *flush = malloc(flush_n * 4), sink = 0;
  for (size_t i = 0; i < flush_n; i++) flush[i] = 1;
  float *check = malloc(sizeof(float) * L * R * G * H * D);
  #ifdef HUGE_PAGES
  const char *pages = "2 MB";
#else
  const char *pages = "4 KB";
#endif
  printf("T=%d, %s pages, %d rounds, ms per 240-op pass (30 layers x 8 rows), median [min-max]; ratio = " SECOND "/transposed "
         "(median of paired rounds)\n", T, pages, rounds);
  printf("%5s %-24s %-24s %-6s | %-22s %-22s | %-22s %-22s | maxdiff\n", "P", "whole transposed", "whole " SECOND, "ratio",
         "writes transposed", "writes " SECOND, "attention transposed", "attention " SECOND);
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
    double t[3][2][64], ratio[64];
    for (int round = 0; round < rounds; round++)
      for (int part = 0; part < 3; part++)
        for (int k = 0; k < 2; k++) {
          const int y = k ^ (round & 1); /* A,B then B,A */
          for (size_t i = 0; i < flush_n; i += 16) sink += flush[i];
          t[part][y][round] = pass(y, part, P);
          for (int r = 0; r < R; r++) sink += ((float *)outs[r]->data)[0];
        }
    for (int round = 0; round < rounds; round++) ratio[round] = t[WHOLE][1][round] / t[WHOLE][0][round];
    char s[6][64];
    for (int part = 0; part < 3; part++)
      for (int y = 0; y < 2; y++) stats(t[part][y], rounds, s[2 * part + y]);
    printf("%5d %-24s %-24s %-6.3f | %-22s %-22s | %-22s %-22s | %.2g\n", P, s[0], s[1], median(ratio, rounds), s[2], s[3],
           s[4], s[5], maxdiff);
    fflush(stdout);
  }
  fprintf(stderr, "(%g)\n", sink);
  return 0;
}
