# SPDX-License-Identifier: Apache-2.0
# cudawait_strict(<target>): the warning set every test, benchmark and example is held to,
# for host (.cpp, g++) and device (.cu, nvcc) sources alike; plus the sanitizers named in
# CUDAWAIT_SANITIZE for host sources.
function(cudawait_strict target)
  # C++20 for .cu sources (CMake before 3.25.2 learns nvcc's flag from cudawaitCuda20.cmake).
  set_target_properties(${target} PROPERTIES CUDA_STANDARD 20 CUDA_STANDARD_REQUIRED ON
                                             CUDA_EXTENSIONS OFF)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Werror>
    $<$<COMPILE_LANGUAGE:CUDA>:-Werror=all-warnings -Xcompiler=-Wall,-Wextra,-Werror>)
  if(CUDAWAIT_SANITIZE)
    target_compile_options(${target} PRIVATE
      $<$<COMPILE_LANGUAGE:CXX>:-fsanitize=${CUDAWAIT_SANITIZE} -fno-omit-frame-pointer -fno-sanitize-recover=all>)
    target_link_options(${target} PRIVATE -fsanitize=${CUDAWAIT_SANITIZE})
  endif()
endfunction()
