/* tests/cuda_emu: the bfloat162 of <cuda_bf16.h> the kernels use: a pair of
 * bfloat16 and its NaN-propagating max (max.NaN.bf16x2). */
#ifndef SF_CUDA_EMU_BF16_H
#define SF_CUDA_EMU_BF16_H

#include "cuda_fp16.h"

struct alignas(4) __nv_bfloat162 { uint16_t x, y; }; /* as on the GPU */

namespace sf_emu {

inline float bf16_to_float(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float v;
    memcpy(&v, &u, 4);
    return v;
}

} /* namespace sf_emu */

inline __nv_bfloat162 __hmax2_nan(__nv_bfloat162 a, __nv_bfloat162 b) {
    return {sf_emu::max_nan16(a.x, b.x, sf_emu::bf16_to_float),
            sf_emu::max_nan16(a.y, b.y, sf_emu::bf16_to_float)};
}

#endif
