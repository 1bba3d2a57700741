/* pool.c: persistent worker threads, started on first use, restarted in a
 * forked child (whose threads did not survive the fork). */
#define _GNU_SOURCE
#include "pool.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <unistd.h>

void *sf_scratch_get(sf_scratch *s, int slot, size_t bytes) {
    if (bytes <= s->cap[slot]) return s->buf[slot];
    size_t want = bytes + bytes / 4 + 64;
    void *p = realloc(s->buf[slot], want);
    if (!p) return NULL;
    s->buf[slot] = p;
    s->cap[slot] = want;
    return p;
}

static pthread_mutex_t call_lock = PTHREAD_MUTEX_INITIALIZER;

static struct {
    int requested;      /* sf_set_num_threads; 0 = one per core */
    int started;        /* workers running (not counting the caller) */
    pthread_t *threads;
    sf_scratch *scratch; /* [0] is the caller's */
    int n_scratch;
    pthread_mutex_t mu;
    pthread_cond_t go, done;
    uint64_t generation, start_generation;
    int active, shutdown;
    /* the job */
    sf_task_fn fn;
    void *ctx;
    int64_t n;
    atomic_llong next;
    int64_t fail_item;
    sf_status fail_status;
} P = {.mu = PTHREAD_MUTEX_INITIALIZER,
       .go = PTHREAD_COND_INITIALIZER,
       .done = PTHREAD_COND_INITIALIZER};

static int core_count(void) {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0) {
        int n = CPU_COUNT(&set);
        if (n > 0) return n;
    }
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}

static int wanted_threads(void) {
    int n = P.requested > 0 ? P.requested : core_count();
    return n > 256 ? 256 : n;
}

static void run_items(int worker) {
    sf_scratch *s = &P.scratch[worker];
    for (;;) {
        int64_t i = atomic_fetch_add(&P.next, 1);
        if (i >= P.n) return;
        sf_status st = P.fn(P.ctx, i, s);
        if (st != SF_OK) {
            pthread_mutex_lock(&P.mu);
            if (P.fail_item < 0 || i < P.fail_item) {
                P.fail_item = i;
                P.fail_status = st;
            }
            pthread_mutex_unlock(&P.mu);
        }
    }
}

static void *worker_main(void *arg) {
    int id = (int)(intptr_t)arg;
    uint64_t seen = 0;
    pthread_mutex_lock(&P.mu);
    seen = P.start_generation; /* a job may be posted before we get here */
    for (;;) {
        while (P.generation == seen && !P.shutdown) pthread_cond_wait(&P.go, &P.mu);
        if (P.shutdown) break;
        seen = P.generation;
        pthread_mutex_unlock(&P.mu);
        run_items(id);
        pthread_mutex_lock(&P.mu);
        if (--P.active == 0) pthread_cond_signal(&P.done);
    }
    pthread_mutex_unlock(&P.mu);
    return NULL;
}

static void stop_workers(void) {
    pthread_mutex_lock(&P.mu);
    P.shutdown = 1;
    pthread_cond_broadcast(&P.go);
    pthread_mutex_unlock(&P.mu);
    for (int i = 0; i < P.started; i++) pthread_join(P.threads[i], NULL);
    P.started = 0;
    P.shutdown = 0;
}

static sf_status ensure_workers(void) {
    int want = wanted_threads();
    if (P.n_scratch < want) {
        sf_scratch *s = realloc(P.scratch, (size_t)want * sizeof *s);
        if (!s) return SF_ERR_NO_MEMORY;
        for (int i = P.n_scratch; i < want; i++) s[i] = (sf_scratch){0};
        P.scratch = s;
        P.n_scratch = want;
    }
    if (P.started == want - 1) return SF_OK;
    if (P.started) stop_workers();
    pthread_t *t = realloc(P.threads, (size_t)want * sizeof *t);
    if (!t) return SF_ERR_NO_MEMORY;
    P.threads = t;
    P.start_generation = P.generation;
    for (int i = 1; i < want; i++) {
        if (pthread_create(&P.threads[P.started], NULL, worker_main,
                           (void *)(intptr_t)i) != 0) {
            stop_workers();
            return SF_ERR_THREADS;
        }
        P.started++;
    }
    return SF_OK;
}

sf_status sf_parallel_for(int64_t n, sf_task_fn fn, void *ctx,
                          int64_t *fail_item) {
    pthread_mutex_lock(&call_lock);
    sf_status st = ensure_workers();
    if (st != SF_OK) {
        pthread_mutex_unlock(&call_lock);
        *fail_item = -1;
        return st;
    }
    P.fn = fn;
    P.ctx = ctx;
    P.n = n;
    P.fail_item = -1;
    P.fail_status = SF_OK;
    atomic_store(&P.next, 0);
    int helpers = P.started;
    if (n > 1 && helpers > 0) {
        pthread_mutex_lock(&P.mu);
        P.active = helpers;
        P.generation++;
        pthread_cond_broadcast(&P.go);
        pthread_mutex_unlock(&P.mu);
    }
    run_items(0);
    if (n > 1 && helpers > 0) {
        pthread_mutex_lock(&P.mu);
        while (P.active > 0) pthread_cond_wait(&P.done, &P.mu);
        pthread_mutex_unlock(&P.mu);
    }
    *fail_item = P.fail_item;
    st = P.fail_status;
    pthread_mutex_unlock(&call_lock);
    return st;
}

SF_API sf_status sf_set_num_threads(int n) {
    if (n < 0) return SF_ERR_ARGUMENT;
    pthread_mutex_lock(&call_lock);
    P.requested = n;
    sf_status st = ensure_workers();
    pthread_mutex_unlock(&call_lock);
    return st;
}

SF_API int sf_get_num_threads(void) {
    pthread_mutex_lock(&call_lock);
    int n = wanted_threads();
    pthread_mutex_unlock(&call_lock);
    return n;
}

/* A forked child has only the forking thread: forget the workers (their
 * scratch memory is still valid) and start new ones on the next call. */
static void before_fork(void) { pthread_mutex_lock(&call_lock); }
static void after_fork_parent(void) { pthread_mutex_unlock(&call_lock); }
static void after_fork_child(void) {
    P.started = 0;
    P.shutdown = 0;
    P.active = 0;
    pthread_mutex_init(&P.mu, NULL);
    pthread_cond_init(&P.go, NULL);
    pthread_cond_init(&P.done, NULL);
    pthread_mutex_init(&call_lock, NULL);
}

__attribute__((constructor)) static void register_fork_handlers(void) {
    pthread_atfork(before_fork, after_fork_parent, after_fork_child);
}
