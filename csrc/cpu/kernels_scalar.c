/* The row kernels built for the scalar level (flags in CMakeLists.txt). */
#define SF_TABLE sf_kernels_scalar
#define SF_TABLE_NAME "scalar"
#include "kernels_impl.h"
