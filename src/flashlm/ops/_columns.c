/* Sparse column products on the CPU: out += coef @ rows, over the rows whose coefficients are not all
 * zero (PowerInfer's neuron-aware operator: a unit's weights are one contiguous row, wherever it sits).
 *
 * Built on first use by flashlm._native; flashlm.ops.columns is the caller, with torch fallbacks.
 *
 *   out[t * ldo + j] += sum_k coef[t * ldc + c(k)] * rows[r(k) * ldr + j]    t < T, k < n, j < width
 *
 * where r(k) = index[k], or k without an index (PowerInfer's gather-GEMV: the kept units' rows are
 * wherever they lie, e.g. a staging matrix read in place, and are never copied together), and c(k) =
 * cidx[k], or k without one (the coefficients of a layer's units, by unit id, are never gathered
 * either: row k is unit cidx[k]).
 * coef and out are float32; rows are bf16, fp16 or fp32, converted as they are read. Columns are
 * split between the threads of the OpenMP team (torch's own: this library links libgomp.so.1, which the
 * dynamic linker resolves to the copy torch has loaded, so no second pool spins against torch's), then
 * processed in blocks of up to BLOCK columns; rows are taken eight at a time so each load and store of
 * `out` carries eight multiply-adds, summed as a pairwise tree (short dependency chains). One token's
 * product over short rows splits the rows instead (`SPLIT_WIDTH`).
 * A row whose coefficients are all zero is skipped, so a masked product costs what the kept units
 * weigh. Each output's summation order is fixed whatever the thread count, so results are
 * deterministic.
 */
#include <math.h>
#include <omp.h>
#include "_elements.h"
#include <stdint.h>
#include <string.h>

#define ALIGN 16          /* column ranges start at multiples of this (an AVX-512 vector of fp32) */
/* Below this many row elements (128 KB of bf16, a few microseconds of reading) one thread works alone:
 * waking the team would cost more. SmolLM2's products (0.1-1.5M elements) once ran slower on two threads,
 * when a Python I/O thread shared the second core; with the reads in C threads that mostly sleep, DIP-CA's
 * compute per token on SmolLM2 fell from 10.1 to 7.5 ms (AVX2 kernels) and 12.1 to 9.6 ms (default) with
 * every unit resident, and by 10-20% at a 50% budget, against a threshold of 2M elements (alternated in
 * one process, as benchmarks/alternate.py does). */
#define PARALLEL_MIN (1 << 16)

/* Wide enough that a thread reads its share of each kept row as one stream (its block of `out` then sits
 * in L2, not L1): the CPU's prefetchers ramp up once per stream. One token's product over a Qwen2.5-1.5B
 * `dip_in` matrix took 1.3 ms in 1024-column pieces and 0.8-0.95 ms in one (benchmarks/column_blocks.py);
 * results do not depend on the block, as each output sums its rows in the same order either way. */
#ifndef BLOCK
#define BLOCK 65536
#endif
#define GROUP 8
/* One token's product over rows of at most this many elements is split by rows, not columns: each of
 * PARTS fixed halves of the rows (whatever the team's size) is summed into an accumulator of its own,
 * then out += part 0 + part 1. Split by columns, each thread read half of every row, a piece too short
 * for the prefetchers to follow (a down row is 1152 bytes on SmolLM2-135M, 3 KB on Qwen2.5-1.5B); by
 * rows, a thread streams whole rows. One token's product over a down matrix at density 0.6, alternated
 * in one process (benchmarks/column_blocks.py, 400 products, 2-core AMD EPYC VM): Qwen2.5-1.5B
 * 0.77-1.01 -> 0.58-0.75 ms, SmolLM2 0.076-0.115 -> 0.062-0.084 ms, default and AVX2 builds; the wider
 * DIP input rows (6 KB and 35 KB) gained nothing from it. In a decode (benchmarks/alternate.py, the two
 * kernels alternated per block in one process), Qwen2.5-1.5B DIP@0.6 with every unit resident computed
 * in 56.2 against 61.1 ms per token (default kernels) and 58.6 against 65.4 (AVX2), every block faster;
 * SmolLM2's compute moved within its noise (6.0 against 6.2 ms). */
#define SPLIT_WIDTH 2048
#define PARTS 2
_Static_assert(GROUP == 8, "the sum in DEFINE_COLUMNS is written out for eight rows");
_Static_assert(PARTS == 2, "the parts' sum in DEFINE_PARALLEL is written out for two");


/* Up to GROUP rows with a nonzero coefficient, starting the scan at *k; returns how many. */
static inline int next_group(const float *coef, int64_t ldc, const int64_t *cidx, int64_t T, int64_t n,
                             int64_t *k, int64_t group[GROUP]) {
    int g = 0;
    for (; *k < n && g < GROUP; (*k)++) {
        const int64_t c = cidx ? cidx[*k] : *k;
        for (int64_t t = 0; t < T; t++) {
            if (coef[t * ldc + c] != 0.0f) {
                group[g++] = *k;
                break;
            }
        }
    }
    return g;
}

/* The eight rows' terms of one output, summed as a pairwise tree. */
#define SUM8(CONVERT, r, c, j)                                                                        \
    (((c[0] * CONVERT(r[0][j]) + c[1] * CONVERT(r[1][j])) +                                           \
      (c[2] * CONVERT(r[2][j]) + c[3] * CONVERT(r[3][j]))) +                                          \
     ((c[4] * CONVERT(r[4][j]) + c[5] * CONVERT(r[5][j])) +                                           \
      (c[6] * CONVERT(r[6][j]) + c[7] * CONVERT(r[7][j]))))

/* Kept rows are scattered (cache slots, staging rows), so the CPU's prefetchers cannot guess the next
 * group's rows, and a short row (SmolLM2's 1152-byte down columns) ends before they ramp up. So while
 * the first token sums one group, the next group's rows are prefetched, a cache line for each line
 * summed. One token's product over a down matrix at density 0.6 took 10-20% less time (SmolLM2
 * 0.12-0.14 -> 0.11-0.12 ms, Qwen2.5-1.5B 0.84-0.98 -> 0.74-0.85 ms, default and AVX2 builds,
 * benchmarks/column_blocks.py); long rows, which the prefetchers follow, neither gained nor lost. */
#define DEFINE_COLUMNS(NAME, ELEM, CONVERT)                                                           \
    static void NAME##_range(const float *coef, int64_t ldc, const int64_t *cidx, int64_t T, int64_t n, \
                             const ELEM *rows, int64_t ldr, const int64_t *index, float *out,         \
                             int64_t ldo, int64_t j0, int64_t j1) {                                   \
        enum { LINE = 64 / sizeof(ELEM) };                                                            \
        for (int64_t b0 = j0; b0 < j1; b0 += BLOCK) {                                                \
            const int64_t len = (j1 - b0) < BLOCK ? (j1 - b0) : BLOCK;                               \
            int64_t group[GROUP], next[GROUP], k = 0;                                                 \
            int g = next_group(coef, ldc, cidx, T, n, &k, group);                                     \
            while (g > 0) {                                                                           \
                const int gn = next_group(coef, ldc, cidx, T, n, &k, next);                           \
                const ELEM *r[GROUP], *ahead[GROUP];                                                  \
                for (int q = 0; q < GROUP; q++) {                                                     \
                    const int64_t k = group[q < g ? q : 0];                                           \
                    r[q] = rows + (index ? index[k] : k) * ldr + b0;                                  \
                }                                                                                     \
                for (int q = 0; q < gn; q++)                                                          \
                    ahead[q] = rows + (index ? index[next[q]] : next[q]) * ldr + b0;                  \
                for (int64_t t = 0; t < T; t++) {                                                     \
                    float c[GROUP];                                                                   \
                    for (int q = 0; q < GROUP; q++)                                                   \
                        c[q] = q < g ? coef[t * ldc + (cidx ? cidx[group[q]] : group[q])] : 0.0f;     \
                    float *o = out + t * ldo + b0;                                                    \
                    if (t > 0 || gn == 0) {                                                           \
                        for (int64_t j = 0; j < len; j++) o[j] += SUM8(CONVERT, r, c, j);               \
                        continue;                                                                     \
                    }                                                                                 \
                    for (int64_t line = 0; line < len; line += LINE) {                                \
                        const int64_t end = line + LINE < len ? line + LINE : len;                    \
                        for (int q = 0; q < gn; q++) __builtin_prefetch(ahead[q] + line);             \
                        for (int64_t j = line; j < end; j++) o[j] += SUM8(CONVERT, r, c, j);          \
                    }                                                                                 \
                }                                                                                     \
                memcpy(group, next, sizeof(next));                                                    \
                g = gn;                                                                               \
            }                                                                                         \
        }                                                                                             \
    }

/* Returns 0, or -1 (having computed nothing) if a coefficient index lies outside 0 .. ncoef-1. */
#define DEFINE_PARALLEL(NAME, ELEM)                                                                   \
    int64_t NAME(const float *coef, int64_t ldc, const int64_t *cidx, int64_t ncoef, int64_t T,       \
                 int64_t n, const ELEM *rows, int64_t ldr, const int64_t *index, float *out,          \
                 int64_t ldo, int64_t width) {                                                        \
        for (int64_t k = 0; cidx && k < n; k++)                                                       \
            if (cidx[k] < 0 || cidx[k] >= ncoef) return -1;                                           \
        if (T == 1 && width <= SPLIT_WIDTH && n * width >= PARALLEL_MIN) {                            \
            float part[PARTS][SPLIT_WIDTH];                                                           \
            _Pragma("omp parallel for schedule(static)")                                              \
            for (int p = 0; p < PARTS; p++) {                                                         \
                const int64_t k0 = n * p / PARTS, k1 = n * (p + 1) / PARTS; /* rows k0 .. k1-1 */      \
                memset(part[p], 0, width * sizeof(float));                                            \
                NAME##_range(cidx ? coef : coef + k0, ldc, cidx ? cidx + k0 : NULL, 1, k1 - k0,        \
                             index ? rows : rows + k0 * ldr, ldr, index ? index + k0 : NULL, part[p],  \
                             width, 0, width);                                                        \
            }                                                                                         \
            for (int64_t j = 0; j < width; j++) out[j] += part[0][j] + part[1][j];                    \
            return 0;                                                                                 \
        }                                                                                             \
        _Pragma("omp parallel if (n * width >= PARALLEL_MIN)") {                                      \
            const int64_t team = omp_get_num_threads(), me = omp_get_thread_num();                    \
            const int64_t j0 = me == 0 ? 0 : width * me / team / ALIGN * ALIGN;                        \
            const int64_t j1 = me == team - 1 ? width : width * (me + 1) / team / ALIGN * ALIGN;       \
            if (j1 > j0) NAME##_range(coef, ldc, cidx, T, n, rows, ldr, index, out, ldo, j0, j1);      \
        }                                                                                             \
        return 0;                                                                                     \
    }

DEFINE_COLUMNS(flashlm_columns_bf16, uint16_t, bf16_to_float)
DEFINE_COLUMNS(flashlm_columns_f16, _Float16, f16_to_float)
DEFINE_COLUMNS(flashlm_columns_f32, float, f32_to_float)
DEFINE_PARALLEL(flashlm_columns_bf16, uint16_t)
DEFINE_PARALLEL(flashlm_columns_f16, _Float16)
DEFINE_PARALLEL(flashlm_columns_f32, float)

/* A decode token's stage, each of its two parts in one call: the cached rows (read by their unit ids) in
 * one, the rows read for this step (staged in place) in the other, so that the cached rows are summed
 * while the read of the others finishes.
 *
 *   mode & TOKEN_START: acc = 0 first; then acc += coef[c(k)] * rows[r(k)] over the part (flashlm_columns,
 *     one token; acc is float32, `width` wide);
 *   mode & TOKEN_ROUND: then out = acc, rounded to the rows' type (DIP's second stage: the MLP's output);
 *   mode & TOKEN_GLU: then out[j] = up[j] * silu(gate[j]), with up = acc[0 .. h) and gate = acc[h .. 2h)
 *     (h = width / 2), each of up, gate, silu(gate) and the product rounded to the rows' type, as torch
 *     computes `up * silu(gate)` on halves rounded to the model's dtype (DIP's first stage).
 *
 * One call where torch took five to seven operators: in a decode step each operator's start costs several
 * times its work (the product before it has evicted the interpreter's and torch's code and data from the
 * CPU caches). SiLU's exp is the C library's; torch's vectorized exp can differ from it in the last bit.
 * Returns 0, or -1 (having computed nothing) if a coefficient index lies outside 0 .. ncoef-1. */
#define TOKEN_START 1
#define TOKEN_ROUND 2
#define TOKEN_GLU 4

static inline uint16_t float_to_bf16(float f) {
    union { float f; uint32_t u; } x;
    x.f = f;
    if ((x.u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0; /* NaN, as torch rounds it */
    return (uint16_t)((x.u + 0x7fffu + ((x.u >> 16) & 1u)) >> 16); /* to nearest, ties to even */
}
static inline _Float16 float_to_f16(float f) { return (_Float16)f; }
static inline float float_to_f32(float f) { return f; }

#define DEFINE_TOKEN(NAME, COLUMNS, ELEM, CONVERT, ROUND)                                             \
    int64_t NAME(const float *coef, int64_t ncoef, const ELEM *rows, int64_t ldr, const int64_t *index, \
                 const int64_t *cidx, int64_t n, float *acc, int64_t width, ELEM *out, int64_t mode) {   \
        if (mode & TOKEN_START) memset(acc, 0, width * sizeof(float));                                \
        if (COLUMNS(coef, ncoef, cidx, ncoef, 1, n, rows, ldr, index, acc, width, width)) return -1;  \
        if (mode & TOKEN_ROUND)                                                                       \
            for (int64_t j = 0; j < width; j++) out[j] = ROUND(acc[j]);                               \
        if (mode & TOKEN_GLU) {                                                                       \
            const int64_t h = width / 2;                                                              \
            for (int64_t j = 0; j < h; j++) {                                                         \
                const float up = CONVERT(ROUND(acc[j])), gate = CONVERT(ROUND(acc[h + j]));           \
                const float act = CONVERT(ROUND(gate / (1.0f + expf(-gate))));                        \
                out[j] = ROUND(up * act);                                                             \
            }                                                                                         \
        }                                                                                             \
        return 0;                                                                                     \
    }

DEFINE_TOKEN(flashlm_token_columns_bf16, flashlm_columns_bf16, uint16_t, bf16_to_float, float_to_bf16)
DEFINE_TOKEN(flashlm_token_columns_f16, flashlm_columns_f16, _Float16, f16_to_float, float_to_f16)
DEFINE_TOKEN(flashlm_token_columns_f32, flashlm_columns_f32, float, f32_to_float, float_to_f32)

/* Row dot products, the other half of a neuron-aware operator: each kept unit's row dotted with each
 * token, the rows read where they lie (never gathered),
 *
 *   out[t * ldo + k] = sum_j x[t * ldx + j] * rows[r(k) * ldr + j]    t < T, k < n, j < width
 *
 * with r(k) = index[k], or k without an index. x and out are float32; rows are bf16, fp16 or fp32,
 * converted as they are read. Rows are split between the threads of the OpenMP team; each dot keeps
 * LANES partial sums (independent vector lanes, no reassociation needed to vectorize) and adds them
 * in a fixed tree, so results do not depend on the thread count. */
#define LANES 32

#define DEFINE_DOTS(NAME, ELEM, CONVERT)                                                              \
    static void NAME##_range(const float *x, int64_t ldx, int64_t T, const ELEM *rows, int64_t ldr,  \
                             const int64_t *index, int64_t width, float *out, int64_t ldo, int64_t k0,   \
                             int64_t k1) {                                                            \
        for (int64_t k = k0; k < k1; k++) {                                                           \
            const ELEM *r = rows + (index ? index[k] : k) * ldr;                                      \
            for (int64_t t = 0; t < T; t++) {                                                         \
                const float *xt = x + t * ldx;                                                        \
                float acc[LANES] = {0};                                                               \
                int64_t j = 0;                                                                        \
                for (; j + LANES <= width; j += LANES)                                                \
                    for (int l = 0; l < LANES; l++) acc[l] += xt[j + l] * CONVERT(r[j + l]);          \
                for (int l = 0; j < width; j++, l++) acc[l] += xt[j] * CONVERT(r[j]);                 \
                for (int half = LANES / 2; half > 0; half /= 2)                                       \
                    for (int l = 0; l < half; l++) acc[l] += acc[l + half];                           \
                out[t * ldo + k] = acc[0];                                                            \
            }                                                                                         \
        }                                                                                             \
    }                                                                                                 \
    void NAME(const float *x, int64_t ldx, int64_t T, const ELEM *rows, int64_t ldr,                  \
              const int64_t *index, int64_t n, int64_t width, float *out, int64_t ldo) {              \
        _Pragma("omp parallel if (n * width >= PARALLEL_MIN)") {                                      \
            const int64_t team = omp_get_num_threads(), me = omp_get_thread_num();                    \
            const int64_t k0 = n * me / team, k1 = n * (me + 1) / team;                               \
            if (k1 > k0) NAME##_range(x, ldx, T, rows, ldr, index, width, out, ldo, k0, k1);          \
        }                                                                                             \
    }

DEFINE_DOTS(flashlm_dots_bf16, uint16_t, bf16_to_float)
DEFINE_DOTS(flashlm_dots_f16, _Float16, f16_to_float)
DEFINE_DOTS(flashlm_dots_f32, float, f32_to_float)

/* Evict [p, p + nbytes) from every cache level, so the next product reads it from memory as a decode
 * step does (the caches of a streamed model hold far more than the CPU's caches). x86 only; elsewhere a
 * no-op, and the measurement is of cache-resident rows. */
void flashlm_flush(const char *p, int64_t nbytes) {
#if defined(__x86_64__) || defined(__i386__)
    for (int64_t i = 0; i < nbytes; i += 64) __builtin_ia32_clflush(p + i);
    __builtin_ia32_mfence();
#else
    (void)p;
    (void)nbytes;
#endif
}
