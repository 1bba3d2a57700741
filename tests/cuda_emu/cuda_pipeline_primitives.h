/* tests/cuda_emu: asynchronous copies to shared memory, done at once (see
 * cuda_runtime.h). */
#ifndef SF_CUDA_EMU_PIPELINE_PRIMITIVES_H
#define SF_CUDA_EMU_PIPELINE_PRIMITIVES_H

#include "cuda_runtime.h"

inline void __pipeline_memcpy_async(void *dst, const void *src, size_t size, size_t zfill = 0) {
    memcpy(dst, src, size - zfill);
    memset((char *)dst + size - zfill, 0, zfill);
}
inline void __pipeline_commit() {}
inline void __pipeline_wait_prior(size_t) {}

#endif
