# SPDX-License-Identifier: Apache-2.0
# The two consumer programs, shared by the find_package and add_subdirectory consumer projects:
# include() it after cudawait::cudawait exists, with CONSUMER_EXPECTED_VERSION set.

# cudawait needs C++20 in .cu files too. CMake before 3.26 has no CUDA_STANDARD 20 for nvcc, so
# there the flag goes in by hand.
if(DEFINED CMAKE_CUDA20_STANDARD_COMPILE_OPTION)
  set(CMAKE_CUDA_STANDARD 20)
  set(CMAKE_CUDA_STANDARD_REQUIRED ON)
  set(_cuda_std "")
else()
  set(_cuda_std -std=c++20)
endif()

add_executable(app_host ${CMAKE_CURRENT_LIST_DIR}/consumer.cpp)
add_executable(app_cuda ${CMAKE_CURRENT_LIST_DIR}/consumer.cu)
foreach(app app_host app_cuda)
  target_link_libraries(${app} PRIVATE cudawait::cudawait)
  target_compile_definitions(${app} PRIVATE CONSUMER_EXPECTED_VERSION="${CONSUMER_EXPECTED_VERSION}")
  target_compile_options(${app} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Werror>
    $<$<COMPILE_LANGUAGE:CUDA>:${_cuda_std} -Werror=all-warnings -Xcompiler=-Wall,-Wextra,-Werror>)
endforeach()

enable_testing()
add_test(NAME app_host COMMAND app_host)
add_test(NAME app_cuda COMMAND app_cuda)
