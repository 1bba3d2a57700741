/* tests/cuda_emu: the half2 of <cuda_fp16.h> the kernels use: a pair of
 * 16-bit floats and its NaN-propagating max (max.NaN.f16x2). */
#ifndef SF_CUDA_EMU_FP16_H
#define SF_CUDA_EMU_FP16_H

#include <math.h>
#include <stdint.h>
#include <string.h>

struct alignas(4) __half2 { uint16_t x, y; }; /* as on the GPU */

namespace sf_emu {

inline float f16_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 31u, m = h & 1023u;
    float v = e == 31 ? (m ? NAN : INFINITY) : e ? ldexpf((float)(m | 1024u), (int)e - 25)
                                                : ldexpf((float)m, -24);
    uint32_t u;
    memcpy(&u, &v, 4);
    u |= sign;
    memcpy(&v, &u, 4);
    return v;
}

/* The larger of two 16-bit floats in bits (-0 below +0), a NaN if either is. */
inline uint16_t max_nan16(uint16_t a, uint16_t b, float (*to_float)(uint16_t)) {
    const float fa = to_float(a), fb = to_float(b);
    if (fa != fa || fb != fb) return 0x7FFF;
    if (fa != fb) return fa > fb ? a : b;
    return (a & 0x8000u) ? b : a;
}

} /* namespace sf_emu */

inline __half2 __hmax2_nan(__half2 a, __half2 b) {
    return {sf_emu::max_nan16(a.x, b.x, sf_emu::f16_to_float),
            sf_emu::max_nan16(a.y, b.y, sf_emu::f16_to_float)};
}

#endif
