/*
 * leak_check.c: calls every entry point many times, on valid and invalid
 * input, with the pool resized between rounds and rows that grow the scratch
 * buffers, so that LeakSanitizer (ASan's detect_leaks=1, at exit) sees any
 * allocation the library loses. Python cannot host this check: the
 * interpreter itself leaks by LeakSanitizer's standards.
 *
 *   cc -fsanitize=address,undefined -Icsrc/include fuzz/leak_check.c \
 *      -L BUILD -lspecfast -lm && ASAN_OPTIONS=detect_leaks=1 ./a.out [ROUNDS]
 *
 * Exits 1 if a call that must succeed fails (LeakSanitizer's own exit code is
 * 23 on a leak).
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "specfast.h"

static uint64_t state = 12345;
static uint32_t rnd(void) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return (uint32_t)(state >> 33);
}
static float rnd_logit(void) { return (float)(rnd() % 2000) / 100.0f - 10.0f; }

static int failures;
static void expect(sf_status got, sf_status want, const char *what, int line) {
    if (got != want) {
        fprintf(stderr, "leak_check.c:%d: %s returned %d (%s), expected %d\n", line, what,
                (int)got, sf_status_string(got), (int)want);
        failures++;
    }
}
#define EXPECT(call, want) expect((call), (want), #call, __LINE__)

static void round_of_calls(int round) {
    /* vocabularies that grow and shrink the scratch: 7 .. 300000 */
    static const int64_t vocabs[] = {7, 1000, 4097, 65536, 300000, 33};
    const int64_t V = vocabs[round % 6];
    const int B = 3, nd[3] = {4, 0, 6}, N = 10;
    const int64_t rows = N + B;
    float *logits = malloc((size_t)(rows * V) * sizeof *logits);
    float *probs = malloc((size_t)(rows * V) * sizeof *probs);
    float *dense = malloc((size_t)(N * V) * sizeof *dense);
    if (!logits || !probs || !dense) abort();
    for (int64_t i = 0; i < rows * V; i++) logits[i] = rnd_logit();
    for (int64_t i = 0; i < N * V; i++) dense[i] = 1.0f / (float)V;
    int32_t tokens[10], parents[10] = {-1, 0, 0, 1, -1, 0, 1, 1, 2, -1};
    for (int i = 0; i < N; i++) tokens[i] = (int32_t)(rnd() % (uint32_t)V);
    int32_t sid[10 * 3], num_draft[3] = {nd[0], nd[1], nd[2]};
    float sp[10 * 3];
    for (int i = 0; i < N; i++)
        for (int a = 0; a < 3; a++) {
            sid[i * 3 + a] = (int32_t)((tokens[i] + a) % V);
            sp[i * 3 + a] = V >= 3 ? (a == 0 ? 0.5f : 0.25f) : (a == 0 ? 1.0f : 0.0f);
            if (V < 3 && a) sid[i * 3 + a] = -1;
        }

    float temp[3] = {1.0f, 0.5f, 0.0f}, top_p[3] = {1.0f, 0.9f, 0.5f}, min_p = 0.0f;
    int32_t top_k[3] = {0, 50, (int32_t)(V - 1)};
    uint64_t seed = (uint64_t)round;
    int64_t pos[3] = {0, 7, 1 << 20};
    sf_params p = {temp, 3, top_k, 3, top_p, 3, &min_p, 1, &seed, 1, pos, 3};
    sf_logits l = {logits, SF_F32, rows, V, V};
    sf_error err;

    int32_t out_tok[3 * 7], out_acc[3], out_nodes[3 * 6];
    sf_verify_out out = {out_tok, out_acc, out_nodes, 6};
    for (int kind = 0; kind < 3; kind++)
        for (int m = 0; m < 2; m++)
            for (int tree = 0; tree < 2; tree++) {
                sf_draft d = {tokens, N, num_draft, B, tree ? parents : NULL,
                              (sf_draft_kind)kind, kind == 1 ? dense : NULL,
                              kind == 2 ? sid : NULL, kind == 2 ? sp : NULL,
                              kind == 2 ? 3 : 0};
                EXPECT(sf_verify(&l, &d, &p, (sf_method)m, &out, &err), SF_OK);
            }

    /* rows for sample and probs: the same logits, one parameter set per row */
    float t13 = 0.8f, tp13 = 0.95f;
    int32_t k13 = 0;
    sf_params p1 = {&t13, 1, &k13, 1, &tp13, 1, &min_p, 1, &seed, 1, pos, 1};
    int32_t *samp = malloc((size_t)rows * sizeof *samp);
    if (!samp) abort();
    EXPECT(sf_sample(&l, &p1, SF_REJECTION, samp, &err), SF_OK);
    EXPECT(sf_sample(&l, &p1, SF_COUPLED, samp, &err), SF_OK);
    EXPECT(sf_probs(&l, &p1, probs, &err), SF_OK);

    /* errors, after the scratch is allocated and before */
    logits[V + 1] = NAN;
    EXPECT(sf_probs(&l, &p1, probs, &err), SF_ERR_LOGITS);
    logits[V + 1] = 0.0f;
    float bad_t = -1.0f;
    sf_params pb = p1;
    pb.temperature = &bad_t;
    EXPECT(sf_sample(&l, &pb, SF_REJECTION, samp, &err), SF_ERR_PARAM);
    int32_t bad_parents[10];
    memcpy(bad_parents, parents, sizeof parents);
    bad_parents[3] = 7;
    sf_draft dbad = {tokens, N, num_draft, B, bad_parents, SF_DRAFT_NONE, NULL, NULL, NULL, 0};
    EXPECT(sf_verify(&l, &dbad, &p, SF_REJECTION, &out, &err), SF_ERR_PARENT);
    dense[5] = -1.0f;
    sf_draft dq = {tokens, N, num_draft, B, parents, SF_DRAFT_DENSE, dense, NULL, NULL, 0};
    sf_status st = sf_verify(&l, &dq, &p, SF_REJECTION, &out, &err);
    if (st != SF_OK && st != SF_ERR_DRAFT_PROBS) EXPECT(st, SF_ERR_DRAFT_PROBS);
    for (int64_t v = 0; v < V; v++) logits[v] = -INFINITY;
    EXPECT(sf_sample(&l, &p1, SF_REJECTION, samp, &err), SF_ERR_ALL_MASKED);

    /* tree masks and KV compaction */
    uint8_t mask[3 * 7 * 7];
    uint32_t bits[3 * 7 * 1];
    int32_t positions[3 * 7];
    EXPECT(sf_tree_mask(parents, num_draft, B, 6, mask, bits, positions, &err), SF_OK);
    EXPECT(sf_tree_mask(bad_parents, num_draft, B, 6, mask, bits, positions, &err),
           SF_ERR_PARENT);
    float kv[2 * 3 * 16 * 4];
    for (int i = 0; i < (int)(sizeof kv / sizeof kv[0]); i++) kv[i] = (float)i;
    sf_kv_cache cache = {kv, 2, 3 * 16 * 16, 3, 16 * 16, 1, 0, 16, 16, 16};
    int32_t acc_nodes[3 * 6] = {0, 1, 3, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                0, 2, -1, -1, -1, -1};
    int32_t nacc[3] = {3, 0, 2};
    int64_t root[3] = {2, 0, 5};
    EXPECT(sf_kv_compact(&cache, acc_nodes, nacc, 6, root, &err), SF_OK);

    free(samp);
    free(logits);
    free(probs);
    free(dense);
}

int main(int argc, char **argv) {
    int rounds = argc > 1 ? atoi(argv[1]) : 60;
    for (int r = 0; r < rounds; r++) {
        if (r % 5 == 0) EXPECT(sf_set_num_threads(1 + r % 4), SF_OK);
        round_of_calls(r);
    }
    EXPECT(sf_set_num_threads(0), SF_OK);
    round_of_calls(rounds);
    printf("leak_check: %d rounds, %d unexpected statuses, SIMD %s, %d threads\n", rounds + 1,
           failures, sf_simd_level(), sf_get_num_threads());
    return failures ? 1 : 0;
}
