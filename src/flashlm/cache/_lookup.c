/* The cache's one per-stage lookup in C: which of a step's units are not resident.
 *
 * Built on first use by flashlm._native and called with the GIL held (ctypes.PyDLL): it takes a
 * microsecond or two, less than handing the GIL to the I/O thread and waiting to get it back, which
 * the three torch operators of `ids[slot_of[ids] < 0]` each do. flashlm.cache.neuron_cache is the
 * caller, with that torch expression where no compiler is found.
 */
#include <stdint.h>

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
