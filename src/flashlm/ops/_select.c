/* Per-token top-k masks on the CPU: DIP's selections (eqs. 7-8, and eq. 10's cache-aware weights).
 *
 * Built on first use by flashlm._native; flashlm.ops.select is the caller, with a torch fallback.
 *
 *   mask[t, j] = 1 for the k largest scores of row t, score[t, j] = |x[t, j]| * (resident[j] ? 1 : gamma)
 *
 * DIP-CA divides the scores by max|x| (eq. 10); a positive factor per row does not change which are
 * the largest, so it is left out. Scores are non-negative floats, whose bit patterns order as unsigned
 * integers: a radix select over the bits (11, 11 and 10 at a time) finds the k-th largest in three
 * passes over the row, O(n) where a sort is O(n log n). Elements equal to it are kept lowest index
 * first, so each row keeps exactly k. Rows are split between torch's OpenMP threads.
 */
#include <math.h>
#include <omp.h>
#include "_elements.h"
#include <stdint.h>
#include <stdlib.h>
#include <string.h>


static inline uint32_t bits_of(float f) {
    union { float f; uint32_t u; } x;
    x.f = f;
    return x.u;
}

/* The largest value v such that at least k of keys[0..n) are >= v (keys non-negative float bits). */
static uint32_t kth_largest(const uint32_t *keys, int64_t n, int64_t k) {
    static const int shifts[3] = {21, 10, 0};
    static const uint32_t widths[3] = {2048, 2048, 1024};
    uint32_t prefix = 0, prefix_mask = 0;
    int64_t above = 0; /* elements known to be larger than every candidate */
    for (int pass = 0; pass < 3; pass++) {
        int64_t hist[2048];
        memset(hist, 0, sizeof(hist));
        const int shift = shifts[pass];
        const uint32_t bins = widths[pass];
        for (int64_t j = 0; j < n; j++)
            if ((keys[j] & prefix_mask) == prefix) hist[(keys[j] >> shift) & (bins - 1)]++;
        int64_t bin = bins - 1;
        for (; bin > 0 && above + hist[bin] < k; bin--) above += hist[bin];
        prefix |= (uint32_t)bin << shift;
        prefix_mask |= (bins - 1) << shift;
    }
    return prefix;
}

/* Mark the k largest of keys[0..n) in out (ties: lowest index first), exactly k of them (k <= n). */
static void mark_largest(const uint32_t *keys, int64_t n, int64_t k, uint8_t *out) {
    if (k <= 0) {
        memset(out, 0, n);
        return;
    }
    const uint32_t threshold = kth_largest(keys, n, k);
    int64_t kept = 0;
    for (int64_t j = 0; j < n; j++) {
        out[j] = keys[j] > threshold;
        kept += out[j];
    }
    for (int64_t j = 0; j < n && kept < k; j++)
        if (keys[j] == threshold) {
            out[j] = 1;
            kept++;
        }
}

#define DEFINE_TOPK(NAME, ELEM, CONVERT)                                                              \
    void NAME(const ELEM *x, int64_t ldx, int64_t T, int64_t n, const uint8_t *resident, float gamma,   \
              int64_t k, uint8_t *mask, int64_t ldm) {                                               \
        _Pragma("omp parallel if (T > 1)") {                                                         \
            uint32_t *keys = malloc(sizeof(uint32_t) * (n > 0 ? n : 1));                             \
            _Pragma("omp for schedule(static)") for (int64_t t = 0; t < T; t++) {                     \
                const ELEM *row = x + t * ldx;                                                       \
                for (int64_t j = 0; j < n; j++) {                                                    \
                    const float magnitude = fabsf(CONVERT(row[j]));                                  \
                    keys[j] = bits_of(resident ? magnitude * (resident[j] ? 1.0f : gamma) : magnitude); \
                }                                                                                    \
                mark_largest(keys, n, k, mask + t * ldm);                                            \
            }                                                                                        \
            free(keys);                                                                              \
        }                                                                                            \
    }

DEFINE_TOPK(flashlm_topk_bf16, uint16_t, bf16_to_float)
DEFINE_TOPK(flashlm_topk_f16, _Float16, f16_to_float)
DEFINE_TOPK(flashlm_topk_f32, float, f32_to_float)

/* One token's stage of a decode step in one pass over its units: the selection above (residency read
 * from a cache's slot_of: unit j is resident where slot_of[j] >= 0, or where `also[j]` is set, units read
 * already by other means (a guess); gamma 1 weighs none), then what the stage needs of it, so that the
 * caller runs no tensor operator between selecting and reading:
 *
 *   mask[j]  the selection;                     coef[j]  x[j] where kept, else 0 (fp32);
 *   ids      the kept units, ascending;         misses   those of them not in the cache, ascending;
 *   unread   (where not NULL) those of the misses not in `also` either, ascending: what is left to read.
 *
 * The keys are built in coef's memory (4 bytes a unit either way), so a call allocates nothing.
 * Returns the number kept and sets *missed, and *n_unread to the number of unread units, or to -1 (with
 * none written past `unread_capacity`) where they do not fit. */
#define DEFINE_TOP_UNITS(NAME, ELEM, CONVERT)                                                         \
    int64_t NAME(const ELEM *x, int64_t n, const int64_t *slot_of, const uint8_t *also, float gamma,     \
                 int64_t k, uint8_t *mask, float *coef, int64_t *ids, int64_t *misses, int64_t *missed,      \
                 int64_t *unread, int64_t unread_capacity, int64_t *n_unread) {                              \
        _Static_assert(sizeof(float) == sizeof(uint32_t), "keys live in coef's memory");             \
        uint32_t *keys = (uint32_t *)coef;                                                           \
        for (int64_t j = 0; j < n; j++) {                                                            \
            const float magnitude = fabsf(CONVERT(x[j]));                                            \
            const int resident = slot_of[j] >= 0 || (also && also[j]);                               \
            keys[j] = bits_of(resident ? magnitude : magnitude * gamma);                             \
        }                                                                                            \
        mark_largest(keys, n, k, mask);                                                              \
        int64_t kept = 0, miss = 0, left = 0;                                                        \
        for (int64_t j = 0; j < n; j++) {                                                            \
            coef[j] = mask[j] ? CONVERT(x[j]) : 0.0f;                                                \
            if (!mask[j]) continue;                                                                  \
            ids[kept++] = j;                                                                         \
            if (slot_of[j] >= 0) continue;                                                           \
            misses[miss++] = j;                                                                      \
            if (!unread || (also && also[j]) || left < 0) continue;                                  \
            if (left == unread_capacity) left = -1; /* they do not fit: nothing is written past */   \
            else unread[left++] = j;                                                                 \
        }                                                                                            \
        *missed = miss;                                                                              \
        if (unread) *n_unread = left;                                                                \
        return kept;                                                                                 \
    }

DEFINE_TOP_UNITS(flashlm_top_units_bf16, uint16_t, bf16_to_float)
DEFINE_TOP_UNITS(flashlm_top_units_f16, _Float16, f16_to_float)
DEFINE_TOP_UNITS(flashlm_top_units_f32, float, f32_to_float)
