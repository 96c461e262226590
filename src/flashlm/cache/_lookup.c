/* The cache's per-stage lookup in C (which of a step's units are not resident), and its admission for
 * the policies whose priority is a count and a step (`flashlm_admit`).
 *
 * Built on first use by flashlm._native and called with the GIL held (ctypes.PyDLL): it takes a
 * microsecond or two, less than handing the GIL to the I/O thread and waiting to get it back, which
 * the three torch operators of `ids[slot_of[ids] < 0]` each do. flashlm.cache.neuron_cache is the
 * caller, with that torch expression where no compiler is found.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Writes to `out`, in order, the `ids` whose `slot_of` is negative; returns their count, or -1 (having
 * written an unspecified prefix) if an id lies outside 0 .. num_units-1. */
int64_t flashlm_missing(const int64_t *slot_of, int64_t num_units, const int64_t *ids, int64_t n, int64_t *out) {
    int64_t m = 0;
    for (int64_t i = 0; i < n; i++) {
        const int64_t u = ids[i];
        if (u < 0 || u >= num_units) return -1;
        out[m] = u;
        m += slot_of[u] < 0;
    }
    return m;
}

/* A unit's rank in admission: priority first (higher stays), then its position in the union of
 * residents and candidates (earlier stays), which is how `NeuronCache._admit`'s stable sort breaks ties. */
typedef struct {
    int64_t priority;
    int64_t position;
} ranked_t;

static int by_rank(const void *a, const void *b) {
    const ranked_t *x = a, *y = b;
    if (x->priority != y->priority) return x->priority > y->priority ? -1 : 1;
    return (x->position > y->position) - (x->position < y->position);
}

static inline int64_t priority_of(const int64_t *count, const int64_t *last_step, int64_t u) {
    return (count ? count[u] * ((int64_t)1 << 32) : 0) + last_step[u];
}

/* `NeuronCache._admit` of the sorted unique `ids` for a policy whose priority is
 * `count * 2**32 + last_step` (`count` NULL: 0), applied to the cache's index (`slot_of`, `slot_ids`).
 * The caller copies the rows: unit `entering[i]` now lives in slot `slots[i]`, i < the returned count.
 * `info` receives {units evicted, the new size, whether the units appended after the old size, first
 * and last, are that size and the new size - 1 (the unit-prefix check)}. Returns -1 (the index
 * untouched) if an id lies outside 0 .. num_units-1, -2 if scratch memory cannot be had. */
int64_t flashlm_admit(int64_t *slot_of, int64_t num_units, int64_t *slot_ids, int64_t capacity, int64_t pinned,
                      int64_t size, const int64_t *count, const int64_t *last_step, const int64_t *ids, int64_t n,
                      int64_t *entering, int64_t *slots, int64_t *info) {
    const int64_t fresh = flashlm_missing(slot_of, num_units, ids, n, entering);
    if (fresh < 0) return -1;
    const int64_t free_slots = capacity - size;
    info[0] = 0;
    info[1] = size;
    info[2] = 1;
    if (fresh == 0) return 0;
    int64_t evicted = 0, entered = 0;
    if (fresh <= free_slots) {
        entered = fresh;  /* the candidates, ascending, into the free slots */
    } else {
        if (free_slots == 0) {
            int64_t weakest = INT64_MAX, best = INT64_MIN;
            for (int64_t s = pinned; s < size; s++) {
                const int64_t p = priority_of(count, last_step, slot_ids[s]);
                if (p < weakest) weakest = p;
            }
            for (int64_t i = 0; i < fresh; i++) {
                const int64_t p = priority_of(count, last_step, entering[i]);
                if (p > best) best = p;
            }
            if (best <= weakest) return 0;
        }
        /* the union: unpinned residents by descending id, then the candidates by ascending id */
        const int64_t residents = size - pinned, total = residents + fresh, room = capacity - pinned;
        int64_t *unit = malloc(total * sizeof(int64_t));
        ranked_t *ranked = malloc(total * sizeof(ranked_t));
        if (unit == NULL || ranked == NULL) {
            free(unit);
            free(ranked);
            return -2;
        }
        int64_t k = 0;
        for (int64_t u = num_units - 1; u >= 0; u--)
            if (slot_of[u] >= pinned) unit[k++] = u;
        for (int64_t i = 0; i < fresh; i++) unit[k++] = entering[i];
        for (int64_t i = 0; i < total; i++) ranked[i] = (ranked_t){priority_of(count, last_step, unit[i]), i};
        qsort(ranked, total, sizeof(ranked_t), by_rank);
        /* evicted residents (in rank order) hand their slots to the first candidates that stay */
        for (int64_t i = room; i < total; i++)
            if (ranked[i].position < residents) {
                const int64_t u = unit[ranked[i].position];
                slots[evicted++] = slot_of[u];
                slot_of[u] = -1;
            }
        for (int64_t i = 0; i < room; i++)
            if (ranked[i].position >= residents) entering[entered++] = unit[ranked[i].position];
        free(unit);
        free(ranked);
    }
    for (int64_t i = 0; i < entered; i++) {
        if (i >= evicted) slots[i] = size + (i - evicted);
        slot_ids[slots[i]] = entering[i];
        slot_of[entering[i]] = slots[i];
    }
    const int64_t appended = entered - evicted;
    info[0] = evicted;
    info[1] = size + appended;
    if (appended) info[2] = entering[evicted] == size && entering[entered - 1] == size + appended - 1;
    return entered;
}

/* `record` of the same policies: each of `ids` used once more (`count`, unless NULL), last at `step`.
 * Returns 0, or -1 (nothing recorded) if an id lies outside 0 .. num_units-1. */
int64_t flashlm_record(int64_t *count, int64_t *last_step, int64_t num_units, const int64_t *ids, int64_t n,
                       int64_t step) {
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= num_units) return -1;
    for (int64_t i = 0; i < n; i++) {
        if (count) count[ids[i]] += 1;
        last_step[ids[i]] = step;
    }
    return 0;
}

/* Row `at[i]` of `src` (of `src_rows` rows) into row `slots[i]` of `dst`, for i < n: the entering units'
 * rows copied into their slots in one pass, with no gathered copy between. Returns 0, or -1 (nothing
 * copied) if an `at` lies outside 0 .. src_rows-1. */
int64_t flashlm_copy_rows(char *dst, int64_t dst_stride, const int64_t *slots, const char *src, int64_t src_stride,
                          int64_t src_rows, const int64_t *at, int64_t n, int64_t row_bytes) {
    for (int64_t i = 0; i < n; i++)
        if (at[i] < 0 || at[i] >= src_rows) return -1;
    for (int64_t i = 0; i < n; i++) memcpy(dst + slots[i] * dst_stride, src + at[i] * src_stride, row_bytes);
    return 0;
}
