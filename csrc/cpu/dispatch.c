/* Picks the row kernels for this CPU once; SPECFAST_SIMD may lower the level
 * (scalar, avx2, avx512), for tests and for machines that throttle wide
 * vectors. */
#include <stdlib.h>
#include <string.h>
#if defined(SF_X86_LEVELS)
#include <cpuid.h>
#endif

#include "kernels.h"

static const sf_kernels *pick(void) {
    int level = 0;
#if defined(SF_X86_LEVELS)
    __builtin_cpu_init();
    /* The avx2 level widens float16 with F16C (not a name clang's
     * __builtin_cpu_supports knows: read CPUID leaf 1). */
    unsigned a, b, c, d;
    const int f16c = __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C);
    if (__builtin_cpu_supports("avx2") && f16c) level = 1;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl"))
        level = 2;
#endif
    const char *want = getenv("SPECFAST_SIMD");
    if (want && strcmp(want, "scalar") == 0) level = 0;
    if (want && strcmp(want, "avx2") == 0 && level > 1) level = 1;
#if defined(SF_X86_LEVELS)
    if (level == 2) return &sf_kernels_avx512;
    if (level == 1) return &sf_kernels_avx2;
#endif
    return &sf_kernels_scalar;
}

const sf_kernels *sf_cpu_kernels(void) {
    /* Threads may race to pick; each picks the same, and the atomics make the
     * race defined. */
    static const sf_kernels *chosen;
    const sf_kernels *k = __atomic_load_n(&chosen, __ATOMIC_ACQUIRE);
    if (!k) {
        k = pick();
        __atomic_store_n(&chosen, k, __ATOMIC_RELEASE);
    }
    return k;
}

SF_API const char *sf_simd_level(void) { return sf_cpu_kernels()->name; }
