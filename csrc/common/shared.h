/*
 * shared.h: the arithmetic both backends must agree on, bit for bit.
 *
 * The CPU (every SIMD level) and CUDA kernels include this header, so that a
 * token is decided the same way wherever it is computed:
 * - Philox4x32-10 streams keyed by the seed, counted by (position, purpose,
 *   index);
 * - exp2 and log as fixed polynomials in plain IEEE multiplies and adds (the
 *   CPU builds with -ffp-contract=off; CUDA uses the _rn intrinsics, which are
 *   never fused), so no libm or FMA difference can change a result;
 * - probability masses as integers: a kept token weighs
 *   floor(2^((l - max) * log2(e) / T) * 2^40), and every sum of weights is an exact
 *   integer, the same in any order.
 */
#ifndef SF_SHARED_H
#define SF_SHARED_H

#include <stdint.h>
#include <string.h>

#include "specfast.h"

#if defined(__CUDACC__)
#define SF_HD __host__ __device__ __forceinline__
#else
#define SF_HD static inline
#endif
/* Device code uses the _rn intrinsics, never fused; host code builds with
 * -ffp-contract=off, so plain operators round the same way. */
#if defined(__CUDA_ARCH__)
#define SF_FMUL(a, b) __fmul_rn((a), (b))
#define SF_FADD(a, b) __fadd_rn((a), (b))
#define SF_FSUB(a, b) __fsub_rn((a), (b))
#define SF_DMUL(a, b) __dmul_rn((a), (b))
#define SF_DSUB(a, b) __dsub_rn((a), (b))
#else
#define SF_FMUL(a, b) ((a) * (b))
#define SF_FADD(a, b) ((a) + (b))
#define SF_FSUB(a, b) ((a) - (b))
#define SF_DMUL(a, b) ((a) * (b))
#define SF_DSUB(a, b) ((a) - (b))
#endif

/* One request's sampling parameters are in range (specfast.h's rules; a NaN
 * is not): the CPU's sf_params_check, the CUDA kernels and the CUDA host's
 * check of values passed by value all ask this. */
SF_HD int sf_params_ok(float temperature, int32_t top_k, float top_p, float min_p) {
    return temperature >= 0.0f && temperature <= SF_MAX_TEMPERATURE && top_k >= 0 &&
           top_p > 0.0f && top_p <= 1.0f && min_p >= 0.0f && min_p <= 1.0f;
}

/* A draft probability the kernels may use: in [0, 1.001] (the slack is for
 * rounding; a NaN is not). kernels_impl.h's vector passes test the same. */
SF_HD int sf_prob_ok(float q) { return q >= 0.0f && q <= 1.001f; }

/* Fixed-point scale of a token's weight: the most probable token weighs 2^40. */
#define SF_MASS_BITS 40
#define SF_MASS_ONE 1099511627776.0f /* 2^40 */

/* Below this power of two a token weighs 0 and is never sampled. */
#define SF_EXP2_MIN (-125.0f)
#define SF_LOG2E 1.44269504088896341f

/* 1 / T for T > 0, capped at FLT_MAX ln 2: a temperature so small that it
 * overflows keeps its limit, all mass on the tied maxima, instead of turning
 * 0 * inf into NaN. At the cap log2(e) / T (the weights' scale, rounded in
 * float) is still finite, so the weights 2^((l - max) log2(e) / T) and the
 * coupled keys (l - max) / T keep one temperature below it too. */
#define SF_INV_T_MAX 2.3586574e38f
SF_HD float sf_inv_temperature(float t) {
    float inv = 1.0f / t;
    return inv <= SF_INV_T_MAX ? inv : SF_INV_T_MAX;
}

/* Purposes: independent random streams at one (seed, position). */
enum {
    SF_PURPOSE_ACCEPT = 1, /* index: sibling order at a node */
    SF_PURPOSE_DRAW = 2,   /* index 0: inverse-CDF draw from a row */
    SF_PURPOSE_NOISE = 3,  /* Gumbel noise: see sf_noise_word */
    SF_PURPOSE_RESID = 4   /* index i: try i of a residual draw (sf_resid_keeps), then
                            * the residual formed whole (sf_draw_block) */
};

SF_HD uint32_t sf_f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
SF_HD float sf_u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* ---- Philox4x32-10 (Salmon et al., SC'11) ---- */

typedef struct sf_u32x4 { uint32_t v[4]; } sf_u32x4;

SF_HD sf_u32x4 sf_philox(uint64_t seed, int64_t position, uint32_t purpose,
                         uint32_t index) {
    uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
    uint32_t c0 = (uint32_t)(uint64_t)position;
    uint32_t c1 = (uint32_t)((uint64_t)position >> 32);
    uint32_t c2 = purpose, c3 = index;
    for (int r = 0; r < 10; r++) {
        uint64_t p0 = (uint64_t)0xD2511F53u * c0;
        uint64_t p1 = (uint64_t)0xCD9E8D57u * c2;
        uint32_t n0 = (uint32_t)(p1 >> 32) ^ c1 ^ k0;
        uint32_t n2 = (uint32_t)(p0 >> 32) ^ c3 ^ k1;
        c1 = (uint32_t)p1;
        c3 = (uint32_t)p0;
        c0 = n0;
        c2 = n2;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    sf_u32x4 out = {{c0, c1, c2, c3}};
    return out;
}

/* The Philox word of token v's Gumbel noise: the 64 tokens from 64 s take
 * the 4 words of the 16 blocks 16 s .. 16 s + 15, word c for tokens
 * 64 s + 16 c + lane, so that 16 blocks at once give 16-token vectors. */
SF_HD uint32_t sf_noise_word(uint64_t seed, int64_t position, int64_t v) {
    uint32_t index = (uint32_t)((v >> 6) * 16 + (v & 15));
    return sf_philox(seed, position, SF_PURPOSE_NOISE, index).v[(v >> 4) & 3];
}

/* 53 random bits from the first two words: a uniform integer in [0, 2^53). */
SF_HD uint64_t sf_bits53(sf_u32x4 r) {
    return ((uint64_t)(r.v[0] >> 5) << 26) | (uint64_t)(r.v[1] >> 6);
}

/* Uniform in (0, 1]: never 0, so `u * q < p` never accepts a token with p = 0. */
SF_HD double sf_uniform_open0(sf_u32x4 r) {
    return (double)(sf_bits53(r) + 1) * (1.0 / 9007199254740992.0);
}

/* Inverse-CDF target in [0, total): floor(bits53 * total / 2^53), exact. */
SF_HD uint64_t sf_draw_target(sf_u32x4 r, uint64_t total) {
    uint64_t b = sf_bits53(r);
#if defined(__CUDA_ARCH__)
    uint64_t hi = __umul64hi(b, total), lo = b * total;
#else
    unsigned __int128 p = (unsigned __int128)b * total;
    uint64_t hi = (uint64_t)(p >> 64), lo = (uint64_t)p;
#endif
    return (hi << 11) | (lo >> 53);
}

/* A residual max(0, p - q), normalised, is drawn by tries before it is formed
 * (which reads every q and costs a pass over the row): try i draws y from p
 * at the target of sf_philox(seed, position, RESID, i) and keeps it with
 * probability max(0, 1 - q(y) total / w(y)), so that a kept y has
 * probability proportional to w(y) - q(y) total, that is to p(y) - q(y).
 * Only when SF_RESID_TRIES tries keep nothing is the residual formed. */
#define SF_RESID_TRIES 16

/* Whether a try keeps its token y, of weight w > 0 out of `total`, whose q
 * is q: u w < w - q total, u in (0, 1] from the Philox block's last two
 * words (its first two drew y). */
SF_HD int sf_resid_keeps(sf_u32x4 r, uint64_t w, float q, uint64_t total) {
    const sf_u32x4 hi = {{r.v[2], r.v[3], 0, 0}};
    const double u = sf_uniform_open0(hi), wd = (double)w;
    return SF_DMUL(u, wd) < SF_DSUB(wd, SF_DMUL((double)q, (double)total));
}

/* The Philox block of an inverse-CDF draw at (seed, position): (DRAW, 0) for
 * a row as it is (sample, a bonus token), (RESID, SF_RESID_TRIES), past the
 * tries, for a residual after a rejection. A drafter that drew its token with
 * specfast.sample at this seed and position used (DRAW, 0): the residual must
 * not reuse the uniform that chose the token it corrects. */
SF_HD sf_u32x4 sf_draw_block(uint64_t seed, int64_t position, int residual) {
    return residual ? sf_philox(seed, position, SF_PURPOSE_RESID, SF_RESID_TRIES)
                    : sf_philox(seed, position, SF_PURPOSE_DRAW, 0);
}

/* ---- exp and log ---- */

/* 2^y for y <= 0 (y is a logit minus the row max, times log2(e) / T):
 * 0 below SF_EXP2_MIN, exactly 1 at 0. Rounds y to an integer n, then
 * 2^(y - n) by a degree-5 polynomial fitted for relative error (1.9e-7 on
 * [-1/2, 1/2]), then adds n to the exponent bits. A NaN y gives garbage: rows
 * are checked for NaN before any exp. */
SF_HD float sf_exp2(float y) {
    const float magic = 12582912.0f; /* 1.5 * 2^23: rounds to an integer */
    float yc = y < SF_EXP2_MIN ? SF_EXP2_MIN : y;
    float t = SF_FADD(yc, magic);
    float n = SF_FSUB(t, magic);
    uint32_t ni = sf_f2u(t) - sf_f2u(magic);
    float f = SF_FSUB(yc, n);
    float p = 1.326472848e-3f;
    p = SF_FADD(SF_FMUL(p, f), 9.671512991e-3f);
    p = SF_FADD(SF_FMUL(p, f), 5.550733581e-2f);
    p = SF_FADD(SF_FMUL(p, f), 2.402224243e-1f);
    p = SF_FADD(SF_FMUL(p, f), 6.931470037e-1f);
    p = SF_FADD(SF_FMUL(p, f), 1.0f);
    float e = sf_u2f(sf_f2u(p) + (ni << 23));
    return y < SF_EXP2_MIN ? 0.0f : e;
}

/* Natural log of a positive normal x: exponent split, then the series of
 * log((1+s)/(1-s)) = 2 atanh(s). */
SF_HD float sf_log(float x) {
    uint32_t b = sf_f2u(x);
    int32_t e = (int32_t)(b >> 23) - 127;
    float m = sf_u2f((b & 0x007FFFFFu) | 0x3F800000u); /* [1, 2) */
    /* Keep m in [sqrt(1/2), sqrt(2)) for a short series. */
    int big = m > 1.41421356f;
    m = big ? SF_FMUL(m, 0.5f) : m;
    e += big;
    float f = SF_FSUB(m, 1.0f);
    float s = f / SF_FADD(f, 2.0f);
    float z = SF_FMUL(s, s);
    float p = 0.1538461538f; /* 2/13, the series in z = s^2 */
    p = SF_FADD(SF_FMUL(p, z), 0.1818181818f);
    p = SF_FADD(SF_FMUL(p, z), 0.2222222222f);
    p = SF_FADD(SF_FMUL(p, z), 0.2857142857f);
    p = SF_FADD(SF_FMUL(p, z), 0.4f);
    p = SF_FADD(SF_FMUL(p, z), 0.6666666667f);
    p = SF_FADD(SF_FMUL(p, z), 2.0f);
    float lm = SF_FMUL(s, p);
    float fe = (float)e;
    return SF_FADD(SF_FADD(SF_FMUL(fe, -2.12194440e-4f), lm),
                   SF_FMUL(fe, 0.693359375f));
}

/* Gumbel noise of token v from its Philox word w: G = -log(E) with
 * E = -log(1 - U) an Exp(1) variate, U = (w + 0.5) / 2^32 kept below 1. For
 * small U, -log(1 - U) is U (1 + U/2 + ...), evaluated without cancellation. */
SF_HD float sf_gumbel(uint32_t w) {
    /* 23 bits and a half: exact in float, so 1 - u is exact and >= 2^-24. */
    float u = SF_FMUL((float)(w >> 9) + 0.5f, 1.1920928955078125e-7f); /* 2^-23 */
    float e;
    if (u < 0.0625f) {
        /* Exp variate from the full 32 bits: -log1p(-u) by its series. */
        float uf = SF_FMUL((float)w + 0.5f, 2.3283064365386963e-10f); /* 2^-32 */
        float p = 0.2f;
        p = SF_FADD(SF_FMUL(p, uf), 0.25f);
        p = SF_FADD(SF_FMUL(p, uf), 0.33333333f);
        p = SF_FADD(SF_FMUL(p, uf), 0.5f);
        p = SF_FADD(SF_FMUL(p, uf), 1.0f);
        e = SF_FMUL(uf, p);
    } else {
        e = -sf_log(SF_FSUB(1.0f, u));
    }
    return -sf_log(e);
}

/* ---- 16-bit floats ---- */

SF_HD float sf_bf16_to_f32(uint16_t h) { return sf_u2f((uint32_t)h << 16); }

SF_HD float sf_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
    uint32_t normal = sign | ((exp + 112u) << 23) | (man << 13);
    uint32_t special = sign | 0x7F800000u | (man << 13);
    uint32_t sub = sign | sf_f2u((float)man * 5.9604644775390625e-8f);
    return sf_u2f(exp == 0 ? sub : exp == 31 ? special : normal);
}

#endif /* SF_SHARED_H */
