# SPDX-License-Identifier: Apache-2.0
# header.cxx20_required (tests/CMakeLists.txt), run in script mode:
#   cmake -DSETTINGS=<file> -DWORK_DIR=<dir> -P cxx20_check.cmake
# Compiles a translation unit that includes one public header, as C++17, for every header with
# the host compiler and for the umbrella and core/task.hpp with nvcc. A header that does not compile
# as C++17 must fail with cudawait's "needs C++20" message as its first error (not with
# <coroutine>'s "requires -fcoroutines" or whatever C++20 feature comes first); the umbrella
# must fail. SETTINGS sets CHECK_CXX, CHECK_NVCC, CHECK_CUDA_HOST_COMPILER, CHECK_INCLUDE_DIRS
# and CHECK_HEADERS (the public headers' names, without .hpp).
cmake_minimum_required(VERSION 3.25)

include("${SETTINGS}")
file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")

set(expected "cudawait needs C++20")
set(include_args "")
foreach(dir IN LISTS CHECK_INCLUDE_DIRS)
  if(dir)
    list(APPEND include_args "-I${dir}")
  endif()
endforeach()
set(failures "")

# compile_as_cxx17(<header> <ext> <compiler command...>): compiles `#include <cudawait/<header>.hpp>`
# from a .<ext> file; sets `rc` and `first_error` (the first line that reports an error) in the
# caller.
function(compile_as_cxx17 header ext)
  string(REPLACE "/" "_" name "${header}")
  set(src "${WORK_DIR}/${name}_${ext}.${ext}")
  file(WRITE "${src}" "#include <cudawait/${header}.hpp>\nint main() { return 0; }\n")
  execute_process(COMMAND ${ARGN} ${include_args} -c "${src}" -o "${WORK_DIR}/${name}_${ext}.o"
    RESULT_VARIABLE status OUTPUT_VARIABLE out ERROR_VARIABLE out)
  string(REGEX MATCH "[^\n]*[ :]error:[^\n]*" first "${out}")
  set(rc "${status}" PARENT_SCOPE)
  set(first_error "${first}" PARENT_SCOPE)
endfunction()

# check_header(<header> <ext> <must-fail> <compiler command...>)
function(check_header header ext must_fail)
  compile_as_cxx17(${header} ${ext} ${ARGN})
  if(rc STREQUAL "0")
    if(must_fail)
      list(APPEND failures "${header}.hpp (${ext}) compiled as C++17")
      set(failures "${failures}" PARENT_SCOPE)
    else()
      message(STATUS "${header}.hpp (${ext}): compiles as C++17 (it needs nothing of C++20)")
    endif()
    return()
  endif()
  string(FIND "${first_error}" "${expected}" at)
  if(at EQUAL -1)
    list(APPEND failures "${header}.hpp (${ext}) failed first with: ${first_error}")
    set(failures "${failures}" PARENT_SCOPE)
  else()
    message(STATUS "${header}.hpp (${ext}): ${first_error}")
  endif()
endfunction()

# The first error is all that matters, so the host compiler stops there.
foreach(header IN LISTS CHECK_HEADERS)
  set(must_fail FALSE)
  if(header STREQUAL "cudawait" OR header STREQUAL "core/task" OR header STREQUAL "core")
    set(must_fail TRUE)
  endif()
  check_header(${header} cpp ${must_fail} "${CHECK_CXX}" -std=c++17 -Wfatal-errors)
endforeach()

set(ccbin_args "")
if(CHECK_CUDA_HOST_COMPILER)
  set(ccbin_args -ccbin "${CHECK_CUDA_HOST_COMPILER}")
endif()
foreach(header cudawait core/task)
  check_header(${header} cu TRUE "${CHECK_NVCC}" ${ccbin_args} -std=c++17)
endforeach()

if(failures)
  string(JOIN "\n  " listing ${failures})
  message(FATAL_ERROR "built as C++17, these did not fail first with \"${expected}\":\n  ${listing}")
endif()
