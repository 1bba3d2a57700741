# cuda.cmake: the optional CUDA backend, libspecfast_cuda.so.
#
# Included from CMakeLists.txt after the CPU library. SPECFAST_CUDA:
#   OFF   never build it;
#   AUTO  build it when check_language(CUDA) finds a compiler (the default);
#   ON    build it, and fail when there is no CUDA compiler.
# The CUDA code is a separate shared library installed next to libspecfast.so,
# so the CPU library never links libcudart and loads where there is no GPU or
# driver; Python loads libspecfast_cuda.so only when a CUDA tensor arrives.

string(TOUPPER "${SPECFAST_CUDA}" _sf_cuda)
if(NOT _sf_cuda MATCHES "^(AUTO|ON|OFF)$")
  message(FATAL_ERROR "SPECFAST_CUDA must be AUTO, ON or OFF, got '${SPECFAST_CUDA}'")
endif()

set(_sf_cuda_build OFF)
if(NOT _sf_cuda STREQUAL "OFF")
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    set(_sf_cuda_build ON)
  elseif(_sf_cuda STREQUAL "ON")
    message(FATAL_ERROR "SPECFAST_CUDA=ON but no CUDA compiler was found "
                        "(set CMAKE_CUDA_COMPILER or CUDACXX)")
  else()
    message(STATUS "specfast: no CUDA compiler found; building the CPU backend only")
  endif()
endif()

if(_sf_cuda_build)
  # Architectures: native code for sm_80 (A100, and sm_86 / sm_89 GPUs, which
  # run sm_80 code: one block per request, no clusters) and sm_90 (H100 /
  # H200: clusters), plus compute_90 PTX that the driver compiles for newer
  # GPUs (Blackwell and later). -DCMAKE_CUDA_ARCHITECTURES=... overrides it
  # (90-real alone halves the build).
  if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
    set(CMAKE_CUDA_ARCHITECTURES "80-real;90-real;90-virtual")
  endif()
  enable_language(CUDA)
  set(CMAKE_CUDA_STANDARD 17)
  set(CMAKE_CUDA_STANDARD_REQUIRED ON)

  add_library(specfast_cuda SHARED csrc/cuda/kernels.cu)
  target_include_directories(specfast_cuda PRIVATE csrc/include csrc/cuda)
  set_target_properties(specfast_cuda PROPERTIES
    CUDA_VISIBILITY_PRESET hidden
    CXX_VISIBILITY_PRESET hidden
    CUDA_RUNTIME_LIBRARY Static  # libcudart_static: only the driver is needed at run time
    POSITION_INDEPENDENT_CODE ON)
  # -fmad=false: no fused multiply-add anywhere (shared.h already uses the _rn
  # intrinsics; this covers the rest), and IEEE division and square root
  # (never --use_fast_math), so the GPU rounds as the CPU does.
  target_compile_options(specfast_cuda PRIVATE
    $<$<COMPILE_LANGUAGE:CUDA>:-O3 -fmad=false -prec-div=true -prec-sqrt=true
      -ftz=false -Xcompiler=-ffp-contract=off -Xcompiler=-fvisibility=hidden>)
  install(TARGETS specfast_cuda LIBRARY DESTINATION specfast RUNTIME DESTINATION specfast)
  message(STATUS "specfast: building the CUDA backend for ${CMAKE_CUDA_ARCHITECTURES}")
endif()
