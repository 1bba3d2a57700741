/*
 * dist.h: one row's target distribution, and the residual that recursive
 * rejection sampling carries across the siblings of a node.
 *
 * A distribution is a set of integer weights w(v) (sf_weight_at) with their
 * exact total and per-block sums; p(v) = w(v) / total. Rejecting a sibling
 * with a one-hot or sparse q patches a few weights (overrides); rejecting one
 * with a dense q runs a weights pass that forms max(0, p - q), unless it is
 * the last sibling and a try draws from that residual first.
 */
#ifndef SF_CPU_DIST_H
#define SF_CPU_DIST_H

#include "../common/params.h"
#include "kernels.h"
#include "pool.h"

typedef struct sf_dist {
    sf_row row;
    sf_weights_in in;  /* where w(v) comes from */
    uint64_t total;
    uint64_t known_total; /* the total before the mass is formed, or 0 */
    uint64_t *blocks;  /* per-SF_BLOCK sums of w, in scratch */
    float *resid[2];   /* residual buffers, in scratch */
    int resid_next;    /* which buffer the next dense rejection writes */
    int64_t n_over;    /* overridden weights (one-hot / sparse rejections) */
    int32_t *over_id;
    uint64_t *over_w;
} sf_dist;


/* Row `row` of the logits. */
static inline const void *sf_row_ptr(const sf_logits *l, int64_t row) {
    return (const char *)l->data +
           (size_t)(row * l->row_stride) * (size_t)sf_dtype_size(l->dtype);
}

/* A bound of a row's mass seen from a draft token's logit `ref`, formed by
 * the max pass in the same read: sum >= the sum of 2^((l - ref) c) (see
 * sf_kernels.row_max_sum), or NAN where it was not formed (under top-k or
 * top-p, whose cut needs the max first). */
typedef struct sf_ref_bound {
    float ref;
    double uq;  /* u q(x), the test's left side: the sum stops where it shows a rejection */
    double sum;
} sf_ref_bound;

/* Reads a row's max and finds the cut of its filters (temperature > 0).
 * With need_mass, also forms its weights, total and block sums in `d`; when
 * d->resid[0] is set, the weights are stored there and read from it after.
 * The max pass prefetches the first half of `next` (all of it when it also
 * forms rb's sum), stopping once the max passes next_until (see sf_row) or
 * the sum shows a rejection.
 * With rb (its ref and uq set), the max pass also forms rb->sum where the
 * row has no top-k or top-p cut; elsewhere rb->sum is NAN.
 * Returns SF_ERR_LOGITS or SF_ERR_ALL_MASKED for a bad row. */
sf_status sf_dist_prepare(sf_dist *d, const sf_kernels *k, sf_scratch *s,
                          const void *data, sf_dtype dtype, int64_t vocab,
                          const sf_rowparams *p, int need_mass, sf_ahead next,
                          float next_until, sf_ref_bound *rb);

/* Forms the weights, total and block sums of a prepared row (what
 * sf_dist_prepare's need_mass does), prefetching `ahead`. With
 * keep_e_for_residuals, dense rejections will form residuals from it: each
 * token's e is kept in d->resid[0] for them. */
sf_status sf_dist_mass(sf_dist *d, const sf_kernels *k, sf_scratch *s, sf_ahead ahead,
                       int keep_e_for_residuals);

/* 1 when u q(x) < p(x) holds for sure before (and instead of) forming the
 * row's mass: from its exact total when the top-k candidates gave it, else
 * from a bound (uq * bound < w(x) implies uq < w(x) / total), whose pass
 * prefetches `ahead`. 0 says nothing.
 * The row is prepared, its mass not formed, nothing rejected. */
int sf_dist_bound_accepts(const sf_dist *d, const sf_kernels *k, double uq, int32_t x,
                          sf_ahead ahead);

/* 1 when u q(x) < p(x) holds for sure from a reference bound's sum (the
 * row prepared with x's logit as ref); 0 says nothing. */
int sf_dist_ref_accepts(const sf_dist *d, double uq, int32_t x, double sum);

/* Greedy token of a row (the first largest logit), or an error status. */
sf_status sf_row_greedy(const sf_kernels *k, const void *data, sf_dtype dtype,
                        int64_t vocab, int32_t *token);

/* p(v) of the current distribution. */
double sf_dist_prob(const sf_dist *d, int64_t v);

/* The residual after rejecting a sibling drawn from a sparse q (n ids and
 * probabilities; ids -1 are skipped) or a one-hot q (n = 1, prob 1). */
void sf_dist_reject_sparse(sf_dist *d, const int32_t *ids, const float *probs,
                           int64_t n);

/* The residual after rejecting a sibling drawn from the dense q row; `more`
 * says whether later siblings will need it as a base. Validates q. */
sf_status sf_dist_reject_dense(sf_dist *d, const sf_kernels *k, const float *q,
                               int more, sf_ahead ahead);

/* The residual that rejecting the last sibling, drawn from the dense q row,
 * leaves, drawn by SF_RESID_TRIES tries from d (shared.h's sf_resid_keeps)
 * before it is formed: *token is the token a try kept, or -1 when none did
 * (then sf_dist_reject_dense forms it). Each try checks q at its token. */
sf_status sf_dist_resid_tries(const sf_dist *d, const sf_kernels *k, const float *q,
                              uint64_t seed, int64_t position, int32_t *token);

/* Coupled sampling's token of a prepared row: the Gumbel-max over its kept
 * tokens with noise at (seed, position) (sf_kernels.coupled_race). */
int32_t sf_dist_coupled(const sf_dist *d, const sf_kernels *k, uint64_t seed,
                        int64_t position);

/* p(v) of a prepared row (its mass not formed) into out[0, vocab). */
void sf_dist_probs(const sf_dist *d, const sf_kernels *k, float *out);

/* Inverse-CDF draw of one token with Philox at sf_draw_block(seed, position,
 * residual): residual where d is what rejecting drafts left. */
int32_t sf_dist_draw(const sf_dist *d, const sf_kernels *k, uint64_t seed,
                     int64_t position, int residual);

#endif /* SF_CPU_DIST_H */
