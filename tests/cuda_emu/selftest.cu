/*
 * tests/cuda_emu/selftest.cu: small kernels that pin down what the emulator
 * models (tests/test_cuda_emu.py): shuffles, per-block shared memory,
 * __syncthreads_or, cluster reductions through distributed shared memory,
 * and the faults it must report rather than hide or hang on; that the
 * kernels' fixed point equals the CPU's on every float; and the bound
 * of a row's mass that the kernels accept on without summing it.
 */
#include <cooperative_groups.h>
#include <cuda_runtime.h>
#include <string.h>

#include "../../csrc/cpu/rowmath.h"
#include "../../csrc/cuda/kernels.cu"

#define FULL 0xFFFFFFFFu

namespace cg = cooperative_groups;

/* out[2 t]: t's value from lane (lane ^ 5); out[2 t + 1]: an inclusive scan
 * of t over the warp by __shfl_up_sync. */
__global__ void k_shuffle(int *out) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x, lane = threadIdx.x & 31;
    out[2 * t] = __shfl_xor_sync(FULL, t, 5);
    int s = t;
    for (int o = 1; o < 32; o <<= 1) {
        const int w = __shfl_up_sync(FULL, s, o);
        if (lane >= o) s += w;
    }
    out[2 * t + 1] = s;
}

/* Each block's shared variable is its own: out[t] is the block's index. */
__global__ void k_shared(int *out) {
    __shared__ int s;
    if (threadIdx.x == 0) s = blockIdx.x;
    __syncthreads();
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}

/* out[2 t], out[2 t + 1]: whether any thread of the block is thread 77 of
 * block 1, then (a second barrier) whether any is thread 5 of block 2; a
 * third barrier ORs nothing in. */
__global__ void k_or(int *out) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    out[2 * t] = __syncthreads_or(blockIdx.x == 1 && threadIdx.x == 77);
    out[2 * t + 1] = __syncthreads_or(blockIdx.x == 2 && threadIdx.x == 5);
    if (__syncthreads_or(0)) out[2 * t] = 7;
}

/* out[t]: a shared variable before the block writes it (every byte 0xFF,
 * whatever an earlier block left there). */
__global__ void k_stale(int *out) {
    __shared__ int s;
    const int before = s;
    __syncthreads();
    if (threadIdx.x == 0) s = 1000 + blockIdx.x;
    out[blockIdx.x * blockDim.x + threadIdx.x] = before;
}

/* out[t]: the sum over the cluster's blocks of 1000 rank + blockIdx. */
__global__ void k_cluster(int *out) {
    __shared__ int s;
    cg::cluster_group cl = cg::this_cluster();
    if (threadIdx.x == 0) s = 1000 * (int)cl.block_rank() + (int)blockIdx.x;
    cl.sync();
    int sum = 0;
    for (unsigned r = 0; r < cl.num_blocks(); r++) sum += *cl.map_shared_rank(&s, r);
    cl.sync();
    out[blockIdx.x * blockDim.x + threadIdx.x] = sum;
}

/* out[t]: the first byte of dynamic shared memory, before any write. */
__global__ void k_dynamic(int *out) {
    unsigned char *smem = (unsigned char *)sf_cu_dynamic;
    out[blockIdx.x * blockDim.x + threadIdx.x] = smem[threadIdx.x];
}

/* Faults. */

__global__ void k_barrier_in_branch(int *) {
    if (threadIdx.x < 100) {
        __syncthreads();
    } else {
        __syncthreads();
    }
}

__global__ void k_shuffle_in_branch(int *out) {
    if (threadIdx.x & 1) out[threadIdx.x] = __shfl_xor_sync(FULL, 1, 2);
}

__global__ void k_read_exited_block(int *out) {
    __shared__ int s;
    cg::cluster_group cl = cg::this_cluster();
    s = 1;
    if (cl.block_rank() == 1) return;
    cl.sync();
    out[threadIdx.x] = *cl.map_shared_rank(&s, 1);
}

/* A launch of `blocks` blocks in clusters of `cluster`; attr holds the
 * cluster's size for as long as the launch configuration is used. */
static cudaLaunchConfig_t config(unsigned blocks, unsigned threads, unsigned cluster, size_t shm,
                                 cudaLaunchAttribute *attr) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(blocks);
    cfg.blockDim = dim3(threads);
    cfg.dynamicSmemBytes = shm;
    attr->id = cudaLaunchAttributeClusterDimension;
    attr->val.clusterDim.x = cluster;
    attr->val.clusterDim.y = attr->val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    return cfg;
}

extern "C" __attribute__((visibility("default")))
int sf_emu_selftest(const char *name, unsigned blocks, unsigned threads, unsigned cluster,
                    size_t shm, int *out, char *message, size_t message_size) {
    struct { const char *name; void (*kernel)(int *); } table[] = {
        {"shuffle", k_shuffle}, {"shared", k_shared}, {"or", k_or}, {"stale", k_stale},
        {"cluster", k_cluster},
        {"dynamic", k_dynamic}, {"barrier_in_branch", k_barrier_in_branch},
        {"shuffle_in_branch", k_shuffle_in_branch}, {"read_exited_block", k_read_exited_block},
    };
    for (auto &k : table) {
        if (strcmp(k.name, name)) continue;
        cudaLaunchAttribute attr;
        const cudaLaunchConfig_t cfg = config(blocks, threads, cluster, shm, &attr);
        const cudaError_t e = cudaLaunchKernelEx(&cfg, k.kernel, out);
        snprintf(message, message_size, "%s", cudaGetErrorString(e));
        return (int)e;
    }
    return -1;
}

/* How many floats in [0, 2048), and -0, sf_cu_fixed maps other than sf_fixed. */
extern "C" __attribute__((visibility("default"))) uint64_t sf_emu_fixed_mismatches(void) {
    uint64_t bad = sf_cu_fixed(-0.0f) != sf_fixed(-0.0f);
    for (uint32_t b = 0; b < sf_f2u(2048.0f); b++) bad += sf_cu_fixed(sf_u2f(b)) != sf_fixed(sf_u2f(b));
    return bad;
}

/* Rows of n logits, each shared by a cluster of blocks in slices of `slice`
 * tokens as sf_verify splits a row: per row the max, whether the row is bad
 * and the bound of its mass under the max, from sf_cu_pass_max_bound. */
template <int DT>
__global__ void k_max_bound(const void *logits, int64_t n, int64_t slice, float c, float *mx,
                            int *bad, double *bound) {
    const int csize = (int)cg::this_cluster().num_blocks();
    const int rank = (int)(blockIdx.x % csize);
    const int64_t r = blockIdx.x / csize, lo = min(rank * slice, n), hi = min(lo + slice, n);
    const char *row = (const char *)logits + r * n * (DT == SF_F32 ? 4 : 2);
    const void *mine = row + lo * (DT == SF_F32 ? 4 : 2);
    const sf_cu_span sp = {mine, row, lo, hi, n, sf_cu_aligned(mine), csize};
    float m;
    int b;
    double u;
    sf_cu_pass_max_bound<DT>(sp, c, &m, &b, &u);
    if (rank == 0 && threadIdx.x == 0) { mx[r] = m; bad[r] = b; bound[r] = u; }
}

extern "C" __attribute__((visibility("default")))
int sf_emu_max_bound(int dtype, const void *logits, int64_t rows, int64_t n, unsigned cluster,
                     float c, float *mx, int *bad, double *bound) {
    cudaLaunchAttribute attr;
    const unsigned blocks = (unsigned)rows * cluster;
    const cudaLaunchConfig_t cfg = config(blocks, SF_CU_THREADS, cluster, 0, &attr);
    const int64_t slice = sf_cu_slice(n, (int)cluster);
    if (dtype == SF_F32)
        return (int)cudaLaunchKernelEx(&cfg, k_max_bound<SF_F32>, logits, n, slice, c, mx, bad, bound);
    if (dtype == SF_BF16)
        return (int)cudaLaunchKernelEx(&cfg, k_max_bound<SF_BF16>, logits, n, slice, c, mx, bad, bound);
    return (int)cudaLaunchKernelEx(&cfg, k_max_bound<SF_F16>, logits, n, slice, c, mx, bad, bound);
}

/* The least and the largest sf_cu_exp2_up(y) / 2^y over every float y in
 * [-126, 0] (-0 included); and whether -inf and NaN count as -126. */
extern "C" __attribute__((visibility("default")))
int sf_emu_exp2_up_range(double *lo, double *hi) {
    double a = INFINITY, b = 0.0;
    for (uint32_t u = 0x80000000u; u <= sf_f2u(-126.0f); u++) {
        const float y = sf_u2f(u);
        const double r = (double)sf_cu_exp2_up(y) / exp2((double)y);
        a = r < a ? r : a;
        b = r > b ? r : b;
    }
    *lo = a;
    *hi = b;
    const float low = sf_cu_exp2_up(-126.0f);
    return sf_cu_exp2_up(-INFINITY) == low && sf_cu_exp2_up(NAN) == low;
}
