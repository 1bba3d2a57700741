/* tests/cuda_emu: asynchronous copies to shared memory, done at once (see
 * cuda_runtime.h). */
#ifndef SF_CUDA_EMU_PIPELINE_PRIMITIVES_H
#define SF_CUDA_EMU_PIPELINE_PRIMITIVES_H

#include "cuda_runtime.h"

/* cp.async copies 4, 8 or 16 bytes between addresses aligned to that size. */
inline void __pipeline_memcpy_async(void *dst, const void *src, size_t size, size_t zfill = 0) {
    sf_emu::Block &b = *sf_emu::cur_block;
    if ((size != 4 && size != 8 && size != 16) || zfill > size ||
        ((uintptr_t)dst | (uintptr_t)src) % size) {
        b.launch->fail(sf_emu::where() + "__pipeline_memcpy_async of " + std::to_string(size) +
                       " bytes, misaligned or of a size cp.async lacks");
        return;
    }
    memcpy(dst, src, size - zfill);
    memset((char *)dst + size - zfill, 0, zfill);
}
inline void __pipeline_commit() {}
inline void __pipeline_wait_prior(size_t) {}

#endif
