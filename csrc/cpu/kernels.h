/*
 * kernels.h: the row kernels of the CPU backend, one table per SIMD level.
 *
 * kernels_impl.h holds one body written in GCC vector extensions (vec.h); it
 * is compiled once per level (kernels_scalar.c, kernels_avx2.c,
 * kernels_avx512.c) and dispatch.c picks a table at run time. Sums are exact
 * integers and maxima, so every level returns the same bits.
 */
#ifndef SF_CPU_KERNELS_H
#define SF_CPU_KERNELS_H

#include <stdint.h>

#include "specfast.h"

#define SF_BLOCK 256 /* elements per block sum of an inverse-CDF draw */

/* Memory a pass over a row prefetches alongside (data NULL: none), `es`
 * bytes per token of the row: a row the caller reads next, or a draft's q
 * row. The pass then reads memory while it computes. */
typedef struct sf_ahead {
    const void *data;
    int64_t es;
} sf_ahead;

/* Which tokens of a row are kept, and how their weights are formed. A token v
 * with logit l is kept when (l > cut_logit || (l == cut_logit && v <= cut_id))
 * and its e = 2^((l - max) * c) >= min_e, where c = inv_t * log2(e). */
typedef struct sf_row {
    const void *data; /* the row's logits */
    sf_dtype dtype;
    int64_t vocab;
    float max, inv_t, c;
    int64_t max_from; /* the first token whose logit is max is at or after it */
    float cut_logit;
    int32_t cut_id;
    float min_e;
    sf_ahead next; /* what the caller likely reads after this row */
    sf_ahead also; /* the noise pass only: what it may read instead */
    /* The max pass only (read when next is set): once its running max passes
     * next_until, the caller will not read `next`, and the pass stops
     * fetching it. */
    float next_until;
} sf_row;

/* Where a weights pass takes its base values b(v): from the row (b = e when
 * kept, else 0) or, when `base` is not NULL, from base[v] (a stored residual).
 * The weight is w(v) = floor(max(0, b(v) * scale - q(v)) * 2^40) with q = 0
 * when `q` is NULL. */
typedef struct sf_weights_in {
    const float *base;
    float scale;
    const float *q; /* dense draft probabilities of the row, or NULL */
    /* Blocks [first_block, first_block + n_blocks) only; n_blocks 0 is all.
     * blocks[] and resid[] are then indexed from the first one. */
    int64_t first_block, n_blocks;
} sf_weights_in;

typedef struct sf_weights_out {
    uint64_t total;   /* sum of w */
    int64_t kept;     /* tokens with a kept logit (row source under a cut
                         only, else 0) */
    double q_sum;     /* sum of the q values in [0, 1.001], in float lane sums
                         (relative error under 1e-5), when q is read whole;
                         else NaN */
    int q_bad;        /* a q value outside [0, 1.001], or NaN */
} sf_weights_out;

typedef struct sf_kernels {
    const char *name;
    /* Largest logit of row->data (its dtype and vocab); *bad is set when a
     * NaN or +inf is met; *from is where row_argmax may start looking.
     * Prefetches the first half of row->next, or less when the running max
     * passes row->next_until. */
    float (*row_max)(const sf_row *row, int *bad, int64_t *from);
    /* row_max, and in the same read an upper bound of the row's mass seen
     * from the logit `ref` (a draft token's): *sum >= the sum over tokens of
     * 2^((l - ref) c), each exponent capped at 127, to a relative 1e-4. Once
     * the sum passes `stop` it stops (the max goes on) and *sum is +inf, as
     * it is when stop <= 0, ref is -inf or c 2^23 overflows. Prefetches all
     * of row->next at this pass's pace, until the max passes
     * row->next_until or the sum passes stop. */
    float (*row_max_sum)(const sf_row *row, float ref, double stop, double *sum, int *bad,
                         int64_t *from);
    /* First index whose logit equals `max` (the row's largest), looking from
     * `from` (row_max's *from, or 0). */
    int64_t (*row_argmax)(const void *row, sf_dtype dtype, int64_t vocab, float max,
                          int64_t from);
    /* Weights pass over the row: returns the sums; when `blocks` is not NULL
     * stores the sum of each SF_BLOCK tokens; when `resid` is not NULL stores
     * max(0, b * scale - q) per token (it may alias in->base). */
    void (*weights)(const sf_row *row, const sf_weights_in *in,
                    uint64_t *blocks, float *resid, sf_weights_out *out);
    /* An upper bound on the sum of e over the tokens with a logit at or
     * above cut_logit (min_e not applied): at least the exact total weight /
     * 2^40, about 6% above it at most. Returns early, with a partial sum
     * above `stop`, once the sum passes `stop`. Prefetches row->next. */
    double (*mass_bound)(const sf_row *row, double stop);
    /* Gumbel-max over the kept tokens in [lo, hi) (lo a multiple of 128, hi
     * too or the vocab): each whose key (l - max) * inv_t + G(v), G from
     * Philox at (seed, position, NOISE, v / 4), beats (*best, *best_id)
     * (larger key, or the same key and a lower id) replaces it. */
    void (*coupled_race)(const sf_row *row, uint64_t seed, int64_t position, int64_t lo,
                         int64_t hi, float *best, int64_t *best_id);
    /* Writes the ids and logits of tokens with lo <= l < hi (at most `cap`;
     * 0: none, a count only) and returns how many there are. */
    int64_t (*gather)(const sf_row *row, float lo, float hi, int32_t *ids,
                      float *vals, int64_t cap);
    /* The top k tokens by (logit descending, id ascending) among those above
     * `bar`, unordered, into ids/vals (capacity cap >= 2 k); returns how
     * many (fewer than k only when fewer lie above bar). A bar is the
     * caller's guess, where a row holds more than k tokens, that keeps most
     * others out: -inf for none. *bad is set when a NaN is met
     * (a +inf shows as the best candidate), so this pass can be the max pass
     * too; like it, it prefetches row->next until the max passes
     * row->next_until. */
    int64_t (*topk)(const sf_row *row, int64_t k, float bar, int32_t *ids, float *vals,
                    int64_t cap, int *bad);
    /* In place, each of n values r in [0, 1] becomes float(sf_fixed(r) * inv)
     * (the product in double): a weight over its total. */
    void (*scale_weights)(float *r, int64_t n, double inv);
} sf_kernels;

extern const sf_kernels sf_kernels_scalar;
extern const sf_kernels sf_kernels_avx2;
extern const sf_kernels sf_kernels_avx512;

/* The table chosen for this CPU (and SPECFAST_SIMD). */
const sf_kernels *sf_cpu_kernels(void);

#endif /* SF_CPU_KERNELS_H */
