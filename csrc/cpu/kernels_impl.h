/*
 * kernels_impl.h: the body of the CPU row kernels, included once per SIMD
 * level with SF_TABLE naming the table to define. Work runs over chunks of
 * SF_W tokens (the level's vector width, vec.h) with exact integer masses,
 * so every level returns the same bits.
 */
#include <math.h>

#include "rowmath.h"
#include "vec.h"

/* Tokens a pass reads between its checks (the bound's partial sums, the max
 * pass's prefetch switch). */
#define SF_BOUND_BLOCK 4096

/* Prefetches what tokens [i, i + n) of a row correspond to in stream a. */
static inline __attribute__((always_inline)) void fetch_ahead(sf_ahead a, int64_t i, int64_t n) {
    if (a.data)
        for (int64_t b = 0; b < n * a.es; b += 64)
            __builtin_prefetch((const char *)a.data + i * a.es + b, 0, 3);
}

/* Tokens [i, i + 16) of a row as float; past the end, -inf. */
static inline __attribute__((always_inline)) vf load_chunk(const void *row, sf_dtype dtype, int64_t i, int64_t n) {
    if (i + SF_W <= n) {
        if (dtype == SF_F32) return vload((const float *)row + i);
        if (dtype == SF_BF16) return vbf16((const uint16_t *)row + i);
        return vf16((const uint16_t *)row + i);
    }
    vf x;
    for (int j = 0; j < SF_W; j++)
        x[j] = i + j < n ? sf_load(row, dtype, i + j) : -INFINITY;
    return x;
}

/* 16 floats from p + i, zeros past n. */
static inline __attribute__((always_inline)) vf load_floats(const float *p, int64_t i, int64_t n) {
    if (i + SF_W <= n) return vload(p + i);
    vf x;
    for (int j = 0; j < SF_W; j++) x[j] = i + j < n ? p[i + j] : 0.0f;
    return x;
}

/* Tokens [i, i + SF_W) of a row that holds them all, dtype known. */
static inline __attribute__((always_inline)) vf load_full(const void *row, sf_dtype dtype, int64_t i) {
    if (dtype == SF_F32) return vload((const float *)row + i);
    if (dtype == SF_BF16) return vbf16((const uint16_t *)row + i);
    return vf16((const uint16_t *)row + i);
}

/* A term of row_max_sum: vexp2_up((l - ref) c), the exponent (times 2^23,
 * c23 = c 2^23) capped at 127 2^23. */
static inline __attribute__((always_inline)) vf ref_term(vf x, float ref, float c23) {
    return vexp2_up_scaled(vminf(vf_set(127.0f * 8388608.0f), (x - ref) * c23));
}

/* The max pass over whole groups of 4 chunks in [*at, end), dtype known at
 * compile time: four chains of maxima, so that the max latency overlaps.
 * With `with_sum` (a constant at each call site) it also adds ref_term of
 * each token into *sum, and prefetches pf at its own pace; without, at half. */
static inline __attribute__((always_inline)) void
max_span(const sf_row *r, sf_dtype dtype, int64_t *at, int64_t end, sf_ahead pf,
         const int with_sum, float ref, float c23, vf m[4], vi *nan, vf *sum) {
    vf m0 = m[0], m1 = m[1], m2 = m[2], m3 = m[3];
    vf s0 = vf_set(0.0f), s1 = s0;
    vi bad = *nan;
    int64_t i = *at;
    for (; i + 4 * SF_W <= end; i += 4 * SF_W) {
        if (with_sum) fetch_ahead(pf, i, 4 * SF_W);
        else fetch_ahead(pf, i / 2, 2 * SF_W);
        vf x0, x1, x2, x3;
        if (dtype == SF_BF16) { /* the order of tokens does not matter here */
            vbf16_halves((const uint16_t *)r->data + i, &x0, &x1);
            vbf16_halves((const uint16_t *)r->data + i + 2 * SF_W, &x2, &x3);
        } else {
            x0 = load_full(r->data, dtype, i);
            x1 = load_full(r->data, dtype, i + SF_W);
            x2 = load_full(r->data, dtype, i + 2 * SF_W);
            x3 = load_full(r->data, dtype, i + 3 * SF_W);
        }
        m0 = vmaxf(x0, m0);
        m1 = vmaxf(x1, m1);
        m2 = vmaxf(x2, m2);
        m3 = vmaxf(x3, m3);
        bad |= (x0 != x0) | (x1 != x1) | (x2 != x2) | (x3 != x3);
        if (with_sum) {
            s0 += ref_term(x0, ref, c23);
            s1 += ref_term(x1, ref, c23);
            s0 += ref_term(x2, ref, c23);
            s1 += ref_term(x3, ref, c23);
        }
    }
    m[0] = m0; m[1] = m1; m[2] = m2; m[3] = m3;
    *nan = bad;
    if (with_sum) *sum = s0 + s1;
    *at = i;
}

/* max_span on the row's dtype, each dtype's loop compiled apart. */
static inline __attribute__((always_inline)) void
max_span_any(const sf_row *r, int64_t *at, int64_t end, sf_ahead pf, const int with_sum,
             float ref, float c23, vf m[4], vi *nan, vf *sum) {
    if (r->dtype == SF_F32) max_span(r, SF_F32, at, end, pf, with_sum, ref, c23, m, nan, sum);
    else if (r->dtype == SF_BF16) max_span(r, SF_BF16, at, end, pf, with_sum, ref, c23, m, nan, sum);
    else max_span(r, SF_F16, at, end, pf, with_sum, ref, c23, m, nan, sum);
}

/* The max pass; with `sum` not NULL, also the bound seen from the
 * reference logit `ref` (see sf_kernels.row_max_sum), all of r->next
 * prefetched at this pass's pace; without, half of it at half the pace (a
 * bound pass fetches the rest). Prefetching stops once the max passes
 * r->next_until (checked once a block). A NaN never wins a compare, so it
 * is flagged apart; +inf shows as the max. *from is the start of the block
 * where the running max last rose: the max's first token is in it. */
static inline __attribute__((always_inline)) float
max_pass(const sf_row *r, float ref, double stop, double *sum, int *bad, int64_t *from) {
    const int64_t n = r->vocab;
    /* No sum (it is then +inf) when c 2^23 overflows (a cap would shrink the
     * terms of tokens above ref) or ref is -inf (l - ref would be NaN). */
    const float c23 = r->c * 8388608.0f;
    vf m[4] = {vf_set(-INFINITY), vf_set(-INFINITY), vf_set(-INFINITY), vf_set(-INFINITY)};
    vi nan = vi_set(0);
    sf_ahead pf = r->next;
    double total = 0.0;
    int summing = sum && stop > 0.0 && r->c <= SF_C23_MAX && ref > -INFINITY;
    int64_t i = 0;
    float risen = -INFINITY; /* the running max, as of the block it rose in */
    *from = 0;
    while (i + 4 * SF_W <= n) {
        const int64_t start = i;
        const int64_t end = i + SF_BOUND_BLOCK < n ? i + SF_BOUND_BLOCK : n;
        if (summing) {
            vf acc;
            max_span_any(r, &i, end, pf, 1, ref, c23, m, &nan, &acc);
            for (int j = 0; j < SF_W; j++) total += (double)acc[j];
            summing = total <= stop;
            if (!summing) pf.data = NULL; /* a rejection: the child's row is not read */
        } else {
            /* Half of next at half pace, or (where a sum was wanted but not
             * formed) all of it a block at a time. */
            sf_ahead half = pf;
            if (sum) {
                fetch_ahead(pf, i, end - i);
                half.data = NULL;
            }
            max_span_any(r, &i, end, half, 0, 0.0f, 0.0f, m, &nan, NULL);
        }
        const float now = vhmax(vmaxf(vmaxf(m[0], m[1]), vmaxf(m[2], m[3])));
        if (now > risen) {
            risen = now;
            *from = start;
        }
        if (pf.data && vany((m[0] > r->next_until) | (m[1] > r->next_until) |
                            (m[2] > r->next_until) | (m[3] > r->next_until)))
            pf.data = NULL;
        if (i < end) break; /* the tail of the row, under 4 chunks */
    }
    const int64_t tail = i;
    for (; i < n; i += SF_W) {
        vf x = load_chunk(r->data, r->dtype, i, n);
        m[0] = vmaxf(x, m[0]);
        nan |= x != x;
        if (summing) { /* -inf padding adds 2^-126 a lane: still a bound */
            vf e = ref_term(x, ref, c23);
            for (int j = 0; j < SF_W; j++) total += (double)e[j];
        }
    }
    const float mx = vhmax(vmaxf(vmaxf(m[0], m[1]), vmaxf(m[2], m[3])));
    if (mx > risen) *from = tail;
    *bad = vany(nan) || mx == INFINITY;
    /* A sum cut short (or never formed) bounds nothing: it says so. */
    if (sum) *sum = summing ? total : INFINITY;
    return mx;
}

static float row_max(const sf_row *r, int *bad, int64_t *from) {
    return max_pass(r, 0.0f, -1.0, NULL, bad, from);
}

static float row_max_sum(const sf_row *r, float ref, double stop, double *sum, int *bad,
                         int64_t *from) {
    return max_pass(r, ref, stop, sum, bad, from);
}

static int64_t row_argmax(const void *row, sf_dtype dtype, int64_t n, float max,
                          int64_t from) {
    for (int64_t i = from; i < n; i += SF_W) {
        vf x = load_chunk(row, dtype, i, n);
        if (vany(x == max))
            for (int j = 0; j < SF_W; j++)
                if (x[j] == max) return i + j;
    }
    return -1;
}

/* Lanes at or above the cut (never -inf). */
static inline __attribute__((always_inline)) vi above_cut(const sf_row *r, vf x, int64_t i) {
    vi ids = vi_iota((int32_t)i);
    return ((x > r->cut_logit) | ((x == r->cut_logit) & (ids <= r->cut_id))) &
           (x > -INFINITY);
}

static inline __attribute__((always_inline)) vf scaled(const sf_row *r, vf x) { return (x - r->max) * r->inv_t; }
static inline __attribute__((always_inline)) vf row_e(const sf_row *r, vf x) { return vexp2((x - r->max) * r->c); }

/* What a weights pass carries across the chunks of a block. */
typedef struct weights_acc {
    vmass mass;
    vf qsum;
    vi kept, qbad;
} weights_acc;

/* One chunk of a weights pass at token i; `full` (a constant) says that all
 * SF_W tokens are in the row. */
static inline __attribute__((always_inline)) void
weights_chunk(const sf_row *r, const sf_weights_in *in, float *resid, int64_t i, int64_t n,
              weights_acc *a, const int cut, const int from_row, const int with_q,
              const int store, const int full) {
    vf b;
    /* Which q values are checked: all of them, or under a cut those of
     * tokens with a weight only (so the vector width cannot matter). */
    vi checked = vi_set(-1);
    if (from_row) {
        vf x = full ? load_full(r->data, r->dtype, i) : load_chunk(r->data, r->dtype, i, n);
        if (cut) {
            vi keep = above_cut(r, x, i);
            a->kept -= keep;
            if (!vany(keep)) {
                /* Nothing kept: weight 0 whatever q is, and q here is never
                 * read (nor checked). */
                b = vf_set(0.0f);
                goto out;
            }
            vf e = row_e(r, x);
            b = vsel(keep & (e >= r->min_e), e, vf_set(0.0f));
            checked = b != 0.0f; /* as from stored weights, and on CUDA */
        } else {
            b = row_e(r, x); /* -inf (and padding) give 0 */
        }
    } else {
        b = full ? vload(in->base + i) : load_floats(in->base, i, n);
        /* A filtered row's stored weights: where all are 0 the residual is 0
         * whatever q is, so q is not read here. */
        if (cut && !vany(b != 0.0f)) goto out;
        if (cut) checked = b != 0.0f;
    }
    if (with_q) {
        vf q = full ? vload(in->q + i) : load_floats(in->q, i, n);
        vi ok = (q >= 0.0f) & (q <= 1.001f); /* shared.h's sf_prob_ok */
        a->qbad |= ~ok & checked;
        /* Under a cut, q of a token that is not kept is not checked: only
         * b > 0 then keeps a negative q from making a residual. */
        if (cut) {
            b = vresid(b, in->scale, q);
        } else {
            a->qsum += vsel(ok, q, vf_set(0.0f));
            b = vresid_checked(b, in->scale, q);
        }
    }
    vmass_add(&a->mass, b); /* without q the scale is 1 and b >= 0 */
out:
    if (store) {
        if (full || i + SF_W <= n) vstore(resid + i, b);
        else for (int j = 0; i + j < n; j++) resid[i + j] = b[j];
    }
}

/* One weights pass, specialised by inlining on what the call needs: `cut`
 * (filters or min-p apply), `from_row` (base values from the logits, else from
 * in->base), `with_q` (a dense q to subtract) and `store` (resid output). */
static inline __attribute__((always_inline)) void
weights_body(const sf_row *r, const sf_weights_in *in, uint64_t *blocks,
             float *resid, sf_weights_out *out, const int cut, const int from_row,
             const int with_q, const int store) {
    const int64_t n = r->vocab;
    const int64_t first = in->first_block;
    int64_t stop = (n + SF_BLOCK - 1) / SF_BLOCK;
    if (in->n_blocks > 0 && first + in->n_blocks < stop) stop = first + in->n_blocks;
    if (store) resid -= first * SF_BLOCK;
    uint64_t total = 0;
    double q_sum = 0.0;
    weights_acc a = {.kept = vi_set(0), .qbad = vi_set(0)};
    for (int64_t blk = first; blk < stop; blk++) {
        a.mass = vmass_zero();
        a.qsum = vf_set(0.0f);
        const int64_t i0 = blk * SF_BLOCK;
        fetch_ahead(r->next, i0, SF_BLOCK);
        if (i0 + SF_BLOCK <= n) {
            for (int64_t i = i0; i < i0 + SF_BLOCK; i += SF_W)
                weights_chunk(r, in, resid, i, n, &a, cut, from_row, with_q, store, 1);
        } else {
            for (int64_t i = i0; i < n; i += SF_W)
                weights_chunk(r, in, resid, i, n, &a, cut, from_row, with_q, store, 0);
        }
        uint64_t bs = vmass_total(a.mass);
        if (blocks) blocks[blk - first] = bs;
        total += bs;
        if (with_q && !cut)
            for (int j = 0; j < SF_W; j++) q_sum += (double)a.qsum[j];
    }
    int64_t k = 0;
    for (int j = 0; j < SF_W; j++) k += a.kept[j];
    out->total = total;
    out->kept = from_row && cut ? k : 0;
    /* Under a cut only the chunks with kept tokens read q: no full sum. */
    out->q_sum = with_q && !cut ? q_sum : NAN;
    out->q_bad = vany(a.qbad);
}

#define SF_WEIGHTS_CASE(c, f, q, s) \
    case (c) | (f) << 1 | (q) << 2 | (s) << 3: \
        weights_body(r, in, blocks, resid, out, c, f, q, s); \
        return;

static void weights(const sf_row *r, const sf_weights_in *in, uint64_t *blocks,
                    float *resid, sf_weights_out *out) {
    const int cut = r->cut_logit > -INFINITY || r->min_e > 0.0f;
    switch (cut | !in->base << 1 | (in->q != NULL) << 2 | (resid != NULL) << 3) {
    SF_WEIGHTS_CASE(0, 0, 0, 0) SF_WEIGHTS_CASE(1, 0, 0, 0)
    SF_WEIGHTS_CASE(0, 1, 0, 0) SF_WEIGHTS_CASE(1, 1, 0, 0)
    SF_WEIGHTS_CASE(0, 0, 1, 0) SF_WEIGHTS_CASE(1, 0, 1, 0)
    SF_WEIGHTS_CASE(0, 1, 1, 0) SF_WEIGHTS_CASE(1, 1, 1, 0)
    SF_WEIGHTS_CASE(0, 0, 0, 1) SF_WEIGHTS_CASE(1, 0, 0, 1)
    SF_WEIGHTS_CASE(0, 1, 0, 1) SF_WEIGHTS_CASE(1, 1, 0, 1)
    SF_WEIGHTS_CASE(0, 0, 1, 1) SF_WEIGHTS_CASE(1, 0, 1, 1)
    SF_WEIGHTS_CASE(0, 1, 1, 1) SF_WEIGHTS_CASE(1, 1, 1, 1)
    }
}

/* mass_bound, an upper bound of the row's mass: vexp2_up instead of the
 * exact exp2 and fixed-point sums, a few operations a token. Each lane adds at
 * most SF_BOUND_BLOCK / SF_W / 2 + 1 floats (a relative error under 4e-5 at
 * every width; callers allow 1e-3), blocks are summed in double. */
static inline __attribute__((always_inline)) vf bound_e(const sf_row *r, vf x, float c23, int cut) {
    vf e = vexp2_up_scaled((x - r->max) * c23);
    /* Ties at the cut all count (the bound then needs no token ids, so a
     * part of a row can be bounded on its own). */
    return cut ? vsel(x >= r->cut_logit, e, vf_set(0.0f)) : e;
}

/* One block of mass_bound with dtype and cut known at compile time (each
 * call site is specialised), so the loop carries no tests but its own. */
static inline __attribute__((always_inline)) vf bound_block(const sf_row *r, sf_dtype dtype,
                                                            int cut, int64_t i, int64_t end) {
    /* c 2^23, the factor of vexp2_up_scaled, capped so that (max - max) *
     * c23 stays 0 (a capped factor only raises the bound). */
    const float c23 = r->c <= SF_C23_MAX ? r->c * 8388608.0f : 3.40282347e38f;
    /* Two sums, so that the add latency overlaps; whole chunks first. */
    vf acc0 = vf_set(0.0f), acc1 = acc0;
    for (; i + 2 * SF_W <= end; i += 2 * SF_W) {
        vf x0, x1;
        if (dtype == SF_BF16) { /* the order of tokens does not matter here */
            vbf16_halves((const uint16_t *)r->data + i, &x0, &x1);
        } else {
            x0 = load_full(r->data, dtype, i);
            x1 = load_full(r->data, dtype, i + SF_W);
        }
        acc0 += bound_e(r, x0, c23, cut);
        acc1 += bound_e(r, x1, c23, cut);
    }
    for (; i < end; i += SF_W) acc0 += bound_e(r, load_chunk(r->data, dtype, i, r->vocab), c23, cut);
    return acc0 + acc1;
}

static double mass_bound(const sf_row *r, double stop) {
    const int64_t n = r->vocab;
    const int cut = r->cut_logit > -INFINITY;
    double total = 0.0;
    for (int64_t b0 = 0; b0 < n; b0 += SF_BOUND_BLOCK) {
        const int64_t end = b0 + SF_BOUND_BLOCK < n ? b0 + SF_BOUND_BLOCK : n;
        fetch_ahead(r->next, b0, end - b0);
        vf acc;
        if (r->dtype == SF_F32)
            acc = cut ? bound_block(r, SF_F32, 1, b0, end) : bound_block(r, SF_F32, 0, b0, end);
        else if (r->dtype == SF_BF16)
            acc = cut ? bound_block(r, SF_BF16, 1, b0, end) : bound_block(r, SF_BF16, 0, b0, end);
        else
            acc = cut ? bound_block(r, SF_F16, 1, b0, end) : bound_block(r, SF_F16, 0, b0, end);
        for (int j = 0; j < SF_W; j++) total += (double)acc[j];
        if (total > stop) break;
    }
    return total;
}

/* No Philox word gives Gumbel noise above this (sf_gumbel of word 0). */
#define SF_GUMBEL_MAX 23.0f

/* One 64-token group of coupled_race: its scaled logits and kept lanes. */
typedef struct noise_group {
    vf s[64 / SF_W];
    vi keep[64 / SF_W];
    int live; /* some token may beat the best key */
} noise_group;

static inline __attribute__((always_inline)) void
noise_group_load(const sf_row *r, int filtered, int64_t i0, float best, noise_group *g) {
    const int64_t n = r->vocab;
    vf smax = vf_set(-INFINITY);
    for (int c = 0; c < 64 / SF_W; c++) {
        const int64_t i = i0 + c * SF_W;
        vf x = i < n ? load_chunk(r->data, r->dtype, i, n) : vf_set(-INFINITY);
        if (filtered) {
            g->keep[c] = above_cut(r, x, i);
            if (r->min_e > 0.0f) g->keep[c] &= row_e(r, x) >= r->min_e;
        } else {
            g->keep[c] = x > -INFINITY;
        }
        g->s[c] = vsel(g->keep[c], scaled(r, x), vf_set(-INFINITY));
        smax = vsel(g->s[c] > smax, g->s[c], smax);
    }
    /* A token's key is s + G with G <= SF_GUMBEL_MAX (lane by lane, the
     * same test as on the largest s: rounding is monotone). */
    g->live = vany(best - smax <= SF_GUMBEL_MAX);
}

/* The group's candidates given its noise words w (see sf_noise_word), each
 * tested exactly against the best key. */
static inline __attribute__((always_inline)) void
noise_group_best(const noise_group *g, int64_t i0, vu w[16 / SF_W][4], float *best,
                 int64_t *best_id) {
    enum { PER = 64 / SF_W };
    /* Chunk c holds tokens i0 + c SF_W ..: word (c SF_W) / 16 of the call
     * covering lanes (c SF_W) % 16 onwards. Per token: noise above g = best -
     * s needs E < exp(-g), so U = w / 2^32 < 1 - exp(-exp(-g)) < exp(-g): a
     * word below 2^32 exp(-g). The test is on logs, with the limit doubled
     * against rounding: h = w / 2 is a candidate if log2(h) < 32 - g log2(e).
     * The bits of float(h), read as an integer and scaled by 2^-23, are
     * log2(h) + 127 or a little less (the mantissa as a chord of log2), so
     * no candidate is lost; the few more are each tested exactly. */
    const float a = (159.0f - *best * SF_LOG2E) * 8388608.0f, b = SF_LOG2E * 8388608.0f;
    vi cand[PER], any = vi_set(0);
    for (int c = 0; c < PER; c++) {
        const vu word = w[(c * SF_W % 16) / SF_W][c * SF_W / 16];
        const vi bits = (vi)__builtin_convertvector((vi)(word >> 1), vf);
        cand[c] = g->keep[c] & (__builtin_convertvector(bits, vf) < g->s[c] * b + a);
        any |= cand[c];
    }
    if (!vany(any)) return;
    for (int c = 0; c < PER; c++) {
        const vu word = w[(c * SF_W % 16) / SF_W][c * SF_W / 16];
        if (!vany(cand[c])) continue;
        for (int j = 0; j < SF_W; j++) {
            if (!cand[c][j]) continue;
            const int64_t id = i0 + c * SF_W + j;
            float key = SF_FADD(g->s[c][j], sf_gumbel(word[j]));
            if (key > *best || (key == *best && id < *best_id)) {
                *best = key;
                *best_id = id;
            }
        }
    }
}

static void coupled_race(const sf_row *r, uint64_t seed, int64_t position, int64_t lo,
                         int64_t hi, float *best, int64_t *best_id) {
    /* 128 tokens at a time, two groups of 64: each group's 16 Philox blocks
     * give its noise words, SF_W blocks per vector call, and the two groups'
     * calls run side by side (one call's rounds are a chain of dependent
     * multiplies). */
    enum { CALLS = 16 / SF_W };
    const vphilox_key key = vphilox_init(seed, position, SF_PURPOSE_NOISE);
    /* Rows without filters (most) skip the cut's tests, in a copy of the load. */
    const int filtered = r->cut_logit > -INFINITY || r->min_e > 0.0f;
    for (int64_t i0 = lo; i0 < hi && *best <= SF_GUMBEL_MAX; i0 += 128) {
        fetch_ahead(r->next, i0, 128);
        fetch_ahead(r->also, i0, 128);
        noise_group ga, gb;
        gb.live = 0;
        if (filtered) {
            noise_group_load(r, 1, i0, *best, &ga);
            if (i0 + 64 < hi) noise_group_load(r, 1, i0 + 64, *best, &gb);
        } else {
            noise_group_load(r, 0, i0, *best, &ga);
            if (i0 + 64 < hi) noise_group_load(r, 0, i0 + 64, *best, &gb);
        }
        if (!ga.live && !gb.live) continue;
        vu wa[CALLS][4], wb[CALLS][4];
        for (int h = 0; h < CALLS; h++)
            vphilox2(&key, (vu)vi_iota((int32_t)((i0 >> 6) * 16 + h * SF_W)),
                     (vu)vi_iota((int32_t)((i0 >> 6) * 16 + 16 + h * SF_W)), wa[h], wb[h]);
        if (ga.live) noise_group_best(&ga, i0, wa, best, best_id);
        if (gb.live) noise_group_best(&gb, i0 + 64, wb, best, best_id);
    }
}

static int64_t gather(const sf_row *r, float lo, float hi, int32_t *ids,
                      float *vals, int64_t cap) {
    const int64_t n = r->vocab;
    if (!cap) { /* a count only, in the lanes */
        vi count = vi_set(0);
        for (int64_t i = 0; i < n; i += SF_W) {
            vf x = load_chunk(r->data, r->dtype, i, n);
            count -= (x >= lo) & (x < hi);
        }
        int64_t total = 0;
        for (int j = 0; j < SF_W; j++) total += (uint32_t)count[j];
        return total;
    }
    int64_t count = 0, i = 0;
    /* Four vectors a test while their hits surely fit: a branch per vector
     * mispredicts wherever hits are neither rare nor common. */
    for (; i + 4 * SF_W <= n && count + 4 * SF_W <= cap; i += 4 * SF_W) {
        vf x[4];
        vi hit[4], any = vi_set(0);
        for (int c = 0; c < 4; c++) {
            x[c] = load_full(r->data, r->dtype, i + c * SF_W);
            hit[c] = (x[c] >= lo) & (x[c] < hi);
            any |= hit[c];
        }
        if (!vany(any)) continue;
        for (int c = 0; c < 4; c++)
            count += vcompress(hit[c], x[c], vi_iota((int32_t)(i + c * SF_W)), vals + count,
                               ids + count);
    }
    for (; i < n; i += SF_W) {
        vf x = load_chunk(r->data, r->dtype, i, n);
        vi hit = (x >= lo) & (x < hi);
        if (!vany(hit)) continue;
        if (count + SF_W <= cap) { /* room for vcompress's whole vectors */
            count += vcompress(hit, x, vi_iota((int32_t)i), vals + count, ids + count);
            continue;
        }
        for (int j = 0; j < SF_W; j++) {
            if (!hit[j]) continue;
            if (count < cap) { ids[count] = (int32_t)(i + j); vals[count] = x[j]; }
            count++;
        }
    }
    return count;
}

/* (a, ia) ranks before (b, ib) in (value descending, id ascending). */
static inline int ranks_before(float a, int32_t ia, float b, int32_t ib) {
    return (a > b) | ((a == b) & (ia < ib)); /* no branch: the outcome is a coin toss */
}

static inline void swap_entries(int32_t *ids, float *vals, int64_t a, int64_t b) {
    int32_t ti = ids[a]; ids[a] = ids[b]; ids[b] = ti;
    float tv = vals[a]; vals[a] = vals[b]; vals[b] = tv;
}

/* Moves the k best entries to [0, k) (unordered), the k-th best to k - 1. */
static void select_best(int32_t *ids, float *vals, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1;
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        /* Median of three to position hi, then a Lomuto partition. */
        if (ranks_before(vals[mid], ids[mid], vals[lo], ids[lo])) swap_entries(ids, vals, mid, lo);
        if (ranks_before(vals[hi], ids[hi], vals[lo], ids[lo])) swap_entries(ids, vals, hi, lo);
        if (ranks_before(vals[hi], ids[hi], vals[mid], ids[mid])) swap_entries(ids, vals, hi, mid);
        swap_entries(ids, vals, mid, hi);
        float pv = vals[hi];
        int32_t pi = ids[hi];
        /* Lomuto without a branch: every entry is swapped with the first one
         * not before the pivot, which only moves when the entry is before it
         * (otherwise both lie in the "not before" run). */
        int64_t store = lo;
        for (int64_t i = lo; i < hi; i++) {
            const int before = ranks_before(vals[i], ids[i], pv, pi);
            swap_entries(ids, vals, i, store);
            store += before;
        }
        swap_entries(ids, vals, store, hi);
        if (store == k - 1) return;
        if (store < k - 1) lo = store + 1; else hi = store - 1;
    }
}

static int64_t topk(const sf_row *r, int64_t k, float bar, int32_t *ids, float *vals,
                    int64_t cap, int *bad) {
    const int64_t n = r->vocab;
    int64_t count = 0;
    float thr = bar; /* a token enters only above the k-th best so far */
    vi nan = vi_set(0);
    sf_ahead pf = r->next;
    vf mx = vf_set(-INFINITY); /* for the prefetch switch only */
    for (int64_t i = 0; i < n; i += SF_W) {
        vf x = load_chunk(r->data, r->dtype, i, n);
        nan |= x != x;
        if (pf.data) {
            fetch_ahead(pf, i, SF_W);
            mx = vmaxf(x, mx);
            if (i % SF_BOUND_BLOCK == 0 && vany(mx > r->next_until)) pf.data = NULL;
        }
        vi hit = x > thr;
        if (!vany(hit)) continue;
        if (count + SF_W > cap) {
            /* Room for a whole chunk: keep the k best so far, raising the bar. */
            select_best(ids, vals, count, k);
            count = k;
            thr = vals[k - 1];
            hit = x > thr;
        }
        count += vcompress(hit, x, vi_iota((int32_t)i), vals + count, ids + count);
    }
    if (count > k) {
        select_best(ids, vals, count, k);
        count = k;
    }
    *bad = vany(nan);
    return count;
}

static void scale_weights(float *r, int64_t n, double inv) {
    typedef double vd SF_VEC(double);
    for (int64_t i = 0; i < n; i += SF_W) {
        /* floor(r 2^40) in float: exact, by an int32 conversion below 2^23
         * (only there: past 2^31 it would overflow), above which a float is
         * whole. */
        vf x = load_floats(r, i, n) * SF_MASS_ONE;
        vi small = x < 8388608.0f;
        vf w = vsel(small, __builtin_convertvector(
                               __builtin_convertvector(vsel(small, x, vf_set(0.0f)), vi), vf),
                    x);
        vf p = __builtin_convertvector(__builtin_convertvector(w, vd) * inv, vf);
        if (i + SF_W <= n) vstore(r + i, p);
        else for (int j = 0; i + j < n; j++) r[i + j] = p[j];
    }
}

const sf_kernels SF_TABLE = {
    SF_TABLE_NAME, row_max, row_max_sum, row_argmax, weights, mass_bound, coupled_race,
    gather, topk, scale_weights,
};
