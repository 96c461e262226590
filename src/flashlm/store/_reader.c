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
 * A pool of threads made once per reader (`flashlm_reader_new`) serves the jobs in the order they were
 * submitted (`flashlm_reader_submit`, which returns at once), each thread claiming the next request, so
 * a thread the scheduler pauses delays only its own request; `flashlm_reader_wait` waits for a job,
 * polling for its end for a while first once all its requests are in flight.
 * ctypes releases the GIL for each call, so a Python thread that submits and later waits runs no
 * Python in between on the reads' behalf.
 */
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

typedef struct {
    int64_t offset, length, needed;
} Request;

/* One call's requests: claimed by the workers in order, done when the last one finishes. */
typedef struct Job {
    struct Job *next_job; /* the next job in the pool's queue */
    int fd;
    Request *requests;
    int64_t n_requests, claimed, finished, alignment, data_offset;
    char *base;
    int64_t bytes, calls, eof_at, error;
    struct timespec started, completed; /* the first request's claim, the last one's end */
    int done;
} Job;

typedef struct {
    pthread_mutex_t lock;
    pthread_cond_t wake, done;
    pthread_t *threads;
    int64_t n_threads;
    int stop;
    Job *head, *tail; /* jobs with requests not yet claimed, first in, first out */
    int64_t unclaimed; /* their requests not yet claimed */
    int64_t sleeping;  /* threads waiting for a request */
    int64_t serving, peak_serving; /* threads reading a request now, and the most at once (for tests) */
} Pool;

/* Wake one sleeping thread if a request waits to be claimed (the caller holds the lock). A submission
 * wakes one, and each thread that claims a request wakes the next while more wait, so a job still
 * brings in as many threads as it has requests, but the wake-ups (a system call each, on a VM an
 * interrupt to the other core, and a woken thread that may run first) fall on the readers instead of
 * the thread that submits, which on a decode is the one the model waits for. Against waking them all
 * from the submission, alternated in one process on a 2-core AMD EPYC VM at a 50% budget: Qwen2.5-1.5B
 * DIP@0.6's cache bookkeeping (lookup, submission, admission) 10.8 -> 6.6 ms per token at 1.02x
 * tokens/s (AVX2 kernels: 10.8 -> 7.0 ms, 0.98x); DIP-CA 1.09x; SmolLM2 dense streaming 8.6 -> 7.5 ms
 * at 0.99x. */
static void wake(Pool *p) {
    if (p->unclaimed > 0 && p->sleeping > 0) pthread_cond_signal(&p->wake);
}

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

/* Read one request of `job` into its place; the totals go into `out` (bytes, calls, eof_at, error). */
static void serve(const Job *job, const Request *r, int64_t *out) {
    char *to = job->base + (r->offset - job->data_offset);
    int64_t got = 0;
    while (got < r->length) {
        ssize_t n = pread(job->fd, to + got, (size_t)(r->length - got), r->offset + got);
        if (n < 0) {
            if (errno == EINTR) continue;
            out[3] = errno;
            break;
        }
        out[1]++;
        out[0] += n;
        got += n;
        if (got >= r->length || got >= r->needed) break; /* complete, or only the aligned tail is past EOF */
        if (n == 0 || (job->alignment > 1 && got % job->alignment)) {
            out[2] = r->offset + got;
            break;
        }
    }
}

/* Claim the next request of the oldest job, read it, record it; sleep while there is none. */
static void *worker(void *arg) {
    Pool *p = arg;
    pthread_mutex_lock(&p->lock);
    for (;;) {
        while (!p->stop && p->head == NULL) {
            p->sleeping++;
            pthread_cond_wait(&p->wake, &p->lock);
            p->sleeping--;
        }
        Job *job = p->head;
        if (job == NULL) break; /* stopping, and nothing is left to claim */
        if (job->claimed == 0) clock_gettime(CLOCK_MONOTONIC, &job->started);
        const Request *r = &job->requests[job->claimed++];
        p->unclaimed--;
        if (job->claimed == job->n_requests) {
            p->head = job->next_job;
            if (p->head == NULL) p->tail = NULL;
        }
        wake(p); /* the next thread, while requests wait */
        if (++p->serving > p->peak_serving) p->peak_serving = p->serving;
        pthread_mutex_unlock(&p->lock);
        int64_t out[4] = {0, 0, -1, 0};
        serve(job, r, out);
        pthread_mutex_lock(&p->lock);
        p->serving--;
        job->bytes += out[0];
        job->calls += out[1];
        if (out[2] >= 0 && (job->eof_at < 0 || out[2] < job->eof_at)) job->eof_at = out[2];
        if (out[3] && !job->error) job->error = out[3];
        if (++job->finished == job->n_requests) {
            clock_gettime(CLOCK_MONOTONIC, &job->completed);
            __atomic_store_n(&job->done, 1, __ATOMIC_RELEASE); /* a polling waiter reads it unlocked */
            pthread_cond_broadcast(&p->done);
        }
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

/* A pool of `threads` reading threads; NULL if it cannot be made. */
Pool *flashlm_reader_new(int64_t threads) {
    Pool *p = calloc(1, sizeof(Pool));
    if (!p) return NULL;
    pthread_mutex_init(&p->lock, NULL);
    pthread_cond_init(&p->wake, NULL);
    pthread_cond_init(&p->done, NULL);
    p->threads = calloc(threads > 0 ? threads : 1, sizeof(pthread_t));
    if (!p->threads) {
        flashlm_reader_free(p);
        return NULL;
    }
    for (int64_t t = 0; t < threads; t++) {
        if (pthread_create(&p->threads[t], NULL, worker, p)) {
            flashlm_reader_free(p);
            return NULL;
        }
        p->n_threads++;
    }
    return p;
}

/* Where reads of one file's rows land: built once per (file, matrix) by the caller (the Python
 * `StoreReader.in_place_reads`), so that a submission passes six arguments instead of thirteen. */
typedef struct {
    Pool *pool;
    int64_t fd, rows, row_bytes, data_offset, alignment, merge_gap;
    char *base; /* byte b of the file lands at byte b - data_offset of base */
} Target;

/* Queue the reading of the rows `ids` of `t`'s file (its first `t->rows` rows) into its matrix in
 * place, after the jobs submitted before, and with `start` wake a sleeping thread, which wakes the next
 * (`wake`). Without `start`, threads awake take the job, and the next submission with `start` or any
 * wait starts the others: a caller queuing several jobs at once wakes a thread once. Returns at once:
 * the job, for `flashlm_reader_wait` (which every job needs: it frees it), or NULL with `*status` set
 * to a plan error (PLAN_UNSORTED, PLAN_OUT_OF_RANGE, NO_MEMORY), having read nothing. */
Job *flashlm_reader_submit(const Target *t, const int64_t *ids, int64_t n, int64_t chunk_bytes, int64_t start,
                           int64_t *status) {
    Pool *p = t->pool;
    /* one allocation: the job, then its requests */
    Job *job = malloc(sizeof(Job) + max_requests(n, t->rows, t->row_bytes, chunk_bytes) * sizeof(Request));
    Request *requests = job ? (Request *)(job + 1) : NULL;
    int64_t count = job ? plan(ids, n, t->rows, t->row_bytes, t->data_offset, t->alignment, t->merge_gap,
                               chunk_bytes, requests)
                        : NO_MEMORY;
    if (count < 0) {
        free(job);
        *status = count;
        return NULL;
    }
    *job = (Job){.fd = (int)t->fd, .requests = requests, .n_requests = count, .alignment = t->alignment,
                 .data_offset = t->data_offset, .base = t->base, .eof_at = -1};
    pthread_mutex_lock(&p->lock);
    if (count == 0) {
        job->done = 1;
    } else {
        if (p->tail) p->tail->next_job = job;
        else p->head = job;
        p->tail = job;
        p->unclaimed += count;
        if (start) wake(p);
    }
    pthread_mutex_unlock(&p->lock);
    *status = 0;
    return job;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* Poll `job` for its end for up to `spin_ns` nanoseconds, giving the core to any thread ready to run on
 * it between polls; returns early when it is done. */
static void poll_for(const Job *job, int64_t spin_ns) {
    struct timespec start, now;
    clock_gettime(CLOCK_MONOTONIC, &start);
    for (int64_t i = 1; !__atomic_load_n(&job->done, __ATOMIC_ACQUIRE); i++) {
        cpu_relax();
        if (i % 256 == 0) {
            sched_yield();
            clock_gettime(CLOCK_MONOTONIC, &now);
            if ((now.tv_sec - start.tv_sec) * 1000000000LL + (now.tv_nsec - start.tv_nsec) > spin_ns) return;
        }
    }
}

/* Wait for `job` (from `flashlm_reader_submit`) and free it. Where every request of the job is claimed
 * already (its end is near), poll for it for up to `spin_ns` before sleeping. Sets stats = {bytes read,
 * read calls, offset of an early end of file or -1, errno or 0, nanoseconds from its first request's
 * start to its last one's end}. */
void flashlm_reader_wait(Pool *p, Job *job, int64_t *stats, int64_t spin_ns) {
    pthread_mutex_lock(&p->lock);
    if (!job->done) wake(p); /* jobs queued without `start` */
    if (!job->done && spin_ns > 0 && job->claimed == job->n_requests) {
        pthread_mutex_unlock(&p->lock);
        poll_for(job, spin_ns);
        pthread_mutex_lock(&p->lock);
    }
    while (!job->done) pthread_cond_wait(&p->done, &p->lock);
    pthread_mutex_unlock(&p->lock);
    stats[0] = job->bytes;
    stats[1] = job->calls;
    stats[2] = job->eof_at;
    stats[3] = job->error;
    stats[4] = (job->completed.tv_sec - job->started.tv_sec) * 1000000000LL +
               (job->completed.tv_nsec - job->started.tv_nsec);
    free(job);
}

/* The most threads that have read requests at once since the pool was made, for tests. */
int64_t flashlm_reader_peak_serving(Pool *p) {
    pthread_mutex_lock(&p->lock);
    int64_t peak = p->peak_serving;
    pthread_mutex_unlock(&p->lock);
    return peak;
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
