# SPDX-License-Identifier: Apache-2.0
# cudawait_nvcc_cxx20_flags(): makes an older CMake know nvcc's C++20 flag, the way CMake 3.25.2
# and later know it.
#
# CMake before 3.25.2 has no flag for the CUDA20 dialect with nvcc, and fails at generate time
# ('requires the language dialect "CUDA20" ... does not know the flags to enable it') for any
# target with .cu sources that must be C++20: through CMAKE_CUDA_STANDARD 20, through
# CMAKE_CXX_STANDARD 20 (a target's CUDA_STANDARD defaults to its CXX_STANDARD), or through a
# cxx_std_20 compile feature such as cudawait::cudawait's (CMake applies it to CUDA sources too)
# whenever the standard is required (CMAKE_CXX_STANDARD_REQUIRED). Where it does not fail, such a
# .cu file is silently compiled as nvcc's default C++17.
#
# The macro sets CMAKE_CUDA20_STANDARD_COMPILE_OPTION and CMAKE_CUDA20_EXTENSION_COMPILE_OPTION to
# -std=c++20 in the calling directory scope when the running CMake is older than 3.25.2, neither
# is defined yet, and the CUDA compiler is nvcc 12.0 or later (the CUDA compiler when CUDA is
# enabled, else the nvcc of the toolkit find_package(CUDAToolkit) found). It sets
# _cudawait_cuda20_defined to TRUE when it defined them. Newer CMake releases are left alone.
macro(cudawait_nvcc_cxx20_flags)
  set(_cudawait_cuda20_defined FALSE)
  if(CMAKE_VERSION VERSION_LESS 3.25.2 AND NOT DEFINED CMAKE_CUDA20_STANDARD_COMPILE_OPTION)
    set(_cudawait_nvcc_version "")
    if(CMAKE_CUDA_COMPILER_ID STREQUAL "NVIDIA")
      set(_cudawait_nvcc_version "${CMAKE_CUDA_COMPILER_VERSION}")
    elseif(NOT CMAKE_CUDA_COMPILER_ID AND CUDAToolkit_NVCC_EXECUTABLE AND CUDAToolkit_VERSION)
      set(_cudawait_nvcc_version "${CUDAToolkit_VERSION}")
    endif()
    if(_cudawait_nvcc_version VERSION_GREATER_EQUAL 12.0
        AND NOT (CMAKE_CUDA_SIMULATE_ID STREQUAL "MSVC"
                 AND CMAKE_CUDA_SIMULATE_VERSION VERSION_LESS 19.29.30129))
      set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
      set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
      set(_cudawait_cuda20_defined TRUE)
    endif()
    unset(_cudawait_nvcc_version)
  endif()
endmacro()
