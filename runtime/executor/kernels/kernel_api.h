/* What every kernel of runtime/executor/kernels shares: the LiteRT types its callbacks take
 * (ai-edge-litert 2.3's C API), the context user_data points to, the failure protocol, and
 * the vector width of the build. Included by each source (each compiles alone too: the
 * benchmarks' harness includes decode_attention.c by path).
 *
 * The LiteRT types are declared here from their documented layout (the wheel ships no
 * header): a tensor type is an int32 element type, then a layout of a 32-bit word whose
 * low 7 bits are the rank, 8 int32 dimensions and 8 strides. */
#ifndef ODML_RUNTIME_KERNEL_API_H
#define ODML_RUNTIME_KERNEL_API_H

#include <stddef.h>
#include <stdint.h>
#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

typedef int Status;   /* LiteRtStatus: 0 ok, 1 invalid argument, 3 runtime failure */
typedef void *Buffer; /* LiteRtTensorBuffer */
typedef struct { uint32_t bits; int32_t dims[8]; uint32_t strides[8]; } Layout;
typedef struct { int32_t element; Layout layout; } TensorType;

/* What user_data points to; runtime/executor/kernels/__init__.py declares the same. */
typedef struct {
  volatile int64_t error; /* 0, or the first failure's code (set here, read and reset by the runtime) */
  Status (*host_memory)(Buffer, void **);
  Status (*tensor_type)(Buffer, TensorType *);
  Status (*size)(Buffer, size_t *);
  int64_t threads; /* the threads an op may run on (the engine's num_threads) */
} Context;

/* Failure codes written to the error word (the runtime names them, per op). */
enum { E_ARGUMENTS = 1, E_BUFFER = 2, E_SHAPES = 3, E_TYPES = 4, E_MEMORY = 5 };

static inline int layout_rank(const Layout *l) { return l->bits & 0x7F; }

/* A failed run: LiteRT ignores the status a kernel returns, so the code goes to the error
 * word (the first failure's stays) and the output is filled with NaN, never numbers that
 * look right; the runtime raises naming the op after the run. */
static inline Status failed(Context *c, int code, size_t n_out, Buffer *out) {
  if (!c->error) c->error = code;
  float *o;
  size_t bytes;
  if (n_out >= 1 && !c->host_memory(out[0], (void **)&o) && !c->size(out[0], &bytes))
    for (size_t i = 0; i < bytes / 4; i++) o[i] = __builtin_nanf("");
  return 3;
}

/* GCC vector types of the build's register width, W floats: 16 where the flags the build
 * chose give AVX-512, 8 with AVX2, else 4 (SSE, NEON). A vector wider than the registers is
 * not split well: with 16 floats on AVX2, GCC kept decode attention's V-pass accumulators
 * on the stack and moved their halves through general registers (its inner loop: 399
 * instructions, 302 of them on the stack, against 26 and none at 8 floats), and the kernel
 * ran at a third of a read loop's rate. */
#if defined(__AVX512F__)
#define W 16
#elif defined(__AVX__)
#define W 8
#else
#define W 4
#endif
typedef float vf __attribute__((vector_size(4 * W), aligned(4)));
typedef float v8 __attribute__((vector_size(32), aligned(4)));

typedef int32_t vi __attribute__((vector_size(4 * W), aligned(4)));
static inline vf loadv(const float *p) { return *(const vf *)p; }

/* float16 tensors (KV caches, LoRA factors) where the compiler has _Float16 (GCC 12 on x86;
 * an older one builds float32 kernels alone, which refuse them). */
#ifdef __FLT16_MAX__
#define F16_TENSORS 1
typedef uint16_t vu __attribute__((vector_size(2 * W), aligned(2), may_alias));
/* W halves as W floats: one vcvtph2ps where the build has it (AVX-512's for 16, F16C's for 8).
 * Else in integer steps on the bits (GCC converts a vector of _Float16 lane by lane, by a
 * library call a lane without F16C: the plain build ran 22x slower than on f32 caches):
 * exponent and mantissa moved into place and rebased; Inf and NaN get the top exponent;
 * zero and subnormals, a normal with its exponent one up less 2^-14, which renormalizes. */
static inline vf loadh(const _Float16 *p) {
#if W == 16
  return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#elif W == 8 && defined(__F16C__)
  return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
  const vi h = __builtin_convertvector(*(const vu *)p, vi), top = (vi){0} + (0x7c00 << 13);
  vi o = (h & 0x7fff) << 13;
  const vi e = o & top, tiny = e == 0;
  o += (127 - 15) << 23;
  o += (e == top) & ((128 - 16) << 23);
  const vi renormalized = (vi)((vf)(o + (1 << 23)) - (vf)((vi){0} + (113 << 23)));
  return (vf)(((o & ~tiny) | (renormalized & tiny)) | ((h & 0x8000) << 16));
#endif
}
#else
#define F16_TENSORS 0
#endif

/* A prefetch the compiler keeps: GCC -O3 deletes a loop of nothing but __builtin_prefetch (it
 * has no effect the program can see), so on x86 the instruction is asked for in an asm. */
#if defined(__x86_64__) || defined(__i386__)
#define PREFETCH_NOW(p) __asm__ volatile("prefetcht0 %0" : : "m"(*(const char *)(p)))
#else
#define PREFETCH_NOW(p) __builtin_prefetch(p)
#endif
/* Where the kernels' streams (W in linear_rows.c, the caches' passes in decode_attention.c) ask
 * for lines ahead, inside loops that do the work: into the first-level cache (prefetcht0) unless
 * AHEAD_INTO_L2 is 1, then into the second only (prefetcht1). On a Zen 4 asked into the first
 * level the reads and the arithmetic did not overlap: the lm_head's 113 MB over 8 rows took 10.8
 * ms where its arithmetic from cache takes 5.7 and the read 5.0. Into the second, 32 KB ahead,
 * SmolLM2-135M's 151 linears (linear_rows_bench, best of 3, six alternating rounds) took
 * 0.64-0.78x the time over 8 rows (52-62 ms before); prefetcht2 the same within the rounds (one
 * row's pass keeps the first level: linear_rows.c's ROWS_L2_AHEAD). The attention op
 * (kernel_bench --baseline, SmolLM2's shapes, 4-5 rounds) over float16 caches 0.78-0.86x the time
 * from 1,000 to 4,095 positions; over float32 caches, whose passes ran faster there with no
 * prefetches at all than asked into the first level, 0.65 / 0.83 / 0.87 / 0.91 / 0.94x the time
 * of none at 128 / 500 / 1,000 / 3,000 / 4,095 positions. So the runtime passes
 * -DAHEAD_INTO_L2=1 there (kernels.tuning_flags()); the Xeon's and the AVX2 box's figures are
 * the first level's. */
#ifndef AHEAD_INTO_L2
#define AHEAD_INTO_L2 0
#endif
#define PREFETCH_AHEAD(p) __builtin_prefetch((p), 0, AHEAD_INTO_L2 ? 2 : 3)

#endif
