# SPDX-License-Identifier: Apache-2.0
# The consumer programs, shared by the find_package and add_subdirectory consumer projects:
# include() it after cudawait::cudawait exists, with CONSUMER_EXPECTED_VERSION set.
#
# The .cu program is built three ways a project may ask for C++20, each of which must work with
# every CMake the project supports (3.25.1 in CI, which does not know nvcc's C++20 flag by
# itself):
#   app_cuda_plain    nothing set: cudawait::cudawait's cxx_std_20 makes the .cu C++20
#   app_cuda          CMAKE_CXX_STANDARD 20 + CMAKE_CXX_STANDARD_REQUIRED ON (CUDA follows CXX)
#   app_cuda_cudastd  CMAKE_CUDA_STANDARD 20 + CMAKE_CUDA_STANDARD_REQUIRED ON
# app_host is the .cpp program, under CMAKE_CXX_STANDARD 20. No target gets -std by hand.
# app_host_compiled and app_cuda_compiled link cudawait::compiled as well.

set(_consumer_dir ${CMAKE_CURRENT_LIST_DIR})

# Targets take these variables' values when they are created, so the plain one comes first.
add_executable(app_cuda_plain ${_consumer_dir}/consumer.cu)

set(CMAKE_CXX_STANDARD 20)
set(CMAKE_CXX_STANDARD_REQUIRED ON)
add_executable(app_host ${_consumer_dir}/consumer.cpp)
add_executable(app_cuda ${_consumer_dir}/consumer.cu)

set(CMAKE_CUDA_STANDARD 20)
set(CMAKE_CUDA_STANDARD_REQUIRED ON)
add_executable(app_cuda_cudastd ${_consumer_dir}/consumer.cu)

# The same programs against cudawait::compiled (the loop compiled once, in the library):
# app_host_compiled from a .cpp, app_cuda_compiled from a .cu.
add_executable(app_host_compiled ${_consumer_dir}/consumer.cpp)
add_executable(app_cuda_compiled ${_consumer_dir}/consumer.cu)
target_link_libraries(app_host_compiled PRIVATE cudawait::compiled)
target_link_libraries(app_cuda_compiled PRIVATE cudawait::compiled)

enable_testing()
foreach(app app_host app_cuda_plain app_cuda app_cuda_cudastd app_host_compiled app_cuda_compiled)
  target_link_libraries(${app} PRIVATE cudawait::cudawait)
  target_compile_definitions(${app} PRIVATE CONSUMER_EXPECTED_VERSION="${CONSUMER_EXPECTED_VERSION}")
  target_compile_options(${app} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Werror>
    $<$<COMPILE_LANGUAGE:CUDA>:-Werror=all-warnings -Xcompiler=-Wall,-Wextra,-Werror>)
  add_test(NAME ${app} COMMAND ${app})
endforeach()
