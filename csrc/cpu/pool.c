/* pool.c: persistent worker threads, started on first use, restarted in a
 * forked child (whose threads did not survive the fork). Workers spin a
 * little after each job before they sleep, so that calls in a decoding loop
 * do not pay a wake-up each. */
#define _GNU_SOURCE
#include "pool.h"

#include <dlfcn.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define SF_PAUSE() _mm_pause()
#else
#define SF_PAUSE() ((void)0)
#endif

/* Spins before sleeping: long enough to bridge back-to-back calls. */
#define SF_SPIN 20000

void *sf_scratch_get(sf_scratch *s, int slot, size_t bytes) {
    if (bytes <= s->cap[slot]) return s->buf[slot];
    size_t want = bytes + bytes / 4 + 64;
    void *p = realloc(s->buf[slot], want);
    if (!p) return NULL;
    s->buf[slot] = p;
    s->cap[slot] = want;
    return p;
}

typedef struct sf_job {
    sf_task_fn fn;
    void *ctx;
    int64_t n;
    atomic_llong next, done;
    int64_t fail_item;
    sf_status fail_status;
    int split;                /* parts of one task (n <= 64): see run_job */
    atomic_ullong taken;      /* the parts claimed, when split */
} sf_job;

static pthread_mutex_t call_lock = PTHREAD_MUTEX_INITIALIZER;

static struct {
    int requested;       /* sf_set_num_threads; 0 = one per core */
    int started;         /* workers running (not counting the caller) */
    int unstartable;     /* a pool size whose workers failed to start: not retried */
    atomic_int in_force; /* threads the calls run on, once known (0: not yet) */
    pthread_t *threads;
    sf_scratch *scratch; /* [0] is the caller's */
    int n_scratch;
    pthread_mutex_t mu;
    pthread_cond_t go, done;
    atomic_ullong generation, current; /* current: the job's generation, 0 once over */
    uint64_t start_generation;
    atomic_int inflight, sleepers;     /* workers inside run_job; asleep */
    int shutdown;
    sf_job *job;         /* what the workers run now */
    int single;          /* the caller runs a one-item job: splits may use the workers */
} P = {.mu = PTHREAD_MUTEX_INITIALIZER,
       .go = PTHREAD_COND_INITIALIZER,
       .done = PTHREAD_COND_INITIALIZER};

/* The process's cores: the main thread's affinity (taskset, a container's
 * cpuset), the same whichever thread asks. A caller pinned to one core must
 * not shrink the pool, nor two differently pinned callers restart it in turn. */
static int process_cores(cpu_set_t *set) {
    return sched_getaffinity(getpid(), sizeof *set, set) == 0 && CPU_COUNT(set) > 0;
}

/* Up to two numbers from dir/name: how many were read. */
static int read_numbers(const char *dir, const char *name, long long *a, long long *b) {
    char file[1100];
    snprintf(file, sizeof file, "%s/%s", dir, name);
    FILE *f = fopen(file, "r");
    if (!f) return 0;
    const int n = fscanf(f, "%lld %lld", a, b);
    fclose(f);
    return n < 0 ? 0 : n;
}

/* The CPU quota of a cgroup folder and its parents up to the mount, in cores
 * rounded up (0: none): v2 cpu.max "quota period" ("max ..." is none), v1
 * cpu.cfs_quota_us (-1 is none) over cpu.cfs_period_us. The tightest holds. */
static int quota_in(const char *mount, const char *path, int v2) {
    char dir[1024];
    if (snprintf(dir, sizeof dir, "%s%s", mount, path) >= (int)sizeof dir) return 0;
    int best = 0;
    for (;;) {
        long long q = 0, p = 0, unused;
        const int found = v2 ? read_numbers(dir, "cpu.max", &q, &p) == 2
                             : read_numbers(dir, "cpu.cfs_quota_us", &q, &unused) >= 1 &&
                                   read_numbers(dir, "cpu.cfs_period_us", &p, &unused) >= 1;
        if (found && q > 0 && p > 0) {
            const long long n = (q + p - 1) / p;
            const int cores = n > 1 << 20 ? 1 << 20 : (int)n;
            if (!best || cores < best) best = cores;
        }
        char *slash = strrchr(dir, '/');
        if (!slash || (size_t)(slash - dir) < strlen(mount)) break;
        *slash = '\0';
    }
    return best;
}

/* Whether a v1 hierarchy's controller list ("cpu,cpuacct") holds cpu. */
static int has_cpu(const char *list) {
    for (const char *c = list; c; c = strchr(c, ',') ? strchr(c, ',') + 1 : NULL)
        if (strncmp(c, "cpu", 3) == 0 && (c[3] == ',' || c[3] == '\0')) return 1;
    return 0;
}

/* A container's CPU limit (docker --cpus, a Kubernetes limit): its affinity
 * still shows every core of the host, and a thread per core would spin
 * against the quota. 0: no quota found. */
static int quota_cores(void) {
    FILE *f = fopen("/proc/self/cgroup", "r");
    if (!f) return 0;
    char line[1024];
    int best = 0;
    while (fgets(line, sizeof line, f)) {
        line[strcspn(line, "\n")] = '\0';
        char *ctrl = strchr(line, ':'), *path = ctrl ? strchr(ctrl + 1, ':') : NULL;
        if (!path) continue;
        *path++ = '\0';
        ctrl++;
        int n = 0;
        if (!*ctrl) { /* v2: unified at /sys/fs/cgroup, or beside v1 in unified/ */
            n = quota_in("/sys/fs/cgroup", path, 1);
            if (!n) n = quota_in("/sys/fs/cgroup/unified", path, 1);
        } else if (has_cpu(ctrl)) { /* v1: mounted under its controllers' names */
            char mount[300];
            snprintf(mount, sizeof mount, "/sys/fs/cgroup/%s", ctrl);
            n = quota_in(mount, path, 0);
            if (!n) n = quota_in("/sys/fs/cgroup/cpu", path, 0);
        }
        if (n && (!best || n < best)) best = n;
    }
    fclose(f);
    return best;
}

/* Read once: every call asks (under call_lock), the files cost syscalls. */
static int cgroup_cores = -1;

static int core_count(void) {
    cpu_set_t set;
    long n = process_cores(&set) ? CPU_COUNT(&set) : sysconf(_SC_NPROCESSORS_ONLN);
    if (n < 1) n = 1;
    if (cgroup_cores < 0) cgroup_cores = quota_cores();
    return cgroup_cores && cgroup_cores < n ? cgroup_cores : (int)n;
}

static int wanted_threads(void) {
    int n = P.requested > 0 ? P.requested : core_count();
    return n > 256 ? 256 : n;
}

static void run_item(sf_job *j, int64_t i, sf_scratch *s) {
    sf_status st = j->fn(j->ctx, i, s);
    if (st != SF_OK) {
        pthread_mutex_lock(&P.mu);
        if (j->fail_item < 0 || i < j->fail_item) {
            j->fail_item = i;
            j->fail_status = st;
        }
        pthread_mutex_unlock(&P.mu);
    }
    if (atomic_fetch_add(&j->done, 1) + 1 == j->n) {
        pthread_mutex_lock(&P.mu);
        pthread_cond_broadcast(&P.done);
        pthread_mutex_unlock(&P.mu);
    }
}

/* Runs items of `j` on thread `tid` (0: the caller) until none is left. */
static void run_job(sf_job *j, sf_scratch *s, int tid) {
    if (j->split) {
        /* Part tid first: a lone request's rows split the same way in every
         * pass, so each thread reads again the part that its own cache holds
         * (taking parts as they come moved half of every row between cores).
         * Then any part left, so that a slow thread delays nothing. */
        for (int64_t k = 0; k < j->n; k++) {
            const int64_t i = (tid + k) % j->n;
            const unsigned long long bit = 1ull << i;
            if (!(atomic_fetch_or(&j->taken, bit) & bit)) run_item(j, i, s);
        }
        return;
    }
    /* While items remain for every thread, each claims its next item before
     * running the current one, so that the task can prefetch that item's
     * data while it computes (near the end, claiming ahead would leave a
     * thread idle). */
    const int64_t threads = P.started + 1;
    int64_t i = atomic_fetch_add(&j->next, 1);
    while (i < j->n) {
        int64_t after = -1;
        if (s && atomic_load(&j->next) + threads <= j->n) {
            after = atomic_fetch_add(&j->next, 1);
            if (after >= j->n) after = -1;
        }
        if (s) s->upcoming = after;
        run_item(j, i, s);
        i = after >= 0 ? after : atomic_fetch_add(&j->next, 1);
    }
}

static void *worker_main(void *arg) {
    const int id = (int)(intptr_t)arg;
    pthread_mutex_lock(&P.mu);
    uint64_t seen = P.start_generation; /* a job may be posted before we get here */
    int stop = P.shutdown;
    pthread_mutex_unlock(&P.mu);
    while (!stop) {
        int spins = 0;
        while (atomic_load(&P.generation) == seen && spins < SF_SPIN) { SF_PAUSE(); spins++; }
        if (atomic_load(&P.generation) == seen) {
            pthread_mutex_lock(&P.mu);
            atomic_fetch_add(&P.sleepers, 1);
            while (atomic_load(&P.generation) == seen && !P.shutdown)
                pthread_cond_wait(&P.go, &P.mu);
            atomic_fetch_sub(&P.sleepers, 1);
            stop = P.shutdown;
            pthread_mutex_unlock(&P.mu);
            if (stop) break;
        }
        seen = atomic_load(&P.generation);
        /* Join only a job still running: the caller may be done with it
         * (its items all taken by faster threads) and gone. */
        atomic_fetch_add(&P.inflight, 1);
        if (atomic_load(&P.current) == seen) run_job(P.job, &P.scratch[id], id);
        atomic_fetch_sub(&P.inflight, 1);
        pthread_mutex_lock(&P.mu);
        stop = P.shutdown;
        pthread_mutex_unlock(&P.mu);
    }
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

/* Workers outlive the calls: the library must stay mapped while they live,
 * past its last dlclose (cffi closes it at interpreter exit, while workers may
 * still spin or wake: they faulted in unmapped code). */
static void pin_library(void) {
    static int pinned;
    Dl_info info;
    if (!pinned && dladdr((void *)worker_main, &info) && info.dli_fname)
        pinned = dlopen(info.dli_fname, RTLD_NOW | RTLD_NOLOAD | RTLD_NODELETE) != NULL;
}

/* Starts workers 1..want-1: on the process's cores (not the pinning of the
 * thread that happens to start them) and with every signal blocked, so that
 * signals reach the application's threads (sigwait, Python's handlers). */
static int start_workers(int want) {
    pthread_attr_t attr;
    if (pthread_attr_init(&attr) != 0) return 0;
    cpu_set_t set;
    if (process_cores(&set)) pthread_attr_setaffinity_np(&attr, sizeof set, &set);
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    int ok = 1;
    for (int i = 1; i < want && ok; i++) {
        ok = pthread_create(&P.threads[P.started], &attr, worker_main, (void *)(intptr_t)i) == 0;
        if (ok) P.started++;
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    pthread_attr_destroy(&attr);
    return ok;
}

/* Frees the scratch memory of threads past the first n (stopped ones). */
static void drop_scratch(int n) {
    for (int i = n; i < P.n_scratch; i++)
        for (size_t k = 0; k < sizeof P.scratch[i].buf / sizeof *P.scratch[i].buf; k++)
            free(P.scratch[i].buf[k]);
    if (n < P.n_scratch) P.n_scratch = n;
}

/* Under call_lock: the pool of wanted_threads() running, or SF_ERR_THREADS
 * where its workers cannot start (then the caller runs alone, and that size
 * is not tried again on every call: only a new sf_set_num_threads retries). */
static sf_status ensure_workers(void) {
    int want = wanted_threads();
    if (P.n_scratch < want) {
        sf_scratch *s = realloc(P.scratch, (size_t)want * sizeof *s);
        if (!s) return SF_ERR_NO_MEMORY;
        for (int i = P.n_scratch; i < want; i++) s[i] = (sf_scratch){0};
        P.scratch = s;
        P.n_scratch = want;
    }
    if (P.started == want - 1) {
        atomic_store(&P.in_force, want);
        return SF_OK;
    }
    if (want == P.unstartable) return SF_ERR_THREADS;
    if (P.started) stop_workers();
    drop_scratch(want); /* a smaller pool keeps no memory of the threads it lost */
    atomic_store(&P.in_force, 1);
    pthread_t *t = realloc(P.threads, (size_t)want * sizeof *t);
    if (!t) return SF_ERR_NO_MEMORY;
    P.threads = t;
    P.start_generation = atomic_load(&P.generation);
    pin_library();
    if (!start_workers(want)) {
        stop_workers();
        P.unstartable = want;
        return SF_ERR_THREADS;
    }
    P.unstartable = 0;
    atomic_store(&P.in_force, want);
    return SF_OK;
}

/* Runs `j` on the caller (whose scratch is `s`) and whichever workers join
 * while items remain: a worker that is slow to wake delays nothing. */
static void run_everywhere(sf_job *j, sf_scratch *s) {
    P.job = j;
    pthread_mutex_lock(&P.mu);
    atomic_store(&P.current, atomic_load(&P.generation) + 1);
    atomic_fetch_add(&P.generation, 1);
    if (atomic_load(&P.sleepers) > 0) pthread_cond_broadcast(&P.go);
    pthread_mutex_unlock(&P.mu);
    run_job(j, s, 0);
    int spins = 0;
    while (atomic_load(&j->done) < j->n && spins < SF_SPIN) { SF_PAUSE(); spins++; }
    if (atomic_load(&j->done) < j->n) {
        pthread_mutex_lock(&P.mu);
        while (atomic_load(&j->done) < j->n) pthread_cond_wait(&P.done, &P.mu);
        pthread_mutex_unlock(&P.mu);
    }
    atomic_store(&P.current, 0);
    while (atomic_load(&P.inflight) > 0) SF_PAUSE(); /* workers leaving j */
}

sf_status sf_parallel_for(int64_t n, sf_task_fn fn, void *ctx,
                          int64_t *fail_item) {
    pthread_mutex_lock(&call_lock);
    sf_status st = ensure_workers();
    if (st == SF_ERR_NO_MEMORY) {
        pthread_mutex_unlock(&call_lock);
        *fail_item = -1;
        return st;
    }
    /* Where threads cannot start, the caller runs the job alone: the results
     * do not depend on the thread count. */
    sf_job j = {fn, ctx, n, 0, 0, -1, SF_OK, 0, 0};
    if (n > 1 && P.started > 0) {
        run_everywhere(&j, &P.scratch[0]);
    } else {
        P.single = 1;
        run_job(&j, &P.scratch[0], 0);
        P.single = 0;
    }
    *fail_item = j.fail_item;
    st = j.fail_status;
    pthread_mutex_unlock(&call_lock);
    return st;
}

int sf_parallel_split(int64_t n, sf_task_fn fn, void *ctx) {
    /* Only from inside a one-item job: then the workers are idle. */
    if (!P.single || P.started == 0 || n < 2 || n > 64) return 0;
    sf_job j = {fn, ctx, n, 0, 0, -1, SF_OK, 1, 0};
    P.single = 0;
    run_everywhere(&j, NULL);
    P.single = 1;
    return 1;
}

int sf_parallel_width(void) { return P.single ? P.started + 1 : 1; }

SF_API sf_status sf_set_num_threads(int n) {
    if (n < 0) return SF_ERR_ARGUMENT;
    pthread_mutex_lock(&call_lock);
    const int before = P.requested;
    P.requested = n;
    P.unstartable = 0; /* asked again: try again */
    sf_status st = ensure_workers();
    if (st != SF_OK) { /* the setting in force stays: its workers again, where they start */
        P.requested = before;
        ensure_workers();
    }
    pthread_mutex_unlock(&call_lock);
    return st;
}

SF_API int sf_get_num_threads(void) {
    /* Without the lock once known: a call in another thread may hold it. */
    int n = atomic_load(&P.in_force);
    if (n) return n;
    pthread_mutex_lock(&call_lock);
    n = wanted_threads(); /* before the first call: the pool it will start */
    pthread_mutex_unlock(&call_lock);
    return n;
}

/* A forked child has only the forking thread: forget the workers (their
 * scratch memory is still valid) and start new ones on the next call. */
static void before_fork(void) { pthread_mutex_lock(&call_lock); }
static void after_fork_parent(void) { pthread_mutex_unlock(&call_lock); }
static void after_fork_child(void) {
    P.started = 0;
    P.unstartable = 0;
    atomic_store(&P.in_force, 0);
    P.shutdown = 0;
    atomic_store(&P.inflight, 0);
    atomic_store(&P.current, 0);
    atomic_store(&P.sleepers, 0);
    pthread_mutex_init(&P.mu, NULL);
    pthread_cond_init(&P.go, NULL);
    pthread_cond_init(&P.done, NULL);
    pthread_mutex_init(&call_lock, NULL);
}

__attribute__((constructor)) static void register_fork_handlers(void) {
    pthread_atfork(before_fork, after_fork_parent, after_fork_child);
}
