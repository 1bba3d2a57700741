/*
 * kernels_impl.h: the body of the CPU row kernels, included once per SIMD
 * level with SF_TABLE naming the table to define. Loops run over chunks of
 * SF_LANES tokens with one accumulator per lane, so the compiler maps each
 * lane loop onto vector instructions and every level adds in the same order.
 */
#include <math.h>

#include "rowmath.h"

/* Loads tokens [i, i + 16) of a row as float; past the end, -inf. */
static inline void load_chunk(const void *row, sf_dtype dtype, int64_t i,
                              int64_t n, float *restrict x) {
    if (i + SF_LANES <= n) {
        if (dtype == SF_F32) {
            const float *p = (const float *)row + i;
            for (int j = 0; j < SF_LANES; j++) x[j] = p[j];
        } else if (dtype == SF_BF16) {
            const uint16_t *p = (const uint16_t *)row + i;
            for (int j = 0; j < SF_LANES; j++) x[j] = sf_bf16_to_f32(p[j]);
        } else {
            const uint16_t *p = (const uint16_t *)row + i;
            for (int j = 0; j < SF_LANES; j++) x[j] = sf_f16_to_f32(p[j]);
        }
    } else {
        for (int j = 0; j < SF_LANES; j++)
            x[j] = i + j < n ? sf_load(row, dtype, i + j) : -INFINITY;
    }
}

static float row_max(const void *row, sf_dtype dtype, int64_t n, int *bad) {
    float m[SF_LANES];
    int32_t b[SF_LANES];
    for (int j = 0; j < SF_LANES; j++) { m[j] = -INFINITY; b[j] = 0; }
    for (int64_t i = 0; i < n; i += SF_LANES) {
        float x[SF_LANES];
        load_chunk(row, dtype, i, n, x);
        for (int j = 0; j < SF_LANES; j++) {
            m[j] = x[j] > m[j] ? x[j] : m[j];
            b[j] |= (x[j] != x[j]) | (x[j] == INFINITY);
        }
    }
    float r = -INFINITY;
    int any = 0;
    for (int j = 0; j < SF_LANES; j++) {
        r = m[j] > r ? m[j] : r;
        any |= b[j];
    }
    *bad = any;
    return r;
}

static int64_t row_argmax(const void *row, sf_dtype dtype, int64_t n, float max) {
    for (int64_t i = 0; i < n; i += SF_LANES) {
        float x[SF_LANES];
        load_chunk(row, dtype, i, n, x);
        int hit = 0;
        for (int j = 0; j < SF_LANES; j++) hit |= x[j] == max;
        if (hit)
            for (int j = 0; j < SF_LANES; j++)
                if (x[j] == max) return i + j;
    }
    return -1;
}

/* Base values of one chunk read from the row; returns how many tokens are at
 * or above the cut. Chunks with no token above the cut skip the exp. */
static inline int64_t row_base_chunk(const sf_row *r, int64_t i,
                                     float *restrict b) {
    float x[SF_LANES];
    load_chunk(r->data, r->dtype, i, r->vocab, x);
    int32_t above[SF_LANES];
    int64_t count = 0;
    for (int j = 0; j < SF_LANES; j++) {
        above[j] = sf_above_cut(r, x[j], i + j) & (x[j] > -INFINITY);
        count += above[j];
    }
    if (count == 0) {
        for (int j = 0; j < SF_LANES; j++) b[j] = 0.0f;
        return 0;
    }
    for (int j = 0; j < SF_LANES; j++) {
        float e = sf_row_e(r, x[j]);
        b[j] = (above[j] & (e >= r->min_e)) ? e : 0.0f;
    }
    return count;
}

static void weights(const sf_row *r, const sf_weights_in *in, uint64_t *blocks,
                    float *resid, sf_weights_out *out) {
    const int64_t n = r->vocab;
    const float scale = in->scale;
    uint64_t total = 0;
    int64_t kept = 0;
    float qs[SF_LANES];
    int32_t qbad[SF_LANES];
    for (int j = 0; j < SF_LANES; j++) { qs[j] = 0.0f; qbad[j] = 0; }

    for (int64_t blk = 0; blk * SF_BLOCK < n; blk++) {
        int32_t hi[SF_LANES], lo[SF_LANES];
        for (int j = 0; j < SF_LANES; j++) { hi[j] = 0; lo[j] = 0; }
        const int64_t end = (blk + 1) * SF_BLOCK < n ? (blk + 1) * SF_BLOCK : n;
        for (int64_t i = blk * SF_BLOCK; i < end; i += SF_LANES) {
            const int full = i + SF_LANES <= n;
            float b[SF_LANES], q[SF_LANES], rr[SF_LANES];
            if (in->base) {
                for (int j = 0; j < SF_LANES; j++)
                    b[j] = (full || i + j < n) ? in->base[i + j] : 0.0f;
            } else {
                kept += row_base_chunk(r, i, b);
            }
            if (in->q) {
                for (int j = 0; j < SF_LANES; j++) {
                    q[j] = (full || i + j < n) ? in->q[i + j] : 0.0f;
                    qs[j] += q[j];
                    qbad[j] |= !(q[j] >= 0.0f) | (q[j] == INFINITY);
                }
            } else {
                for (int j = 0; j < SF_LANES; j++) q[j] = 0.0f;
            }
            for (int j = 0; j < SF_LANES; j++) {
                rr[j] = sf_resid(b[j], scale, q[j]);
                int32_t h = sf_fixed_hi(rr[j]);
                hi[j] += h;
                lo[j] += sf_fixed_lo(rr[j], h);
            }
            if (resid) {
                if (full)
                    for (int j = 0; j < SF_LANES; j++) resid[i + j] = rr[j];
                else
                    for (int j = 0; i + j < n; j++) resid[i + j] = rr[j];
            }
        }
        int64_t hs = 0, ls = 0;
        for (int j = 0; j < SF_LANES; j++) { hs += hi[j]; ls += lo[j]; }
        uint64_t bs = ((uint64_t)hs << 20) + (uint64_t)ls;
        if (blocks) blocks[blk] = bs;
        total += bs;
    }
    float qsum = 0.0f;
    int bad = 0;
    for (int j = 0; j < SF_LANES; j++) { qsum += qs[j]; bad |= qbad[j]; }
    out->total = total;
    out->kept = kept;
    out->q_sum = qsum;
    out->q_bad = bad;
}

/* Philox words of 16 consecutive tokens starting at i (a multiple of 16). */
static inline void noise_words(uint64_t seed, int64_t position, int64_t i,
                               uint32_t *restrict w) {
    for (int c = 0; c < SF_LANES / 4; c++) {
        sf_u32x4 r = sf_philox(seed, position, SF_PURPOSE_NOISE,
                               (uint32_t)((i >> 2) + c));
        for (int j = 0; j < 4; j++) w[4 * c + j] = r.v[j];
    }
}

/* A Philox word at or above this cannot lift a token's key by more than g:
 * G(w) > g needs U < 1 - exp(-exp(-g)). Doubled, plus slack, to stay safe
 * against the rounding of sf_gumbel; only speed depends on it. */
static inline uint64_t noise_bound(float g) {
    if (!(g > 2.0f)) return (uint64_t)1 << 32;
    double u = -expm1(-exp(-(double)g));
    double w = 2.0 * u * 4294967296.0 + 4096.0;
    return w >= 4294967296.0 ? (uint64_t)1 << 32 : (uint64_t)w;
}

static int64_t coupled_argmax(const sf_row *r, uint64_t seed, int64_t position) {
    const int64_t n = r->vocab;
    float best = -INFINITY;
    int64_t best_id = -1;
    for (int64_t i = 0; i < n; i += SF_LANES) {
        float x[SF_LANES], s[SF_LANES];
        int32_t keep[SF_LANES];
        load_chunk(r->data, r->dtype, i, n, x);
        float smax = -INFINITY;
        for (int j = 0; j < SF_LANES; j++) {
            keep[j] = sf_above_cut(r, x[j], i + j) & (x[j] > -INFINITY);
            if (r->min_e > 0.0f) keep[j] &= sf_row_e(r, x[j]) >= r->min_e;
            s[j] = keep[j] ? SF_FMUL(SF_FSUB(x[j], r->max), r->inv_t) : -INFINITY;
            smax = s[j] > smax ? s[j] : smax;
        }
        if (smax == -INFINITY) continue;
        uint32_t w[SF_LANES];
        noise_words(seed, position, i, w);
        /* Most chunks cannot beat the best key: only tokens whose noise
         * word is small enough get their Gumbel noise computed. */
        uint64_t bound = best_id < 0 ? (uint64_t)1 << 32
                                     : noise_bound(best - smax);
        int32_t cand[SF_LANES];
        int any = 0;
        for (int j = 0; j < SF_LANES; j++) {
            cand[j] = keep[j] & ((uint64_t)w[j] < bound);
            any |= cand[j];
        }
        if (!any) continue;
        for (int j = 0; j < SF_LANES; j++) {
            if (!cand[j]) continue;
            float key = SF_FADD(s[j], sf_gumbel(w[j]));
            if (key > best || best_id < 0) { best = key; best_id = i + j; }
        }
    }
    return best_id;
}

static int64_t gather(const sf_row *r, float lo, float hi, int32_t *ids,
                      float *vals, int64_t cap) {
    const int64_t n = r->vocab;
    int64_t count = 0;
    for (int64_t i = 0; i < n; i += SF_LANES) {
        float x[SF_LANES];
        load_chunk(r->data, r->dtype, i, n, x);
        int hit = 0;
        for (int j = 0; j < SF_LANES; j++) hit |= (x[j] >= lo) & (x[j] < hi);
        if (!hit) continue;
        for (int j = 0; j < SF_LANES; j++) {
            if (x[j] >= lo && x[j] < hi && i + j < n) {
                if (count < cap) { ids[count] = (int32_t)(i + j); vals[count] = x[j]; }
                count++;
            }
        }
    }
    return count;
}

/* (val, id) ranks before (val2, id2) in (value descending, id ascending). */
static inline int ranks_before(float a, int32_t ia, float b, int32_t ib) {
    return a > b || (a == b && ia < ib);
}

static inline void swap_entries(int32_t *ids, float *vals, int64_t a, int64_t b) {
    int32_t ti = ids[a]; ids[a] = ids[b]; ids[b] = ti;
    float tv = vals[a]; vals[a] = vals[b]; vals[b] = tv;
}

/* Moves the k best entries to [0, k) (unordered), k-th best at k - 1. */
static void select_best(int32_t *ids, float *vals, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1;
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        /* Median of three to position mid, then Lomuto partition. */
        if (ranks_before(vals[mid], ids[mid], vals[lo], ids[lo])) swap_entries(ids, vals, mid, lo);
        if (ranks_before(vals[hi], ids[hi], vals[lo], ids[lo])) swap_entries(ids, vals, hi, lo);
        if (ranks_before(vals[hi], ids[hi], vals[mid], ids[mid])) swap_entries(ids, vals, hi, mid);
        swap_entries(ids, vals, mid, hi);
        float pv = vals[hi];
        int32_t pi = ids[hi];
        int64_t store = lo;
        for (int64_t i = lo; i < hi; i++)
            if (ranks_before(vals[i], ids[i], pv, pi)) swap_entries(ids, vals, i, store++);
        swap_entries(ids, vals, store, hi);
        if (store == k - 1) return;
        if (store < k - 1) lo = store + 1; else hi = store - 1;
    }
}

static int64_t topk(const sf_row *r, int64_t k, int32_t *ids, float *vals,
                    int64_t cap) {
    const int64_t n = r->vocab;
    int64_t count = 0;
    float thr = -INFINITY; /* a token enters only above the k-th best so far */
    for (int64_t i = 0; i < n; i += SF_LANES) {
        float x[SF_LANES];
        load_chunk(r->data, r->dtype, i, n, x);
        int hit = 0;
        for (int j = 0; j < SF_LANES; j++) hit |= x[j] > thr;
        if (!hit) continue;
        for (int j = 0; j < SF_LANES && i + j < n; j++) {
            if (!(x[j] > thr)) continue;
            ids[count] = (int32_t)(i + j);
            vals[count] = x[j];
            if (++count == cap) {
                select_best(ids, vals, count, k);
                count = k;
                thr = vals[k - 1];
            }
        }
    }
    if (count > k) {
        select_best(ids, vals, count, k);
        count = k;
    }
    return count;
}

const sf_kernels SF_TABLE = {
    SF_TABLE_NAME, row_max, row_argmax, weights, coupled_argmax, gather, topk,
};
