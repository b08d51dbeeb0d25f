# SPDX-License-Identifier: Apache-2.0
# cudawait_find_nccl(<include_dir_var> <library_var>): where nccl.h and libnccl are, the
# toolkit's directories first, then NCCL_HOME / NCCL_ROOT, then the system's; both empty when
# either is missing. Used by the build tree and by the installed package (cudawaitConfig.cmake),
# so that cudawait::nccl exists wherever the consumer's machine has NCCL.
function(cudawait_find_nccl include_var library_var)
  find_path(CUDAWAIT_NCCL_INCLUDE_DIR nccl.h
    HINTS ${CUDAToolkit_INCLUDE_DIRS} ENV NCCL_HOME ENV NCCL_ROOT PATH_SUFFIXES include)
  find_library(CUDAWAIT_NCCL_LIBRARY nccl
    HINTS ${CUDAToolkit_LIBRARY_DIR} ENV NCCL_HOME ENV NCCL_ROOT PATH_SUFFIXES lib lib64)
  if(CUDAWAIT_NCCL_INCLUDE_DIR AND CUDAWAIT_NCCL_LIBRARY)
    set(${include_var} "${CUDAWAIT_NCCL_INCLUDE_DIR}" PARENT_SCOPE)
    set(${library_var} "${CUDAWAIT_NCCL_LIBRARY}" PARENT_SCOPE)
  else()
    set(${include_var} "" PARENT_SCOPE)
    set(${library_var} "" PARENT_SCOPE)
  endif()
endfunction()
