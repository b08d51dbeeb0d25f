# SPDX-License-Identifier: Apache-2.0
# cudawait_cccl_include_dirs(<out-var>): the directories that hold libcu++ (<cuda/stream_ref>)
# for the CUDA toolkit found by find_package(CUDAToolkit). Since CUDA 13 CCCL sits in
# <toolkit>/include/cccl; older toolkits keep it in <toolkit>/include, which needs nothing extra.
function(cudawait_cccl_include_dirs out)
  set(dirs "")
  foreach(dir IN LISTS CUDAToolkit_INCLUDE_DIRS)
    if(EXISTS "${dir}/cccl/cuda/stream_ref")
      list(APPEND dirs "${dir}/cccl")
    endif()
  endforeach()
  list(REMOVE_DUPLICATES dirs)
  set(${out} "${dirs}" PARENT_SCOPE)
endfunction()
