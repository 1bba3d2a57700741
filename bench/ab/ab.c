/*
 * ab.c: times sf_verify from several builds of the library side by side, in
 * one process, on one input written by inputs.py. This machine's speed
 * drifts by tens of percent within minutes, so a kernel change is judged by
 * builds interleaved in blocks of calls, not by runs one after the other.
 *
 *   cc -O2 -I csrc/include bench/ab/ab.c -o /tmp/ab -ldl
 *   /tmp/ab INPUT THREADS build-a/libspecfast.so build-b/libspecfast.so ...
 *   (AB_METHOD=coupled times coupled verification, AB_TEMPERATURE=0 greedy)
 *
 * Each library is loaded with RTLD_LOCAL (its own pool); a short sleep
 * between blocks lets the previous library's spinning workers go to sleep.
 * Prints the 10th percentile and the median of each library's calls.
 */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "specfast.h"

typedef sf_status (*verify_fn)(const sf_logits *, const sf_draft *, const sf_params *,
                               sf_method, sf_verify_out *, sf_error *);
typedef sf_status (*threads_fn)(int);

enum { MAX_LIBS = 8, ROUNDS = 20 };

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec * 1e-3;
}

static int by_value(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static void *read_exactly(FILE *f, size_t bytes) {
    void *p = malloc(bytes ? bytes : 1);
    if (!p || fread(p, 1, bytes, f) != bytes) {
        fprintf(stderr, "ab: short input file\n");
        exit(1);
    }
    return p;
}

int main(int argc, char **argv) {
    if (argc < 4 || argc - 3 > MAX_LIBS) {
        fprintf(stderr, "usage: ab INPUT THREADS LIB... (at most %d)\n", MAX_LIBS);
        return 2;
    }
    FILE *f = fopen(argv[1], "rb");
    if (!f) { perror(argv[1]); return 1; }
    int64_t *head = read_exactly(f, 5 * sizeof(int64_t));
    const int64_t batch = head[0], k = head[1], vocab = head[2], dense = head[3];
    const int32_t top_k = (int32_t)head[4];
    const float top_p = (float)*(double *)read_exactly(f, sizeof(double));
    const int64_t rows = batch * (k + 1), nodes = batch * k;
    float *logits = read_exactly(f, (size_t)(rows * vocab) * sizeof(float));
    int32_t *tokens = read_exactly(f, (size_t)nodes * sizeof(int32_t));
    uint64_t *seeds = read_exactly(f, (size_t)batch * sizeof(uint64_t));
    int64_t *positions = read_exactly(f, (size_t)batch * sizeof(int64_t));
    float *q = dense ? read_exactly(f, (size_t)(nodes * vocab) * sizeof(float)) : NULL;
    fclose(f);

    const int n_libs = argc - 3;
    verify_fn verify[MAX_LIBS];
    for (int l = 0; l < n_libs; l++) {
        void *h = dlopen(argv[3 + l], RTLD_NOW | RTLD_LOCAL);
        if (!h) { fprintf(stderr, "ab: %s\n", dlerror()); return 1; }
        verify[l] = (verify_fn)dlsym(h, "sf_verify");
        threads_fn set_threads = (threads_fn)dlsym(h, "sf_set_num_threads");
        if (!verify[l] || !set_threads) { fprintf(stderr, "ab: %s: no sf_verify\n", argv[3 + l]); return 1; }
        set_threads(atoi(argv[2]));
    }

    int32_t *num_draft = malloc((size_t)batch * sizeof(int32_t));
    for (int64_t b = 0; b < batch; b++) num_draft[b] = (int32_t)k;
    int32_t *out_tokens = malloc((size_t)(batch * (k + 1)) * sizeof(int32_t));
    int32_t *out_acc = malloc((size_t)batch * sizeof(int32_t));
    int32_t *out_nodes = malloc((size_t)(nodes ? nodes : 1) * sizeof(int32_t));
    const char *t = getenv("AB_TEMPERATURE");
    const float one = t ? strtof(t, NULL) : 1.0f, zero = 0.0f;
    const sf_logits lg = {logits, SF_F32, rows, vocab, vocab};
    const sf_draft d = {tokens, nodes, num_draft, batch, NULL,
                        dense ? SF_DRAFT_DENSE : SF_DRAFT_NONE, q, NULL, NULL, 0};
    const sf_params p = {&one, 1, &top_k, 1, &top_p, 1, &zero, 1, seeds, batch, positions, batch};
    sf_verify_out o = {out_tokens, out_acc, out_nodes, k};

    const char *m = getenv("AB_METHOD"); /* "coupled", or rejection by default */
    if (m && strcmp(m, "coupled") != 0 && strcmp(m, "rejection") != 0) {
        fprintf(stderr, "ab: AB_METHOD=%s: give rejection or coupled\n", m);
        return 2;
    }
    const sf_method method = m && strcmp(m, "coupled") == 0 ? SF_COUPLED : SF_REJECTION;
    /* About 50 ms of calls a block. */
    double t0 = now_us();
    if (verify[0](&lg, &d, &p, method, &o, NULL) != SF_OK) { fprintf(stderr, "ab: sf_verify failed\n"); return 1; }
    const double once = now_us() - t0;
    const int per = once > 50000 ? 1 : (int)(50000 / (once + 1)) + 1;
    double *times[MAX_LIBS];
    for (int l = 0; l < n_libs; l++) times[l] = malloc(sizeof(double) * per * ROUNDS);
    for (int r = 0; r < ROUNDS; r++) {
        for (int l = 0; l < n_libs; l++) {
            usleep(3000);
            for (int i = 0; i < per; i++) {
                t0 = now_us();
                sf_status st = verify[l](&lg, &d, &p, method, &o, NULL);
                times[l][r * per + i] = now_us() - t0;
                if (st != SF_OK) { fprintf(stderr, "ab: %s: status %d\n", argv[3 + l], st); return 1; }
            }
        }
    }
    printf("%s, temperature %g, batch %lld, draft %lld, vocab %lld, %s q, top_k %d, top_p %g, "
           "%d calls a library\n", method == SF_COUPLED ? "coupled" : "rejection",
           one, (long long)batch, (long long)k, (long long)vocab, dense ? "dense" : "no", top_k,
           top_p, per * ROUNDS);
    for (int l = 0; l < n_libs; l++) {
        qsort(times[l], (size_t)(per * ROUNDS), sizeof(double), by_value);
        printf("%-40s p10 %10.1f us   median %10.1f us\n", argv[3 + l],
               times[l][per * ROUNDS / 10], times[l][per * ROUNDS / 2]);
    }
    return 0;
}
