/*
 * shared.cuh: csrc/common/shared.h for nvcc.
 *
 * shared.h marks its functions __host__ __device__ and, under __CUDACC__,
 * maps SF_FMUL / SF_FADD / SF_FSUB to __fmul_rn / __fadd_rn / __fsub_rn,
 * which exist only in device code, so the host pass of nvcc rejects them.
 * Until shared.h selects the intrinsics on __CUDA_ARCH__ (the device pass)
 * instead, the names are routed here through __host__ __device__ wrappers:
 * the device pass still gets the unfused _rn intrinsics, the host pass
 * plain IEEE operations (built with -ffp-contract=off). With the fix in
 * shared.h this header changes nothing.
 */
#ifndef SF_CUDA_SHARED_CUH
#define SF_CUDA_SHARED_CUH

#include <cuda_runtime.h>

__host__ __device__ __forceinline__ float sf_hd_fmul(float a, float b) {
#if defined(__CUDA_ARCH__)
    return __fmul_rn(a, b);
#else
    return a * b;
#endif
}
__host__ __device__ __forceinline__ float sf_hd_fadd(float a, float b) {
#if defined(__CUDA_ARCH__)
    return __fadd_rn(a, b);
#else
    return a + b;
#endif
}
__host__ __device__ __forceinline__ float sf_hd_fsub(float a, float b) {
#if defined(__CUDA_ARCH__)
    return __fsub_rn(a, b);
#else
    return a - b;
#endif
}

#define __fmul_rn(a, b) sf_hd_fmul((a), (b))
#define __fadd_rn(a, b) sf_hd_fadd((a), (b))
#define __fsub_rn(a, b) sf_hd_fsub((a), (b))
#include "../common/shared.h"
#undef __fmul_rn
#undef __fadd_rn
#undef __fsub_rn

#endif /* SF_CUDA_SHARED_CUH */
