# SPDX-License-Identifier: Apache-2.0
# cudawait_strict(<target>): the warning set every test, benchmark and example is held to,
# for host (.cpp, g++) and device (.cu, nvcc) sources alike; plus the sanitizers named in
# CUDAWAIT_SANITIZE for host sources.
function(cudawait_strict target)
  # C++20 for .cu sources. CMake releases before 3.26 do not know nvcc's -std=c++20, so it is
  # passed by hand there.
  if(DEFINED CMAKE_CUDA20_STANDARD_COMPILE_OPTION)
    set_target_properties(${target} PROPERTIES CUDA_STANDARD 20 CUDA_STANDARD_REQUIRED ON
                                               CUDA_EXTENSIONS OFF)
  else()
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-std=c++20>)
  endif()
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Werror>
    $<$<COMPILE_LANGUAGE:CUDA>:-Werror=all-warnings -Xcompiler=-Wall,-Wextra,-Werror>)
  if(CUDAWAIT_SANITIZE)
    target_compile_options(${target} PRIVATE
      $<$<COMPILE_LANGUAGE:CXX>:-fsanitize=${CUDAWAIT_SANITIZE} -fno-omit-frame-pointer -fno-sanitize-recover=all>)
    target_link_options(${target} PRIVATE -fsanitize=${CUDAWAIT_SANITIZE})
  endif()
endfunction()
