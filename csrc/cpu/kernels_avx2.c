/* The row kernels built for the avx2 level (flags in CMakeLists.txt). */
#define SF_TABLE sf_kernels_avx2
#define SF_TABLE_NAME "avx2"
#include "kernels_impl.h"
