/*
 * kernels.cu: sf_verify, sf_sample and sf_probs on the GPU.
 *
 * One launch per call. sf_verify: a cluster of blocks per request, walking
 * its chain or tree as csrc/cpu/verify.c does and reading only the rows it
 * reaches; each block owns a slice of every row, copies it into shared memory
 * when it fits (one read from HBM, the passes then run from shared memory)
 * and the blocks combine their results through distributed shared memory.
 * sample / probs: one block per row. Each step of csrc/cpu/dist.c becomes a
 * pass over the row (over the slices of the cluster):
 * - the max: 16-byte loads, 16-bit rows kept in pairs under the
 *   NaN-propagating bf16x2 / half2 max (greedy's first index of it: a second
 *   pass in which each thread stops at its first hit);
 * - top-k and top-p cuts by a radix select on the rank key (logit
 *   descending, id ascending), 8 bits per pass, with exact integer counts
 *   (top-k) or exact integer masses (top-p): no sort, the same cut as the CPU
 *   whatever the order of the sums;
 * - the weights pass: per-tile sums of floor(w * 2^40) in shared memory,
 *   added with integer atomics (order-independent, exact);
 * - the inverse-CDF draw: the tile holding the target, then a block scan of
 *   the threads' 8-token sums, then the token inside: the first token whose
 *   inclusive prefix exceeds the target, as sf_dist_draw finds it;
 * - the residual of a rejected last sibling with a dense q: up to
 *   SF_RESID_TRIES such draws from p (shared.h), formed whole only when none
 *   keeps its token;
 * - Gumbel-max: argmax of (l - max) * inv_t + G, lowest id on ties.
 * Decisions that are serial on the CPU (acceptance tests, sparse residual
 * patches) run on thread 0 with the same double arithmetic.
 */
#include <cuda_runtime.h>
#include <math.h>
#include <stdlib.h>

#include <atomic>
#include <mutex>

#include "../common/params.h"
#include "block.cuh"
#include "specfast_cuda.h"

/* ---- state ---- */

struct sf_cu_params_row {
    float temperature;
    int32_t top_k;
    float top_p, min_p;
    uint64_t seed;
    int64_t position;
};

/* The current distribution of a row (sf_dist): filters, where the weights
 * come from (in.base / scale / q), total, overrides. Lives in shared memory. */
struct sf_cu_dist {
    sf_cu_row r;
    const float *base;
    float scale;
    const float *q;
    uint64_t total;
    int n_over;
    int resid_next;
    int32_t etab_at; /* float offset of the block's e table in sf_cu_dynamic; 0: none */
};

struct sf_cu_verify_args {
    const void *logits;
    int64_t vocab, row_stride;
    const int32_t *tokens;
    int64_t n;
    const int32_t *num_draft;
    int64_t batch;
    const int32_t *parents;
    int kind;
    const float *dense;
    const int32_t *sparse_ids;
    const float *sparse_probs;
    int64_t sparse_k;
    sf_cuda_params params;
    int method;
    int32_t *out_tokens, *out_acc, *out_nodes;
    int64_t max_draft;
    int32_t *status;
    int32_t *over_id;  /* n * k_over */
    uint64_t *over_w;  /* n * k_over */
    float *resid;      /* batch * 2 * vocab, or NULL */
    int csize;         /* blocks per request (the cluster) */
    int64_t slice;     /* tokens per block, a multiple of SF_CU_TILE */
    int cache;         /* stage each slice in shared memory */
    int32_t etab;      /* float offset of the e table in dynamic shared memory; 0: none */
};

struct sf_cu_rows_args {
    const void *logits;
    int64_t rows, vocab, row_stride;
    sf_cuda_params params;
    int method;
    int32_t *tokens;
    float *probs;
    int32_t *status;
    int32_t etab; /* as sf_cu_verify_args' */
};

/* Blocks per request in sf_verify (a cluster; 8 is the portable maximum),
 * and the most shared memory a block stages a slice of a row in. */
#define SF_CU_CLUSTER 8
static_assert(SF_CU_CLUSTER <= 8, "sf_cu_cluster_all combines a cluster in 8 lanes");
#define SF_CU_STAGE_MAX (96 * 1024)
#define SF_CU_PRE 32 /* nodes per request whose acceptance inputs are read up front */
#ifndef SF_CU_MIN_BLOCKS /* resident blocks per SM the registers must allow */
#define SF_CU_MIN_BLOCKS 3
#endif

#define SF_PHASE_PARAMS 0
#define SF_PHASE_DRAFT 1
#define SF_PHASE_RUN 2
#define SF_STATUS(code, phase) ((int32_t)(code) | ((phase) << 8))

template <class T>
__device__ __forceinline__ T sf_cu_pick(const T *p, int64_t n, T value, int64_t b) {
    return p ? p[n == 1 ? 0 : b] : value;
}

__device__ sf_cu_params_row sf_cu_get_params(const sf_cuda_params &p, int64_t b) {
    sf_cu_params_row r;
    r.temperature = sf_cu_pick(p.temperature, p.n_temperature, p.temperature_value, b);
    r.top_k = sf_cu_pick(p.top_k, p.n_top_k, p.top_k_value, b);
    r.top_p = sf_cu_pick(p.top_p, p.n_top_p, p.top_p_value, b);
    r.min_p = sf_cu_pick(p.min_p, p.n_min_p, p.min_p_value, b);
    r.seed = sf_cu_pick(p.seed, p.n_seed, p.seed_value, b);
    r.position = sf_cu_pick(p.position, p.n_position, p.position_value, b);
    return r;
}

__device__ bool sf_cu_params_ok(const sf_cu_params_row &r) {
    return sf_params_ok(r.temperature, r.top_k, r.top_p, r.min_p);
}

/* ---- per-token weights, as the CPU's weights pass forms them ---- */

struct sf_cu_in {
    const float *base; /* stored residual, or NULL: from the row */
    float scale;
    const float *q;    /* dense q of the row, or NULL */
};

/* What a block reads of a row: its tokens [lo, hi) (the whole row, or its
 * slice when a cluster of csize blocks shares the row) at src, which holds
 * token lo (in shared memory when the block staged its slice there), and the
 * row itself in global memory for single tokens. Token ids stay global:
 * base, q and stored residuals are indexed by them. */
struct sf_cu_span {
    const void *src;
    const void *row;
    int64_t lo, hi, n;
    bool al; /* src 16-byte aligned */
    int csize;
};

template <int DT>
__device__ __forceinline__ void sf_cu_span8(const sf_cu_span &sp, int64_t i0, float *x) {
    sf_cu_load8<DT>(sp.src, i0 - sp.lo, sp.hi - sp.lo, sp.al, x);
}

template <int DT>
__device__ __forceinline__ float sf_cu_span1(const sf_cu_span &sp, int64_t v) {
    return sf_cu_load1<DT>(sp.src, v - sp.lo);
}

/* Copies tokens [lo, hi) of the row into dst (shared memory, 16-byte
 * aligned) with asynchronous 16-byte copies, all in flight at once. */
template <int DT>
__device__ void sf_cu_stage(void *dst, const void *src, int64_t count, bool al) {
    const int64_t es = DT == SF_F32 ? 4 : 2;
    int64_t done = 0;
    if (al) {
        const int64_t chunks = count * es / 16;
        for (int64_t c = threadIdx.x; c < chunks; c += SF_CU_THREADS)
            __pipeline_memcpy_async((char *)dst + c * 16, (const char *)src + c * 16, 16);
        __pipeline_commit();
        __pipeline_wait_prior(0);
        done = chunks * 16 / es;
    }
    for (int64_t i = done + threadIdx.x; i < count; i += SF_CU_THREADS) {
        if (DT == SF_F32) ((float *)dst)[i] = ((const float *)src)[i];
        else ((uint16_t *)dst)[i] = ((const uint16_t *)src)[i];
    }
    __syncthreads();
}

/* Weights of tokens [i0, i0 + 8) (0 past n) into rr (the residual floats);
 * all threads of the block must call it together (a shuffle pairs the two
 * threads of one CPU 16-token chunk). *read_q tells whether q was read; base
 * and qv, when not NULL, take the weights before q and q itself. FULL: the
 * eight tokens lie inside the span and every source is 16-byte aligned, so
 * the loads go without checks. */
template <int DT, bool FULL = false>
__device__ __forceinline__ void sf_cu_weights8(const sf_cu_row &r, const sf_cu_span &sp,
                                               const sf_cu_in &in, bool cut, int64_t i0,
                                               float *rr, bool *read_q, float *base = NULL,
                                               float *qv = NULL) {
    const int64_t n = sp.hi;
    float b[8];
    bool rq = true;
    if (!in.base) {
        float x[8];
        if (FULL) sf_cu_load8<DT>(sp.src, i0 - sp.lo, i0 - sp.lo + 8, true, x);
        else sf_cu_span8<DT>(sp, i0, x);
        if (cut) {
            bool keep[8];
            int any = 0;
#pragma unroll
            for (int j = 0; j < 8; j++) {
                keep[j] = sf_cu_above_cut(r, x[j], i0 + j);
                any |= keep[j];
            }
            any |= __shfl_xor_sync(SF_FULL_MASK, any, 1);
            rq = any != 0;
            float e[8];
            sf_cu_row_e8<DT>(r, x, e);
#pragma unroll
            for (int j = 0; j < 8; j++) b[j] = (keep[j] && e[j] >= r.min_e) ? e[j] : 0.0f;
        } else {
            sf_cu_row_e8<DT>(r, x, b);
        }
    } else if (FULL) {
        /* Written earlier in this kernel (by this block): plain loads, not __ldg. */
        const float4 u = *(const float4 *)(in.base + i0), w = *(const float4 *)(in.base + i0 + 4);
        b[0] = u.x; b[1] = u.y; b[2] = u.z; b[3] = u.w;
        b[4] = w.x; b[5] = w.y; b[6] = w.z; b[7] = w.w;
    } else {
#pragma unroll
        for (int j = 0; j < 8; j++) b[j] = i0 + j < n ? in.base[i0 + j] : 0.0f;
    }
    if (base) {
#pragma unroll
        for (int j = 0; j < 8; j++) base[j] = b[j];
    }
    if (in.q) {
        float q[8];
        if (rq) {
            sf_cu_floats8(in.q, i0, FULL ? i0 + 8 : n, FULL || sf_cu_aligned(in.q), q);
#pragma unroll
            for (int j = 0; j < 8; j++) rr[j] = sf_cu_resid(b[j], in.scale, q[j]);
        } else {
#pragma unroll
            for (int j = 0; j < 8; j++) rr[j] = q[j] = 0.0f;
        }
        if (qv) {
#pragma unroll
            for (int j = 0; j < 8; j++) qv[j] = q[j];
        }
    } else {
#pragma unroll
        for (int j = 0; j < 8; j++) rr[j] = b[j];
    }
    *read_q = rq;
}

__device__ __forceinline__ bool sf_cu_cut_active(const sf_cu_row &r) {
    return r.cut_logit > -INFINITY || r.min_e > 0.0f;
}

/* ---- passes over a row (all threads call them together) ---- */

/* (max, NaN met): the max as fmaxf takes it, -0 read as +0 so that the
 * combine is commutative to the bit. */
struct sf_cu_maxr { float m; int bad; };
struct sf_cu_pick_max {
    __device__ sf_cu_maxr operator()(sf_cu_maxr a, sf_cu_maxr b) const {
        return {SF_FADD(fmaxf(a.m, b.m), 0.0f), a.bad | b.bad};
    }
    static __device__ sf_cu_maxr id() { return {-INFINITY, 0}; }
};

/* Walks this thread's tokens of the span: whole 8-token chunks of an aligned
 * span to chunk(id of the first, x[8]), the rest (all of an unaligned span)
 * one by one to token(id, x). Either stops the walk by returning true. */
template <int DT, class Chunk, class Token>
__device__ __forceinline__ void sf_cu_walk(const sf_cu_span &sp, Chunk chunk, Token token) {
    int64_t done = 0;
    if (sp.al) {
        const int nfull = (int)((sp.hi - sp.lo) >> 3);
        for (int c = threadIdx.x; c < nfull; c += SF_CU_THREADS) {
            float x[8];
            sf_cu_load8<DT>(sp.src, (int64_t)c * 8, (int64_t)c * 8 + 8, true, x);
            if (chunk(sp.lo + (int64_t)c * 8, x)) return;
        }
        done = (int64_t)nfull * 8;
    }
    for (int64_t v = sp.lo + done + threadIdx.x; v < sp.hi; v += SF_CU_THREADS)
        if (token(v, sf_cu_span1<DT>(sp, v))) return;
}

/* This thread's max of the span and whether it met a NaN. 16-bit rows stay
 * in pairs under the NaN-propagating bf16x2 / half2 max over whole 8-token
 * chunks (exact: a max rounds nothing); the rest, and float32, go by the walk. */
template <int DT>
__device__ sf_cu_maxr sf_cu_local_max(const sf_cu_span &sp) {
    float m = -INFINITY;
    uint32_t mag = 0; /* |x| bits: above +inf's is a NaN */
    const auto take = [&](float x) {
        m = fmaxf(m, x);
        mag = max(mag, sf_f2u(x) & 0x7FFFFFFFu);
    };
    sf_cu_span rest = sp;
    if constexpr (DT != SF_F32) {
        if (sp.al) {
            const uint4 *s = (const uint4 *)sp.src;
            const int nfull = (int)((sp.hi - sp.lo) >> 3);
            const uint32_t ninf = DT == SF_BF16 ? 0xFF80FF80u : 0xFC00FC00u;
            uint32_t m0 = ninf, m1 = ninf, m2 = ninf, m3 = ninf;
            for (int c = threadIdx.x; c < nfull; c += SF_CU_THREADS) {
                const uint4 u = s[c];
                m0 = sf_cu_max2<DT>(m0, u.x);
                m1 = sf_cu_max2<DT>(m1, u.y);
                m2 = sf_cu_max2<DT>(m2, u.z);
                m3 = sf_cu_max2<DT>(m3, u.w);
            }
            float x[2];
            sf_cu_unpack16(DT, sf_cu_max2<DT>(sf_cu_max2<DT>(m0, m1), sf_cu_max2<DT>(m2, m3)), x);
            take(x[0]);
            take(x[1]);
            rest.src = s + nfull;
            rest.lo += (int64_t)nfull * 8;
        }
        rest.al = false; /* what is left goes token by token */
    }
    sf_cu_walk<DT>(
        rest,
        [&](int64_t, const float *x) {
#pragma unroll
            for (int j = 0; j < 8; j++) take(x[j]);
            return false;
        },
        [&](int64_t, float x) {
            take(x);
            return false;
        });
    return {m, mag > 0x7F800000u};
}

/* This thread's first token of the span equal to m (INT32_MAX if none):
 * each thread's tokens rise along its walk, so it stops at its first. */
template <int DT>
__device__ int32_t sf_cu_local_first(const sf_cu_span &sp, float m) {
    int32_t first = INT32_MAX;
    sf_cu_walk<DT>(
        sp,
        [&](int64_t i0, const float *x) {
#pragma unroll
            for (int j = 0; j < 8; j++)
                if (x[j] == m) { first = (int32_t)(i0 + j); return true; }
            return false;
        },
        [&](int64_t v, float x) {
            if (x == m) first = (int32_t)v;
            return x == m;
        });
    return first;
}

/* The row's max, the first index of it when amax is not NULL (greedy), and
 * whether a NaN or +inf is met. */
template <int DT>
__device__ void sf_cu_pass_max(const sf_cu_span &sp, float *mx, int32_t *amax, int *bad) {
    sf_cu_maxr v = sf_cu_local_max<DT>(sp);
    v = sf_cu_cluster_all(sf_cu_block_all(v, sf_cu_pick_max()), sp.csize, sf_cu_pick_max());
    *mx = v.m;
    *bad = v.bad || v.m == INFINITY;
    if (amax) {
        /* No index when the row is bad or masked, as the caller stops. */
        const uint64_t first = *bad || v.m == -INFINITY ? UINT64_MAX
                               : (uint64_t)sf_cu_local_first<DT>(sp, v.m);
        const uint64_t id = sf_cu_cluster_all(sf_cu_block_min64(first), sp.csize, sf_cu_min());
        *amax = id >= INT32_MAX ? -1 : (int32_t)id;
    }
}

struct sf_cu_wsum { uint64_t total, q_mass; int q_bad; };
struct sf_cu_add_wsum {
    __device__ sf_cu_wsum operator()(sf_cu_wsum a, sf_cu_wsum b) const {
        return {a.total + b.total, a.q_mass + b.q_mass, a.q_bad | b.q_bad};
    }
    static __device__ sf_cu_wsum id() { return {0, 0, 0}; }
};

/* One tile of the weights pass for this thread's tokens [i0, i0 + 8): their
 * weights, summed, into the tile's sum (returning 0), or returned where tile
 * is NULL; the residual into `store`; q checked as sf_weights_out checks it. */
template <int DT, bool FULL>
__device__ __forceinline__ uint64_t sf_cu_weights_tile(const sf_cu_row &r, const sf_cu_span &sp,
                                                       const sf_cu_in &in, bool cut,
                                                       bool weighted_only, int64_t i0,
                                                       float *store, uint64_t *tile, int *qbad,
                                                       uint64_t *qm) {
    const int64_t n = sp.hi;
    float rr[8], bb[8], qv[8];
    bool rq;
    sf_cu_weights8<DT, FULL>(r, sp, in, cut, i0, rr, &rq, bb, qv);
    if (in.q && rq) {
#pragma unroll
        for (int j = 0; j < 8; j++) {
            /* kernels_impl.h: q outside [0, 1.001] (or NaN) is bad; the good
             * values sum exactly as fixed-point masses. Past n q reads 0. */
            if (weighted_only && bb[j] == 0.0f) continue;
            const bool ok = sf_prob_ok(qv[j]);
            *qbad |= !ok;
            *qm += sf_cu_fixed(ok ? qv[j] : 0.0f);
        }
    }
    /* Past n every weight is 0 (-inf logits, zero base and q). */
    uint64_t s = 0;
#pragma unroll
    for (int j = 0; j < 8; j++) s += sf_cu_fixed(rr[j]);
    if (store && FULL) {
        float4 *p = (float4 *)(store + i0);
        p[0] = make_float4(rr[0], rr[1], rr[2], rr[3]);
        p[1] = make_float4(rr[4], rr[5], rr[6], rr[7]);
    } else if (store) {
        for (int j = 0; j < 8 && i0 + j < n; j++) store[i0 + j] = rr[j];
    }
    if (!tile) return s;
    s = sf_cu_warp_sum(s);
    if ((threadIdx.x & 31) == 0 && s) atomicAdd((unsigned long long *)tile, (unsigned long long)s);
    return 0;
}

/* Weights pass: per-tile sums of the block's span into tiles[] (none where
 * it is NULL: a mass no draw reads), the residual into `store` (indexed by
 * token id) when not NULL; returns the row's total.
 * q_bad / q_mass as sf_weights_out's. The tiles wholly inside the span run
 * without bounds checks when every source is aligned. */
template <int DT>
__device__ uint64_t sf_cu_pass_weights(const sf_cu_row &r, const sf_cu_span &sp,
                                       const sf_cu_in &in, float *store, uint64_t *tiles,
                                       int ntiles, int *q_bad, uint64_t *q_mass) {
    const bool cut = sf_cu_cut_active(r) && !in.base;
    /* dist.c: under the row's cut, from the row or a stored base alike, only
     * the q of tokens with a weight are checked (and not q's sum). */
    const bool weighted_only = sf_cu_cut_active(r);
    if (tiles) {
        for (int t = threadIdx.x; t < ntiles; t += SF_CU_THREADS) tiles[t] = 0;
        __syncthreads();
    }
    int qbad = 0;
    uint64_t qm = 0, part = 0;
    const bool fast = (in.base ? sf_cu_aligned(in.base) : sp.al) &&
                      (!in.q || sf_cu_aligned(in.q)) && (!store || sf_cu_aligned(store));
    const int nfull = fast ? (int)((sp.hi - sp.lo) / SF_CU_TILE) : 0;
    const int64_t i0 = sp.lo + threadIdx.x * 8;
    for (int t = 0; t < nfull; t++)
        part += sf_cu_weights_tile<DT, true>(r, sp, in, cut, weighted_only,
                                             i0 + (int64_t)t * SF_CU_TILE, store,
                                             tiles ? &tiles[t] : NULL, &qbad, &qm);
    for (int t = nfull; t < ntiles; t++)
        part += sf_cu_weights_tile<DT, false>(r, sp, in, cut, weighted_only,
                                              i0 + (int64_t)t * SF_CU_TILE, store,
                                              tiles ? &tiles[t] : NULL, &qbad, &qm);
    sf_cu_wsum v;
    v.q_bad = __syncthreads_or(qbad); /* also: every tile's sum is in */
    v.q_mass = sf_cu_block_sum(qm);
    if (tiles)
        for (int t = threadIdx.x; t < ntiles; t += SF_CU_THREADS) part += tiles[t];
    v.total = sf_cu_block_sum(part);
    v = sf_cu_cluster_all(v, sp.csize, sf_cu_add_wsum());
    if (q_bad) *q_bad = v.q_bad;
    if (q_mass) *q_mass = v.q_mass;
    return v.total;
}

/* Upper bounds of a row's mass over 2^40, to the end of kernels_impl.h's
 * mass_bound (any bound will do: it only lets an acceptance skip the exact
 * sum). Under a power of two 2^k with k = ceil(m c) for a max m (m c is
 * exact in double): the chord of 2^(x c - k) per token, x c - k in one fused
 * multiply-add, so rounded once near its own size whatever x c's (no x - m
 * first); eight tokens summed in float, the rest in double. k is then moved
 * to the max, s 2^(k - m c), once. */
#define SF_CU_KMAX (1 << 24) /* |k| within it: exact in float */
#define SF_CU_KBAD (1 << 30)

template <bool CUT>
__device__ __forceinline__ float sf_cu_bound_e(const sf_cu_row &r, float k, float x) {
    const float e = sf_cu_exp2_up(__fmaf_rn(x, r.c, -k));
    return CUT && !(x >= r.cut_logit) ? 0.0f : e;
}

/* This thread's bound of the sum of 2^(x c - k) over its tokens. */
template <int DT, bool CUT>
__device__ double sf_cu_local_bound(const sf_cu_row &r, const sf_cu_span &sp, float k) {
    double total = 0.0;
    sf_cu_walk<DT>(
        sp,
        [&](int64_t, const float *x) {
            float acc = sf_cu_bound_e<CUT>(r, k, x[0]);
#pragma unroll
            for (int j = 1; j < 8; j++) acc += sf_cu_bound_e<CUT>(r, k, x[j]);
            total += (double)acc;
            return false;
        },
        [&](int64_t, float x) {
            total += (double)sf_cu_bound_e<CUT>(r, k, x);
            return false;
        });
    return total;
}

/* ceil(m c), or SF_CU_KMAX where m c is NaN or too large for a bound, and
 * -SF_CU_KMAX where it lies far below (-inf: no tokens), where 2^(m c - k)
 * <= 1 keeps the sum under k a bound. */
__device__ __forceinline__ int32_t sf_cu_bound_k(float m, float c) {
    const double y = (double)m * (double)c;
    if (!(y < SF_CU_KMAX)) return SF_CU_KMAX;
    return y > -SF_CU_KMAX ? (int32_t)ceil(y) : -SF_CU_KMAX;
}

/* The bound under the row's max m from s, a bound of the sum of 2^(x c - k):
 * k - m c lies in [0, 1] (1 where m c is a positive hair above 0: its
 * difference rounds) unless no bound was worth giving or the row is masked,
 * where it is +inf (the caller then sums the mass). */
__device__ __forceinline__ double sf_cu_bound_at_max(double s, int32_t k, float m, float c) {
    const double e = (double)k - (double)m * (double)c;
    return e >= 0.0 && e <= 1.0 && k < SF_CU_KMAX ? s * exp2(e) * (1.0 + 0x1p-40) : INFINITY;
}

/* The bound of a row with a cut (d.r, its max found). */
template <int DT>
__device__ double sf_cu_pass_bound(const sf_cu_row &r, const sf_cu_span &sp) {
    const int32_t k = sf_cu_bound_k(r.max, r.c);
    if (k == SF_CU_KMAX || k == -SF_CU_KMAX) return INFINITY; /* the same in every block */
    const double total = r.cut_logit > -INFINITY ? sf_cu_local_bound<DT, true>(r, sp, (float)k)
                                                 : sf_cu_local_bound<DT, false>(r, sp, (float)k);
    const double s = sf_cu_cluster_all(sf_cu_block_dsum(total), sp.csize, sf_cu_dadd());
    return sf_cu_bound_at_max(s, k, r.max, r.c);
}

/* (max, k, bound of the sum of 2^(x c - k)): what the acceptance test of a
 * row without a top-k / top-p cut needs, in one combine instead of a max and
 * then a bound. Each thread bounds its tokens under its own max's k; parts
 * combine by exact powers of two (a shift and two adds, no exp2 a step). A
 * NaN met sets k to SF_CU_KBAD, which wins every step. */
struct sf_cu_maxb { float m; int32_t k; double s; };

/* 2^d for d <= 0, and 2^-1022 below that (an upper bound, never 0). */
__device__ __forceinline__ double sf_cu_pow2(int32_t d) {
    const uint64_t b = (uint64_t)(1023 + max(d, -1022)) << 52;
    double r;
    memcpy(&r, &b, 8);
    return r;
}

struct sf_cu_pick_maxb {
    __device__ sf_cu_maxb operator()(sf_cu_maxb a, sf_cu_maxb b) const {
        const int32_t k = max(a.k, b.k);
        /* _rn: no contraction into an fma, whose operand order would differ
         * between the two lanes of a butterfly. */
        const double sa = __dmul_rn(a.s, sf_cu_pow2(a.k - k));
        const double sb = __dmul_rn(b.s, sf_cu_pow2(b.k - k));
        return {SF_FADD(fmaxf(a.m, b.m), 0.0f), k, __dadd_rn(sa, sb)};
    }
    static __device__ sf_cu_maxb id() { return {-INFINITY, -SF_CU_KMAX, 0.0}; }
};

template <int DT>
__device__ void sf_cu_pass_max_bound(const sf_cu_span &sp, float c, float *mx, int *bad,
                                     double *bound) {
    const sf_cu_maxr lm = sf_cu_local_max<DT>(sp);
    sf_cu_row r = {};
    r.c = c;
    sf_cu_maxb v = {lm.m, lm.bad ? SF_CU_KBAD : sf_cu_bound_k(lm.m, c), 0.0};
    if (v.k == SF_CU_KMAX) v.s = INFINITY;
    else if (v.k != SF_CU_KBAD) v.s = sf_cu_local_bound<DT, false>(r, sp, (float)v.k);
    const sf_cu_pick_maxb op = {};
    v = sf_cu_cluster_all(sf_cu_block_all(v, op), sp.csize, op);
    *mx = v.m;
    *bad = v.k == SF_CU_KBAD || v.m == INFINITY;
    *bound = sf_cu_bound_at_max(v.s, v.k, v.m, c);
}

/* Radix select: the smallest rank key K of a candidate such that the
 * candidates with keys <= K weigh enough: count >= k (mode 0, candidates: the
 * finite logits) or (double) mass >= top_p * total mass (mode 1, candidates:
 * finite logits above the current cut, mass floor(e * 2^40)). Returns false
 * when no key qualifies (fewer than k candidates). */
template <int DT>
__device__ bool sf_cu_select(const sf_cu_row &r, const sf_cu_span &sp, int mode, int64_t k,
                             float top_p, uint64_t *out_key) {
    __shared__ uint32_t hc[256], gc[256];
    __shared__ unsigned long long hm[256], gm[256];
    const uint32_t *cnt = sp.csize > 1 ? gc : hc;
    const unsigned long long *mass = sp.csize > 1 ? gm : hm;
    __shared__ uint64_t s_prefix, s_mask, s_base_c, s_base_m;
    __shared__ double s_goal;
    __shared__ int s_state; /* 0 go on, 1 one candidate left, 2 done, 3 none */
    const int shifts[7] = {56, 48, 40, 32, 16, 8, 0};
    if (threadIdx.x == 0) { s_prefix = 0; s_mask = 0; s_base_c = 0; s_base_m = 0; }
    for (int si = 0; si < 7; si++) {
        const int shift = shifts[si];
        for (int i = threadIdx.x; i < 256; i += SF_CU_THREADS) { hc[i] = 0; hm[i] = 0; }
        __syncthreads();
        const uint64_t prefix = s_prefix, mask = s_mask;
        int ld = -1;
        uint32_t lc = 0;
        uint64_t lm = 0;
        for (int64_t i0 = sp.lo + (int64_t)threadIdx.x * 8; i0 < sp.hi; i0 += SF_CU_TILE) {
            float x[8];
            sf_cu_span8<DT>(sp, i0, x);
#pragma unroll
            for (int j = 0; j < 8; j++) {
                const int64_t v = i0 + j;
                if (v >= sp.hi || !(x[j] > -INFINITY)) continue;
                if (mode && !sf_cu_above_cut(r, x[j], v)) continue;
                const uint64_t key = sf_cu_rank_key(x[j], v);
                if ((key & mask) != prefix) continue;
                const int dg = (int)((key >> shift) & 255);
                if (dg != ld) {
                    if (ld >= 0) {
                        atomicAdd(&hc[ld], lc);
                        if (mode) atomicAdd(&hm[ld], (unsigned long long)lm);
                    }
                    ld = dg; lc = 0; lm = 0;
                }
                lc++;
                if (mode) lm += sf_cu_fixed(sf_cu_row_e(r, x[j]));
            }
        }
        if (ld >= 0) {
            atomicAdd(&hc[ld], lc);
            if (mode) atomicAdd(&hm[ld], (unsigned long long)lm);
        }
        __syncthreads();
#if SF_CU_CLUSTERS
        if (sp.csize > 1) {
            /* The cluster's histogram: every block sums the blocks' bins. */
            cooperative_groups::cluster_group cl = cooperative_groups::this_cluster();
            cl.sync();
            for (int i = threadIdx.x; i < 256; i += SF_CU_THREADS) {
                uint32_t c = 0;
                unsigned long long m = 0;
                for (int q = 0; q < sp.csize; q++) {
                    c += *cl.map_shared_rank(&hc[i], q);
                    m += *cl.map_shared_rank(&hm[i], q);
                }
                gc[i] = c;
                gm[i] = m;
            }
            cl.sync(); /* all have read before the next round clears hc / hm */
        }
#endif
        if (threadIdx.x == 0) {
            if (si == 0 && mode) {
                uint64_t total = 0;
                for (int i = 0; i < 256; i++) total += mass[i];
                s_goal = (double)top_p * (double)total;
            }
            uint64_t cc = s_base_c, cm = s_base_m;
            int chosen = -1;
            for (int i = 0; i < 256; i++) {
                uint64_t nc = cc + cnt[i], nm = cm + mass[i];
                bool ok = mode ? (double)nm >= s_goal : nc >= (uint64_t)k;
                if (ok) { chosen = i; break; }
                cc = nc;
                cm = nm;
            }
            if (chosen < 0) {
                s_state = 3;
            } else {
                s_base_c = cc;
                s_base_m = cm;
                s_prefix |= (uint64_t)chosen << shift;
                s_mask |= (uint64_t)255 << shift;
                s_state = cnt[chosen] == 1 ? 1 : si == 6 ? 2 : 0;
            }
        }
        __syncthreads();
        const int state = s_state;
        if (state == 3) return false;
        if (state == 2) { *out_key = s_prefix; return true; }
        if (state == 1) break;
    }
    /* One candidate matches the prefix: find it. */
    const uint64_t prefix = s_prefix, mask = s_mask;
    uint64_t found = UINT64_MAX;
    for (int64_t i0 = sp.lo + (int64_t)threadIdx.x * 8; i0 < sp.hi; i0 += SF_CU_TILE) {
        float x[8];
        sf_cu_span8<DT>(sp, i0, x);
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const int64_t v = i0 + j;
            if (v >= sp.hi || !(x[j] > -INFINITY)) continue;
            if (mode && !sf_cu_above_cut(r, x[j], v)) continue;
            const uint64_t key = sf_cu_rank_key(x[j], v);
            if ((key & mask) == prefix && key < found) found = key;
        }
    }
    *out_key = sf_cu_cluster_all(sf_cu_block_min64(found), sp.csize, sf_cu_min());
    return true;
}

/* sf_dist_prepare without the mass: max, inverse temperature, top-k, top-p
 * and min-p cuts into d.r; resets the weights source. Returns a status.
 * bound, when not NULL, takes an upper bound of the row's mass over 2^40
 * where no top-k / top-p cut is to be found (with the max, in one combine),
 * else -1. */
template <int DT>
__device__ int sf_cu_prepare(sf_cu_dist &d, const sf_cu_span &sp, const sf_cu_params_row &p,
                             double *bound = NULL) {
    const int64_t n = sp.n;
    const bool select = (p.top_k > 0 && p.top_k < n) || p.top_p < 1.0f;
    const float inv_t = sf_inv_temperature(p.temperature);
    float m;
    int bad;
    if (bound && !select) {
        sf_cu_pass_max_bound<DT>(sp, SF_FMUL(inv_t, SF_LOG2E), &m, &bad, bound);
    } else {
        sf_cu_pass_max<DT>(sp, &m, NULL, &bad);
        if (bound) *bound = -1.0;
    }
    if (bad) return SF_ERR_LOGITS;
    if (m == -INFINITY) return SF_ERR_ALL_MASKED;
    if (threadIdx.x == 0) {
        d.r.max = m;
        d.r.inv_t = inv_t;
        d.r.c = SF_FMUL(inv_t, SF_LOG2E);
        d.r.cut_logit = -INFINITY;
        d.r.cut_id = INT32_MAX;
        d.r.min_e = select ? 0.0f : p.min_p; /* the cuts are found without it */
        d.r.etab = 0;
        d.r.etab_lo = 0;
        d.base = NULL;
        d.scale = 1.0f;
        d.q = NULL;
        d.total = 0;
        d.n_over = 0;
        d.resid_next = 0;
    }
    __syncthreads();
    if (!select) return SF_OK;
    uint64_t key;
    if (p.top_k > 0 && p.top_k < n) {
        sf_cu_row r = d.r;
        if (sf_cu_select<DT>(r, sp, 0, p.top_k, 0.0f, &key) && threadIdx.x == 0) {
            d.r.cut_logit = sf_cu_key_logit(key);
            d.r.cut_id = (int32_t)(uint32_t)key;
        }
        __syncthreads();
    }
    if (p.top_p < 1.0f) {
        sf_cu_row r = d.r;
        if (sf_cu_select<DT>(r, sp, 1, 0, p.top_p, &key) && threadIdx.x == 0) {
            d.r.cut_logit = sf_cu_key_logit(key);
            d.r.cut_id = (int32_t)(uint32_t)key;
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) d.r.min_e = p.min_p;
    __syncthreads();
    return SF_OK;
}

/* Gumbel-max over the kept tokens (coupled_race of kernels_impl.h). Thread
 * item g = 16 s + lane holds tokens 64 s + 16 c + lane, c = 0..3: the four
 * words of one Philox call. */
template <int DT>
__device__ int32_t sf_cu_coupled(const sf_cu_row &r, const sf_cu_span &sp, uint64_t seed,
                                 int64_t position) {
    sf_cu_best best = {-INFINITY, -1};
    /* lo is a multiple of 64 (groups never straddle blocks) unless the span
     * is empty: lo = hi = n. */
    const int64_t n = sp.hi;
    const int64_t items = sp.hi > sp.lo ? (n + 63) / 64 * 16 : 0;
    const bool minp = r.min_e > 0.0f;
    for (int64_t g = sp.lo / 4 + threadIdx.x; g < items; g += SF_CU_THREADS) {
        const int64_t s = g >> 4, lane = g & 15;
        float x[4];
        bool keep[4], any = false;
#pragma unroll
        for (int c = 0; c < 4; c++) {
            const int64_t v = 64 * s + 16 * c + lane;
            x[c] = v < n ? sf_cu_span1<DT>(sp, v) : -INFINITY;
            keep[c] = sf_cu_above_cut(r, x[c], v);
            if (minp) keep[c] = keep[c] && sf_cu_row_e(r, x[c]) >= r.min_e;
            any |= keep[c];
        }
        if (!any) continue;
        const sf_u32x4 w = sf_philox(seed, position, SF_PURPOSE_NOISE, (uint32_t)g);
#pragma unroll
        for (int c = 0; c < 4; c++) {
            if (!keep[c]) continue;
            const float key = SF_FADD(SF_FMUL(SF_FSUB(x[c], r.max), r.inv_t), sf_gumbel(w.v[c]));
            sf_cu_best cand = {key, (int32_t)(64 * s + 16 * c + lane)};
            best = sf_cu_better(best, cand);
        }
    }
    return sf_cu_cluster_all(sf_cu_block_best(best), sp.csize, sf_cu_pick_better()).id;
}

/* Overrides of one request's current row (one-hot / sparse rejections). */
struct sf_cu_over {
    int32_t *id;
    uint64_t *w;
};

/* A token's weight under d, overrides first (dist.c's weight); one thread.
 * l, when not NULL, holds the token's logit, read earlier. */
template <int DT>
__device__ uint64_t sf_cu_weight_at(const sf_cu_dist &d, const sf_cu_over &ov,
                                    const void *row, int64_t v, const float *l = NULL) {
    for (int i = d.n_over - 1; i >= 0; i--)
        if (ov.id[i] == v) return ov.w[i];
    /* Another block of the cluster may have written base[v]: read it from L2
     * (__ldcg), where the cluster barrier made it visible, not from this
     * SM's L1. */
    float b = d.base ? __ldcg(d.base + v)
                     : sf_cu_row_base(d.r, l ? *l : sf_cu_load1<DT>(row, v), v);
    return sf_cu_fixed(sf_cu_resid(b, d.scale, d.q ? d.q[v] : 0.0f));
}

/* The draws of targets[k] (k < n) that lie in tile `tile` of the block's
 * span (in[k] == tile), whose tiles before it (and the blocks before this
 * one) weigh cum: into tok[k]. All threads of the block. */
template <int DT>
__device__ void sf_cu_draw_tile(const sf_cu_dist &d, const sf_cu_over &ov, const sf_cu_span &sp,
                                int tile, uint64_t cum, const uint64_t *targets,
                                const int32_t *in, int32_t *tok, int n) {
    const int64_t i0 = sp.lo + (int64_t)tile * SF_CU_TILE + threadIdx.x * 8;
    sf_cu_in src = {d.base, d.scale, d.q};
    float rr[8];
    bool rq;
    sf_cu_weights8<DT>(d.r, sp, src, sf_cu_cut_active(d.r) && !d.base, i0, rr, &rq);
    uint64_t w[8], s = 0;
#pragma unroll
    for (int j = 0; j < 8; j++) w[j] = i0 + j < sp.hi ? sf_cu_fixed(rr[j]) : 0;
    for (int i = 0; i < d.n_over; i++) {
        const int64_t id = ov.id[i];
        if (id >= i0 && id < i0 + 8) w[id - i0] = ov.w[i];
    }
#pragma unroll
    for (int j = 0; j < 8; j++) s += w[j];
    int32_t last = -1;
#pragma unroll
    for (int j = 0; j < 8; j++) if (w[j]) last = (int32_t)(i0 + j);
    const uint64_t ex = cum + sf_cu_block_exscan(s);
    for (int k = 0; k < n; k++) {
        if (in[k] != tile || s == 0 || targets[k] < ex || targets[k] - ex >= s) continue;
        uint64_t c = ex;
        for (int j = 0; j < 8; j++) {
            if (!w[j]) continue;
            c += w[j];
            if (c > targets[k]) { tok[k] = (int32_t)(i0 + j); break; }
        }
    }
    /* Unreachable fallback (the sums are exact): the last weighted token.
     * The reduction's barriers make the tokens found visible. */
    sf_cu_best lb = {(float)last, last};
    lb = sf_cu_block_best(lb);
    if (threadIdx.x < n && in[threadIdx.x] == tile && tok[threadIdx.x] < 0)
        tok[threadIdx.x] = lb.id;
}

/* Inverse-CDF draws from d at targets[0, n) (shared memory, each in
 * [0, d.total), n <= SF_CU_DRAWS) into tok[] (shared memory): for each, the
 * first token whose inclusive prefix of weights exceeds it, as sf_dist_draw
 * finds it. The block whose span holds a target finds its token, scanning
 * each tile that holds targets once; the cluster then shares them. All
 * threads of the cluster. */
#define SF_CU_DRAWS 32
template <int DT>
__device__ void sf_cu_draws(const sf_cu_dist &d, const sf_cu_over &ov, const sf_cu_span &sp,
                            const uint64_t *tiles, int ntiles, const uint64_t *targets,
                            int32_t *tok, int n) {
    __shared__ int32_t s_in[SF_CU_DRAWS]; /* the tile of the span holding each, or -1 */
    __shared__ uint64_t s_cum[SF_CU_DRAWS];
    uint64_t part = 0;
    for (int t = threadIdx.x; t < ntiles; t += SF_CU_THREADS) part += tiles[t];
    part = sf_cu_block_sum(part); /* also: targets[] is written */
    const uint64_t before = sf_cu_cluster_before(part, sp.csize);
    if (threadIdx.x < n) {
        const uint64_t target = targets[threadIdx.x];
        int t = -1;
        uint64_t cum = before;
        if (target >= before && target - before < part)
            for (t = 0; t < ntiles - 1 && cum + tiles[t] <= target;) cum += tiles[t++];
        s_in[threadIdx.x] = t;
        s_cum[threadIdx.x] = cum;
        tok[threadIdx.x] = -1;
    }
    __syncthreads();
    for (int k = 0; k < n; k++) {
        bool first = s_in[k] >= 0; /* the first target of its tile */
        for (int e = 0; e < k; e++) first = first && s_in[e] != s_in[k];
        if (first) sf_cu_draw_tile<DT>(d, ov, sp, s_in[k], s_cum[k], targets, s_in, tok, n);
    }
    /* Each token was found by one block (-1 in the others). */
#if SF_CU_CLUSTERS
    if (sp.csize > 1) {
        cooperative_groups::cluster_group cl = cooperative_groups::this_cluster();
        cl.sync();
        int32_t found = -1;
        if (threadIdx.x < n)
            for (int b = 0; b < sp.csize; b++)
                found = max(found, *cl.map_shared_rank(tok + threadIdx.x, b));
        cl.sync();
        if (threadIdx.x < n) tok[threadIdx.x] = found;
    }
#endif
    __syncthreads();
}

/* The draw from d at sf_draw_block(seed, position, residual) (sf_dist_draw). */
template <int DT>
__device__ int32_t sf_cu_draw(const sf_cu_dist &d, const sf_cu_over &ov, const sf_cu_span &sp,
                              const uint64_t *tiles, int ntiles, uint64_t seed,
                              int64_t position, bool residual) {
    __shared__ uint64_t s_target;
    __shared__ int32_t s_tok;
    if (threadIdx.x == 0)
        s_target = sf_draw_target(sf_draw_block(seed, position, residual), d.total);
    sf_cu_draws<DT>(d, ov, sp, tiles, ntiles, &s_target, &s_tok, 1);
    return s_tok;
}

/* sf_dist_resid_tries: the residual that rejecting the last sibling, drawn
 * from the dense q, leaves, drawn by SF_RESID_TRIES tries from d (its tiles
 * summed) before it is formed. The CPU makes them one after another; here
 * all are drawn at once (a round of barriers, one load of q and of the
 * weight per try, all in flight together), and the first that keeps its
 * token or meets a bad q decides, as there. Returns the kept token, or -1
 * (a bad q sets *st). Every block takes the same decisions. */
template <int DT>
__device__ int32_t sf_cu_resid_tries(const sf_cu_dist &d, const sf_cu_over &ov,
                                     const sf_cu_span &sp, const uint64_t *tiles, int ntiles,
                                     const float *q, uint64_t seed, int64_t position, int *st) {
    static_assert(SF_RESID_TRIES <= SF_CU_DRAWS, "one draw per thread of the first warp");
    __shared__ uint64_t s_target[SF_RESID_TRIES];
    __shared__ int32_t s_y[SF_RESID_TRIES];
    __shared__ int s_keep[SF_RESID_TRIES];
    const int i = threadIdx.x;
    if (i < SF_RESID_TRIES)
        s_target[i] = sf_draw_target(sf_philox(seed, position, SF_PURPOSE_RESID, (uint32_t)i),
                                     d.total);
    sf_cu_draws<DT>(d, ov, sp, tiles, ntiles, s_target, s_y, SF_RESID_TRIES);
    if (i < SF_RESID_TRIES) {
        /* Drawn again rather than kept live across the draws. */
        const sf_u32x4 r = sf_philox(seed, position, SF_PURPOSE_RESID, (uint32_t)i);
        /* y has a weight, so the filters keep it: its q is checked. */
        const int32_t y = s_y[i];
        const float qy = y >= 0 ? q[y] : 0.0f;
        int keep = 0; /* -1: a bad q */
        if (y >= 0 && !sf_prob_ok(qy))
            keep = -1;
        else if (y >= 0)
            keep = sf_resid_keeps(r, sf_cu_weight_at<DT>(d, ov, sp.row, y), qy, d.total);
        s_keep[i] = keep;
    }
    __syncthreads();
    int32_t kept = -1;
    for (int k = 0; k < SF_RESID_TRIES && s_y[k] >= 0; k++) {
        if (s_keep[k] < 0) *st = SF_ERR_DRAFT_PROBS;
        if (s_keep[k]) {
            kept = s_keep[k] > 0 ? s_y[k] : -1;
            break;
        }
    }
    __syncthreads(); /* s_y and s_keep are free again */
    return kept;
}

/* Where the e table of a bf16 row starts (sf_cu_etab_e): the field whose
 * SF_CU_ETAB_FIELDS - 1 next end at that of the larger of |max| and
 * |max - 131 / c|. A negative logit of a later field is below max - 130 / c
 * (the margins cover the roundings in double), so its (l - max) c rounds
 * below -125 and its e is 0; no logit of the row is above max. */
__device__ __forceinline__ uint32_t sf_cu_etab_place(float max, float c) {
    const double m = (double)max;
    const double a = fmax(fabs(m), fabs(m - 131.0 / (double)c)) * (1.0 + 1e-6);
    const uint32_t top = sf_f2u(a < 3.0e38 ? (float)a : 3.0e38f) >> 23;
    return (top >= SF_CU_ETAB_FIELDS ? top - (SF_CU_ETAB_FIELDS - 1) : 0) << 23;
}

/* d's row with its e table, filled here (all threads) on its first exact
 * pass: bf16 rows of blocks that have room for one. */
template <int DT>
__device__ sf_cu_row sf_cu_with_etab(sf_cu_dist &d) {
    if (DT == SF_BF16 && d.etab_at && !d.r.etab) {
        const sf_cu_row r = d.r;
        const uint32_t lo = sf_cu_etab_place(r.max, r.c);
        float *t = (float *)sf_cu_dynamic + d.etab_at;
        for (int i = threadIdx.x; i < 2 * SF_CU_ETAB_SIDE; i += SF_CU_THREADS) {
            const int neg = i >= SF_CU_ETAB_SIDE, k = i - neg * SF_CU_ETAB_SIDE;
            const uint16_t h = (uint16_t)((uint32_t)neg << 15 | ((lo >> 16) + (uint32_t)k));
            t[i] = k == SF_CU_ETAB_SIDE - 1 ? 0.0f : sf_cu_row_e(r, sf_bf16_to_f32(h));
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            d.r.etab = d.etab_at;
            d.r.etab_lo = lo;
        }
        __syncthreads();
    }
    return d.r;
}

/* ---- verify ---- */

template <int DT>
__device__ int sf_cu_reject_dense(sf_cu_dist &d, const sf_cu_span &sp, const float *q,
                                  float *resid2, bool more, uint64_t *tiles, int ntiles) {
    const int64_t n = sp.n;
    const sf_cu_in old = {d.base, d.scale, d.q};
    const sf_cu_in in = {d.base, (float)(SF_MASS_ONE / (double)d.total), q};
    float *out = more ? resid2 + (int64_t)d.resid_next * n : NULL;
    int q_bad;
    uint64_t q_mass;
    const sf_cu_row r = sf_cu_with_etab<DT>(d);
    uint64_t total = sf_cu_pass_weights<DT>(r, sp, in, out, tiles, ntiles, &q_bad, &q_mass);
    /* q must sum to 1 within 1e-3 where the pass read it whole (dist.c). */
    const uint64_t one = (uint64_t)1 << SF_MASS_BITS, tol = one / 1000;
    const bool whole = !sf_cu_cut_active(r);
    if (q_bad || (whole && (q_mass > one + tol || q_mass + tol < one))) return SF_ERR_DRAFT_PROBS;
    if (total == 0) {
        /* p <= q everywhere (p == q up to rounding): keep p. Under a cut,
         * unless q's kept mass shows it is no distribution (dist.c). */
        if (!whole && q_mass > one + tol) return SF_ERR_DRAFT_PROBS;
        sf_cu_pass_weights<DT>(r, sp, old, NULL, tiles, ntiles, NULL, NULL);
        return SF_OK;
    }
    if (threadIdx.x == 0) {
        d.total = total;
        if (more) {
            d.base = out;
            d.scale = 1.0f;
            d.q = NULL;
            d.resid_next ^= 1;
        } else {
            d.scale = in.scale;
            d.q = q;
        }
    }
    __syncthreads();
    return SF_OK;
}

/* sf_dist_reject_sparse, on thread 0. */
template <int DT>
__device__ void sf_cu_reject_sparse(sf_cu_dist &d, const sf_cu_over &ov, const sf_cu_span &sp,
                                    const int32_t *ids, const float *probs, int64_t k,
                                    uint64_t *tiles) {
    const void *row = sp.row;
    const double z = (double)d.total;
    uint64_t total = d.total;
    int m = 0;
    for (int64_t i = 0; i < k; i++) {
        if (ids[i] < 0) continue;
        uint64_t w = sf_cu_weight_at<DT>(d, ov, row, ids[i]);
        uint64_t sub = (uint64_t)((double)probs[i] * z);
        uint64_t nw = w > sub ? w - sub : 0;
        total = total - w + nw;
        ov.id[d.n_over + m] = ids[i];
        ov.w[d.n_over + m] = nw;
        m++;
    }
    if (total == 0) return;
    for (int i = 0; i < m; i++) {
        int32_t id = ov.id[d.n_over];
        uint64_t old = sf_cu_weight_at<DT>(d, ov, row, id);
        if (id >= sp.lo && id < sp.hi) tiles[(id - sp.lo) / SF_CU_TILE] += ov.w[d.n_over] - old;
        d.n_over++;
    }
    d.total = total;
}

/* verify.c's check_draft over the nd nodes of a request: the lowest
 * (node << 8 | status), UINT64_MAX when all pass. The lowest status of a node
 * is the one the CPU's order of checks meets first (token, parent, probs).
 * A sparse node's entries are spread over the block, each thread looking
 * for its entry's id among the entries before it: k^2 / 2 compares per node
 * on 256 threads, not on one. All threads call it. */
__device__ uint64_t sf_cu_check_draft(const sf_cu_verify_args &a, int64_t node0, int32_t nd) {
    const int64_t k = a.sparse_k;
    uint64_t worst = UINT64_MAX;
    for (int64_t i = threadIdx.x; i < nd; i += SF_CU_THREADS) {
        const int64_t node = node0 + i;
        const int32_t t = a.tokens[node];
        int code = 0;
        if (t < 0 || t >= a.vocab) {
            code = SF_ERR_TOKEN;
        } else if (a.parents && (a.parents[node] < -1 || a.parents[node] >= i)) {
            code = SF_ERR_PARENT;
        } else if (a.kind == SF_DRAFT_SPARSE) {
            double sum = 0.0; /* in order, as the CPU sums */
            for (int64_t e = 0; e < k; e++) sum += a.sparse_probs[node * k + e];
            if (!(fabs(sum - 1.0) <= 1e-3)) code = SF_ERR_DRAFT_PROBS;
        }
        if (code) worst = min(worst, (uint64_t)i << 8 | (uint64_t)code);
    }
    if (a.kind == SF_DRAFT_SPARSE) {
        for (int64_t e = threadIdx.x; e < (int64_t)nd * k; e += SF_CU_THREADS) {
            const int64_t i = e / k, j = e % k;
            const int32_t *ids = a.sparse_ids + (node0 + i) * k;
            const int32_t id = ids[j];
            const float pr = a.sparse_probs[(node0 + i) * k + j];
            bool bad = id < -1 || id >= a.vocab || !sf_prob_ok(pr) ||
                       (id == -1 && pr != 0.0f);
            for (int64_t z = 0; z < j && id >= 0 && !bad; z++) bad = ids[z] == id;
            if (bad) worst = min(worst, (uint64_t)i << 8 | (uint64_t)SF_ERR_DRAFT_PROBS);
        }
    }
    return sf_cu_block_min64(worst);
}

__device__ float sf_cu_draft_prob(const sf_cu_verify_args &a, int64_t node, int32_t x) {
    if (a.kind == SF_DRAFT_DENSE) return a.dense[node * a.vocab + x];
    if (a.kind == SF_DRAFT_SPARSE) {
        for (int64_t i = 0; i < a.sparse_k; i++)
            if (a.sparse_ids[node * a.sparse_k + i] == x)
                return a.sparse_probs[node * a.sparse_k + i];
        return 0.0f;
    }
    return 1.0f;
}

/* The exact mass of d's row (fresh from sf_cu_prepare) into d.total, and
 * into tiles unless they are NULL. */
template <int DT>
__device__ void sf_cu_set_mass(sf_cu_dist &d, const sf_cu_span &sp, uint64_t *tiles, int ntiles) {
    const sf_cu_row r = sf_cu_with_etab<DT>(d);
    const sf_cu_in in0 = {NULL, 1.0f, NULL};
    const uint64_t total = sf_cu_pass_weights<DT>(r, sp, in0, NULL, tiles, ntiles, NULL, NULL);
    if (threadIdx.x == 0) d.total = total;
    __syncthreads();
}

template <int DT>
__global__ void __launch_bounds__(SF_CU_THREADS, SF_CU_MIN_BLOCKS)
sf_cu_verify_kernel(sf_cu_verify_args a) {
    uint64_t *const tiles = sf_cu_dynamic; /* the span's tiles, then its staged tokens */
    __shared__ sf_cu_dist d;
    __shared__ int32_t first[SF_MAX_DRAFT + 1], next[SF_MAX_DRAFT];
    __shared__ int s_flag, s_try;
    __shared__ double s_uq;
    __shared__ uint64_t s_w;
    /* The first SF_CU_PRE nodes' acceptance inputs, found at once. */
    __shared__ int32_t s_depth[SF_CU_PRE];
    __shared__ float s_qx[SF_CU_PRE], s_lx[SF_CU_PRE];
    __shared__ double s_u[SF_CU_PRE];
    /* Request b, block `rank` of its cluster: tokens [lo, hi) of each row.
     * Every block walks the same tree and takes the same decisions (thread 0
     * of each, same arithmetic); rank 0 writes the results. */
    const int64_t b = blockIdx.x / a.csize;
    const int rank = (int)(blockIdx.x % a.csize);
    const bool writer = rank == 0;
    const int64_t n = a.vocab, width = a.max_draft + 1;
    const int64_t lo = min((int64_t)rank * a.slice, n), hi = min(lo + a.slice, n);
    const int ntiles = (int)((hi - lo + SF_CU_TILE - 1) / SF_CU_TILE);
    void *stage = a.cache ? (void *)(tiles + ((a.slice / SF_CU_TILE + 1) & ~1)) : NULL;
    int32_t *out_tok = a.out_tokens + b * width;
    int32_t *out_nodes = a.out_nodes ? a.out_nodes + b * a.max_draft : NULL;
    if (writer) {
        for (int64_t i = threadIdx.x; i < width; i += SF_CU_THREADS) out_tok[i] = -1;
        if (out_nodes)
            for (int64_t i = threadIdx.x; i < a.max_draft; i += SF_CU_THREADS) out_nodes[i] = -1;
    }

    /* Node offset of this request, and whether any num_draft before it is bad. */
    int64_t acc = 0;
    int bad = 0;
    for (int64_t i = threadIdx.x; i < b; i += SF_CU_THREADS) {
        const int32_t v = a.num_draft[i];
        acc += v;
        bad |= v < 0 || v > SF_MAX_DRAFT || v > a.max_draft;
    }
    const int64_t node0 = (int64_t)sf_cu_block_sum((uint64_t)acc);
    bad = __syncthreads_or(bad);
    const int32_t nd = a.num_draft[b];
    sf_cu_params_row p = sf_cu_get_params(a.params, b);
    int32_t err = 0;
    if (!sf_cu_params_ok(p)) {
        err = SF_STATUS(SF_ERR_PARAM, SF_PHASE_PARAMS);
    } else if (bad || nd < 0 || nd > SF_MAX_DRAFT || nd > a.max_draft || node0 < 0 ||
               node0 + nd > a.n || (b == a.batch - 1 && node0 + nd != a.n)) {
        err = SF_STATUS(SF_ERR_SHAPE, SF_PHASE_DRAFT);
    } else {
        const uint64_t worst = sf_cu_check_draft(a, node0, nd);
        if (worst != UINT64_MAX) err = SF_STATUS((int)(worst & 255), SF_PHASE_DRAFT);
    }
    if (err) {
        if (writer && threadIdx.x == 0) { a.status[b] = err; a.out_acc[b] = 0; }
        return;
    }

    const int32_t *tok = a.tokens + node0;
    if (threadIdx.x == 0) {
        d.etab_at = a.etab;
        for (int32_t i = 0; i <= nd; i++) first[i] = -1;
        for (int32_t i = nd - 1; i >= 0; i--) {
            int32_t parent = a.parents ? a.parents[node0 + i] : i - 1;
            next[i] = first[parent + 1];
            first[parent + 1] = i;
            if (i < SF_CU_PRE) s_depth[i] = parent; /* a parent comes before its children */
        }
        for (int32_t i = 0; i < min(nd, SF_CU_PRE); i++)
            s_depth[i] = s_depth[i] < 0 ? 0 : s_depth[s_depth[i]] + 1;
    }
    __syncthreads();
    const int64_t k_over = a.kind == SF_DRAFT_SPARSE ? a.sparse_k : 1;
    /* Each block keeps its own copy of the overrides. */
    const int64_t ov0 = ((int64_t)rank * a.n + node0) * k_over;
    const sf_cu_over ov = {a.over_id ? a.over_id + ov0 : NULL, a.over_w ? a.over_w + ov0 : NULL};
    float *resid2 = a.resid ? a.resid + b * 2 * n : NULL;
    const int64_t row0 = node0 + b;
    const size_t esize = DT == SF_F32 ? 4 : 2;
    /* Acceptance tests (rejection sampling), or one draw a row to compare. */
    const bool tests = a.method != SF_COUPLED && p.temperature != 0.0f;
    /* What the acceptance test of node i reads (its draft probability, its
     * uniform, its logit in its parent's row): for the first SF_CU_PRE nodes,
     * read and drawn here by a thread each, so the loads are in flight
     * together instead of one after another on thread 0, row by row. */
    if (tests) {
        for (int32_t i = threadIdx.x; i < min(nd, SF_CU_PRE); i += SF_CU_THREADS) {
            const int32_t parent = a.parents ? a.parents[node0 + i] : i - 1;
            uint32_t j = 0; /* its place among its siblings */
            for (int32_t s = first[parent + 1]; s != i; s = next[s]) j++;
            const uint64_t pos = (uint64_t)p.position + (uint64_t)s_depth[i];
            s_qx[i] = sf_cu_draft_prob(a, node0 + i, tok[i]);
            s_u[i] = sf_uniform_open0(sf_philox(p.seed, (int64_t)pos, SF_PURPOSE_ACCEPT, j));
            s_lx[i] = sf_cu_load1<DT>((const char *)a.logits +
                                          (size_t)((row0 + parent + 1) * a.row_stride) * esize,
                                      tok[i]);
        }
        __syncthreads();
    }

    int32_t cur = -1, depth = 0;
    int st = SF_OK;
    for (;;) {
        const void *row = (const char *)a.logits + (size_t)((row0 + cur + 1) * a.row_stride) * esize;
        const void *mine = (const char *)row + (size_t)lo * esize;
        sf_cu_span sp = {mine, row, lo, hi, n, sf_cu_aligned(mine), a.csize};
        /* The next row if the first child is accepted: into L2 while this
         * one is staged and worked on (wasted where it is rejected). */
        if (threadIdx.x == 0 && first[cur + 1] >= 0)
            sf_cu_prefetch_l2((const char *)a.logits +
                                  ((size_t)((row0 + first[cur + 1] + 1) * a.row_stride) + lo) * esize,
                              (hi - lo) * (int64_t)esize);
        if (stage) {
            __syncthreads(); /* the last row's tokens are no longer read */
            sf_cu_stage<DT>(stage, mine, hi - lo, sp.al);
            sp.src = stage;
            sp.al = true;
        }
        const int64_t pos = (int64_t)((uint64_t)p.position + (uint64_t)depth); /* wraps, as on the CPU */
        int32_t accepted = -1, emit = -1;
        if (!tests) {
            if (p.temperature == 0.0f) {
                float m;
                int bad_row;
                sf_cu_pass_max<DT>(sp, &m, &emit, &bad_row);
                st = bad_row ? SF_ERR_LOGITS : m == -INFINITY ? SF_ERR_ALL_MASKED : SF_OK;
            } else {
                st = sf_cu_prepare<DT>(d, sp, p);
                if (st == SF_OK) emit = sf_cu_coupled<DT>(d.r, sp, p.seed, pos);
            }
            if (st != SF_OK) break;
            for (int32_t ch = first[cur + 1]; ch >= 0; ch = next[ch])
                if (tok[ch] == emit) { accepted = ch; break; }
        } else {
            double bound0;
            st = sf_cu_prepare<DT>(d, sp, p, &bound0);
            if (st != SF_OK) break;
            /* verify.c: the exact mass of the row is summed only when a bound
             * on it cannot accept the first child (the bound came with the
             * max unless a top-k / top-p cut was found). */
            bool have_mass = false;
            uint32_t j = 0;
            for (int32_t ch = first[cur + 1]; ch >= 0; ch = next[ch], j++) {
                const int64_t node = node0 + ch;
                const int32_t x = tok[ch];
                if (threadIdx.x == 0) {
                    const bool pre = ch < SF_CU_PRE;
                    const float qx = pre ? s_qx[ch] : sf_cu_draft_prob(a, node, x);
                    const bool ok = sf_prob_ok(qx);
                    const double u =
                        pre ? s_u[ch]
                            : sf_uniform_open0(sf_philox(p.seed, pos, SF_PURPOSE_ACCEPT, j));
                    const uint64_t w = sf_cu_weight_at<DT>(d, ov, row, x, pre ? &s_lx[ch] : NULL);
                    s_flag = ok ? 0 : -1;
                    s_uq = u * (double)qx;
                    s_w = w;
                    /* No bound can accept where the total is at least one max's weight. */
                    s_try = ok && qx > 0.0f && !have_mass && s_uq * SF_MASS_ONE < (double)w;
                }
                __syncthreads();
                const int bad_q = s_flag, try_bound = s_try;
                const double uq = s_uq;
                const uint64_t w = s_w;
                __syncthreads();
                if (bad_q < 0) { st = SF_ERR_DRAFT_PROBS; break; }
                if (try_bound) {
                    /* The margin covers the float sums and exp2's error many times over. */
                    const double bound = bound0 >= 0.0 ? bound0 : sf_cu_pass_bound<DT>(d.r, sp);
                    const double up = bound * 1.001 * SF_MASS_ONE + 1.0;
                    if (uq * up < (double)w) { accepted = ch; break; }
                }
                /* A dense rejection with later siblings forms its residual
                 * whole (the last one's is drawn by tries, reading few q):
                 * its q row into L2 under the mass pass. */
                const bool whole = a.kind == SF_DRAFT_DENSE && next[ch] >= 0;
                if (whole && threadIdx.x == 0)
                    sf_cu_prefetch_l2(a.dense + node * n + lo, (hi - lo) * 4);
                if (!have_mass) {
                    /* A whole residual sums tiles of its own: none here. */
                    sf_cu_set_mass<DT>(d, sp, whole ? NULL : tiles, ntiles);
                    have_mass = true;
                }
                if (uq > 0.0 && uq < (double)w / (double)d.total) { accepted = ch; break; }
                if (a.kind == SF_DRAFT_DENSE) {
                    const float *q = a.dense + node * n;
                    if (!whole) {
                        emit = sf_cu_resid_tries<DT>(d, ov, sp, tiles, ntiles, q, p.seed, pos, &st);
                        if (st != SF_OK || emit >= 0) break;
                    }
                    st = sf_cu_reject_dense<DT>(d, sp, q, resid2, whole, tiles, ntiles);
                    if (st != SF_OK) break;
                } else {
                    __syncthreads(); /* every thread has read d.total above */
                    if (threadIdx.x == 0) {
                        const float one = 1.0f;
                        if (a.kind == SF_DRAFT_SPARSE)
                            sf_cu_reject_sparse<DT>(d, ov, sp, a.sparse_ids + node * a.sparse_k,
                                                    a.sparse_probs + node * a.sparse_k,
                                                    a.sparse_k, tiles);
                        else
                            sf_cu_reject_sparse<DT>(d, ov, sp, &x, &one, 1, tiles);
                    }
                    __syncthreads();
                }
            }
            if (st == SF_OK && accepted < 0 && !have_mass) sf_cu_set_mass<DT>(d, sp, tiles, ntiles);
            if (st != SF_OK) break;
            if (accepted < 0 && emit < 0)
                emit = sf_cu_draw<DT>(d, ov, sp, tiles, ntiles, p.seed, pos,
                                      first[cur + 1] >= 0);
        }
        if (accepted < 0) {
            if (writer && threadIdx.x == 0) out_tok[depth] = emit;
            break;
        }
        if (writer && threadIdx.x == 0) {
            out_tok[depth] = tok[accepted];
            if (out_nodes) out_nodes[depth] = accepted;
        }
        depth++;
        cur = accepted;
    }
    if (!writer) return;
    __syncthreads();
    if (st != SF_OK) {
        for (int64_t i = threadIdx.x; i < width; i += SF_CU_THREADS) out_tok[i] = -1;
        if (out_nodes)
            for (int64_t i = threadIdx.x; i < a.max_draft; i += SF_CU_THREADS) out_nodes[i] = -1;
        depth = 0;
    }
    if (threadIdx.x == 0) {
        a.out_acc[b] = depth;
        a.status[b] = st == SF_OK ? 0 : SF_STATUS(st, SF_PHASE_RUN);
    }
}

/* ---- sample and probs: one block per row ---- */

template <int DT>
__global__ void __launch_bounds__(SF_CU_THREADS) sf_cu_rows_kernel(sf_cu_rows_args a) {
    uint64_t *const tiles = sf_cu_dynamic;
    __shared__ sf_cu_dist d;
    const int64_t b = blockIdx.x, n = a.vocab;
    const int ntiles = (int)((n + SF_CU_TILE - 1) / SF_CU_TILE);
    const void *row = (const char *)a.logits +
                      (size_t)(b * a.row_stride) * (size_t)(DT == SF_F32 ? 4 : 2);
    const sf_cu_span sp = {row, row, 0, n, n, sf_cu_aligned(row), 1};
    float *out = a.probs ? a.probs + b * n : NULL;
    sf_cu_params_row p = sf_cu_get_params(a.params, b);
    int32_t err = 0, tok = -1;
    if (threadIdx.x == 0) d.etab_at = a.etab; /* read after sf_cu_prepare's barriers */
    if (!sf_cu_params_ok(p)) {
        err = SF_STATUS(SF_ERR_PARAM, SF_PHASE_PARAMS);
    } else if (p.temperature == 0.0f) {
        float m;
        int bad;
        sf_cu_pass_max<DT>(sp, &m, &tok, &bad);
        int st = bad ? SF_ERR_LOGITS : m == -INFINITY ? SF_ERR_ALL_MASKED : SF_OK;
        if (st) err = SF_STATUS(st, SF_PHASE_RUN);
        if (out && !st) {
            for (int64_t v = threadIdx.x; v < n; v += SF_CU_THREADS) out[v] = v == tok ? 1.0f : 0.0f;
        }
    } else {
        int st = sf_cu_prepare<DT>(d, sp, p);
        if (st == SF_OK) {
            const sf_cu_row r = d.r;
            if (!out && a.method == SF_COUPLED) {
                tok = sf_cu_coupled<DT>(r, sp, p.seed, p.position);
            } else {
                sf_cu_set_mass<DT>(d, sp, tiles, ntiles);
                if (out) {
                    /* sample.c's probs_one: each kept token's e, then its exact weight. */
                    const sf_cu_row rt = d.r; /* with its e table, if it has one */
                    const sf_cu_in in0 = {NULL, 1.0f, NULL};
                    const double inv = 1.0 / (double)d.total;
                    const bool cut = sf_cu_cut_active(r);
                    for (int t = 0; t < ntiles; t++) {
                        const int64_t i0 = (int64_t)t * SF_CU_TILE + threadIdx.x * 8;
                        float rr[8];
                        bool rq;
                        sf_cu_weights8<DT>(rt, sp, in0, cut, i0, rr, &rq);
                        for (int j = 0; j < 8 && i0 + j < n; j++)
                            out[i0 + j] = (float)((double)sf_cu_fixed(rr[j]) * inv);
                    }
                } else {
                    const sf_cu_over ov = {NULL, NULL};
                    tok = sf_cu_draw<DT>(d, ov, sp, tiles, ntiles, p.seed, p.position, false);
                }
            }
        }
        if (st) err = SF_STATUS(st, SF_PHASE_RUN);
    }
    if (out && err) /* a failed row reads NaN, never what the buffer held */
        for (int64_t v = threadIdx.x; v < n; v += SF_CU_THREADS) out[v] = NAN;
    if (threadIdx.x == 0) {
        a.status[b] = err;
        if (a.tokens) a.tokens[b] = err ? -1 : tok;
    }
}

/* ---- host entry points ---- */

static thread_local int sf_cu_last_error = 0;

/* A launch's own status: cudaGetLastError would also return (and clear) an
 * earlier asynchronous error of the caller's, as if it were this launch's. */
static sf_status sf_cu_launched(cudaError_t e) {
    sf_cu_last_error = (int)e;
    return e == cudaSuccess ? SF_OK : SF_ERR_UNSUPPORTED;
}

static sf_status sf_cu_check_params(const sf_cuda_params *p, int64_t batch) {
    if (!p || SF_PARAMS_MISALIGNED(p)) return SF_ERR_ARGUMENT;
    const void *ptr[6] = {p->temperature, p->top_k, p->top_p, p->min_p, p->seed, p->position};
    const int64_t cnt[6] = {p->n_temperature, p->n_top_k, p->n_top_p, p->n_min_p, p->n_seed,
                            p->n_position};
    for (int i = 0; i < 6; i++)
        if (ptr[i] && cnt[i] != 1 && cnt[i] != batch) return SF_ERR_SHAPE;
    /* Values given on the host are checked here, device arrays by the kernel
     * (a valid value stands in for them); no request, nothing read (as on the
     * CPU). */
    if (batch == 0) return SF_OK;
    if (!sf_params_ok(p->temperature ? 0.0f : p->temperature_value, p->top_k ? 0 : p->top_k_value,
                      p->top_p ? 1.0f : p->top_p_value, p->min_p ? 0.0f : p->min_p_value))
        return SF_ERR_PARAM;
    return SF_OK;
}

/* Static and dynamic shared memory together beyond 48 KB must be asked for,
 * per device, up to what the device lets a block opt in to; each grant is
 * remembered, under a lock (host threads may call at once). Too much is
 * refused here, before cudaFuncSetAttribute would fail: its error would stay
 * for the caller's next cudaGetLastError (torch checks it after its kernels). */
static cudaError_t sf_cu_allow_shm(const void *kernel, size_t bytes) {
    enum { DEVICES = 16, KERNELS = 8 };
    static const void *kernels[DEVICES][KERNELS];
    static size_t granted[DEVICES][KERNELS];
    static std::mutex lock;
    int dev = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e != cudaSuccess) return e;
    const std::lock_guard<std::mutex> hold(lock);
    const bool cache = dev >= 0 && dev < DEVICES;
    int k = 0;
    if (cache) {
        while (k < KERNELS - 1 && kernels[dev][k] && kernels[dev][k] != kernel) k++;
        if (kernels[dev][k] == kernel && granted[dev][k] >= bytes) return cudaSuccess;
    }
    cudaFuncAttributes fa;
    e = cudaFuncGetAttributes(&fa, kernel);
    if (e != cudaSuccess) return e;
    if (fa.sharedSizeBytes + bytes > 48 * 1024) {
        int most = 0;
        e = cudaDeviceGetAttribute(&most, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
        if (e != cudaSuccess) return e;
        if (fa.sharedSizeBytes + bytes > (size_t)most) return cudaErrorInvalidValue;
        e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes);
        if (e == cudaSuccess)
            e = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                     cudaSharedmemCarveoutMaxShared);
        if (e != cudaSuccess) return e;
    }
    if (cache) {
        kernels[dev][k] = kernel;
        granted[dev][k] = bytes;
    }
    return cudaSuccess;
}

/* kernel(a) on `stream`: `blocks` blocks of SF_CU_THREADS threads with `shm`
 * bytes of dynamic shared memory, in clusters of `cluster` blocks. */
template <class Args>
static sf_status sf_cu_launch(void (*kernel)(Args), Args a, int64_t blocks, size_t shm,
                              int cluster, void *stream) {
    const cudaError_t e = sf_cu_allow_shm((const void *)kernel, shm);
    if (e != cudaSuccess) return sf_cu_launched(e);
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3((unsigned)blocks);
    cfg.blockDim = dim3(SF_CU_THREADS);
    cfg.dynamicSmemBytes = shm;
    cfg.stream = (cudaStream_t)stream;
    cudaLaunchAttribute attr;
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = (unsigned)cluster;
    attr.val.clusterDim.y = 1;
    attr.val.clusterDim.z = 1;
    cfg.attrs = &attr;
    cfg.numAttrs = cluster > 1; /* a lone block needs no cluster (nor sm_90) */
    return sf_cu_launched(cudaLaunchKernelEx(&cfg, kernel, a));
}

static size_t sf_cu_tiles_bytes(int64_t vocab) {
    return (size_t)((vocab + SF_CU_TILE - 1) / SF_CU_TILE) * sizeof(uint64_t);
}

static size_t sf_cu_align16(size_t x) { return (x + 15) & ~(size_t)15; }

/* Room for an e table (sf_cu_etab_e) after a block's `shm` bytes of dynamic
 * shared memory: for bf16 rows of which the block reads enough tokens to pay
 * for filling it (twice its entries), where it leaves an SM as many blocks.
 * Returns its float offset there, 0 for none. SPECFAST_CUDA_ETAB=0: never
 * (for tuning). */
static int32_t sf_cu_etab_room(const void *kernel, int dtype, int64_t tokens, size_t shm) {
    const char *env = getenv("SPECFAST_CUDA_ETAB");
    if (dtype != SF_BF16 || tokens < 4 * SF_CU_ETAB_SIDE || (env && env[0] == '0')) return 0;
    int without = 0, with = 0;
    if (sf_cu_allow_shm(kernel, shm + SF_CU_ETAB_BYTES) != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&without, kernel, SF_CU_THREADS, shm) !=
            cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&with, kernel, SF_CU_THREADS,
                                                      shm + SF_CU_ETAB_BYTES) != cudaSuccess ||
        with < without)
        return 0;
    return (int32_t)(shm / 4);
}

/* The largest cluster of verify blocks device `dev` runs, at most
 * SF_CU_CLUSTER: 1 where it launches none (before sm_90, some MIG and vGPU
 * setups), where the code it runs was built for an older GPU (sm_80 PTX that
 * the driver compiled for it: no cluster paths, SF_CU_CLUSTERS) or where it
 * cannot say; fewer than 8 on a MIG slice of few SMs. Asked once per device
 * (the answer is the hardware's and the build's). */
static int sf_cu_device_cluster(int dev) {
    enum { DEVICES = 16 };
    static std::atomic<int> known[DEVICES]; /* 0: not asked yet */
    if (dev >= 0 && dev < DEVICES) {
        const int k = known[dev].load(std::memory_order_relaxed);
        if (k) return k;
    }
    int clusters = 0, most = 1;
    cudaFuncAttributes fa;
    if (cudaDeviceGetAttribute(&clusters, cudaDevAttrClusterLaunch, dev) == cudaSuccess &&
        clusters && cudaFuncGetAttributes(&fa, (const void *)sf_cu_verify_kernel<SF_F32>) ==
                        cudaSuccess && fa.ptxVersion >= 90) {
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3(SF_CU_CLUSTER);
        cfg.blockDim = dim3(SF_CU_THREADS);
        if (cudaOccupancyMaxPotentialClusterSize(&most, (const void *)sf_cu_verify_kernel<SF_F32>,
                                                 &cfg) != cudaSuccess) {
            (void)cudaGetLastError(); /* not left for the caller's next check */
            most = 1;
        }
        most = most < 1 ? 1 : most > SF_CU_CLUSTER ? SF_CU_CLUSTER : most;
    }
    if (dev >= 0 && dev < DEVICES) known[dev].store(most, std::memory_order_relaxed);
    return most;
}

/* Blocks per request on the current device: one per tile up to the largest
 * cluster it runs, so a row is read by many SMs at once (a lone request too)
 * and each slice is small enough to stage in shared memory.
 * SPECFAST_CUDA_CLUSTER=1..8 lowers the limit (for tuning). */
static int sf_cu_cluster_size(int64_t vocab) {
    const char *env = getenv("SPECFAST_CUDA_CLUSTER");
    int most = env ? atoi(env) : SF_CU_CLUSTER;
    if (most < 1 || most > SF_CU_CLUSTER) most = SF_CU_CLUSTER;
    int dev = 0;
    const int device = cudaGetDevice(&dev) == cudaSuccess ? sf_cu_device_cluster(dev) : 1;
    if (device < most) most = device;
    const int64_t t = (vocab + SF_CU_TILE - 1) / SF_CU_TILE;
    return (int)(t < most ? t : most);
}

/* Tokens per block of a cluster of csize sharing a row: whole tiles. */
static int64_t sf_cu_slice(int64_t vocab, int csize) {
    const int64_t tiles = (vocab + SF_CU_TILE - 1) / SF_CU_TILE;
    return (tiles + csize - 1) / csize * SF_CU_TILE;
}

/* Workspace layout: over_w (csize n k_over uint64), over_id (csize n k_over
 * int32), resid (batch 2 vocab float, dense trees with rejection only). */
static void sf_cu_layout(const sf_logits *l, const sf_draft *d, sf_method method,
                         size_t *w_bytes, size_t *id_bytes, size_t *resid_bytes) {
    const int64_t k_over = d->kind == SF_DRAFT_SPARSE ? d->sparse_k : 1;
    const bool over = method == SF_REJECTION && d->kind != SF_DRAFT_DENSE && d->n > 0;
    const int64_t c = sf_cu_cluster_size(l->vocab);
    *w_bytes = over ? sf_cu_align16((size_t)(c * d->n * k_over) * 8) : 0;
    *id_bytes = over ? sf_cu_align16((size_t)(c * d->n * k_over) * 4) : 0;
    *resid_bytes = method == SF_REJECTION && d->kind == SF_DRAFT_DENSE && d->parents && d->n > 0
                       ? (size_t)(d->batch * 2 * l->vocab) * 4 : 0;
}

extern "C" {

SF_API unsigned sf_cuda_version(void) { return SF_VERSION_NUMBER; }

SF_API int sf_cuda_last_error(void) { return sf_cu_last_error; }

SF_API const char *sf_cuda_error_string(int error) {
    return cudaGetErrorString((cudaError_t)error);
}

SF_API int64_t sf_cuda_verify_workspace(const sf_logits *logits, const sf_draft *draft,
                                        sf_method method) {
    if (!logits || !draft) return 0;
    size_t a, b, c;
    sf_cu_layout(logits, draft, method, &a, &b, &c);
    return (int64_t)(a + b + c);
}

SF_API sf_status sf_cuda_verify(const sf_logits *logits, const sf_draft *draft,
                                const sf_cuda_params *params, sf_method method,
                                sf_verify_out *out, int32_t *status, void *workspace,
                                int64_t workspace_bytes, void *stream) {
    sf_status st = sf_logits_check(logits);
    if (st != SF_OK) return st;
    if (!draft || !out || !status || !out->tokens || !out->num_accepted || out->max_draft < 0 ||
        out->max_draft > SF_MAX_DRAFT || (out->max_draft > 0 && !out->accepted_nodes) ||
        sf_verify_misaligned(draft, out) || SF_MISALIGNED(status))
        return SF_ERR_ARGUMENT;
    if (method != SF_REJECTION && method != SF_COUPLED) return SF_ERR_ARGUMENT;
    if (draft->kind != SF_DRAFT_NONE && draft->kind != SF_DRAFT_DENSE &&
        draft->kind != SF_DRAFT_SPARSE)
        return SF_ERR_ARGUMENT;
    if (draft->batch < 0 || draft->batch > SF_MAX_BATCH || draft->n < 0) return SF_ERR_SHAPE;
    if ((draft->n > 0 && !draft->tokens) || (draft->batch > 0 && !draft->num_draft))
        return SF_ERR_ARGUMENT;
    if (draft->n + draft->batch != logits->rows) return SF_ERR_SHAPE;
    if (draft->kind == SF_DRAFT_DENSE && draft->n > 0 && !draft->dense) return SF_ERR_ARGUMENT;
    if (draft->kind == SF_DRAFT_SPARSE &&
        (draft->sparse_k < 1 || (draft->n > 0 && (!draft->sparse_ids || !draft->sparse_probs))))
        return SF_ERR_ARGUMENT;
    st = sf_cu_check_params(params, draft->batch);
    if (st != SF_OK) return st;
    size_t wb, ib, rb;
    sf_cu_layout(logits, draft, method, &wb, &ib, &rb);
    /* The workspace holds uint64 overrides first: 8-byte stores, 16 to be safe. */
    if ((wb + ib + rb) > 0 && (!workspace || ((uintptr_t)workspace & 15) ||
                               workspace_bytes < (int64_t)(wb + ib + rb)))
        return SF_ERR_ARGUMENT;
    if (draft->batch == 0) return SF_OK;

    sf_cu_verify_args a;
    a.logits = logits->data;
    a.vocab = logits->vocab;
    a.row_stride = logits->row_stride;
    a.tokens = draft->tokens;
    a.n = draft->n;
    a.num_draft = draft->num_draft;
    a.batch = draft->batch;
    a.parents = draft->parents;
    a.kind = draft->kind;
    a.dense = draft->dense;
    a.sparse_ids = draft->sparse_ids;
    a.sparse_probs = draft->sparse_probs;
    a.sparse_k = draft->sparse_k;
    a.params = *params;
    a.method = method;
    a.out_tokens = out->tokens;
    a.out_acc = out->num_accepted;
    a.out_nodes = out->max_draft > 0 ? out->accepted_nodes : NULL;
    a.max_draft = out->max_draft;
    a.status = status;
    char *ws = (char *)workspace;
    a.over_w = wb ? (uint64_t *)ws : NULL;
    a.over_id = ib ? (int32_t *)(ws + wb) : NULL;
    a.resid = rb ? (float *)(ws + wb + ib) : NULL;

    a.csize = sf_cu_cluster_size(logits->vocab);
    a.slice = sf_cu_slice(logits->vocab, a.csize);
    const size_t stage = (size_t)a.slice * (logits->dtype == SF_F32 ? 4 : 2);
    void (*kernel)(sf_cu_verify_args) =
        logits->dtype == SF_F32 ? sf_cu_verify_kernel<SF_F32>
        : logits->dtype == SF_F16 ? sf_cu_verify_kernel<SF_F16> : sf_cu_verify_kernel<SF_BF16>;
    /* The layout the kernel assumes: an even number of tile sums, then the
     * stage, then the e table. The stage is left out where the device grants
     * a block no room for it (its static shared memory counted too). */
    const size_t tiles = (size_t)((a.slice / SF_CU_TILE + 1) & ~1) * 8;
    const char *env = getenv("SPECFAST_CUDA_STAGE"); /* 0: never stage (for tuning) */
    a.cache = stage <= SF_CU_STAGE_MAX && !(env && env[0] == '0') &&
              sf_cu_allow_shm((const void *)kernel, tiles + stage) == cudaSuccess;
    const size_t shm = tiles + (a.cache ? stage : 0);
    a.etab = sf_cu_etab_room((const void *)kernel, logits->dtype, a.slice, shm);
    return sf_cu_launch(kernel, a, draft->batch * a.csize, shm + (a.etab ? SF_CU_ETAB_BYTES : 0),
                        a.csize, stream);
}

static sf_status sf_cu_rows(const sf_logits *logits, const sf_cuda_params *params,
                            sf_method method, int32_t *tokens, float *probs,
                            int32_t *status, void *stream) {
    sf_status st = sf_logits_check(logits);
    if (st != SF_OK) return st;
    if (!status || (!tokens && !probs) || SF_MISALIGNED(status) || SF_MISALIGNED(tokens) ||
        SF_MISALIGNED(probs))
        return SF_ERR_ARGUMENT;
    if (method != SF_REJECTION && method != SF_COUPLED) return SF_ERR_ARGUMENT;
    if (logits->rows > INT32_MAX) return SF_ERR_SHAPE;
    st = sf_cu_check_params(params, logits->rows);
    if (st != SF_OK) return st;
    if (logits->rows == 0) return SF_OK;
    sf_cu_rows_args a;
    a.logits = logits->data;
    a.rows = logits->rows;
    a.vocab = logits->vocab;
    a.row_stride = logits->row_stride;
    a.params = *params;
    a.method = method;
    a.tokens = tokens;
    a.probs = probs;
    a.status = status;
    const size_t shm = sf_cu_tiles_bytes(logits->vocab); /* then the e table */
    void (*kernel)(sf_cu_rows_args) =
        logits->dtype == SF_F32 ? sf_cu_rows_kernel<SF_F32>
        : logits->dtype == SF_F16 ? sf_cu_rows_kernel<SF_F16> : sf_cu_rows_kernel<SF_BF16>;
    a.etab = sf_cu_etab_room((const void *)kernel, logits->dtype, logits->vocab, shm);
    return sf_cu_launch(kernel, a, logits->rows, shm + (a.etab ? SF_CU_ETAB_BYTES : 0), 1,
                        stream);
}

SF_API sf_status sf_cuda_sample(const sf_logits *logits, const sf_cuda_params *params,
                                sf_method method, int32_t *tokens, int32_t *status,
                                void *stream) {
    if (!tokens) return SF_ERR_ARGUMENT;
    return sf_cu_rows(logits, params, method, tokens, NULL, status, stream);
}

SF_API sf_status sf_cuda_probs(const sf_logits *logits, const sf_cuda_params *params,
                               float *out, int32_t *status, void *stream) {
    if (!out) return SF_ERR_ARGUMENT;
    return sf_cu_rows(logits, params, SF_REJECTION, NULL, out, status, stream);
}

} /* extern "C" */
