/*
 * block.cuh: what the CUDA kernels build on: loading logits of any dtype,
 * the per-token arithmetic of the CPU backend (csrc/cpu/rowmath.h, written
 * again with the _rn intrinsics of shared.h so nvcc can fuse nothing), and
 * block-wide reductions and scans.
 *
 * A block of SF_CU_THREADS threads walks its span of a row (sf_cu_span: the
 * whole row, or the block's slice when a cluster of blocks shares the row) in
 * tiles of SF_CU_TILE tokens; thread t holds the 8 consecutive tokens
 * [t * 8, t * 8 + 8) of a tile, read with 16-byte loads when aligned. Two neighbouring threads hold
 * one 16-token chunk of the CPU's vector code, which matters where the CPU
 * skips a chunk (a dense q is read only in chunks with a kept token).
 */
#ifndef SF_CUDA_BLOCK_CUH
#define SF_CUDA_BLOCK_CUH

#include <stdint.h>
#include <string.h>

#include <type_traits>

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_pipeline_primitives.h>
#include <cuda_runtime.h>

#include "../common/shared.h"
#include "specfast.h"

#define SF_CU_THREADS 256
#define SF_CU_WARPS (SF_CU_THREADS / 32)
#define SF_CU_PER 8 /* tokens per thread per tile */
#define SF_CU_TILE (SF_CU_THREADS * SF_CU_PER)
#define SF_FULL_MASK 0xFFFFFFFFu

/* Clusters exist from sm_90. Code built for older GPUs has no cluster paths:
 * the host never launches a cluster there (sf_cu_cluster_size is 1 where the
 * device launches none), so csize is 1. */
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define SF_CU_CLUSTERS 0
#else
#define SF_CU_CLUSTERS 1
#endif

/* The launch's dynamic shared memory (every extern __shared__ array is this
 * one memory; one name lets tests/cuda_emu provide it). 16-byte aligned
 * whatever the static shared memory before it: rows are staged there in
 * 16-byte copies. */
extern __shared__ __align__(16) uint64_t sf_cu_dynamic[];

/* ---- loads ---- */

/* Logits are read with plain (generic) loads: a span's tokens may sit in
 * shared memory, where __ldg cannot go. */
template <int DT>
__device__ __forceinline__ float sf_cu_load1(const void *row, int64_t v) {
    if (DT == SF_F32) return ((const float *)row)[v];
    uint16_t h = ((const unsigned short *)row)[v];
    return DT == SF_BF16 ? sf_bf16_to_f32(h) : sf_f16_to_f32(h);
}

__device__ __forceinline__ void sf_cu_unpack16(int DT, uint32_t w, float *x) {
    uint16_t a = (uint16_t)w, b = (uint16_t)(w >> 16);
    x[0] = DT == SF_BF16 ? sf_bf16_to_f32(a) : sf_f16_to_f32(a);
    x[1] = DT == SF_BF16 ? sf_bf16_to_f32(b) : sf_f16_to_f32(b);
}

/* The NaN-propagating max of two pairs of bf16 (or f16) floats, in words. */
template <int DT>
__device__ __forceinline__ uint32_t sf_cu_max2(uint32_t a, uint32_t b) {
    typedef typename std::conditional<DT == SF_BF16, __nv_bfloat162, __half2>::type pair;
    pair x, y;
    memcpy(&x, &a, 4);
    memcpy(&y, &b, 4);
    const pair r = __hmax2_nan(x, y);
    uint32_t w;
    memcpy(&w, &r, 4);
    return w;
}

/* Tokens [i0, i0 + 8) of a row as float; past n, -inf. */
template <int DT>
__device__ __forceinline__ void sf_cu_load8(const void *row, int64_t i0, int64_t n,
                                            bool aligned, float *x) {
    if (aligned && i0 + 8 <= n) {
        if (DT == SF_F32) {
            const float4 *p = (const float4 *)((const float *)row + i0);
            float4 a = p[0], b = p[1];
            x[0] = a.x; x[1] = a.y; x[2] = a.z; x[3] = a.w;
            x[4] = b.x; x[5] = b.y; x[6] = b.z; x[7] = b.w;
        } else {
            uint4 u = *(const uint4 *)((const uint16_t *)row + i0);
            sf_cu_unpack16(DT, u.x, x);
            sf_cu_unpack16(DT, u.y, x + 2);
            sf_cu_unpack16(DT, u.z, x + 4);
            sf_cu_unpack16(DT, u.w, x + 6);
        }
        return;
    }
#pragma unroll
    for (int j = 0; j < 8; j++) x[j] = i0 + j < n ? sf_cu_load1<DT>(row, i0 + j) : -INFINITY;
}

/* A hint: global memory [p, p + bytes) into L2 while the block goes on
 * (cp.async.bulk.prefetch of sm_90, which no intrinsic of CUDA 13.0 names),
 * its whole 16-byte blocks (the instruction takes no other); older GPUs skip
 * it. The emulator (tests/cuda_emu, no nvcc) reads the range's two ends
 * instead, so that its AddressSanitizer sees a range that leaves the buffer.
 * One thread issues it. */
__device__ __forceinline__ void sf_cu_prefetch_l2(const void *p, int64_t bytes) {
    if (bytes <= 0) return;
#if !defined(__NVCC__)
    (void)*(const volatile char *)p;
    (void)((const volatile char *)p)[bytes - 1];
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const uintptr_t a = ((uintptr_t)p + 15) & ~(uintptr_t)15;
    const uintptr_t e = ((uintptr_t)p + (uintptr_t)bytes) & ~(uintptr_t)15;
    if (e <= a || e - a > UINT32_MAX) return;
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;"
                 ::"l"(__cvta_generic_to_global((const void *)a)), "r"((uint32_t)(e - a))
                 : "memory");
#endif
}

/* 8 floats from p + i0 (a dense q or a stored residual); past n, 0. */
__device__ __forceinline__ void sf_cu_floats8(const float *p, int64_t i0, int64_t n,
                                              bool aligned, float *x) {
    if (aligned && i0 + 8 <= n) {
        float4 a = __ldg((const float4 *)(p + i0)), b = __ldg((const float4 *)(p + i0) + 1);
        x[0] = a.x; x[1] = a.y; x[2] = a.z; x[3] = a.w;
        x[4] = b.x; x[5] = b.y; x[6] = b.z; x[7] = b.w;
        return;
    }
#pragma unroll
    for (int j = 0; j < 8; j++) x[j] = i0 + j < n ? p[i0 + j] : 0.0f;
}

__device__ __forceinline__ bool sf_cu_aligned(const void *p) {
    return ((uintptr_t)p & 15u) == 0;
}

/* ---- per-token arithmetic (csrc/cpu/rowmath.h) ---- */

/* What the kernels know of a row once its filters are found (sf_row), and
 * where its e table is (bf16 rows; see sf_cu_etab_e). */
struct sf_cu_row {
    float max, inv_t, c, cut_logit, min_e;
    int32_t cut_id;
    int32_t etab;     /* float offset of the table in sf_cu_dynamic; 0: none */
    uint32_t etab_lo; /* bits of the table's first magnitude */
};

/* At or above the cut, and not -inf (the CPU's vector above_cut). */
__device__ __forceinline__ bool sf_cu_above_cut(const sf_cu_row &r, float l, int64_t v) {
    return ((l > r.cut_logit) || (l == r.cut_logit && v <= r.cut_id)) && l > -INFINITY;
}

__device__ __forceinline__ float sf_cu_row_e(const sf_cu_row &r, float l) {
    return sf_exp2(SF_FMUL(SF_FSUB(l, r.max), r.c));
}

__device__ __forceinline__ float sf_cu_row_base(const sf_cu_row &r, float l, int64_t v) {
    float e = sf_cu_row_e(r, l);
    return (sf_cu_above_cut(r, l, v) && e >= r.min_e) ? e : 0.0f;
}

/* ---- bf16 rows: e from a table ----
 * A bf16 logit takes one of 2^16 values, so a row's e = 2^((l - max) c) can be
 * read from a table of the row instead of computed (19 instructions a token).
 * The table holds e for every bf16 of SF_CU_ETAB_FIELDS exponent fields, each
 * sign, filled by sf_cu_row_e itself: a lookup is the computation, bit for
 * bit. Its fields end at the larger of |max| and |max - 131 / c|, below which
 * every e is 0 (sf_cu_etab_place), so a token past them weighs 0 (the entry
 * after each sign's fields); only tokens nearer 0 than the first field are
 * computed. */
#define SF_CU_ETAB_FIELDS 16
#define SF_CU_ETAB_SIDE (SF_CU_ETAB_FIELDS * 128 + 1) /* entries per sign */
#define SF_CU_ETAB_BYTES ((2 * SF_CU_ETAB_SIDE * 4 + 15) & ~15)

/* e of the bf16 logit x from the row's table; `near` is set where x is nearer
 * 0 than the table (its e is then to be computed). */
__device__ __forceinline__ float sf_cu_etab_e(const sf_cu_row &r, float x, bool *near) {
    const uint32_t u = sf_f2u(x), mag = u & 0x7FFFFFFFu;
    /* Past the table (or, wrapped, before it): the 0 entry. */
    const uint32_t d = min(mag - r.etab_lo, (uint32_t)(SF_CU_ETAB_SIDE - 1) << 16);
    *near |= mag < r.etab_lo;
    const float *t = (const float *)sf_cu_dynamic + r.etab;
    return t[(d >> 16) + ((int32_t)u < 0 ? SF_CU_ETAB_SIDE : 0)];
}

/* sf_cu_row_e of eight logits (from a table where the row has one). */
template <int DT>
__device__ __forceinline__ void sf_cu_row_e8(const sf_cu_row &r, const float *x, float *e) {
    if (DT != SF_BF16 || !r.etab) {
#pragma unroll
        for (int j = 0; j < 8; j++) e[j] = sf_cu_row_e(r, x[j]);
        return;
    }
    bool near = false;
#pragma unroll
    for (int j = 0; j < 8; j++) e[j] = sf_cu_etab_e(r, x[j], &near);
    if (near) {
#pragma unroll
        for (int j = 0; j < 8; j++)
            if ((sf_f2u(x[j]) & 0x7FFFFFFFu) < r.etab_lo) e[j] = sf_cu_row_e(r, x[j]);
    }
}

/* An upper bound of 2^y for y <= 0: the CPU's chord (vec.h's vexp2_up),
 * read off the bits of (y + 127) 2^23, without its float-to-int conversion
 * (a slow pipe on the GPU). 384 + y (in [258, 384] once y is clamped at
 * -126) holds y to the nearest 2^-15 in its low bits; half a step more puts
 * the chord's point at or above y: the chord at most 2^-15 above y. */
__device__ __forceinline__ float sf_cu_exp2_up(float y) {
    y = y > -126.0f ? y : -126.0f;
    const uint32_t t = sf_f2u(SF_FADD(y, 384.0f));
    return sf_u2f(t * 256u + (0x3F800080u - 0x43C00000u * 256u));
}

/* As rowmath.h's sf_resid: 0 where b is 0, whatever an unchecked q holds. */
__device__ __forceinline__ float sf_cu_resid(float b, float scale, float q) {
    float x = SF_FSUB(SF_FMUL(b, scale), q);
    return (x > 0.0f && b > 0.0f) ? x : 0.0f;
}

/* floor(r * 2^40) for 0 <= r < 2048, as rowmath.h's sf_fixed: the product is
 * exact (a power of two; subnormals come out normal), the conversion
 * truncates it. One multiply and one conversion: the conversion pipe runs at
 * an eighth of the rate, but the bit-by-bit shift it replaces took 11 issue
 * slots, and the passes that call this are issue-bound with that pipe idle.
 * Equal to sf_fixed on every float in [0, 2048), -0 included (test_cuda_emu
 * checks them all). */
__device__ __forceinline__ uint64_t sf_cu_fixed(float r) {
    return (uint64_t)SF_FMUL(r, 0x1p40f);
}

/* Rank key of a finite logit and its id: ascending keys are (logit
 * descending, id ascending); -0 counts as +0 (dist.c's rank_key). */
__device__ __forceinline__ uint64_t sf_cu_rank_key(float l, int64_t id) {
    uint32_t u = l == 0.0f ? 0u : sf_f2u(l);
    u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    return ((uint64_t)~u << 32) | (uint32_t)id;
}
__device__ __forceinline__ float sf_cu_key_logit(uint64_t key) {
    uint32_t u = ~(uint32_t)(key >> 32);
    return sf_u2f((u & 0x80000000u) ? (u & 0x7FFFFFFFu) : ~u);
}

/* ---- block reductions (every thread gets the result) ----
 * A butterfly of xor shuffles: every lane combines the same values in the
 * same tree, so with a commutative op every thread of every block gets the
 * same bits (an ordered double sum would need a loop of 8 per thread). Each
 * op names its identity, which fills the lanes past the values. */

struct sf_cu_add {
    __device__ uint64_t operator()(uint64_t a, uint64_t b) const { return a + b; }
    static __device__ uint64_t id() { return 0; }
};
struct sf_cu_dadd {
    __device__ double operator()(double a, double b) const { return a + b; }
    static __device__ double id() { return 0.0; }
};
struct sf_cu_min {
    __device__ uint64_t operator()(uint64_t a, uint64_t b) const { return b < a ? b : a; }
    static __device__ uint64_t id() { return UINT64_MAX; }
};

/* Shuffles a value of any size (a multiple of 4 bytes) word by word. */
template <class T>
__device__ __forceinline__ T sf_cu_shfl_xor(T v, int o) {
    static_assert(sizeof(T) % 4 == 0, "shuffled values are whole words");
    uint32_t w[sizeof(T) / 4];
    memcpy(w, &v, sizeof(T));
#pragma unroll
    for (int i = 0; i < (int)(sizeof(T) / 4); i++) w[i] = __shfl_xor_sync(SF_FULL_MASK, w[i], o);
    memcpy(&v, w, sizeof(T));
    return v;
}

/* op over each aligned group of `width` lanes (a power of two). */
template <class T, class Op>
__device__ __forceinline__ T sf_cu_lanes_all(T v, int width, Op op) {
    for (int o = width >> 1; o; o >>= 1) v = op(v, sf_cu_shfl_xor(v, o));
    return v;
}

__device__ __forceinline__ uint64_t sf_cu_warp_sum(uint64_t v) {
    return sf_cu_lanes_all(v, 32, sf_cu_add());
}

template <class T, class Op>
__device__ __forceinline__ T sf_cu_block_all(T v, Op op) {
    static_assert(SF_CU_WARPS == 8, "the second round spans 8 lanes");
    __shared__ T buf[SF_CU_WARPS];
    v = sf_cu_lanes_all(v, 32, op);
    if ((threadIdx.x & 31) == 0) buf[threadIdx.x >> 5] = v;
    __syncthreads();
    v = sf_cu_lanes_all(buf[threadIdx.x & 7], SF_CU_WARPS, op);
    __syncthreads(); /* buf is free again */
    return v;
}

__device__ __forceinline__ uint64_t sf_cu_block_sum(uint64_t v) {
    return sf_cu_block_all(v, sf_cu_add());
}

__device__ __forceinline__ double sf_cu_block_dsum(double v) {
    return sf_cu_block_all(v, sf_cu_dadd());
}

__device__ __forceinline__ uint64_t sf_cu_block_min64(uint64_t v) {
    return sf_cu_block_all(v, sf_cu_min());
}

/* (value, id) with the larger value, the lower id on ties; id < 0 is empty. */
struct sf_cu_best { float key; int32_t id; };

__device__ __forceinline__ sf_cu_best sf_cu_better(sf_cu_best a, sf_cu_best b) {
    if (a.id < 0) return b;
    if (b.id < 0) return a;
    if (b.key > a.key || (b.key == a.key && b.id < a.id)) return b;
    return a;
}

struct sf_cu_pick_better {
    __device__ sf_cu_best operator()(sf_cu_best a, sf_cu_best b) const { return sf_cu_better(a, b); }
    static __device__ sf_cu_best id() { return {-INFINITY, -1}; }
};

__device__ __forceinline__ sf_cu_best sf_cu_block_best(sf_cu_best v) {
    return sf_cu_block_all(v, sf_cu_pick_better());
}

/* Exclusive prefix sum of v over the threads of the block, in thread order. */
__device__ __forceinline__ uint64_t sf_cu_block_exscan(uint64_t v) {
    __shared__ uint64_t buf[SF_CU_WARPS];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    uint64_t inc = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        uint64_t w = __shfl_up_sync(SF_FULL_MASK, inc, o);
        if (lane >= o) inc += w;
    }
    if (lane == 31) buf[warp] = inc;
    __syncthreads();
    uint64_t before = 0;
    for (int w = 0; w < warp; w++) before += buf[w];
    __syncthreads();
    return before + inc - v;
}

/* ---- cluster reductions ----
 * A cluster of csize blocks shares a row, each block a slice of it. Each
 * block puts its block-wide value in shared memory; after a cluster barrier
 * lane k of every group of 8 lanes reads block k's value through distributed
 * shared memory and a butterfly combines them, so every thread of every
 * block gets the same result; a second barrier keeps the slot until all have
 * read it. All threads of all blocks call it together. csize 1: the value
 * itself, no barrier. */
template <class T, class Op>
__device__ __forceinline__ T sf_cu_cluster_all(T v, int csize, Op op) {
#if !SF_CU_CLUSTERS
    return v;
#else
    if (csize == 1) return v;
    __shared__ T slot;
    cooperative_groups::cluster_group cl = cooperative_groups::this_cluster();
    if (threadIdx.x == 0) slot = v;
    cl.sync();
    const int k = threadIdx.x & 7; /* csize <= 8 */
    T r = sf_cu_lanes_all(k < csize ? *cl.map_shared_rank(&slot, k) : Op::id(), 8, op);
    cl.sync();
    return r;
#endif
}

/* The sum of v over the blocks of lower rank (0 for rank 0). */
__device__ __forceinline__ uint64_t sf_cu_cluster_before(uint64_t v, int csize) {
#if !SF_CU_CLUSTERS
    return 0;
#else
    if (csize == 1) return 0;
    __shared__ uint64_t slot;
    cooperative_groups::cluster_group cl = cooperative_groups::this_cluster();
    if (threadIdx.x == 0) slot = v;
    cl.sync();
    uint64_t r = 0;
    for (unsigned k = 0; k < cl.block_rank(); k++) r += *cl.map_shared_rank(&slot, k);
    cl.sync();
    return r;
#endif
}

#endif /* SF_CUDA_BLOCK_CUH */
