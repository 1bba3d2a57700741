/*
 * vec.h: vectors of SF_W lanes in GCC's vector extensions, SF_W being the
 * native width of the level a file is built for (16 with AVX-512, 8 with AVX2,
 * 4 on plain x86-64 or any other target). Each lane does exactly the scalar
 * operations of shared.h, and every sum the kernels take is an exact integer
 * or a maximum, so the width never changes a result.
 */
#ifndef SF_CPU_VEC_H
#define SF_CPU_VEC_H

#include <stdint.h>
#include <string.h>

#include "../common/shared.h"

#if defined(__AVX512F__)
#define SF_W 16
#elif defined(__AVX2__)
#define SF_W 8
#else
#define SF_W 4
#endif

#if SF_W >= 8
#include <immintrin.h>
#endif

#define SF_VEC(t) __attribute__((vector_size(SF_W * sizeof(t))))
typedef float vf SF_VEC(float);
typedef int32_t vi SF_VEC(int32_t);
typedef uint32_t vu SF_VEC(uint32_t);
typedef uint16_t vh SF_VEC(uint16_t);
#define SF_INLINE static inline __attribute__((always_inline))

SF_INLINE vf vf_set(float x) { return (vf){0} + x; }
SF_INLINE vi vi_set(int32_t x) { return (vi){0} + x; }
SF_INLINE vi vi_iota(int32_t x) {
    vi v;
    for (int j = 0; j < SF_W; j++) v[j] = j;
    return v + x;
}

/* m ? a : b, lane by lane (m lanes are 0 or -1, as comparisons give). */
SF_INLINE vf vsel(vi m, vf a, vf b) { return (vf)((m & (vi)a) | (~m & (vi)b)); }

/* Any lane set: the lanes' sign bits as an integer where the level has an
 * instruction for it. */
SF_INLINE int vany(vi m) {
#if SF_W == 16
    return _mm512_movepi32_mask((__m512i)m) != 0;
#elif SF_W == 8
    return _mm256_movemask_ps((__m256)m) != 0;
#else
    return (m[0] | m[1] | m[2] | m[3]) != 0;
#endif
}

/* Writes the lanes of x and ids where m is set, in lane order, to vals[0..)
 * and out[0..); returns how many. Each array needs room for SF_W: a level may
 * write whole vectors. */
SF_INLINE int vcompress(vi m, vf x, vi ids, float *vals, int32_t *out) {
#if SF_W == 16
    const __mmask16 k = _mm512_movepi32_mask((__m512i)m);
    _mm512_storeu_ps(vals, _mm512_maskz_compress_ps(k, (__m512)x));
    _mm512_storeu_si512(out, _mm512_maskz_compress_epi32(k, (__m512i)ids));
    return __builtin_popcount(k);
#else
    int c = 0;
    for (int j = 0; j < SF_W; j++) { /* no branch: a lane's hit is a coin toss */
        vals[c] = x[j];
        out[c] = ids[j];
        c -= m[j];
    }
    return c;
#endif
}

SF_INLINE vf vload(const float *p) { vf x; memcpy(&x, p, sizeof x); return x; }
SF_INLINE void vstore(float *p, vf x) { memcpy(p, &x, sizeof x); }

SF_INLINE vf vbf16(const uint16_t *p) {
    vh h;
    memcpy(&h, p, sizeof h);
    return (vf)(__builtin_convertvector(h, vu) << 16);
}

/* 2 SF_W bfloat16 values as two float vectors, one of the values at even
 * indices and one of those at odd (which is which depends on byte order): two
 * operations for 2 SF_W values, for passes that do not care about order. */
SF_INLINE void vbf16_halves(const uint16_t *p, vf *a, vf *b) {
    vu w;
    memcpy(&w, p, sizeof w);
    *a = (vf)(w << 16);
    *b = (vf)(w & 0xFFFF0000u);
}

/* sf_f16_to_f32, lane by lane: one instruction where the level has F16C (an
 * exact conversion; NaNs may differ in payload, and are rejected anyway). */
SF_INLINE vf vf16(const uint16_t *p) {
#if SF_W == 16
    return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#elif SF_W == 8 && defined(__F16C__)
    return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    vh h16;
    memcpy(&h16, p, sizeof h16);
    vu h = __builtin_convertvector(h16, vu);
    vu sign = (h & 0x8000u) << 16;
    vu exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
    vu normal = sign | ((exp + 112u) << 23) | (man << 13);
    vu special = sign | 0x7F800000u | (man << 13);
    vf subf = __builtin_convertvector((vi)man, vf) * 5.9604644775390625e-8f;
    vu sub = sign | (vu)subf;
    vi is0 = (vi)(exp == 0), is31 = (vi)(exp == 31);
    return (vf)(((vu)is0 & sub) | ((vu)is31 & special) | (~(vu)(is0 | is31) & normal));
#endif
}

/* max(y, lo) for y not NaN: one instruction where the level has one. */
SF_INLINE vf vmax_lo(vf y, float lo) {
#if SF_W == 16
    return (vf)_mm512_max_ps((__m512)y, _mm512_set1_ps(lo));
#elif SF_W == 8
    return (vf)_mm256_max_ps((__m256)y, _mm256_set1_ps(lo));
#else
    return vsel(y < lo, vf_set(lo), y);
#endif
}

/* a > b ? a : b, lane by lane (b where either is NaN): one instruction where
 * the level has one (GCC does not fuse the compare and select itself). */
SF_INLINE vf vmaxf(vf a, vf b) {
#if SF_W == 16
    return (vf)_mm512_max_ps((__m512)a, (__m512)b);
#elif SF_W == 8
    return (vf)_mm256_max_ps((__m256)a, (__m256)b);
#else
    return vsel(a > b, a, b);
#endif
}

/* The largest lane (-inf when none is larger; lanes are never NaN). */
SF_INLINE float vhmax(vf a) {
    float m = -INFINITY;
    for (int j = 0; j < SF_W; j++) m = a[j] > m ? a[j] : m;
    return m;
}

/* a < b ? a : b, lane by lane (b where either is NaN). */
SF_INLINE vf vminf(vf a, vf b) {
#if SF_W == 16
    return (vf)_mm512_min_ps((__m512)a, (__m512)b);
#elif SF_W == 8
    return (vf)_mm256_min_ps((__m256)a, (__m256)b);
#else
    return vsel(a < b, a, b);
#endif
}

/* sf_exp2, lane by lane. Lanes below SF_EXP2_MIN are set to 0 at the end,
 * so y needs no clamp (what they compute meanwhile is discarded), and
 * 2^n scales p by vscalefps where the level has it: p 2^n is a normal float
 * for n >= -125, so it equals the exponent add bit for bit. */
SF_INLINE vf vexp2(vf y) {
    const vf magic = vf_set(12582912.0f);
    vi low = y < SF_EXP2_MIN;
    vf t = y + magic;
    vf n = t - magic;
    vf f = y - n;
    vf p = vf_set(1.326472848e-3f);
    p = p * f + 9.671512991e-3f;
    p = p * f + 5.550733581e-2f;
    p = p * f + 2.402224243e-1f;
    p = p * f + 6.931470037e-1f;
    p = p * f + 1.0f;
#if SF_W == 16
    vf e = (vf)_mm512_scalef_ps((__m512)p, (__m512)n);
#else
    /* n << 23 is (t - magic) << 23, and magic's low 9 bits are 0. */
    vf e = (vf)((vu)p + ((vu)t << 23));
#endif
    return vsel(low, vf_set(0.0f), e);
}

/* Largest factor c for which c 2^23 is still a finite float. */
#define SF_C23_MAX 4.05e31f

/* vexp2_up of y given y 2^23 (a caller can fold 2^23 into its factor). */
SF_INLINE vf vexp2_up_scaled(vf y23) {
    y23 = vmax_lo(y23, -126.0f * 8388608.0f);
    return (vf)(__builtin_convertvector(y23, vi) + 0x3F800000);
}

/* An upper bound of 2^y, lane by lane: 2^floor(y) (1 + frac(y)), the chord
 * of a convex function (at most 6.2% above it), read off the bits of
 * y 2^23 + 127 2^23 (truncating toward zero only raises it); y below -126
 * counts as -126. Scaling by 2^23 is exact, so clamping before or after it
 * gives the same bits. */
SF_INLINE vf vexp2_up(vf y) { return vexp2_up_scaled(y * 8388608.0f); }

/* hi and lo words of a * k, lane by lane: the even and the odd lanes seen as
 * 64-bit lanes with their upper halves cleared, so that each product is one
 * 32 x 32 -> 64 multiply (pmuludq) rather than a 64-bit one. */
SF_INLINE void vmulhilo(vu a, uint32_t k, vu *hi, vu *lo) {
    typedef uint64_t vq2 __attribute__((vector_size(SF_W * 4)));
    const vq2 low = (vq2){0} + 0xFFFFFFFFull;
#if SF_W == 16
    /* vpmuludq (GCC picks the slower 64-bit vpmullq), and in-lane dword
     * shuffles rather than shifts to sort the halves: 512-bit shifts and
     * multiplies share one port, shuffles take the other. */
    (void)low;
    const __m512i kk = _mm512_set1_epi64((long long)k);
    const __m512i even = _mm512_mul_epu32((__m512i)a, kk);
    const __m512i odd = _mm512_mul_epu32(_mm512_shuffle_epi32((__m512i)a, _MM_PERM_CDAB), kk);
    /* Dword 2m + 1 of even holds hi(a[2m] k), of odd hi(a[2m + 1] k); dword
     * 2m of each, the lo halves. */
    *hi = (vu)_mm512_mask_shuffle_epi32(odd, 0x5555, even, _MM_PERM_CDAB);
    *lo = (vu)_mm512_mask_shuffle_epi32(even, 0xAAAA, odd, _MM_PERM_CDAB);
#elif SF_W == 8
    /* hi the same way with vpmuludq and a dword blend (GCC emulates the
     * vector extension's 64-bit multiply below with three vpmuludq and
     * shifts); lo is vpmulld, which spares the shuffle ports a shuffle and a
     * blend (on Zen 3, 8% faster coupled verification). */
    (void)low;
    const __m256i kk = _mm256_set1_epi64x((long long)k);
    const __m256i even = _mm256_mul_epu32((__m256i)a, kk);
    const __m256i odd = _mm256_mul_epu32(_mm256_shuffle_epi32((__m256i)a, 0xB1), kk);
    *hi = (vu)_mm256_blend_epi32(_mm256_shuffle_epi32(even, 0xB1), odd, 0xAA);
    *lo = (vu)_mm256_mullo_epi32((__m256i)a, _mm256_set1_epi32((int)k));
#else
    const vq2 x = (vq2)a;
    const vq2 even = (x & low) * (uint64_t)k, odd = (x >> 32) * (uint64_t)k;
    *hi = (vu)((even >> 32) | (odd & ~low));
    *lo = (vu)((even & low) | (odd << 32));
#endif
}

/* sf_philox for SF_W counters that differ only in their index word (the
 * last). Only the index varies, so the first round is the same for every
 * lane but for one xor, and rounds 2 and 3 each have one multiply that is the
 * same for every lane: vphilox_init computes those once (per row), vphilox2
 * the rest, 16 vector multiplies instead of 20. */
typedef struct vphilox_key {
    uint32_t b1;             /* round 1: c2 = b1 ^ index; c0, c1, c3 are: */
    uint32_t a1, c1, d1;
    uint32_t e2, f2;         /* round 2: c2, c3 */
    uint32_t he3, le3;       /* round 3: the product of c2 */
    uint32_t k0[10], k1[10]; /* the round keys */
} vphilox_key;

SF_INLINE vphilox_key vphilox_init(uint64_t seed, int64_t position, uint32_t purpose) {
    vphilox_key q;
    q.k0[0] = (uint32_t)seed;
    q.k1[0] = (uint32_t)(seed >> 32);
    for (int r = 1; r < 10; r++) {
        q.k0[r] = q.k0[r - 1] + 0x9E3779B9u;
        q.k1[r] = q.k1[r - 1] + 0xBB67AE85u;
    }
    const uint32_t p0 = (uint32_t)(uint64_t)position;
    const uint32_t p1 = (uint32_t)((uint64_t)position >> 32);
    uint64_t m0 = (uint64_t)0xD2511F53u * p0, m1 = (uint64_t)0xCD9E8D57u * purpose;
    q.a1 = (uint32_t)(m1 >> 32) ^ p1 ^ q.k0[0];
    q.b1 = (uint32_t)(m0 >> 32) ^ q.k1[0];
    q.c1 = (uint32_t)m1;
    q.d1 = (uint32_t)m0;
    m0 = (uint64_t)0xD2511F53u * q.a1;
    q.e2 = (uint32_t)(m0 >> 32) ^ q.d1 ^ q.k1[1];
    q.f2 = (uint32_t)m0;
    m1 = (uint64_t)0xCD9E8D57u * q.e2;
    q.he3 = (uint32_t)(m1 >> 32);
    q.le3 = (uint32_t)m1;
    return q;
}

/* vphilox of two index vectors, their rounds interleaved: each round waits
 * on its multiplies, so one chain alone leaves the units idle. */
SF_INLINE void vphilox2(const vphilox_key *q, vu index_a, vu index_b, vu out_a[4],
                        vu out_b[4]) {
    vu idx[2] = {index_a, index_b};
    vu c0[2], c1[2], c2[2], c3[2];
    for (int t = 0; t < 2; t++) {
        vu hi, lo;
        /* Round 2: only c2 = b1 ^ index differs between lanes. */
        vmulhilo(idx[t] ^ q->b1, 0xCD9E8D57u, &hi, &lo);
        c0[t] = hi ^ (q->c1 ^ q->k0[1]);
        c1[t] = lo;
    }
    for (int t = 0; t < 2; t++) {
        vu hi, lo;
        /* Round 3: only c0 differs. */
        vmulhilo(c0[t], 0xD2511F53u, &hi, &lo);
        c0[t] = c1[t] ^ (q->he3 ^ q->k0[2]);
        c2[t] = hi ^ (q->f2 ^ q->k1[2]);
        c3[t] = lo;
        c1[t] = (vu){0} + q->le3;
    }
    for (int r = 3; r < 10; r++) {
        for (int t = 0; t < 2; t++) {
            vu hi0, lo0, hi1, lo1;
            vmulhilo(c0[t], 0xD2511F53u, &hi0, &lo0);
            vmulhilo(c2[t], 0xCD9E8D57u, &hi1, &lo1);
            c0[t] = hi1 ^ c1[t] ^ q->k0[r];
            c2[t] = hi0 ^ c3[t] ^ q->k1[r];
            c1[t] = lo1;
            c3[t] = lo0;
        }
    }
    out_a[0] = c0[0]; out_a[1] = c1[0]; out_a[2] = c2[0]; out_a[3] = c3[0];
    out_b[0] = c0[1]; out_b[1] = c1[1]; out_b[2] = c2[1]; out_b[3] = c3[1];
}

/* vresid where q >= 0 or the call fails: b = 0 then gives x <= 0 (or NaN),
 * so the test of b is not needed. */
SF_INLINE vf vresid_checked(vf b, float scale, vf q) {
    vf x = b * scale - q;
    return vsel(x > 0.0f, x, vf_set(0.0f));
}

/* sf_resid, lane by lane. */
SF_INLINE vf vresid(vf b, float scale, vf q) {
    return vsel(b > 0.0f, vresid_checked(b, scale, q), vf_set(0.0f));
}

/* Exact sums of floor(r * 2^40), 0 <= r < 2048, over the lanes of many
 * vectors. With AVX-512DQ a float converts straight to uint64; elsewhere r is
 * split into two exact 20-bit halves that int32 lanes convert and add. Either
 * way the total is the same integer. */
#if defined(__AVX512DQ__) && SF_W == 16
/* Intrinsics, not vector extensions: GCC splits a converted half into four
 * 128-bit conversions, which made this the costliest step of a mass pass. */
typedef struct { __m512i a, b; } vmass;
SF_INLINE vmass vmass_zero(void) { return (vmass){_mm512_setzero_si512(), _mm512_setzero_si512()}; }
SF_INLINE void vmass_add(vmass *m, vf r) {
    __m512 s = (__m512)(r * SF_MASS_ONE);
    m->a = _mm512_add_epi64(m->a, _mm512_cvttps_epu64(_mm512_castps512_ps256(s)));
    m->b = _mm512_add_epi64(m->b, _mm512_cvttps_epu64(_mm512_extractf32x8_ps(s, 1)));
}
SF_INLINE uint64_t vmass_total(vmass m) {
    return (uint64_t)_mm512_reduce_add_epi64(_mm512_add_epi64(m.a, m.b));
}
#else
typedef struct { vi hi, lo; } vmass;
SF_INLINE vmass vmass_zero(void) { return (vmass){{0}, {0}}; }
SF_INLINE void vmass_add(vmass *m, vf r) {
    vf s = r * 1048576.0f;
    vi h = __builtin_convertvector(s, vi);
    m->hi += h;
    m->lo += __builtin_convertvector((s - __builtin_convertvector(h, vf)) * 1048576.0f, vi);
}
SF_INLINE uint64_t vmass_total(vmass m) {
    int64_t hs = 0, ls = 0;
    for (int j = 0; j < SF_W; j++) { hs += m.hi[j]; ls += m.lo[j]; }
    return ((uint64_t)hs << 20) + (uint64_t)ls;
}
#endif

#endif /* SF_CPU_VEC_H */
