/* The row kernels built for the avx512 level (flags in CMakeLists.txt). */
#define SF_TABLE sf_kernels_avx512
#define SF_TABLE_NAME "avx512"
#include "kernels_impl.h"
