/*
 * rowmath.h: per-token arithmetic shared by the vector passes and the scalar
 * code that revisits single tokens (an acceptance test, the token inside a
 * drawn block). Both call these functions, so both get the same bits.
 */
#ifndef SF_CPU_ROWMATH_H
#define SF_CPU_ROWMATH_H

#include "../common/shared.h"
#include "kernels.h"

static inline float sf_load(const void *row, sf_dtype dtype, int64_t v) {
    switch (dtype) {
    case SF_F16: return sf_f16_to_f32(((const uint16_t *)row)[v]);
    case SF_BF16: return sf_bf16_to_f32(((const uint16_t *)row)[v]);
    default: return ((const float *)row)[v];
    }
}

/* The cut of the filters: (logit descending, id ascending) order. */
static inline int sf_above_cut(const sf_row *r, float l, int64_t v) {
    return (l > r->cut_logit) | ((l == r->cut_logit) & (v <= r->cut_id));
}

static inline float sf_row_e(const sf_row *r, float l) {
    return sf_exp2(SF_FMUL(SF_FSUB(l, r->max), r->c));
}

/* Base value of a token read from the row: e when kept, else 0. */
static inline float sf_row_base(const sf_row *r, float l, int64_t v) {
    float e = sf_row_e(r, l);
    return (sf_above_cut(r, l, v) & (e >= r->min_e)) ? e : 0.0f;
}

/* max(0, b * scale - q), and 0 where b is 0: a token of probability 0 stays
 * so even where q, unchecked there (outside a filter's cut), is negative.
 * NaN becomes 0 (a bad q is reported separately). */
static inline float sf_resid(float b, float scale, float q) {
    float x = SF_FSUB(SF_FMUL(b, scale), q);
    return (x > 0.0f) & (b > 0.0f) ? x : 0.0f;
}

/* floor(r * 2^40) for 0 <= r < 2048, as the vector passes form it (through
 * two exact 20-bit halves, for units without float-to-int64 conversion):
 * r * 2^40 is exact, and its conversion truncates. */
static inline uint64_t sf_fixed(float r) { return (uint64_t)(int64_t)(r * 0x1p40f); }

/* A token's weight as the weights pass computes it. */
static inline uint64_t sf_weight_at(const sf_row *r, const sf_weights_in *in,
                                    int64_t v) {
    float b = in->base ? in->base[v]
                       : sf_row_base(r, sf_load(r->data, r->dtype, v), v);
    return sf_fixed(sf_resid(b, in->scale, in->q ? in->q[v] : 0.0f));
}

#endif /* SF_CPU_ROWMATH_H */
