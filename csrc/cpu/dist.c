/* dist.c: a row's target distribution (filters without sorting the row) and
 * the residuals of recursive rejection sampling. */
#include "dist.h"

#include <float.h>
#include <math.h>
#include <string.h>

#include "rowmath.h"

/* Tokens between two pivots of a top-k cut scan that are sorted, not bisected. */
#define SF_TOP_K_SORT 4096
/* Buckets of top_p's histogram: a token's e (in (0, 1]) by its float bits
 * past 7 mantissa bits, 128 a power of two, in logit order (e is monotone). */
#define SF_TOP_P_SHIFT 16
#define SF_TOP_P_BUCKETS ((0x3F800000 >> SF_TOP_P_SHIFT) + 1)
/* Up to this top_k a one-pass reservoir finds the cut; above, a cut scan. */
#define SF_TOP_K_RESERVOIR 4096
/* Tokens spread evenly over a row whose order estimates where its k-th best
 * lies (top-k), on rows of 4 times as many tokens or more. */
#define SF_SAMPLE 2048
/* From this top_k the reservoir takes its entry bar from the sample. */
#define SF_TOP_K_BAR 256

/* A lone request's row is split across threads from this many tokens; the
 * max and bound passes, a few operations a token, from SF_SPLIT_VOCAB_CHEAP
 * (below it, waking the pool and moving the row between cores cost more than
 * the half pass they save). */
#define SF_SPLIT_VOCAB 16384
#define SF_SPLIT_VOCAB_CHEAP 32768
#define SF_MAX_SPLIT 64

/* The slack sf_dist_ref_accepts allows the reference bound's sum. */
#define SF_REF_MARGIN 1.001
/* Past this over u q(x) the reference sum, which over-states the mass by
 * 6.2% at most (vexp2_up's chord) and its float sums' error, shows a
 * rejection all but surely: there the max pass stops the sum and its
 * prefetch of the child's row. */
#define SF_REF_REJECT 1.07

/* The parts a lone request's pass over n tokens is split into: the pool's
 * width (at most SF_MAX_SPLIT) from `from` tokens on, else 1. A part's
 * tokens, *per, are a multiple of `unit`. */
static int split_parts(int64_t n, int64_t from, int64_t unit, int64_t *per) {
    int parts = sf_parallel_width();
    if (parts > SF_MAX_SPLIT) parts = SF_MAX_SPLIT;
    if (parts < 2 || n < from) return 1;
    *per = ((n + parts - 1) / parts + unit - 1) / unit * unit;
    return parts;
}

/* Part `part`'s first token (*lo) and how many tokens it takes: `per`, fewer
 * at the row's end, 0 past it. */
static int64_t part_len(int64_t part, int64_t per, int64_t n, int64_t *lo) {
    *lo = part * per;
    return *lo >= n ? 0 : (n - *lo < per ? n - *lo : per);
}

typedef struct split_ctx {
    const sf_kernels *k;
    const sf_row *row;
    sf_weights_in in;
    uint64_t *blocks;
    float *resid;
    int64_t per; /* blocks a part */
    sf_weights_out out[SF_MAX_SPLIT];
} split_ctx;

static sf_status split_part(void *arg, int64_t part, sf_scratch *s) {
    (void)s;
    split_ctx *c = arg;
    sf_weights_in in = c->in;
    in.first_block = part * c->per;
    in.n_blocks = c->per;
    const int64_t nb = (c->row->vocab + SF_BLOCK - 1) / SF_BLOCK;
    if (in.first_block >= nb) {
        c->out[part] = (sf_weights_out){0, 0, 0, 0};
        return SF_OK;
    }
    c->k->weights(c->row, &in, c->blocks ? c->blocks + in.first_block : NULL,
                  c->resid ? c->resid + in.first_block * SF_BLOCK : NULL, &c->out[part]);
    return SF_OK;
}

/* k->weights over the whole row, on every thread when a lone request leaves
 * the pool idle. Integer sums make the split invisible in the result. */
static void weights_all(const sf_kernels *k, const sf_row *r, const sf_weights_in *in,
                        uint64_t *blocks, float *resid, sf_weights_out *out) {
    int64_t per;
    const int parts = split_parts(r->vocab, SF_SPLIT_VOCAB, SF_BLOCK, &per);
    if (parts > 1) {
        split_ctx c = {k, r, *in, blocks, resid, per / SF_BLOCK, {{0}}};
        if (sf_parallel_split(parts, split_part, &c)) {
            *out = (sf_weights_out){0, 0, 0.0, 0};
            for (int i = 0; i < parts; i++) {
                out->total += c.out[i].total;
                out->kept += c.out[i].kept;
                out->q_sum += c.out[i].q_sum;
                out->q_bad |= c.out[i].q_bad;
            }
            return;
        }
    }
    k->weights(r, in, blocks, resid, out);
}

/* The max pass and the mass bound of a lone request's row, split the same
 * way: each part reads its own range of tokens. */
typedef struct range_ctx {
    const sf_kernels *k;
    const sf_row *row; /* data, dtype, vocab; the row's max for the bound */
    int64_t per;
    int bound;         /* 0: max pass, 1: mass bound, 2: max pass and sum */
    double stop;       /* where the bound (or sum) may stop */
    float ref;         /* the sum's reference logit */
    float max[SF_MAX_SPLIT];
    int64_t from[SF_MAX_SPLIT];
    int bad[SF_MAX_SPLIT];
    double mass[SF_MAX_SPLIT];
} range_ctx;

static sf_status range_part(void *arg, int64_t part, sf_scratch *s) {
    (void)s;
    range_ctx *c = arg;
    const sf_row *r = c->row;
    int64_t lo;
    const int64_t n = part_len(part, c->per, r->vocab, &lo);
    c->max[part] = -INFINITY;
    c->from[part] = lo;
    c->bad[part] = 0;
    c->mass[part] = 0.0;
    if (n == 0) return SF_OK;
    const size_t off = (size_t)lo * sf_dtype_size(r->dtype);
    sf_row sub = *r;
    sub.data = (const char *)r->data + off;
    if (sub.next.data) sub.next.data = (const char *)sub.next.data + lo * sub.next.es;
    sub.vocab = n;
    if (c->bound == 1)
        c->mass[part] = c->k->mass_bound(&sub, c->stop);
    else if (c->bound == 2)
        c->max[part] = c->k->row_max_sum(&sub, c->ref, c->stop, &c->mass[part], &c->bad[part],
                                         &c->from[part]);
    else
        c->max[part] = c->k->row_max(&sub, &c->bad[part], &c->from[part]);
    if (c->bound != 1) c->from[part] += lo;
    return SF_OK;
}

/* Splits the pass when a lone request leaves the pool idle; 0 when not. */
static int range_split(range_ctx *c) {
    /* Whole SIMD-friendly chunks per part. */
    const int parts = split_parts(c->row->vocab, SF_SPLIT_VOCAB_CHEAP, 64, &c->per);
    return parts > 1 && sf_parallel_split(parts, range_part, c);
}

/* The max pass (k->row_max, or with `sum` k->row_max_sum from ref and stop)
 * over the whole row, split when a lone request leaves the pool idle. */
static float row_max_all(const sf_kernels *k, const sf_row *r, float ref, double stop,
                         double *sum, int *bad, int64_t *from) {
    range_ctx c = {.k = k, .row = r, .bound = sum ? 2 : 0, .stop = stop, .ref = ref};
    if (!range_split(&c))
        return sum ? k->row_max_sum(r, ref, stop, sum, bad, from) : k->row_max(r, bad, from);
    float m = -INFINITY;
    *from = 0;
    if (sum) *sum = 0.0;
    for (int i = 0; i < SF_MAX_SPLIT && i * c.per < r->vocab; i++) {
        if (c.max[i] > m) {
            m = c.max[i];
            *from = c.from[i];
        }
        *bad |= c.bad[i];
        if (sum) *sum += c.mass[i];
    }
    return m;
}

static double mass_bound_all(const sf_kernels *k, const sf_row *r, double stop) {
    range_ctx c = {.k = k, .row = r, .bound = 1, .stop = stop};
    if (!range_split(&c)) return k->mass_bound(r, stop);
    double total = 0.0;
    for (int i = 0; i < SF_MAX_SPLIT && i * c.per < r->vocab; i++) total += c.mass[i];
    return total;
}

/* Coupled sampling's race over a prepared row, split the same way: each part
 * runs its range of tokens from the same start and the best of the parts'
 * bests is the row's (the order of a race's tests cannot change its winner). */
typedef struct race_ctx {
    const sf_kernels *k;
    const sf_row *row;
    uint64_t seed;
    int64_t position, per;
    float best[SF_MAX_SPLIT];
    int64_t id[SF_MAX_SPLIT];
} race_ctx;

static sf_status race_part(void *arg, int64_t part, sf_scratch *s) {
    (void)s;
    race_ctx *c = arg;
    int64_t lo;
    const int64_t n = part_len(part, c->per, c->row->vocab, &lo);
    if (n > 0)
        c->k->coupled_race(c->row, c->seed, c->position, lo, lo + n, &c->best[part],
                           &c->id[part]);
    return SF_OK;
}

int32_t sf_dist_coupled(const sf_dist *d, const sf_kernels *k, uint64_t seed,
                        int64_t position) {
    const sf_row *r = &d->row;
    /* Start from the most probable token (always kept): on a peaked row its
     * key rules out most others before any of their noise is drawn. */
    int64_t id = k->row_argmax(r->data, r->dtype, r->vocab, r->max, r->max_from);
    float best = sf_gumbel(sf_noise_word(seed, position, id));
    /* Parts of whole 128-token steps (the race's unit). */
    int64_t per;
    const int parts = split_parts(r->vocab, SF_SPLIT_VOCAB, 128, &per);
    if (parts > 1) {
        race_ctx c = {k, r, seed, position, per, {0}, {0}};
        for (int i = 0; i < parts; i++) {
            c.best[i] = best;
            c.id[i] = id;
        }
        if (sf_parallel_split(parts, race_part, &c)) {
            for (int i = 0; i < parts; i++)
                if (c.best[i] > best || (c.best[i] == best && c.id[i] < id)) {
                    best = c.best[i];
                    id = c.id[i];
                }
            return (int32_t)id;
        }
    }
    k->coupled_race(r, seed, position, 0, r->vocab, &best, &id);
    return (int32_t)id;
}

/* probs' output scaled in parts the same way. */
typedef struct scale_ctx {
    const sf_kernels *k;
    float *out;
    int64_t n, per;
    double inv;
} scale_ctx;

static sf_status scale_part(void *arg, int64_t part, sf_scratch *s) {
    (void)s;
    scale_ctx *c = arg;
    int64_t lo;
    const int64_t n = part_len(part, c->per, c->n, &lo);
    if (n > 0) c->k->scale_weights(c->out + lo, n, c->inv);
    return SF_OK;
}

void sf_dist_probs(const sf_dist *d, const sf_kernels *k, float *out) {
    /* The pass stores each kept token's e; its weight is then exact. */
    sf_weights_out o;
    weights_all(k, &d->row, &d->in, NULL, out, &o);
    const int64_t n = d->row.vocab;
    scale_ctx c = {k, out, n, n, 1.0 / (double)o.total};
    const int parts = split_parts(n, SF_SPLIT_VOCAB, 64, &c.per);
    if (parts > 1 && sf_parallel_split(parts, scale_part, &c)) return;
    k->scale_weights(out, n, c.inv);
}

/* Sort key of a candidate: ascending keys are (logit descending, id
 * ascending). -0 counts as +0, as the float comparisons of the cut do. */
static uint64_t rank_key(float l, int32_t id) {
    uint32_t u = l == 0.0f ? 0u : sf_f2u(l);
    u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    return ((uint64_t)~u << 32) | (uint32_t)id;
}
static float key_logit(uint64_t key) {
    uint32_t u = ~(uint32_t)(key >> 32);
    return sf_u2f((u & 0x80000000u) ? (u & 0x7FFFFFFFu) : ~u);
}
static int32_t key_id(uint64_t key) { return (int32_t)(uint32_t)key; }

/* Sorts keys[0..n) ascending, tmp holding as many: a radix sort by bytes
 * (stable), from byte `from` up, that skips the bytes all keys share (the
 * ids' high bits, the low bits of 16-bit logits, every logit byte of a tie):
 * a few linear passes, not n log n comparisons. */
static void sort_keys(uint64_t *keys, uint64_t *tmp, int64_t n, int from) {
    if (n <= 64) { /* fewer steps than a radix pass's 256 counts */
        for (int64_t i = 1; i < n; i++) {
            const uint64_t key = keys[i];
            int64_t j = i;
            for (; j > 0 && keys[j - 1] > key; j--) keys[j] = keys[j - 1];
            keys[j] = key;
        }
        return;
    }
    uint64_t all = ~(uint64_t)0, any = 0;
    for (int64_t i = 0; i < n; i++) {
        all &= keys[i];
        any |= keys[i];
    }
    uint64_t *src = keys, *dst = tmp;
    for (int shift = 8 * from; shift < 64; shift += 8) {
        if (!(((all ^ any) >> shift) & 255)) continue;
        int64_t at[256] = {0};
        for (int64_t i = 0; i < n; i++) at[(src[i] >> shift) & 255]++;
        int64_t sum = 0;
        for (int d = 0; d < 256; d++) {
            const int64_t c = at[d];
            at[d] = sum;
            sum += c;
        }
        for (int64_t i = 0; i < n; i++) dst[at[(src[i] >> shift) & 255]++] = src[i];
        uint64_t *t = src;
        src = dst;
        dst = t;
    }
    if (src != keys) memcpy(keys, src, (size_t)n * sizeof *keys);
}

/* Sorts n candidates into keys[] (room for 2 n), in rank order; candidates
 * gathered in id order need sorting by their logits only. */
static void sort_candidates(const int32_t *ids, const float *vals, int64_t n,
                            uint64_t *keys, int in_id_order) {
    for (int64_t i = 0; i < n; i++) keys[i] = rank_key(vals[i], ids[i]);
    sort_keys(keys, keys + n, n, in_id_order ? 4 : 0);
}

/* The rank keys of SF_SAMPLE tokens spread evenly over the row, sorted, in
 * the scratch's keys slot (valid until its next use); NULL where the row is
 * too short to sample, or no memory is left for it (then no guess is made). */
static const uint64_t *sample_row(const sf_row *r, sf_scratch *s) {
    const int64_t n = r->vocab, step = n / SF_SAMPLE;
    uint64_t *keys = step >= 4 ? sf_scratch_get(s, SF_SLOT_KEYS, SF_SAMPLE * 16) : NULL;
    if (!keys) return NULL;
    for (int64_t i = 0; i < SF_SAMPLE; i++) {
        const int64_t v = i * step + step / 2;
        keys[i] = rank_key(sf_load(r->data, r->dtype, v), (int32_t)v);
    }
    sort_keys(keys, keys + SF_SAMPLE, SF_SAMPLE, 4); /* in id order */
    return keys;
}

/* The logit at which the row likely holds `count` tokens or more (more == 1)
 * or fewer (more == 0), from its sample: the sample's best at the expected
 * rank of the count-th, 3 standard deviations (and 2 ranks) beyond, and
 * `spare` times more on the side of more. -inf (more) or +inf where the
 * sample cannot tell. A wrong guess costs a pass, never the result. */
static float sampled_logit(const uint64_t *sample, int64_t n, int64_t count, int more,
                           double spare) {
    const double mean = (double)count * SF_SAMPLE / (double)n;
    const double off = 3.0 * sqrt(mean) + 2.0;
    const double j = more ? ceil(mean * spare + off) : floor(mean - off);
    if (j < 1.0 || j > SF_SAMPLE) return more ? -INFINITY : INFINITY;
    return key_logit(sample[(int64_t)j - 1]);
}

static uint64_t mass_of(const sf_row *r, float l) {
    return sf_fixed(sf_row_e(r, l));
}

/* Walks sorted candidates after a prefix of `base_mass` and `base_count`
 * until the prefix reaches the goal (a mass, or a count when goal_count > 0);
 * sets the cut there. Returns 1 when it did; a mass goal's prefix then ends
 * at the cut (the mass the cut keeps). */
static int cut_at_goal(sf_row *r, const uint64_t *keys, int64_t n, uint64_t *base_mass,
                       int64_t base_count, double goal_mass, int64_t goal_count) {
    uint64_t prefix = base_mass ? *base_mass : 0, w = 0;
    float last = NAN; /* ties share their weight: one exp a logit */
    for (int64_t i = 0; i < n; i++) {
        int reached;
        if (goal_count > 0) {
            reached = base_count + i + 1 >= goal_count;
        } else {
            const float l = key_logit(keys[i]);
            if (!(l == last)) w = mass_of(r, last = l);
            prefix += w;
            reached = (double)prefix >= goal_mass;
        }
        if (reached) {
            r->cut_logit = key_logit(keys[i]);
            r->cut_id = key_id(keys[i]);
            if (base_mass) *base_mass = prefix;
            return 1;
        }
    }
    return 0;
}

/* How many tokens have a logit at or above t (t > -inf). */
static int64_t count_above(const sf_kernels *k, const sf_row *r, float t) {
    return k->gather(r, t, INFINITY, NULL, NULL, 0);
}

/* top_p's cut among the tokens the row keeps (under a top-k cut, if any): the
 * shortest prefix in rank order whose mass reaches top_p of theirs. One
 * weights pass stores each token's e; the exact weights summed by e's float
 * bits (monotone in the logit, so a bucket is a range of logits and equal
 * logits share one) show the bucket where the prefix reaches the goal, and
 * only its tokens are sorted: the same cut as sorting the whole row, since
 * the masses are exact integers. Only tokens of weight w_min or more are
 * summed: the others, fewer than the vocabulary, hold less than the mass
 * past the goal, and rank after all of them (e is monotone), so the prefix
 * reaches the goal first. On a model's row that leaves few tokens. *kept is
 * the exact mass the cut keeps (0 where the walk found no cut). */
static sf_status cut_top_p(sf_row *r, const sf_kernels *k, sf_scratch *s, float top_p,
                           uint64_t *kept) {
    const int64_t n = r->vocab;
    const size_t e_bytes = ((size_t)n * 4 + 63) & ~(size_t)63;
    char *buf = sf_scratch_get(s, SF_SLOT_CUT, e_bytes + SF_TOP_P_BUCKETS * 32);
    if (!buf) return SF_ERR_NO_MEMORY;
    float *e = (float *)buf;
    uint64_t *mass = (uint64_t *)(buf + e_bytes);
    sf_weights_in in = {NULL, 1.0f, NULL, 0, 0}; /* min_e is not set yet */
    sf_weights_out o;
    weights_all(k, r, &in, NULL, e, &o);
    const double goal = (double)top_p * (double)o.total;
    /* 1e-6 under the bound: room for the doubles' rounding. A weight of 0
     * never reaches the goal, so w_min is 1 at least. */
    double w_min = floor(((double)o.total - goal) * (1.0 - 1e-6) / (double)n);
    if (!(w_min >= 1.0)) w_min = 1.0;
    float e_min = (float)(w_min * 0x1p-40);
    if ((double)e_min > w_min * 0x1p-40) e_min = nextafterf(e_min, 0.0f);
    const sf_row er = {.data = e, .dtype = SF_F32, .vocab = n};
    int32_t *ids = sf_scratch_get(s, SF_SLOT_IDS, (size_t)n * 4);
    float *vals = sf_scratch_get(s, SF_SLOT_VALS, (size_t)n * 4);
    if (!ids || !vals) return SF_ERR_NO_MEMORY;
    const int64_t m = k->gather(&er, e_min, INFINITY, ids, vals, n);
    const uint32_t lowest = sf_f2u(e_min) >> SF_TOP_P_SHIFT;
    /* Each bucket's sum in 4 parts, token i adding to part i % 4: a run of
     * ties then waits on an add to memory every 4th token, not every one. */
    memset(mass + 4 * lowest, 0, (SF_TOP_P_BUCKETS - lowest) * 32);
    for (int64_t i = 0; i < m; i++)
        mass[4 * (sf_f2u(vals[i]) >> SF_TOP_P_SHIFT) + (i & 3)] += sf_fixed(vals[i]);
    uint64_t above = 0;
    uint32_t b = SF_TOP_P_BUCKETS - 1;
    for (;; b--) {
        const uint64_t *p = mass + 4 * b, in_b = p[0] + p[1] + p[2] + p[3];
        if (b == lowest || (double)(above + in_b) >= goal) break;
        above += in_b;
    }
    /* The bucket's tokens, with their logits: their places among the m by a
     * gather over their e (into e's buffer, free now), then their ids (in
     * place: the c-th place is c or later). */
    const sf_row mr = {.data = vals, .dtype = SF_F32, .vocab = m};
    int32_t *at = (int32_t *)e;
    const int64_t c = k->gather(&mr, sf_u2f(b << SF_TOP_P_SHIFT),
                                sf_u2f((b + 1) << SF_TOP_P_SHIFT), at, vals, m);
    for (int64_t i = 0; i < c; i++) {
        ids[i] = ids[at[i]];
        vals[i] = sf_load(r->data, r->dtype, ids[i]);
    }
    uint64_t *keys = sf_scratch_get(s, SF_SLOT_KEYS, (size_t)c * 16 + 8);
    if (!keys) return SF_ERR_NO_MEMORY;
    sort_candidates(ids, vals, c, keys, 1);
    *kept = cut_at_goal(r, keys, c, &above, 0, goal, 0) ? above : 0;
    return SF_OK;
}

/* Two pivots on the logit and the tokens at or above each: at least the goal
 * at lo, fewer at hi. */
typedef struct bracket {
    float lo, hi;
    int64_t c_lo, c_hi;
} bracket;

/* Moves a pivot of `b` to t, where count_above is c. */
static void narrow(bracket *b, float t, int64_t c, int64_t goal_count) {
    if (c >= goal_count) {
        b->lo = t;
        b->c_lo = c;
    } else {
        b->hi = t;
        b->c_hi = c;
    }
}

/* A large top-k's cut (past the reservoir): the first goal_count tokens in
 * rank order. Counting passes move two pivots on the logit until few tokens
 * lie between them, then just those are sorted: first to where the row's
 * sample puts a little more and a little fewer than goal_count, then by
 * halves. Counts are exact, so the cut is the same whatever the pivots.
 * Tokens below max - 128 / c weigh 0 (2^-128 of the max): a cut among them
 * changes no probability, so a count reaching below there cuts at that
 * floor; it still cuts (a cut reads q only at kept tokens, and does not
 * check its sum) where the row has goal_count finite logits, as the
 * reservoir's cut and CUDA's do. */
static sf_status cut_scan(sf_row *r, const sf_kernels *k, sf_scratch *s, int64_t goal_count) {
    bracket b = {r->max - 128.0f / r->c, INFINITY, 0, 0};
    if (!(b.lo > -FLT_MAX)) b.lo = -FLT_MAX;
    b.c_lo = count_above(k, r, b.lo);
    if (b.c_lo <= goal_count) {
        int64_t finite = b.c_lo;
        if (b.c_lo < goal_count && b.lo > -FLT_MAX) finite = count_above(k, r, -FLT_MAX);
        if (finite >= goal_count) {
            r->cut_logit = b.lo;
            r->cut_id = INT32_MAX;
        }
        return SF_OK;
    }
    const uint64_t *sample = sample_row(r, s);
    for (int more = 1; sample && more >= 0; more--) {
        const float t = sampled_logit(sample, r->vocab, goal_count, more, 1.0);
        if (t > b.lo && t < b.hi) narrow(&b, t, count_above(k, r, t), goal_count);
    }
    for (;;) {
        const float mid = b.hi == INFINITY ? r->max : b.lo * 0.5f + b.hi * 0.5f;
        if (b.c_lo - b.c_hi <= SF_TOP_K_SORT || mid <= b.lo || mid >= b.hi) break;
        const int64_t c_hi = b.c_hi;
        narrow(&b, mid, count_above(k, r, mid), goal_count);
        /* None between mid and hi: those left may all tie at lo, which
         * halving never splits; the next float above lo tells. */
        const float next = nextafterf(b.lo, INFINITY);
        if (b.hi == mid && b.c_hi == c_hi && next < b.hi)
            narrow(&b, next, count_above(k, r, next), goal_count);
    }
    const int64_t n = b.c_lo - b.c_hi;
    int32_t *ids = sf_scratch_get(s, SF_SLOT_IDS, (size_t)n * 4 + 4);
    float *vals = sf_scratch_get(s, SF_SLOT_VALS, (size_t)n * 4 + 4);
    uint64_t *keys = sf_scratch_get(s, SF_SLOT_KEYS, (size_t)n * 16 + 8);
    if (!ids || !vals || !keys) return SF_ERR_NO_MEMORY;
    int64_t got = k->gather(r, b.lo, b.hi, ids, vals, n);
    if (got > n) got = n;
    sort_candidates(ids, vals, got, keys, 1);
    cut_at_goal(r, keys, got, NULL, b.c_hi, 0.0, goal_count);
    return SF_OK;
}

sf_status sf_row_greedy(const sf_kernels *k, const void *data, sf_dtype dtype,
                        int64_t vocab, int32_t *token) {
    int bad = 0;
    const sf_row r = {.data = data, .dtype = dtype, .vocab = vocab};
    int64_t from;
    float m = row_max_all(k, &r, 0.0f, 0.0, NULL, &bad, &from);
    if (bad) return SF_ERR_LOGITS;
    if (m == -INFINITY) return SF_ERR_ALL_MASKED;
    *token = (int32_t)k->row_argmax(data, dtype, vocab, m, from);
    return SF_OK;
}

sf_status sf_dist_prepare(sf_dist *d, const sf_kernels *k, sf_scratch *s,
                          const void *data, sf_dtype dtype, int64_t vocab,
                          const sf_rowparams *p, int need_mass, sf_ahead next,
                          float next_until, sf_ref_bound *rb) {
    sf_row *r = &d->row;
    r->data = data;
    r->dtype = dtype;
    r->vocab = vocab;
    r->inv_t = sf_inv_temperature(p->temperature);
    r->c = SF_FMUL(r->inv_t, SF_LOG2E);
    r->cut_logit = -INFINITY;
    r->cut_id = INT32_MAX;
    r->min_e = 0.0f;
    r->max_from = 0;
    r->next = r->also = (sf_ahead){NULL, 0};
    r->next_until = INFINITY;

    if (rb) rb->sum = NAN;
    int bad = 0;
    float m;
    int64_t nc = -1; /* sorted top-k candidates, when the reservoir ran */
    uint64_t top_p_kept = 0;
    uint64_t *keys = NULL;
    if (p->top_k > 0 && p->top_k < vocab && p->top_k <= SF_TOP_K_RESERVOIR) {
        /* The reservoir's best candidate is the max: one pass for both. */
        int64_t cap = 2 * (int64_t)p->top_k + 1024;
        int32_t *ids = sf_scratch_get(s, SF_SLOT_IDS, (size_t)cap * 4);
        float *vals = sf_scratch_get(s, SF_SLOT_VALS, (size_t)cap * 4);
        if (!ids || !vals) return SF_ERR_NO_MEMORY;
        r->next = next;
        r->next_until = next_until;
        /* A bar where the row likely holds 1.5 k tokens: the others never
         * enter the reservoir, which then rarely fills. (A small k's
         * reservoir, in a row of random order, does not fill anyway.) */
        const uint64_t *sample = p->top_k >= SF_TOP_K_BAR ? sample_row(r, s) : NULL;
        const float bar =
            sample ? sampled_logit(sample, vocab, p->top_k, 1, 1.5) : -INFINITY;
        nc = k->topk(r, p->top_k, bar, ids, vals, cap, &bad);
        if (!bad && nc < p->top_k && bar > -INFINITY) /* the guess was too high */
            nc = k->topk(r, p->top_k, -INFINITY, ids, vals, cap, &bad);
        r->next = (sf_ahead){NULL, 0};
        if (bad) return SF_ERR_LOGITS;
        if (nc == 0) return SF_ERR_ALL_MASKED;
        keys = sf_scratch_get(s, SF_SLOT_KEYS, (size_t)cap * 16);
        if (!keys) return SF_ERR_NO_MEMORY;
        sort_candidates(ids, vals, nc, keys, 0);
        m = key_logit(keys[0]);
        if (m == INFINITY) return SF_ERR_LOGITS;
        if (nc == p->top_k) {
            r->cut_logit = key_logit(keys[nc - 1]);
            r->cut_id = key_id(keys[nc - 1]);
        }
        r->max = m;
    } else {
        r->next = next;
        r->next_until = next_until;
        /* Without top-k or top-p the bound needs no cut: it comes with the
         * max pass, in the same read, until it shows a rejection. */
        const int with_sum = rb && (p->top_k <= 0 || p->top_k >= vocab) && p->top_p >= 1.0f;
        const double stop = with_sum ? SF_REF_REJECT / rb->uq : 0.0;
        m = row_max_all(k, r, with_sum ? rb->ref : 0.0f, stop, with_sum ? &rb->sum : NULL,
                        &bad, &r->max_from);
        r->next = (sf_ahead){NULL, 0};
        if (bad) return SF_ERR_LOGITS;
        if (m == -INFINITY) return SF_ERR_ALL_MASKED;
        r->max = m;
        if (p->top_k > 0 && p->top_k < vocab) {
            sf_status st = cut_scan(r, k, s, p->top_k);
            if (st != SF_OK) return st;
        }
    }
    if (p->top_p < 1.0f) {
        if (nc >= 0) {
            uint64_t total = 0;
            for (int64_t i = 0; i < nc; i++) total += mass_of(r, key_logit(keys[i]));
            cut_at_goal(r, keys, nc, NULL, 0, (double)p->top_p * (double)total, 0);
        } else {
            sf_status st = cut_top_p(r, k, s, p->top_p, &top_p_kept);
            if (st != SF_OK) return st;
        }
    }
    r->min_e = p->min_p;
    /* With the top-k candidates in hand the kept tokens are among them, and
     * top_p's walk summed the mass it keeps: the exact total needs no pass
     * over the row (unless min_p drops more). */
    d->known_total = r->min_e > 0.0f ? 0 : top_p_kept;
    if (nc >= 0) {
        const uint64_t last =
            r->cut_logit > -INFINITY ? rank_key(r->cut_logit, r->cut_id) : UINT64_MAX;
        for (int64_t i = 0; i < nc && keys[i] <= last; i++) {
            float e = sf_row_e(r, key_logit(keys[i]));
            if (e >= r->min_e) d->known_total += sf_fixed(e);
        }
    }

    d->in = (sf_weights_in){NULL, 1.0f, NULL, 0, 0};
    d->n_over = 0;
    d->resid_next = 0;
    d->total = 0;
    return need_mass ? sf_dist_mass(d, k, s, (sf_ahead){NULL, 0}, 0) : SF_OK;
}

sf_status sf_dist_mass(sf_dist *d, const sf_kernels *k, sf_scratch *s, sf_ahead ahead,
                       int keep_e_for_residuals) {
    sf_row *r = &d->row;
    size_t nb = (size_t)((r->vocab + SF_BLOCK - 1) / SF_BLOCK);
    d->blocks = sf_scratch_get(s, SF_SLOT_BLOCKS, nb * 8);
    if (!d->blocks) return SF_ERR_NO_MEMORY;
    /* Where residual passes will follow (dense drafts), keep each token's e:
     * they then read it instead of recomputing the exp. */
    float *keep_e = keep_e_for_residuals ? d->resid[0] : NULL;
    sf_weights_out o;
    r->next = ahead;
    weights_all(k, r, &d->in, d->blocks, keep_e, &o);
    r->next = (sf_ahead){NULL, 0};
    d->total = o.total;
    if (keep_e) {
        d->in.base = keep_e;
        d->resid_next = 1;
    }
    return SF_OK;
}

int sf_dist_bound_accepts(const sf_dist *d, const sf_kernels *k, double uq, int32_t x,
                          sf_ahead ahead) {
    uint64_t w = sf_weight_at(&d->row, &d->in, x);
    if (d->known_total) /* the exact test, as sf_dist_prob makes it */
        return uq < (double)w / (double)d->known_total;
    /* The total is at least the max's weight, 2^40: no bound can accept then. */
    if (!(uq * SF_MASS_ONE < (double)w)) return 0;
    sf_row r = d->row;
    r.next = ahead;
    /* The margin covers the float sums and exp2's error many times over. A
     * bound past `stop` cannot accept: the pass ends there (and so does its
     * prefetch of a row that a rejection leaves unread). */
    const double stop = ((double)w / uq - 1.0) / (1.001 * SF_MASS_ONE);
    const double bound = mass_bound_all(k, &r, stop);
    if (bound > stop) return 0;
    return uq * (bound * 1.001 * SF_MASS_ONE + 1.0) < (double)w;
}

int sf_dist_ref_accepts(const sf_dist *d, double uq, int32_t x, double sum) {
    /* p(x) = w(x) / total, and total <= sum (w(x) + 1) times 1 + 1e-4 (exp2's
     * error, rounded exponents, float sums) when no exponent hit its cap of
     * 127, which holds for sure when w(x) >= 2^20: then no token is 2^20
     * times likelier than x (and 1 / w(x) <= 2^-20). The margin covers that
     * many times over. A sum that is +inf or NaN accepts nothing. */
    if (!(sum >= 0.0)) return 0;
    const uint64_t w = sf_weight_at(&d->row, &d->in, x);
    return w >= ((uint64_t)1 << 20) && uq * sum * SF_REF_MARGIN < 1.0;
}

static uint64_t weight(const sf_dist *d, int64_t v) {
    for (int64_t i = d->n_over - 1; i >= 0; i--)
        if (d->over_id[i] == v) return d->over_w[i];
    return sf_weight_at(&d->row, &d->in, v);
}

double sf_dist_prob(const sf_dist *d, int64_t v) {
    return (double)weight(d, v) / (double)d->total;
}

void sf_dist_reject_sparse(sf_dist *d, const int32_t *ids, const float *probs,
                           int64_t n) {
    /* New weights of the ids, all from the old total; ids are distinct. The
     * blocks take them at once (wrapping sums), and give them back where q
     * covers all of p. */
    const double z = (double)d->total;
    uint64_t total = d->total;
    int64_t m = 0;
    for (int64_t i = 0; i < n; i++) {
        if (ids[i] < 0) continue;
        uint64_t w = weight(d, ids[i]);
        uint64_t sub = (uint64_t)((double)probs[i] * z);
        uint64_t nw = w > sub ? w - sub : 0;
        total = total - w + nw;
        d->blocks[ids[i] / SF_BLOCK] += nw - w;
        d->over_id[d->n_over + m] = ids[i];
        d->over_w[d->n_over + m] = nw;
        m++;
    }
    if (total == 0) { /* measure zero: keep p */
        for (int64_t i = d->n_over; i < d->n_over + m; i++)
            d->blocks[d->over_id[i] / SF_BLOCK] += weight(d, d->over_id[i]) - d->over_w[i];
        return;
    }
    d->n_over += m;
    d->total = total;
}

/* q's mass may be off 1 (2^40 as a fixed-point mass) by this much: 1e-3. */
#define SF_Q_ONE ((uint64_t)1 << SF_MASS_BITS)
#define SF_Q_TOL (SF_Q_ONE / 1000)

/* The exact sum of floor(q 2^40) over q in [0, 1.001] (as the CUDA backend
 * makes it), over every token, or, with `kept`, over the tokens its filters
 * keep (a nonzero base). Scalar: asked only near the edges of the sum's
 * test, or where a residual is left empty. */
static uint64_t q_mass(const float *q, int64_t n, const sf_dist *kept) {
    uint64_t m = 0;
    for (int64_t v = 0; v < n; v++) {
        const float b = !kept              ? 1.0f
                        : kept->in.base ? kept->in.base[v]
                                        : sf_row_base(&kept->row,
                                                      sf_load(kept->row.data, kept->row.dtype, v), v);
        if (b != 0.0f && sf_prob_ok(q[v])) m += sf_fixed(q[v]);
    }
    return m;
}

/* Whether q's sum is off 1 by more than 1e-3: the test on q_mass, which
 * `approx` (sf_weights_out.q_sum) decides but near the edges, where the exact
 * sum is formed. */
static int q_sum_off(const float *q, int64_t n, double approx) {
    /* The exact sum lies in [lo, hi]: each floor loses less than 1. */
    const double lo = approx * (1.0 - 1e-5) * SF_MASS_ONE - (double)n;
    const double hi = approx * (1.0 + 1e-5) * SF_MASS_ONE;
    if (lo > (double)(SF_Q_ONE + SF_Q_TOL) || hi < (double)(SF_Q_ONE - SF_Q_TOL)) return 1;
    if (lo >= (double)(SF_Q_ONE - SF_Q_TOL) && hi <= (double)(SF_Q_ONE + SF_Q_TOL)) return 0;
    const uint64_t m = q_mass(q, n, NULL);
    return m > SF_Q_ONE + SF_Q_TOL || m + SF_Q_TOL < SF_Q_ONE;
}

sf_status sf_dist_reject_dense(sf_dist *d, const sf_kernels *k, const float *q,
                               int more, sf_ahead ahead) {
    sf_weights_in in = {d->in.base, (float)(SF_MASS_ONE / (double)d->total), q, 0, 0};
    float *out = more ? d->resid[d->resid_next] : NULL;
    sf_weights_out o;
    sf_row r = d->row;
    r.next = ahead;
    weights_all(k, &r, &in, d->blocks, out, &o);
    /* q must sum to 1 within 1e-3 where the pass read it whole. */
    if (o.q_bad || (!isnan(o.q_sum) && q_sum_off(q, d->row.vocab, o.q_sum)))
        return SF_ERR_DRAFT_PROBS;
    if (o.total == 0) {
        /* p <= q everywhere (p == q up to rounding): keep p. Under a cut,
         * unless q's kept mass shows it is no distribution. */
        if (isnan(o.q_sum) && q_mass(q, d->row.vocab, d) > SF_Q_ONE + SF_Q_TOL)
            return SF_ERR_DRAFT_PROBS;
        weights_all(k, &d->row, &d->in, d->blocks, NULL, &o);
        return SF_OK;
    }
    d->total = o.total;
    if (more) {
        d->in = (sf_weights_in){out, 1.0f, NULL, 0, 0};
        d->resid_next ^= 1;
    } else {
        d->in = in;
    }
    return SF_OK;
}

/* The inverse-CDF draw at `target` (in [0, d->total)): the first token
 * whose inclusive prefix of weights exceeds it. */
static int32_t draw_at(const sf_dist *d, const sf_kernels *k, uint64_t target) {
    const int64_t nb = (d->row.vocab + SF_BLOCK - 1) / SF_BLOCK;
    uint64_t cum = 0;
    int64_t b = 0;
    while (b < nb - 1 && cum + d->blocks[b] <= target) cum += d->blocks[b++];
    /* The block's weights, by the same vector pass that summed them. */
    float r[SF_BLOCK];
    sf_weights_in in = d->in;
    in.first_block = b;
    in.n_blocks = 1;
    sf_weights_out o;
    k->weights(&d->row, &in, NULL, r, &o);
    const int64_t start = b * SF_BLOCK;
    const int64_t end = start + SF_BLOCK < d->row.vocab ? start + SF_BLOCK : d->row.vocab;
    uint64_t w_of[SF_BLOCK];
    for (int64_t v = start; v < end; v++) w_of[v - start] = sf_fixed(r[v - start]);
    for (int64_t i = 0; i < d->n_over; i++) /* in order: the last override holds */
        if (d->over_id[i] >= start && d->over_id[i] < end)
            w_of[d->over_id[i] - start] = d->over_w[i];
    int64_t last = -1;
    for (int64_t v = start; v < end; v++) {
        const uint64_t w = w_of[v - start];
        if (!w) continue;
        cum += w;
        last = v;
        if (cum > target) return (int32_t)v;
    }
    return (int32_t)last; /* unreachable: the sums are exact */
}

int32_t sf_dist_draw(const sf_dist *d, const sf_kernels *k, uint64_t seed,
                     int64_t position, int residual) {
    return draw_at(d, k, sf_draw_target(sf_draw_block(seed, position, residual), d->total));
}

sf_status sf_dist_resid_tries(const sf_dist *d, const sf_kernels *k, const float *q,
                              uint64_t seed, int64_t position, int32_t *token) {
    *token = -1;
    for (uint32_t i = 0; i < SF_RESID_TRIES; i++) {
        const sf_u32x4 r = sf_philox(seed, position, SF_PURPOSE_RESID, i);
        const int32_t y = draw_at(d, k, sf_draw_target(r, d->total));
        if (y < 0) break; /* unreachable: total > 0 */
        /* y has a weight, so the filters keep it: its q is checked. */
        if (!sf_prob_ok(q[y])) return SF_ERR_DRAFT_PROBS;
        if (sf_resid_keeps(r, weight(d, y), q[y], d->total)) {
            *token = y;
            break;
        }
    }
    return SF_OK;
}
