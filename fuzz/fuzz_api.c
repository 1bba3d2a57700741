/*
 * fuzz_api.c: a libFuzzer harness over sf_verify, sf_sample and sf_probs.
 *
 * The input is decoded into one call: shapes, counts, parents, draft tokens,
 * draft distributions (dense or sparse), sampling parameters and logits
 * (NaN, +-inf, +-1e30, FLT_MAX, denormals, all-equal rows, all -inf rows,
 * ties, f32/f16/bf16, strided rows). Large rows come from a small PRNG seeded
 * by the input, so that a few hundred bytes describe a call of any size.
 *
 * The library must never crash (ASan and UBSan watch it), and:
 * - it returns SF_OK whenever the decoder built a valid call, and otherwise
 *   SF_OK or an input error (never SF_ERR_NO_MEMORY / SF_ERR_THREADS for
 *   these small calls), with err.index in [-1, batch);
 * - sf_probs rows are finite, in [0, 1], sum to 1, are 0 at -inf logits, are
 *   non-increasing in rank order (logit descending, id ascending) with a
 *   support that is a prefix of that order, give ties equal mass, are one-hot
 *   at the first largest logit when greedy, match a float64 softmax when no
 *   filter is on, and keep exactly ceil(top_p * min(top_k, V)) tokens of an
 *   all-equal row;
 * - sf_sample tokens lie in [0, V) and have positive probability;
 * - sf_verify outputs: tokens in [0, V) or -1 padding, num_accepted <=
 *   num_draft, accepted nodes forming a path from the root whose tokens are
 *   the emitted ones, every emitted token of positive probability under its
 *   row; greedy and coupled verification emit exactly what sf_sample emits at
 *   the same (seed, position + depth), accept the first matching child, and
 *   never end on a token that a child drafted; rejection sampling at a leaf
 *   emits what sf_sample(rejection) emits, and after rejecting one-hot drafts
 *   never emits one of their tokens;
 * - every call is deterministic and each request (row) gives the same result
 *   alone as inside the batch.
 * A broken invariant prints what broke and aborts, which libFuzzer reports.
 *
 * Build: fuzz/run.sh. Define SF_FUZZ_SKIP_KNOWN to keep the decoder away from
 * bugs already reported and not yet fixed (see make_params), for a run that
 * looks for new ones meanwhile.
 */
#include <float.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "specfast.h"

/* ---- input reader and PRNG ---- */

typedef struct reader {
    const uint8_t *p;
    size_t n, i;
} reader;

static uint8_t u8(reader *r) { return r->i < r->n ? r->p[r->i++] : 0; }
static uint32_t u32(reader *r) {
    uint32_t v = 0;
    for (int k = 0; k < 4; k++) v |= (uint32_t)u8(r) << (8 * k);
    return v;
}
static uint64_t u64(reader *r) { return (uint64_t)u32(r) | (uint64_t)u32(r) << 32; }

static uint64_t rng_state;
static uint64_t rnd(void) { /* splitmix64 */
    uint64_t z = (rng_state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
static double rnd_unit(void) { return (double)(rnd() >> 11) * (1.0 / 9007199254740992.0); }
static double rnd_normal(void) { /* Irwin-Hall of 4 uniforms: cheap, close enough */
    uint64_t z = rnd();
    double s = (double)(z & 0xFFFF) + (double)((z >> 16) & 0xFFFF) +
               (double)((z >> 32) & 0xFFFF) + (double)(z >> 48);
    return (s / 65536.0 - 2.0) * 1.7320508075688772;
}

/* ---- failures ---- */

static const char *g_what = "?";

__attribute__((noreturn, format(printf, 1, 2))) static void fail(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "\nspecfast fuzz: invariant broken in %s: ", g_what);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    abort();
}

static void *xcalloc(size_t n, size_t size) {
    void *p = calloc(n ? n : 1, size ? size : 1);
    if (!p) abort();
    return p;
}

/* ---- values ---- */

static const float SPECIAL[] = {
    0.0f, -0.0f, 1.0f, -1.0f, 0.5f, 2.0f, 10.0f, -10.0f, 100.0f, -100.0f,
    1e30f, -1e30f, FLT_MAX, -FLT_MAX, INFINITY, -INFINITY, NAN, 1e-30f,
    1e-45f, -1e-45f, 65504.0f, -65504.0f, 88.0f, -88.0f, 1e4f, -1e4f, 3.0f,
};
#define N_SPECIAL (int)(sizeof SPECIAL / sizeof SPECIAL[0])

static const int64_t VOCABS[] = {1, 2, 3, 5, 7, 15, 16, 17, 31, 32, 33, 64, 100,
                                 255, 256, 257, 1000, 4096, 4097, 5000, 9000};
#define N_VOCABS (int)(sizeof VOCABS / sizeof VOCABS[0])

/* f32 -> f16 bits, rounding toward zero; NaN stays NaN. */
static uint16_t f32_to_f16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    if (f != f) return sign | 0x7E00u;
    float a = fabsf(f);
    if (a >= 65520.0f) return sign | 0x7C00u; /* inf (or overflow) */
    if (a < 5.9604644775390625e-8f) return sign;
    if (a < 6.103515625e-5f) return sign | (uint16_t)(a / 5.9604644775390625e-8f);
    int e;
    float m = frexpf(a, &e); /* a = m 2^e, m in [0.5, 1) */
    return sign | (uint16_t)((e + 14) << 10) | (uint16_t)((m * 2048.0f - 1024.0f));
}
static float f16_to_f32(uint16_t h) {
    int e = (h >> 10) & 31, m = h & 1023;
    float v = e == 0 ? ldexpf((float)m, -24)
            : e == 31 ? (m ? NAN : INFINITY)
            : ldexpf((float)(m + 1024), e - 25);
    return (h & 0x8000u) ? -v : v;
}
static uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if (f != f) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)(u >> 16);
}
static float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* ---- logits ---- */

typedef struct logits_buf {
    sf_logits l;
    void *mem;
    float *val;     /* (rows, vocab): the values the library sees, decoded */
    int64_t rows;   /* rows allocated (>= l.rows) */
    uint8_t *bad;   /* per row: NaN or +inf present, or all -inf */
} logits_buf;

static void fill_row(reader *r, float *x, int64_t V) {
    uint8_t mode = u8(r) % 8;
    float scale_tab[] = {0.01f, 1.0f, 5.0f, 30.0f, 1e4f, 1e30f};
    float s = scale_tab[u8(r) % 6];
    switch (mode) {
    case 0: case 1: /* Gaussian */
        for (int64_t v = 0; v < V; v++) x[v] = (float)(rnd_normal() * s);
        break;
    case 2: { /* all equal */
        float c = SPECIAL[u8(r) % N_SPECIAL];
        if (c != c || c == INFINITY) c = 0.0f;
        if (u8(r) & 1) c = -INFINITY; /* an all -inf row, now and then */
        for (int64_t v = 0; v < V; v++) x[v] = c;
        break;
    }
    case 3: { /* banned tokens around a few finite ones */
        for (int64_t v = 0; v < V; v++) x[v] = -INFINITY;
        int k = u8(r) % 4;
        for (int i = 0; i < k; i++) x[rnd() % (uint64_t)V] = (float)(rnd_normal() * s);
        break;
    }
    case 4: /* small integers: many ties */
        for (int64_t v = 0; v < V; v++) x[v] = (float)(rnd() % 4);
        break;
    case 5: /* special values straight from the input */
        for (int64_t v = 0; v < V; v++) x[v] = SPECIAL[u8(r) % N_SPECIAL];
        break;
    case 6: /* Gaussian with a banned half */
        for (int64_t v = 0; v < V; v++)
            x[v] = (rnd() & 1) ? -INFINITY : (float)(rnd_normal() * s);
        break;
    default: /* one dominant token among near-ties */
        for (int64_t v = 0; v < V; v++) x[v] = (float)(rnd_normal() * 1e-6);
        x[rnd() % (uint64_t)V] = s;
        break;
    }
    int overrides = u8(r) % 6;
    for (int i = 0; i < overrides; i++) {
        int64_t v = (int64_t)(u32(r) % (uint32_t)V);
        x[v] = SPECIAL[u8(r) % N_SPECIAL];
    }
}

static void make_logits(reader *r, logits_buf *b, int64_t rows, int64_t claimed_rows,
                        int64_t V) {
    const sf_dtype dt = (sf_dtype)(u8(r) % 3);
    const int64_t stride = V + (u8(r) % 4 == 0 ? (int64_t)(u8(r) % 5) : 0);
    b->rows = rows > claimed_rows ? rows : claimed_rows;
    b->val = xcalloc((size_t)(b->rows * V), sizeof(float));
    b->bad = xcalloc((size_t)b->rows, 1);
    const size_t es = dt == SF_F32 ? 4 : 2;
    /* exactly the bytes the library may read: rows - 1 strides and a row */
    size_t bytes = b->rows ? (size_t)((b->rows - 1) * stride + V) * es : es;
    b->mem = malloc(bytes);
    if (!b->mem) abort();
    memset(b->mem, 0x7F, bytes); /* padding between rows: large, never read */
    for (int64_t row = 0; row < b->rows; row++) {
        float *x = b->val + row * V;
        fill_row(r, x, V);
        int finite = 0, bad = 0;
        for (int64_t v = 0; v < V; v++) {
            float f = x[v];
            if (dt == SF_F32) {
                ((float *)b->mem)[row * stride + v] = f;
            } else {
                uint16_t h = dt == SF_F16 ? f32_to_f16(f) : f32_to_bf16(f);
                ((uint16_t *)b->mem)[row * stride + v] = h;
                f = dt == SF_F16 ? f16_to_f32(h) : bf16_to_f32(h);
                x[v] = f;
            }
            if (f != f || f == INFINITY) bad = 1;
            if (f > -INFINITY) finite = 1;
        }
        b->bad[row] = (uint8_t)(bad || !finite);
    }
    b->l = (sf_logits){b->mem, dt, claimed_rows, V, stride};
}

static void free_logits(logits_buf *b) {
    free(b->mem);
    free(b->val);
    free(b->bad);
}

/* ---- parameters ---- */

typedef struct params_buf {
    float *temperature, *top_p, *min_p;
    int32_t *top_k;
    uint64_t *seed;
    int64_t *position;
    sf_params p;
    int valid;
} params_buf;

/* A temperature so small that log2(e) / T overflows float: the library may
 * treat it as greedy (one-hot at the first largest logit) or as its limit
 * (all mass on the tied maxima); the checks accept either. */
static int tiny_t(float t) {
    return t > 0.0f && !((1.0f / t) * 1.44269504088896341f < INFINITY);
}

static void make_params(reader *r, params_buf *pb, int64_t batch, int64_t V) {
    static const float TEMPS[] = {1.0f, 0.7f, 0.0f, 1e-3f, 1e-6f, 1e-20f, 1e-38f,
                                  3.5e-39f, 1e-45f, 2.0f, 1e30f, FLT_MAX, -0.0f,
                                  -1.0f, NAN, INFINITY};
    static const float TOPP[] = {1.0f, 0.9f, 0.5f, 0.1f, 1e-6f, 1e-30f,
                                 0.99999994f, 1e-45f, 0.0f, -0.5f, 1.5f, NAN};
    static const float MINP[] = {0.0f, 0.05f, 0.5f, 1.0f, 0.999f, 1e-30f, 1e-45f,
                                 -0.1f, 1.1f, NAN};
    const int64_t n = batch > 0 ? batch : 1;
    uint8_t shape = u8(r);
    int64_t cnt[6];
    for (int i = 0; i < 6; i++) cnt[i] = ((shape >> i) & 1) ? n : 1;
    pb->temperature = xcalloc((size_t)cnt[0], 4);
    pb->top_k = xcalloc((size_t)cnt[1], 4);
    pb->top_p = xcalloc((size_t)cnt[2], 4);
    pb->min_p = xcalloc((size_t)cnt[3], 4);
    pb->seed = xcalloc((size_t)cnt[4], 8);
    pb->position = xcalloc((size_t)cnt[5], 8);
    pb->valid = 1;
    /* Mostly valid values: invalid ones sit at the end of each table. */
    for (int64_t i = 0; i < cnt[0]; i++) {
        uint8_t c = u8(r);
        float t = TEMPS[(c & 0x80) ? c % 16 : c % 13];
        pb->temperature[i] = t;
        if (!(t >= 0.0f && t <= SF_MAX_TEMPERATURE)) pb->valid = 0;
    }
    for (int64_t i = 0; i < cnt[1]; i++) {
        uint8_t c = u8(r);
        int64_t k;
        switch (c % 12) {
        case 0: case 1: case 2: k = 0; break;
        case 3: k = 1; break;
        case 4: k = 2; break;
        case 5: k = 1 + u8(r); break;
        case 6: k = V - 1; break;
        case 7: k = V; break;
        case 8: k = V + 1; break;
        case 9: k = INT32_MAX; break;
        case 10: k = 50; break;
        default: k = (c & 0x80) ? -1 : 5; break;
        }
        pb->top_k[i] = (int32_t)k;
        if (k < 0) pb->valid = 0;
    }
    for (int64_t i = 0; i < cnt[2]; i++) {
        uint8_t c = u8(r);
        float p = TOPP[(c & 0x80) ? c % 12 : c % 8];
        pb->top_p[i] = p;
        if (!(p > 0.0f && p <= 1.0f)) pb->valid = 0;
    }
    for (int64_t i = 0; i < cnt[3]; i++) {
        uint8_t c = u8(r);
        float p = MINP[(c & 0x80) ? c % 10 : c % 7];
        pb->min_p[i] = p;
        if (!(p >= 0.0f && p <= 1.0f)) pb->valid = 0;
    }
    for (int64_t i = 0; i < cnt[4]; i++) pb->seed[i] = (u8(r) & 1) ? u64(r) : u8(r);
    for (int64_t i = 0; i < cnt[5]; i++) {
        uint8_t c = u8(r);
        int64_t pos;
        switch (c % 8) {
        case 0: case 1: pos = 0; break;
        case 2: pos = u8(r); break;
        case 3: pos = (int64_t)u32(r); break;
        case 4: pos = -1 - (int64_t)u8(r); break;
        case 5: pos = INT64_MIN; break;
        case 6: pos = INT64_MAX - (int64_t)(u8(r) % 70); break;
        default: pos = (int64_t)u64(r); break;
        }
        pb->position[i] = pos;
    }
#ifdef SF_FUZZ_SKIP_KNOWN
    /* Steer clear of reported, unfixed bugs here (none open now). Fixed:
     * position + depth overflowing int64 in sf_verify; temperatures whose
     * log2(e) / T overflows (2.9e-39 to 4.3e-39) giving NaN masses. */
#endif
    pb->p = (sf_params){pb->temperature, cnt[0], pb->top_k, cnt[1], pb->top_p, cnt[2],
                        pb->min_p, cnt[3], pb->seed, cnt[4], pb->position, cnt[5]};
    /* A mismatched count, now and then. */
    if (batch > 1 && (shape & 0xC0) == 0xC0) {
        pb->p.n_top_p = batch - 1;
        if (cnt[2] == n) pb->valid = 0; else pb->p.n_top_p = 1;
    }
}

static void free_params(params_buf *pb) {
    free(pb->temperature);
    free(pb->top_k);
    free(pb->top_p);
    free(pb->min_p);
    free(pb->seed);
    free(pb->position);
}

/* Parameters of request b alone, with `dpos` added to its position. */
static sf_params one_params(const sf_params *p, int64_t b, int64_t dpos, float *t,
                            int32_t *k, float *tp, float *mp, uint64_t *seed,
                            int64_t *pos) {
#define PICK(f) (p->f[p->n_##f == 1 ? 0 : b])
    *t = PICK(temperature);
    *k = PICK(top_k);
    *tp = PICK(top_p);
    *mp = PICK(min_p);
    *seed = PICK(seed);
    *pos = (int64_t)((uint64_t)PICK(position) + (uint64_t)dpos);
#undef PICK
    return (sf_params){t, 1, k, 1, tp, 1, mp, 1, seed, 1, pos, 1};
}

/* ---- checks of one row ---- */

static const float *g_rank_x;
static int rank_cmp(const void *a, const void *b) {
    int32_t i = *(const int32_t *)a, j = *(const int32_t *)b;
    float x = g_rank_x[i], y = g_rank_x[j];
    if (x > y) return -1;
    if (x < y) return 1;
    return (i > j) - (i < j);
}

/* sf_probs of one row of `lb` under request b's parameters. */
static sf_status row_probs(const logits_buf *lb, int64_t row, const sf_params *p,
                           int64_t b, float *out) {
    float t, tp, mp;
    int32_t k;
    uint64_t seed;
    int64_t pos;
    sf_params one = one_params(p, b, 0, &t, &k, &tp, &mp, &seed, &pos);
    const size_t es = lb->l.dtype == SF_F32 ? 4 : 2;
    sf_logits l1 = {(const char *)lb->l.data + (size_t)(row * lb->l.row_stride) * es,
                    lb->l.dtype, 1, lb->l.vocab, lb->l.vocab};
    sf_error err;
    return sf_probs(&l1, &one, out, &err);
}

/* sf_sample of one row of `lb` under request b's parameters at position + dpos. */
static int32_t row_sample(const logits_buf *lb, int64_t row, const sf_params *p,
                          int64_t b, int64_t dpos, sf_method m) {
    float t, tp, mp;
    int32_t k;
    uint64_t seed;
    int64_t pos;
    sf_params one = one_params(p, b, dpos, &t, &k, &tp, &mp, &seed, &pos);
    const size_t es = lb->l.dtype == SF_F32 ? 4 : 2;
    sf_logits l1 = {(const char *)lb->l.data + (size_t)(row * lb->l.row_stride) * es,
                    lb->l.dtype, 1, lb->l.vocab, lb->l.vocab};
    sf_error err;
    int32_t tok = -7;
    sf_status st = sf_sample(&l1, &one, m, &tok, &err);
    if (st != SF_OK) fail("sf_sample of row %lld failed (%d) after the batch call passed",
                          (long long)row, (int)st);
    return tok;
}

static int32_t first_argmax(const float *x, int64_t V) {
    int32_t best = 0;
    for (int64_t v = 1; v < V; v++)
        if (x[v] > x[best]) best = (int32_t)v;
    return best;
}

/* Every property of one sf_probs row (see the top of the file). */
static void check_probs_row(const float *x, const float *pr, int64_t V, float T,
                            int32_t top_k, float top_p, float min_p, int64_t row) {
    double sum = 0.0;
    int64_t support = 0;
    float pmax = 0.0f;
    for (int64_t v = 0; v < V; v++) {
        float p = pr[v];
        if (!(p >= 0.0f && p <= 1.0f))
            fail("row %lld: p[%lld] = %g out of [0, 1]", (long long)row, (long long)v, p);
        if (x[v] == -INFINITY && p != 0.0f)
            fail("row %lld: banned token %lld has p = %g", (long long)row, (long long)v, p);
        sum += p;
        support += p > 0.0f;
        if (p > pmax) pmax = p;
    }
    if (!(fabs(sum - 1.0) <= 1e-4))
        fail("row %lld: probabilities sum to %.9g", (long long)row, sum);
    if (T == 0.0f) {
        int32_t g = first_argmax(x, V);
        if (pr[g] != 1.0f) fail("row %lld: greedy row not one-hot at %d", (long long)row, g);
        return;
    }
    if (tiny_t(T)) {
        /* log2(e) / T overflows float and is capped at FLT_MAX (shared.h): a
         * token keeps mass only if its distance to the max, so scaled, is
         * above the 2^-125 floor of sf_exp2; tokens tied with the max (and
         * those within a few FLT_MIN of it) share the mass. */
        int32_t g = first_argmax(x, V);
        if (!(pr[g] > 0.0f)) fail("row %lld: T = %g, the first max %d has p = 0",
                                  (long long)row, T, g);
        for (int64_t v = 0; v < V; v++)
            if (pr[v] > 0.0f && !((double)(x[v] - x[g]) * FLT_MAX >= -126.0))
                fail("row %lld: T = %g keeps %lld far below the max", (long long)row, T,
                     (long long)v);
        return;
    }
    int32_t *order = xcalloc((size_t)V, 4);
    for (int64_t v = 0; v < V; v++) order[v] = (int32_t)v;
    g_rank_x = x;
    qsort(order, (size_t)V, 4, rank_cmp);
    for (int64_t i = 1; i < V; i++) {
        int32_t a = order[i - 1], c = order[i];
        if (pr[c] > 0.0f && !(pr[a] > 0.0f))
            fail("row %lld: support not a prefix of the rank order (%d has 0, %d has %g)",
                 (long long)row, a, c, pr[c]);
        /* exp2 is a polynomial per unit interval: at the seams a larger
         * logit may get a mass a few ulps smaller (measured: 1e-7 relative). */
        if (pr[c] > pr[a] * (1.0f + 4e-7f) + 1e-12f)
            fail("row %lld: p not monotone in rank (p[%d] = %.9g < p[%d] = %.9g)",
                 (long long)row, a, pr[a], c, pr[c]);
        if (x[a] == x[c] && pr[c] > 0.0f && pr[a] != pr[c])
            fail("row %lld: tied logits %d and %d differ: %g vs %g", (long long)row, a, c,
                 pr[a], pr[c]);
    }
    if (pr[order[0]] <= 0.0f) fail("row %lld: the top token has p = 0", (long long)row);
    int64_t kk = top_k > 0 && top_k < V ? top_k : V;
    if (support > kk) fail("row %lld: %lld tokens kept, top_k %d", (long long)row,
                           (long long)support, top_k);
    if (min_p > 0.0f)
        for (int64_t v = 0; v < V; v++)
            if (pr[v] > 0.0f && pr[v] < min_p * pmax * 0.9999f - 1e-7f)
                fail("row %lld: p[%lld] = %g below min_p %g of %g", (long long)row,
                     (long long)v, pr[v], min_p, pmax);
    /* An all-equal finite row keeps the lowest ids: ceil(top_p * min(top_k, V)). */
    int equal = x[0] > -INFINITY;
    for (int64_t v = 1; v < V && equal; v++) equal = x[v] == x[0];
    if (equal) {
        int64_t want = (int64_t)ceil((double)top_p * (double)kk);
        if (want < 1) want = 1;
        if (support != want)
            fail("row %lld: all-equal row kept %lld tokens, expected %lld (top_k %d top_p %g)",
                 (long long)row, (long long)support, (long long)want, top_k, top_p);
    }
    if (kk == V && top_p == 1.0f && min_p == 0.0f) {
        /* No filter: a float64 softmax. */
        double m = x[order[0]], z = 0.0;
        for (int64_t v = 0; v < V; v++) z += exp(((double)x[v] - m) / (double)T);
        for (int64_t v = 0; v < V; v++) {
            double ref = exp(((double)x[v] - m) / (double)T) / z;
            if (!(fabs(pr[v] - ref) <= 1e-6 + 2e-4 * ref))
                fail("row %lld: p[%lld] = %.9g, softmax %.9g (T = %g)", (long long)row,
                     (long long)v, pr[v], ref, T);
        }
    }
    free(order);
}

/* ---- the three entry points ---- */

static void check_status(sf_status st, const sf_error *err, int64_t n_index, int valid) {
    if (valid && st != SF_OK) fail("a valid call failed with %d (%s) at index %lld", (int)st,
                                   sf_status_string(st), (long long)err->index);
    if (st == SF_ERR_NO_MEMORY || st == SF_ERR_THREADS || st == SF_ERR_UNSUPPORTED ||
        (int)st < 0 || (int)st > SF_ERR_UNSUPPORTED)
        fail("status %d for a small call", (int)st);
    if (err->index < -1 || err->index >= (n_index > 0 ? n_index : 1))
        fail("err.index %lld out of range", (long long)err->index);
}

static void run_rows(reader *r, int op) {
    const int64_t V = VOCABS[u8(r) % N_VOCABS];
    int64_t rows = u8(r) % 5;
    if (V > 1000 && rows > 2) rows = 2;
    logits_buf lb;
    make_logits(r, &lb, rows, rows, V);
    params_buf pb;
    make_params(r, &pb, rows, V);
    int valid = pb.valid;
    for (int64_t i = 0; i < rows; i++) valid &= !lb.bad[i];
    sf_error err = {-5};
    if (op == 0) {
        g_what = "sf_probs";
        float *out = xcalloc((size_t)(rows * V), 4);
        sf_status st = sf_probs(&lb.l, &pb.p, out, &err);
        check_status(st, &err, rows, valid);
        if (st == SF_OK) {
            for (int64_t i = 0; i < rows; i++) {
                float t, tp, mp;
                int32_t k;
                uint64_t seed;
                int64_t pos;
                one_params(&pb.p, i, 0, &t, &k, &tp, &mp, &seed, &pos);
                check_probs_row(lb.val + i * V, out + i * V, V, t, k, tp, mp, i);
            }
        }
        free(out);
    } else {
        g_what = "sf_sample";
        uint8_t mb = u8(r);
        sf_method m = (sf_method)(mb % 16 == 15 ? 2 : mb & 1);
        if (m > SF_COUPLED) valid = 0;
        int32_t *tok = xcalloc((size_t)rows, 4), *again = xcalloc((size_t)rows, 4);
        sf_status st = sf_sample(&lb.l, &pb.p, m, tok, &err);
        check_status(st, &err, rows, valid);
        if (st == SF_OK) {
            if (sf_sample(&lb.l, &pb.p, m, again, &err) != SF_OK ||
                memcmp(tok, again, (size_t)rows * 4))
                fail("sf_sample is not deterministic");
            float *pr = xcalloc((size_t)V, 4);
            for (int64_t i = 0; i < rows; i++) {
                if (tok[i] < 0 || tok[i] >= V) fail("row %lld: token %d", (long long)i, tok[i]);
                if (row_probs(&lb, i, &pb.p, i, pr) != SF_OK) fail("sf_probs failed");
                if (!(pr[tok[i]] > 0.0f))
                    fail("row %lld: sampled token %d has p = 0", (long long)i, tok[i]);
                if (row_sample(&lb, i, &pb.p, i, 0, m) != tok[i])
                    fail("row %lld: token differs alone and in the batch", (long long)i);
            }
            free(pr);
        }
        free(tok);
        free(again);
    }
    free_params(&pb);
    free_logits(&lb);
}

typedef struct draft_buf {
    int32_t *tokens, *num_draft, *parents, *sparse_ids;
    float *dense, *sparse_probs;
    int64_t *node0;
    sf_draft d;
    int valid;
} draft_buf;

static void run_verify(reader *r) {
    g_what = "sf_verify";
    const int64_t V = VOCABS[u8(r) % N_VOCABS];
    uint8_t bb = u8(r);
    int64_t batch = bb % 6;
    if (bb >= 0xF0) batch = 6 + bb % 30;
    draft_buf db;
    memset(&db, 0, sizeof db);
    db.valid = 1;
    db.num_draft = xcalloc((size_t)batch, 4);
    db.node0 = xcalloc((size_t)batch + 1, 8);
    int64_t n = 0, max_nd = 0;
    for (int64_t b = 0; b < batch; b++) {
        uint8_t c = u8(r);
        int32_t nd = c % 10;
        if (c == 0xFF) nd = 64; /* a long chain */
        if (c == 0xFE) { nd = -1; db.valid = 0; }
        if (c == 0xFD) { nd = SF_MAX_DRAFT + 1; db.valid = 0; }
        db.num_draft[b] = nd;
        db.node0[b] = n;
        if (nd > 0 && nd <= 64) n += nd;
        if (nd > max_nd && nd <= 64) max_nd = nd;
    }
    db.node0[batch] = n;
    if (V * (n + batch) > 150000) { /* keep a run fast */
        free(db.num_draft);
        free(db.node0);
        return;
    }
    int64_t rows = n + batch, claimed = rows;
    uint8_t shape = u8(r);
    if (shape == 0xFF) { claimed = rows + 1; db.valid = 0; }
    if (shape == 0xFE && rows > 0) { claimed = rows - 1; db.valid = 0; }
    logits_buf lb;
    make_logits(r, &lb, rows, claimed, V);
    params_buf pb;
    make_params(r, &pb, batch, V);

    /* parents */
    uint8_t pmode = u8(r) % 5;
    db.parents = pmode ? xcalloc((size_t)n, 4) : NULL;
    db.tokens = xcalloc((size_t)n, 4);
    int64_t *prow_of = xcalloc((size_t)n, 8); /* each node's parent row */
    for (int64_t b = 0; b < batch; b++) {
        for (int32_t i = 0; i < db.num_draft[b] && db.num_draft[b] <= 64; i++) {
            int64_t node = db.node0[b] + i;
            int32_t par = i - 1;
            if (pmode == 1 || pmode == 4) par = (int32_t)(u8(r) % (uint32_t)(i + 1)) - 1;
            if (pmode == 2) par = -1;
            prow_of[node] = db.node0[b] + b + par + 1;
            if (pmode == 4 && u8(r) == 0xFF) { par = (u8(r) & 1) ? i : -2; db.valid = 0; }
            if (db.parents) db.parents[node] = par;
            /* tokens: the parent row's argmax (accepted often), else random */
            uint8_t tm = u8(r) % 8;
            const float *prow = lb.val + prow_of[node] * V;
            int64_t t;
            if (tm < 4) t = first_argmax(prow, V);
            else if (tm < 6) t = (int64_t)(rnd() % (uint64_t)V);
            else if (tm == 6) t = u8(r) % V;
            else {
                uint8_t z = u8(r);
                t = z == 0xFF ? V : z == 0xFE ? -1 : 0;
                if (t < 0 || t >= V) db.valid = 0;
            }
            db.tokens[node] = (int32_t)t;
        }
    }

    /* draft distributions */
    sf_draft_kind kind = (sf_draft_kind)(u8(r) % 3);
    int64_t sk = 0;
    if (kind == SF_DRAFT_DENSE && n * V <= 300000) {
        db.dense = xcalloc((size_t)(n * V), 4);
        for (int64_t node = 0; node < n; node++) {
            float *q = db.dense + node * V;
            int32_t tok = db.tokens[node];
            int tin = tok >= 0 && tok < V;
            uint8_t qm = u8(r) % 10;
            double s = 0.0;
            switch (qm) {
            case 0: case 1: case 2: /* random, normalised */
                for (int64_t v = 0; v < V; v++) s += q[v] = (float)rnd_unit();
                break;
            case 3: /* one-hot at the token */
                if (tin) s = q[tok] = 1.0f; else s = q[0] = 1.0f;
                break;
            case 4: /* q(token) = 0: a rejection */
                for (int64_t v = 0; v < V; v++) s += q[v] = (v == tok) ? 0.0f : 1.0f;
                if (s == 0.0) s = q[0] = 1.0f; /* V = 1 */
                break;
            case 5: /* the target's own distribution */
                if (row_probs(&lb, prow_of[node], &pb.p, 0, q) == SF_OK) {
                    for (int64_t v = 0; v < V; v++) s += q[v];
                } else {
                    for (int64_t v = 0; v < V; v++) s += q[v] = 1.0f;
                }
                break;
            default: /* uniform */
                for (int64_t v = 0; v < V; v++) s += q[v] = 1.0f;
                break;
            }
            for (int64_t v = 0; v < V; v++) q[v] = (float)(q[v] / s);
            uint8_t bad = u8(r);
            if (bad >= 0xF8) {
                db.valid = 0;
                switch (bad & 3) {
                case 0: q[rnd() % (uint64_t)V] = -0.25f; break;
                case 1: q[rnd() % (uint64_t)V] = NAN; break;
                case 2: for (int64_t v = 0; v < V; v++) q[v] *= 0.5f; break;
                default: q[rnd() % (uint64_t)V] = INFINITY; break;
                }
            }
        }
    } else if (kind == SF_DRAFT_SPARSE) {
        uint8_t kc = u8(r);
        sk = 1 + kc % 6;
        if (kc == 0xFF) sk = 40;
        if (sk > V + 2) sk = V + 2;
        if (kc == 0xFE) { sk = 0; db.valid = 0; }
        db.sparse_ids = xcalloc((size_t)(n * (sk ? sk : 1)), 4);
        db.sparse_probs = xcalloc((size_t)(n * (sk ? sk : 1)), 4);
        for (int64_t node = 0; node < n && sk > 0; node++) {
            int32_t *ids = db.sparse_ids + node * sk;
            float *pr = db.sparse_probs + node * sk;
            int32_t tok = db.tokens[node];
            /* distinct ids: the token first (usually), then consecutive ids */
            int64_t used = 0;
            uint8_t im = u8(r);
            int64_t start = (int64_t)(rnd() % (uint64_t)V);
            if ((im & 3) != 0 && tok >= 0 && tok < V) ids[used++] = tok;
            for (int64_t off = 0; used < sk && off < V; off++) {
                int32_t id = (int32_t)((start + off) % V);
                int dup = 0;
                for (int64_t z = 0; z < used; z++) dup |= ids[z] == id;
                if (!dup && (im & 4) == 0) ids[used++] = id;
                else if (!dup && (off & 1)) ids[used++] = id;
            }
            double s = 0.0;
            for (int64_t a = 0; a < sk; a++) {
                if (a >= used) { ids[a] = -1; pr[a] = 0.0f; continue; }
                pr[a] = (im & 8) && a == 0 ? 0.0f : (float)(0.05 + rnd_unit());
                s += pr[a];
            }
            if (s == 0.0 && used > 0) { pr[used - 1] = 1.0f; s = 1.0; }
            if (used == 0) db.valid = 0; /* probabilities cannot sum to 1 */
            for (int64_t a = 0; a < used; a++) pr[a] = (float)(pr[a] / s);
            uint8_t bad = u8(r);
            if (bad >= 0xF8) {
                db.valid = 0;
                int64_t a = (int64_t)(rnd() % (uint64_t)sk);
                switch (bad & 7) {
                case 0: pr[a] = -0.1f; break;
                case 1: pr[a] = NAN; break;
                case 2: pr[a] += 0.5f; break;
                case 3: ids[a] = (int32_t)V; break;
                case 4: ids[a] = -2; break;
                case 5: ids[a] = ids[(a + 1) % sk]; if (sk == 1) ids[a] = -2; break;
                case 6: ids[a] = -1; pr[a] = pr[a] > 0.0f ? pr[a] : 0.5f; break;
                default: pr[a] = INFINITY; break;
                }
            }
        }
    } else {
        kind = SF_DRAFT_NONE;
    }
    if (n == 0 && kind == SF_DRAFT_SPARSE && sk > 0 && (u8(r) & 1)) {
        /* NULL arrays for zero nodes are allowed */
        free(db.sparse_ids);
        free(db.sparse_probs);
        db.sparse_ids = NULL;
        db.sparse_probs = NULL;
    }
    db.d = (sf_draft){db.tokens, n, db.num_draft, batch, db.parents, kind,
                      db.dense, db.sparse_ids, db.sparse_probs, sk};
    if (kind == SF_DRAFT_NONE) {
        db.d.dense = NULL;
        db.d.sparse_ids = NULL;
        db.d.sparse_probs = NULL;
        db.d.sparse_k = 0;
    }

    uint8_t oc = u8(r);
    int64_t max_draft = max_nd + oc % 3;
    if (oc == 0xFF && max_nd > 0) { max_draft = max_nd - 1; db.valid = 0; }
    const int64_t width = max_draft + 1;
    sf_method m = (sf_method)(oc == 0xFE ? 7 : (oc >> 2) & 1);
    int valid = db.valid && pb.valid && m <= SF_COUPLED;
    for (int64_t i = 0; i < claimed; i++) valid &= !lb.bad[i];
    int32_t *otok = xcalloc((size_t)(batch * width), 4), *oacc = xcalloc((size_t)batch, 4);
    int32_t *onodes = max_draft > 0 ? xcalloc((size_t)(batch * max_draft), 4) : NULL;
    if (max_draft == 0 && (oc & 0x80)) onodes = xcalloc(1, 4); /* unused, allowed */
    sf_verify_out out = {otok, oacc, onodes, max_draft};
    sf_error err = {-5};
    sf_status st = sf_verify(&lb.l, &db.d, &pb.p, m, &out, &err);
    check_status(st, &err, batch, valid);

    if (st == SF_OK) {
        /* determinism */
        int32_t *t2 = xcalloc((size_t)(batch * width), 4), *a2 = xcalloc((size_t)batch, 4);
        int32_t *n2 = max_draft > 0 ? xcalloc((size_t)(batch * max_draft), 4) : NULL;
        sf_verify_out out2 = {t2, a2, n2, max_draft};
        if (sf_verify(&lb.l, &db.d, &pb.p, m, &out2, &err) != SF_OK ||
            memcmp(t2, otok, (size_t)(batch * width) * 4) ||
            memcmp(a2, oacc, (size_t)batch * 4) ||
            (n2 && memcmp(n2, onodes, (size_t)(batch * max_draft) * 4)))
            fail("sf_verify is not deterministic");
        free(t2);
        free(a2);
        free(n2);

        float *pr = xcalloc((size_t)V, 4);
        for (int64_t b = 0; b < batch; b++) {
            const int32_t nd = db.num_draft[b];
            const int64_t node0 = db.node0[b], row0 = node0 + b;
            const int32_t na = oacc[b];
            const int32_t *tk = otok + b * width;
            const int32_t *an = onodes ? onodes + b * max_draft : NULL;
            if (na < 0 || na > nd) fail("request %lld: num_accepted %d of %d", (long long)b, na, nd);
            float t, tp, mp;
            int32_t k;
            uint64_t seed;
            int64_t pos;
            one_params(&pb.p, b, 0, &t, &k, &tp, &mp, &seed, &pos);
            const int greedy = t == 0.0f; /* tiny_t: checked as T > 0, valid for both */
            int32_t cur = -1;
            for (int32_t d = 0; d <= na; d++) {
                const int64_t row = row0 + cur + 1;
                const int32_t x = tk[d];
                if (x < 0 || x >= V) fail("request %lld: token %d at depth %d", (long long)b, x, d);
                if (row_probs(&lb, row, &pb.p, b, pr) != SF_OK)
                    fail("request %lld: sf_probs failed on a row verify read", (long long)b);
                if (!(pr[x] > 0.0f))
                    fail("request %lld: depth %d emitted token %d of p = 0", (long long)b, d, x);
                int32_t node = d < na ? an[d] : -1;
                if (d < na) {
                    if (node < 0 || node >= nd) fail("request %lld: node %d", (long long)b, node);
                    int32_t par = db.parents ? db.parents[node0 + node] : node - 1;
                    if (par != cur) fail("request %lld: node %d's parent %d is not %d",
                                         (long long)b, node, par, cur);
                    if (db.tokens[node0 + node] != x)
                        fail("request %lld: token %d is not node %d's %d", (long long)b, x,
                             node, db.tokens[node0 + node]);
                }
                /* children of cur, in node order */
                int first_match = -1;
                for (int32_t c = 0; c < nd; c++) {
                    int32_t par = db.parents ? db.parents[node0 + c] : c - 1;
                    if (par != cur) continue;
                    if (first_match < 0 && db.tokens[node0 + c] == x) first_match = c;
                    if (d == na && kind == SF_DRAFT_NONE && db.tokens[node0 + c] == x)
                        fail("request %lld: emitted %d after rejecting a draft of it",
                             (long long)b, x);
                }
                if (greedy || m == SF_COUPLED) {
                    int32_t want = row_sample(&lb, row, &pb.p, b, d, m);
                    if (x != want)
                        fail("request %lld depth %d: %d, sf_sample gives %d", (long long)b, d,
                             x, want);
                    if (d < na && first_match != node)
                        fail("request %lld: accepted node %d, not the first match %d",
                             (long long)b, node, first_match);
                    if (d == na && first_match >= 0)
                        fail("request %lld: ended on %d, which child %d drafted",
                             (long long)b, x, first_match);
                } else if (d == na && first_match < 0) {
                    int leaf = 1;
                    for (int32_t c = 0; c < nd; c++)
                        leaf &= (db.parents ? db.parents[node0 + c] : c - 1) != cur;
                    if (leaf && row_sample(&lb, row, &pb.p, b, d, m) != x)
                        fail("request %lld: leaf draw %d differs from sf_sample", (long long)b, x);
                }
                cur = node;
            }
            for (int64_t i = na + 1; i < width; i++)
                if (tk[i] != -1) fail("request %lld: padding %d at %lld", (long long)b, tk[i],
                                      (long long)i);
            for (int64_t i = na; an && i < max_draft; i++)
                if (an[i] != -1) fail("request %lld: node padding %d", (long long)b, an[i]);

            /* the request alone gives the same result */
            if (batch > 1) {
                int32_t one_nd = nd, ot[65 + 3], oa = -3, on[64 + 3];
                sf_params one = one_params(&pb.p, b, 0, &t, &k, &tp, &mp, &seed, &pos);
                const size_t es = lb.l.dtype == SF_F32 ? 4 : 2;
                sf_logits l1 = lb.l;
                l1.data = (const char *)lb.l.data + (size_t)(row0 * lb.l.row_stride) * es;
                l1.rows = nd + 1;
                sf_draft d1 = db.d;
                d1.tokens = db.tokens + node0;
                d1.n = nd;
                d1.num_draft = &one_nd;
                d1.batch = 1;
                if (d1.parents) d1.parents = db.parents + node0;
                if (d1.dense) d1.dense = db.dense + node0 * V;
                if (d1.sparse_ids) {
                    d1.sparse_ids = db.sparse_ids + node0 * sk;
                    d1.sparse_probs = db.sparse_probs + node0 * sk;
                }
                sf_verify_out o1 = {ot, &oa, on, nd};
                if (sf_verify(&l1, &d1, &one, m, &o1, &err) != SF_OK || oa != na ||
                    memcmp(ot, tk, (size_t)(nd + 1) * 4) ||
                    (nd && memcmp(on, an, (size_t)nd * 4)))
                    fail("request %lld differs alone and in the batch", (long long)b);
            }
        }
        free(pr);
    }
    free(otok);
    free(oacc);
    free(onodes);
    free(prow_of);
    free(db.tokens);
    free(db.num_draft);
    free(db.node0);
    free(db.parents);
    free(db.dense);
    free(db.sparse_ids);
    free(db.sparse_probs);
    free_params(&pb);
    free_logits(&lb);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    reader r = {data, size, 0};
    uint8_t head = u8(&r);
    rng_state = u64(&r);
    if ((head & 0xF0) == 0xF0) {
        /* The pool: change its size now and then. */
        if (sf_set_num_threads(1 + (head & 3)) != SF_OK) fail("sf_set_num_threads");
    }
    switch (head % 4) {
    case 0: run_rows(&r, 0); break;
    case 1: run_rows(&r, 1); break;
    default: run_verify(&r); break;
    }
    return 0;
}
