/* The cache's per-stage lookup in C (which of a step's units are not resident), and its whole update for
 * the policies whose priority is a count and a step (`flashlm_update`: record, expiry, admission, rows).
 *
 * Built on first use by flashlm._native. The lookup is called with the GIL held (ctypes.PyDLL): it takes a
 * microsecond or two, less than handing the GIL to the I/O thread and waiting to get it back, which
 * the three torch operators of `ids[slot_of[ids] < 0]` each do; so is an update that copies little.
 * flashlm.cache.neuron_cache is the caller, with torch operators where no compiler is found.
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

static inline int ranks_before(ranked_t x, ranked_t y) {
    return x.priority != y.priority ? x.priority > y.priority : x.position < y.position;
}

static int by_rank(const void *a, const void *b) {
    const ranked_t *x = a, *y = b;
    return ranks_before(*x, *y) ? -1 : ranks_before(*y, *x);
}

/* Reorders `r[0..n)` so that its first `k` (0 < k < n) are the `k` best ranked, in no particular order
 * (Hoare's selection: linear on average, where a sort of all would be n log n). */
static void select_best(ranked_t *r, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1;
    while (lo < hi) {
        const ranked_t pivot = r[lo + (hi - lo) / 2];
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (ranks_before(r[i], pivot)) i++;
            while (ranks_before(pivot, r[j])) j--;
            if (i <= j) {
                const ranked_t swap = r[i];
                r[i++] = r[j];
                r[j--] = swap;
            }
        }
        if (k <= j) hi = j;
        else if (k >= i) lo = i;
        else break;
    }
}

/* The cache (`NeuronCache`'s buffers and size) and its policy's terms: `priority = count * 2**32 +
 * last_step` (`count` NULL: 0); a resident last used `window` or more steps ago expires (0: never). */
typedef struct {
    int64_t *slot_of, *slot_ids, *count, *last_step;
    int64_t num_units, capacity, pinned, size, window;
    char *rows;
    int64_t row_stride, row_bytes;
} cache_t;

static inline int64_t priority_of(const cache_t *c, int64_t u) {
    return (c->count ? c->count[u] * ((int64_t)1 << 32) : 0) + c->last_step[u];
}

/* `NeuronCache._delete` of the unpinned residents that expire at `step`: the survivors of the tail
 * fill the holes below the new size, in order. Returns the units removed; clears `*prefix` on a hole. */
static int64_t expire(cache_t *c, int64_t step, int *prefix) {
    const int64_t oldest = step - c->window;
    int64_t doomed = 0;
    for (int64_t s = c->pinned; s < c->size; s++) doomed += c->last_step[c->slot_ids[s]] <= oldest;
    if (doomed == 0) return 0;
    const int64_t new_size = c->size - doomed;
    int64_t mover = new_size;
    for (int64_t s = c->pinned; s < c->size; s++) {
        const int64_t u = c->slot_ids[s];
        if (c->last_step[u] > oldest) continue;
        c->slot_of[u] = -1;
        if (s >= new_size) continue;  /* a doomed slot in the tail is simply cut */
        while (c->last_step[c->slot_ids[mover]] <= oldest) mover++;
        if (c->row_bytes) memcpy(c->rows + s * c->row_stride, c->rows + mover * c->row_stride, c->row_bytes);
        c->slot_ids[s] = c->slot_ids[mover];
        c->slot_of[c->slot_ids[s]] = s;
        mover++;
        *prefix = 0;
    }
    for (int64_t s = new_size; s < c->size; s++) c->slot_ids[s] = -1;
    c->size = new_size;
    return doomed;
}

/* `NeuronCache._admit` of the `fresh` candidates (sorted, not resident): who enters (`entering`, in
 * order) and where (`slots`), the index updated. Returns the count entering and sets `*evicted`. `unit`
 * and `ranked` are scratch for `capacity - pinned + n_fresh` units. */
static int64_t admit(cache_t *c, const int64_t *fresh, int64_t n_fresh, int64_t *entering, int64_t *slots,
                     int64_t *evicted, int64_t *unit, ranked_t *ranked) {
    const int64_t free_slots = c->capacity - c->size;
    int64_t entered = 0;
    *evicted = 0;
    if (n_fresh <= free_slots) {
        memcpy(entering, fresh, n_fresh * sizeof(int64_t));  /* the candidates, ascending, into the free slots */
        entered = n_fresh;
    } else {
        if (free_slots == 0) {
            int64_t weakest = INT64_MAX, best = INT64_MIN;
            for (int64_t s = c->pinned; s < c->size; s++) {
                const int64_t p = priority_of(c, c->slot_ids[s]);
                if (p < weakest) weakest = p;
            }
            for (int64_t i = 0; i < n_fresh; i++) {
                const int64_t p = priority_of(c, fresh[i]);
                if (p > best) best = p;
            }
            if (best <= weakest) return 0;
        }
        /* the union: unpinned residents by descending id, then the candidates by ascending id */
        const int64_t residents = c->size - c->pinned, total = residents + n_fresh, room = c->capacity - c->pinned;
        int64_t k = 0;
        for (int64_t u = c->num_units - 1; u >= 0; u--)
            if (c->slot_of[u] >= c->pinned) unit[k++] = u;
        memcpy(unit + k, fresh, n_fresh * sizeof(int64_t));
        for (int64_t i = 0; i < total; i++) ranked[i] = (ranked_t){priority_of(c, unit[i]), i};
        /* the `room` best stay; only the residents below them and the candidates among them are sorted */
        select_best(ranked, total, room);
        int64_t leaving = room, staying = 0;
        for (int64_t i = room; i < total; i++)
            if (ranked[i].position < residents) ranked[leaving++] = ranked[i];
        for (int64_t i = 0; i < room; i++)
            if (ranked[i].position >= residents) ranked[staying++] = ranked[i];
        qsort(ranked + room, leaving - room, sizeof(ranked_t), by_rank);
        qsort(ranked, staying, sizeof(ranked_t), by_rank);
        /* evicted residents (in rank order) hand their slots to the first candidates that stay */
        for (int64_t i = room; i < leaving; i++) {
            const int64_t u = unit[ranked[i].position];
            slots[(*evicted)++] = c->slot_of[u];
            c->slot_of[u] = -1;
        }
        for (int64_t i = 0; i < staying; i++) entering[entered++] = unit[ranked[i].position];
    }
    for (int64_t i = 0; i < entered; i++) {
        if (i >= *evicted) slots[i] = c->size + (i - *evicted);
        c->slot_ids[slots[i]] = entering[i];
        c->slot_of[entering[i]] = slots[i];
    }
    return entered;
}

/* Where unit `u`'s row lies in the read rows: row `u` (`row_ids` NULL: a staging matrix by unit), else
 * its index in the sorted `row_ids`; -1 where it is not there. */
static int64_t source_row(int64_t u, const int64_t *row_ids, int64_t src_rows) {
    if (row_ids == NULL) return u < src_rows ? u : -1;
    int64_t lo = 0, hi = src_rows;
    while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        if (row_ids[mid] < u) lo = mid + 1;
        else hi = mid;
    }
    return lo < src_rows && row_ids[lo] == u ? lo : -1;
}

/* `NeuronCache.update` for the policies with priority terms: record the step's `used` units (`count`
 * and `last_step`), expire, then admit the non-resident units among the sorted `ids`, the step's misses
 * (a subset of `used`, or `used` empty and nothing expiring: none of them expires here) (free slots first,
 * then a candidate displaces a resident only while strictly better; one stable ranking of residents and
 * candidates). `src` holds the read rows (`source_row`); with `copy` the entering rows are copied from
 * it into the cache's rows (same element type), else the caller copies unit `entering[i]` into slot
 * `slots[i]` for i < the returned count (arrays of `capacity`).
 *
 * `info` receives {units that left (expired or displaced), the new size, whether the cache still holds
 * the unit prefix (`info[2]` on entry: whether it held it before)}. Returns the count entering, or, with
 * the cache and the policy untouched: -1 if an id lies outside 0 .. num_units-1, -2 if scratch memory
 * cannot be had, -3 if a candidate's row is not among the read rows. */
int64_t flashlm_update(int64_t *slot_of, int64_t *slot_ids, int64_t *count, int64_t *last_step, const int64_t *shape,
                       char *rows, const int64_t *used, int64_t n_used, const int64_t *ids, int64_t n, int64_t step,
                       const char *src, int64_t src_stride, int64_t src_rows, const int64_t *row_ids, int64_t copy,
                       int64_t *entering, int64_t *slots, int64_t *info) {
    /* shape: num_units, capacity, pinned, size, window, row stride and row bytes (bytes) */
    cache_t c = {slot_of, slot_ids, count, last_step, shape[0], shape[1], shape[2], shape[3], shape[4],
                 rows, shape[5], shape[6]};
    for (int64_t i = 0; i < n_used; i++)
        if (used[i] < 0 || used[i] >= c.num_units) return -1;
    const int admitting = c.capacity > c.pinned && n > 0;
    /* one block of scratch: the candidates, the rows' slots (when copied here), the ranking's union */
    const int64_t room = c.capacity - c.pinned, union_size = room + n;
    char *scratch = NULL;
    int64_t *fresh = NULL, *unit = NULL;
    ranked_t *ranked = NULL;
    int64_t n_fresh = 0;
    if (admitting) {
        scratch = malloc(3 * n * sizeof(int64_t) + union_size * (sizeof(int64_t) + sizeof(ranked_t)));
        if (scratch == NULL) return -2;
        fresh = (int64_t *)scratch;
        if (copy) {
            entering = fresh + n;
            slots = fresh + 2 * n;
        }
        unit = fresh + 3 * n;
        ranked = (ranked_t *)(unit + union_size);
        n_fresh = flashlm_missing(slot_of, c.num_units, ids, n, fresh);
        for (int64_t i = 0; i < n_fresh; i++)
            if (source_row(fresh[i], row_ids, src_rows) < 0) n_fresh = -3;
        if (n_fresh < 0) {
            free(scratch);
            return n_fresh;
        }
    }
    for (int64_t i = 0; i < n_used; i++) {
        if (count) count[used[i]] += 1;
        last_step[used[i]] = step;
    }
    int prefix = info[2] != 0;
    const int64_t expired = c.window > 0 && c.size > c.pinned ? expire(&c, step, &prefix) : 0;
    int64_t entered = 0, evicted = 0;
    if (n_fresh > 0) entered = admit(&c, fresh, n_fresh, entering, slots, &evicted, unit, ranked);
    if (copy)
        for (int64_t i = 0; i < entered; i++)
            memcpy(rows + slots[i] * c.row_stride, src + source_row(entering[i], row_ids, src_rows) * src_stride,
                   c.row_bytes);
    const int64_t appended = entered - evicted;
    if (evicted) prefix = 0;
    else if (appended && prefix) prefix = entering[0] == c.size && entering[entered - 1] == c.size + appended - 1;
    free(scratch);
    info[0] = expired + evicted;
    info[1] = c.size + appended;
    info[2] = prefix;
    return entered;
}
