/* sample.c: sf_sample and sf_probs on the CPU, one row per task. */
#include "../common/params.h"
#include "dist.h"

typedef struct row_ctx {
    const sf_logits *logits;
    const sf_params *params;
    sf_method method;
    int32_t *tokens; /* sf_sample */
    float *probs;    /* sf_probs */
    const sf_kernels *k;
} row_ctx;

static sf_status sample_one(void *arg, int64_t b, sf_scratch *s) {
    const row_ctx *c = arg;
    const void *row = sf_row_ptr(c->logits, b);
    sf_rowparams p;
    if (sf_params_load(c->params, b, &p) != SF_OK) return SF_ERR_PARAM;
    if (p.temperature == 0.0f)
        return sf_row_greedy(c->k, row, c->logits->dtype, c->logits->vocab, &c->tokens[b]);
    sf_dist d = {.n_over = 0};
    sf_status st = sf_dist_prepare(&d, c->k, s, row, c->logits->dtype,
                                   c->logits->vocab, &p, c->method == SF_REJECTION,
                                   (sf_ahead){NULL, 0}, INFINITY, NULL);
    if (st != SF_OK) return st;
    c->tokens[b] = c->method == SF_COUPLED
                       ? sf_dist_coupled(&d, c->k, p.seed, p.position)
                       : sf_dist_draw(&d, c->k, p.seed, p.position, 0);
    return SF_OK;
}

static sf_status probs_one(void *arg, int64_t b, sf_scratch *s) {
    const row_ctx *c = arg;
    const int64_t vocab = c->logits->vocab;
    const void *row = sf_row_ptr(c->logits, b);
    float *out = c->probs + b * vocab;
    sf_rowparams p;
    if (sf_params_load(c->params, b, &p) != SF_OK) return SF_ERR_PARAM;
    if (p.temperature == 0.0f) {
        int32_t t;
        sf_status st = sf_row_greedy(c->k, row, c->logits->dtype, vocab, &t);
        if (st != SF_OK) return st;
        for (int64_t v = 0; v < vocab; v++) out[v] = 0.0f;
        out[t] = 1.0f;
        return SF_OK;
    }
    sf_dist d = {.n_over = 0};
    sf_status st = sf_dist_prepare(&d, c->k, s, row, c->logits->dtype, vocab, &p, 0,
                                   (sf_ahead){NULL, 0}, INFINITY, NULL);
    if (st == SF_OK) sf_dist_probs(&d, c->k, out);
    return st;
}

static sf_status run_rows(const sf_logits *logits, const sf_params *params,
                          row_ctx *c, sf_task_fn fn, sf_error *err) {
    int64_t index = -1;
    sf_status st = sf_logits_check(logits);
    if (st == SF_OK) st = sf_params_check(params, logits->rows, &index);
    if (st == SF_OK) {
        c->k = sf_cpu_kernels();
        st = sf_parallel_for(logits->rows, fn, c, &index);
    }
    if (err) err->index = index;
    return st;
}

SF_API sf_status sf_sample(const sf_logits *logits, const sf_params *params,
                           sf_method method, int32_t *tokens, sf_error *err) {
    if (!tokens || SF_MISALIGNED(tokens) || (method != SF_REJECTION && method != SF_COUPLED)) {
        if (err) err->index = -1;
        return SF_ERR_ARGUMENT;
    }
    row_ctx c = {logits, params, method, tokens, NULL, NULL};
    return run_rows(logits, params, &c, sample_one, err);
}

SF_API sf_status sf_probs(const sf_logits *logits, const sf_params *params,
                          float *out, sf_error *err) {
    if (!out || SF_MISALIGNED(out)) {
        if (err) err->index = -1;
        return SF_ERR_ARGUMENT;
    }
    row_ctx c = {logits, params, SF_REJECTION, NULL, out, NULL};
    return run_rows(logits, params, &c, probs_one, err);
}
