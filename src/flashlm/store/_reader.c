/* Planned, coalesced, parallel reads of store rows in place, without Python per request.
 *
 * Built on first use by flashlm._native; flashlm.store.reader.StoreReader.read_in_place is the caller,
 * with its Python path (numpy planning, a thread pool of os.preadv) where no compiler is found. The plan
 * is the one `plan_reads` and `split_chunks` make (tests/store/test_reader.py compares them):
 *
 *   row r of the file spans [data_offset + r * row_bytes, + row_bytes), widened to `alignment`; rows
 *   whose widened extents lie at most `merge_gap` bytes apart join one run; runs are cut into requests
 *   of at most `chunk_bytes`; byte b of the file lands at byte b - data_offset of `base`.
 *
 * A pool of threads made once per reader (`flashlm_reader_new`) serves the requests of one call at a
 * time, each thread claiming the next request (the caller's thread works too), so a thread the
 * scheduler pauses delays only its own request. ctypes releases the GIL for the call.
 */
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <unistd.h>

typedef struct {
    int64_t offset, length, needed;
} Request;

typedef struct {
    pthread_mutex_t lock;
    pthread_cond_t wake, done;
    pthread_t *threads;
    int64_t n_threads; /* workers besides the calling thread */
    uint64_t generation;
    int stop;
    /* the call being served */
    int fd;
    const Request *requests;
    int64_t n_requests, next, alignment, data_offset;
    char *base;
    int64_t bytes, calls, eof_at, error;
    int64_t busy; /* workers still serving the call */
} Pool;

enum { PLAN_UNSORTED = -1, PLAN_OUT_OF_RANGE = -2, NO_MEMORY = -3 };

/* The requests for the sorted unique `ids` (at most n + total / chunk_bytes + 1 of them); returns
 * their count, or PLAN_UNSORTED / PLAN_OUT_OF_RANGE. */
static int64_t plan(const int64_t *ids, int64_t n, int64_t rows, int64_t row_bytes, int64_t data_offset,
                    int64_t alignment, int64_t merge_gap, int64_t chunk_bytes, Request *out) {
    int64_t count = 0;
    for (int64_t i = 0; i < n;) {
        if (ids[i] < 0 || ids[i] >= rows) return PLAN_OUT_OF_RANGE;
        int64_t start = data_offset + ids[i] * row_bytes;
        int64_t lo = start / alignment * alignment;
        int64_t end = start + row_bytes;
        int64_t hi = (end + alignment - 1) / alignment * alignment;
        for (i++; i < n; i++) {
            if (ids[i] <= ids[i - 1]) return PLAN_UNSORTED;
            if (ids[i] >= rows) return PLAN_OUT_OF_RANGE;
            int64_t next_start = data_offset + ids[i] * row_bytes;
            if (next_start / alignment * alignment - hi > merge_gap) break;
            end = next_start + row_bytes;
            hi = (end + alignment - 1) / alignment * alignment;
        }
        for (int64_t offset = lo; offset < hi; offset += chunk_bytes) {
            int64_t length = hi - offset < chunk_bytes ? hi - offset : chunk_bytes;
            int64_t needed = end - offset;
            out[count++] = (Request){offset, length, needed < 0 ? 0 : needed > length ? length : needed};
        }
    }
    return count;
}

/* A bound on the requests `plan` makes: every run is cut into its bytes / chunk_bytes requests plus one,
 * and the runs together span at most the file plus two alignment blocks per run (chunk >= alignment). */
static int64_t max_requests(int64_t n, int64_t rows, int64_t row_bytes, int64_t chunk_bytes) {
    return 3 * n + rows * row_bytes / chunk_bytes + 2;
}

/* Serve requests until none is left; totals and errors go into the pool under its lock. */
static void serve(Pool *p) {
    int64_t bytes = 0, calls = 0, eof_at = -1, error = 0;
    for (;;) {
        int64_t i = __atomic_fetch_add(&p->next, 1, __ATOMIC_RELAXED);
        if (i >= p->n_requests) break;
        const Request *r = &p->requests[i];
        char *to = p->base + (r->offset - p->data_offset);
        int64_t got = 0;
        while (got < r->length) {
            ssize_t n = pread(p->fd, to + got, (size_t)(r->length - got), r->offset + got);
            if (n < 0) {
                if (errno == EINTR) continue;
                error = errno;
                break;
            }
            calls++;
            bytes += n;
            got += n;
            if (got >= r->length || got >= r->needed) break; /* complete, or only the aligned tail is past EOF */
            if (n == 0 || (p->alignment > 1 && got % p->alignment)) {
                eof_at = r->offset + got;
                break;
            }
        }
    }
    pthread_mutex_lock(&p->lock);
    p->bytes += bytes;
    p->calls += calls;
    if (eof_at >= 0 && (p->eof_at < 0 || eof_at < p->eof_at)) p->eof_at = eof_at;
    if (error && !p->error) p->error = error;
    pthread_mutex_unlock(&p->lock);
}

static void *worker(void *arg) {
    Pool *p = arg;
    uint64_t seen = 0;
    pthread_mutex_lock(&p->lock);
    for (;;) {
        while (!p->stop && p->generation == seen) pthread_cond_wait(&p->wake, &p->lock);
        if (p->stop) break;
        seen = p->generation;
        pthread_mutex_unlock(&p->lock);
        serve(p);
        pthread_mutex_lock(&p->lock);
        if (--p->busy == 0) pthread_cond_signal(&p->done);
    }
    pthread_mutex_unlock(&p->lock);
    return NULL;
}

void flashlm_reader_free(Pool *p) {
    if (!p) return;
    pthread_mutex_lock(&p->lock);
    p->stop = 1;
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->lock);
    for (int64_t t = 0; t < p->n_threads; t++) pthread_join(p->threads[t], NULL);
    pthread_mutex_destroy(&p->lock);
    pthread_cond_destroy(&p->wake);
    pthread_cond_destroy(&p->done);
    free(p->threads);
    free(p);
}

/* A pool of `threads` readers (the calling thread and threads - 1 workers); NULL if it cannot be made. */
Pool *flashlm_reader_new(int64_t threads) {
    Pool *p = calloc(1, sizeof(Pool));
    if (!p) return NULL;
    pthread_mutex_init(&p->lock, NULL);
    pthread_cond_init(&p->wake, NULL);
    pthread_cond_init(&p->done, NULL);
    p->threads = calloc(threads > 1 ? threads - 1 : 1, sizeof(pthread_t));
    if (!p->threads) {
        flashlm_reader_free(p);
        return NULL;
    }
    for (int64_t t = 0; t + 1 < threads; t++) {
        if (pthread_create(&p->threads[t], NULL, worker, p)) {
            flashlm_reader_free(p);
            return NULL;
        }
        p->n_threads++;
    }
    return p;
}

/* Read the rows `ids` of the file open as `fd` (`rows` rows) into `base` in place. Returns 0 and sets
 * stats = {bytes read, read calls, offset of an early end of file or -1, errno or 0}, or a negative
 * plan error (PLAN_UNSORTED, PLAN_OUT_OF_RANGE, NO_MEMORY) having read nothing. */
int64_t flashlm_read_rows(Pool *p, int64_t fd, const int64_t *ids, int64_t n, int64_t rows, int64_t row_bytes,
                          int64_t data_offset, int64_t alignment, int64_t merge_gap, int64_t chunk_bytes,
                          char *base, int64_t *stats) {
    Request *requests = malloc(max_requests(n, rows, row_bytes, chunk_bytes) * sizeof(Request));
    if (!requests) return NO_MEMORY;
    int64_t count = plan(ids, n, rows, row_bytes, data_offset, alignment, merge_gap, chunk_bytes, requests);
    if (count < 0) {
        free(requests);
        return count;
    }
    pthread_mutex_lock(&p->lock);
    p->fd = (int)fd;
    p->requests = requests;
    p->n_requests = count;
    p->next = 0;
    p->alignment = alignment;
    p->data_offset = data_offset;
    p->base = base;
    p->bytes = p->calls = p->error = 0;
    p->eof_at = -1;
    int64_t helpers = count - 1 < p->n_threads ? count - 1 : p->n_threads;
    if (helpers > 0) {
        p->busy = p->n_threads;
        p->generation++;
        pthread_cond_broadcast(&p->wake);
    }
    pthread_mutex_unlock(&p->lock);
    serve(p);
    pthread_mutex_lock(&p->lock);
    if (helpers > 0)
        while (p->busy) pthread_cond_wait(&p->done, &p->lock);
    stats[0] = p->bytes;
    stats[1] = p->calls;
    stats[2] = p->eof_at;
    stats[3] = p->error;
    pthread_mutex_unlock(&p->lock);
    free(requests);
    return 0;
}

/* The plan alone, for tests: writes up to `capacity` requests as (offset, length, needed) triples and
 * returns the count (which may exceed `capacity`), or a negative plan error. */
int64_t flashlm_plan_rows(const int64_t *ids, int64_t n, int64_t rows, int64_t row_bytes, int64_t data_offset,
                          int64_t alignment, int64_t merge_gap, int64_t chunk_bytes, int64_t *out,
                          int64_t capacity) {
    Request *requests = malloc(max_requests(n, rows, row_bytes, chunk_bytes) * sizeof(Request));
    if (!requests) return NO_MEMORY;
    int64_t count = plan(ids, n, rows, row_bytes, data_offset, alignment, merge_gap, chunk_bytes, requests);
    for (int64_t i = 0; i < count && i < capacity; i++) {
        out[3 * i] = requests[i].offset;
        out[3 * i + 1] = requests[i].length;
        out[3 * i + 2] = requests[i].needed;
    }
    free(requests);
    return count;
}
