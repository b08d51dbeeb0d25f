# SPDX-License-Identifier: Apache-2.0
# Driver of the packaging tests (tests/package/CMakeLists.txt), run in script mode. Each step
# runs through execute_process with its command echoed; the first one that fails ends the test
# with a message naming the step. Every run starts from an empty BINARY_DIR / PREFIX.
#
#   cmake -DMODE=install -DBUILD_DIR=<cudawait build tree> -DPREFIX=<dir>
#         -DSOURCE_DIR=<cudawait source> [-DLIBDIR=<dir>] [-DDOCDIR=<dir>] [-DCONFIG=<cfg>]
#         -P run_consumer.cmake
#       cmake --install BUILD_DIR --prefix PREFIX, then checks what landed there (LIBDIR and
#       DOCDIR: GNUInstallDirs' CMAKE_INSTALL_LIBDIR and _DOCDIR, relative to PREFIX).
#
#   cmake -DMODE=project -DSOURCE_DIR=<consumer project> -DBINARY_DIR=<dir> -DINIT_CACHE=<file>
#         -DGENERATOR=<name> [-DPLATFORM=<p>] [-DTOOLSET=<t>] [-DPREFIX_PATH=<dir>]
#         [-DCONFIG=<cfg>] -P run_consumer.cmake
#       Configures (-C INIT_CACHE), builds and runs (ctest) a consumer CMake project.
#
#   cmake -DMODE=bare -DSOURCE_DIR=<cudawait source> -DBINARY_DIR=<dir> -DPREFIX=<dir>
#         -DINIT_CACHE=<file> -DGENERATOR=<name> [-DPLATFORM=<p>] [-DTOOLSET=<t>] [-DCONFIG=<cfg>]
#         -P run_consumer.cmake
#       Configures cudawait itself as a top-level project with its default options, on a machine
#       made to lack GoogleTest and Google Benchmark (CMAKE_DISABLE_FIND_PACKAGE_<name>): the
#       configure must succeed and warn, naming each package; then builds the demo (the pipeline
#       example) and installs into PREFIX.
#
#   cmake -DMODE=vendored -DSOURCE_DIR=<cudawait source> -DCONSUMER_DIR=<consumer sources>
#         -DBINARY_DIR=<dir> -DSETTINGS=<file> -P run_consumer.cmake
#       Copies include/ and the consumer sources into BINARY_DIR and builds them with bare
#       compiler commands, once by the host C++ compiler and once by nvcc, then runs both.
cmake_minimum_required(VERSION 3.25)

# run_step(<description> <command> [<arg>...])
function(run_step what)
  string(JOIN " " cmdline ${ARGN})
  message(STATUS "==> ${what}")
  execute_process(COMMAND ${ARGN} COMMAND_ECHO STDOUT RESULT_VARIABLE rc)
  if(NOT rc STREQUAL "0")
    message(FATAL_ERROR "package test step failed: ${what}\n  exit status: ${rc}\n  command: ${cmdline}")
  endif()
endfunction()

function(require)
  foreach(var IN LISTS ARGN)
    if(NOT DEFINED ${var} OR "${${var}}" STREQUAL "")
      message(FATAL_ERROR "run_consumer.cmake (MODE=${MODE}): -D${var}=... is required")
    endif()
  endforeach()
endfunction()

function(fresh_dir dir)
  file(REMOVE_RECURSE "${dir}")
  file(MAKE_DIRECTORY "${dir}")
endfunction()

# Relative paths of all files under `dir`, sorted.
function(list_tree out dir)
  file(GLOB_RECURSE files LIST_DIRECTORIES false RELATIVE "${dir}" "${dir}/*")
  list(SORT files)
  set(${out} "${files}" PARENT_SCOPE)
endfunction()

require(MODE)

if(MODE STREQUAL "install")
  require(BUILD_DIR PREFIX SOURCE_DIR)
  file(REMOVE_RECURSE "${PREFIX}")
  set(config_args "")
  if(CONFIG)
    set(config_args --config "${CONFIG}")
  endif()
  run_step("install ${BUILD_DIR} into ${PREFIX}"
    "${CMAKE_COMMAND}" --install "${BUILD_DIR}" --prefix "${PREFIX}" ${config_args})

  # Exactly the public headers, nothing more, nothing less.
  list_tree(source_headers "${SOURCE_DIR}/include/cudawait")
  list_tree(installed_headers "${PREFIX}/include/cudawait")
  if(NOT source_headers STREQUAL installed_headers)
    message(FATAL_ERROR "installed headers differ from include/cudawait in the source tree\n"
      "  source:    ${source_headers}\n  installed: ${installed_headers}")
  endif()
  if(NOT source_headers)
    message(FATAL_ERROR "no headers were installed under ${PREFIX}/include/cudawait")
  endif()

  # The package files find_package(cudawait CONFIG) reads.
  if(LIBDIR AND NOT IS_ABSOLUTE "${LIBDIR}")
    foreach(f cudawaitConfig.cmake cudawaitConfigVersion.cmake cudawaitTargets.cmake cudawaitCccl.cmake
        cudawaitCuda20.cmake)
      if(NOT EXISTS "${PREFIX}/${LIBDIR}/cmake/cudawait/${f}")
        message(FATAL_ERROR "install did not create ${PREFIX}/${LIBDIR}/cmake/cudawait/${f}")
      endif()
    endforeach()
  endif()

  # cudawait::compiled's archive.
  if(LIBDIR AND NOT IS_ABSOLUTE "${LIBDIR}" AND NOT EXISTS "${PREFIX}/${LIBDIR}/libcudawait.a")
    message(FATAL_ERROR "install did not create ${PREFIX}/${LIBDIR}/libcudawait.a")
  endif()

  if(DOCDIR AND NOT IS_ABSOLUTE "${DOCDIR}" AND NOT EXISTS "${PREFIX}/${DOCDIR}/LICENSE")
    message(FATAL_ERROR "install did not create ${PREFIX}/${DOCDIR}/LICENSE")
  endif()

  # A relocatable package: no installed file may hold an absolute path into the source or the
  # build tree (the prefix itself lies in the build tree, so this covers the prefix too).
  list_tree(all_files "${PREFIX}")
  foreach(f IN LISTS all_files)
    if(f MATCHES "\\.cmake$")
      file(READ "${PREFIX}/${f}" text)
      foreach(tree "${SOURCE_DIR}" "${BUILD_DIR}")
        string(FIND "${text}" "${tree}" at)
        if(NOT at EQUAL -1)
          message(FATAL_ERROR "installed ${f} holds the absolute path ${tree}; the package is not "
            "relocatable")
        endif()
      endforeach()
    endif()
  endforeach()
  string(JOIN "\n  " listing ${all_files})
  message(STATUS "installed into ${PREFIX}:\n  ${listing}")

elseif(MODE STREQUAL "project")
  require(SOURCE_DIR BINARY_DIR INIT_CACHE GENERATOR)
  fresh_dir("${BINARY_DIR}")
  set(configure_args -S "${SOURCE_DIR}" -B "${BINARY_DIR}" -C "${INIT_CACHE}" -G "${GENERATOR}")
  if(PLATFORM)
    list(APPEND configure_args -A "${PLATFORM}")
  endif()
  if(TOOLSET)
    list(APPEND configure_args -T "${TOOLSET}")
  endif()
  if(PREFIX_PATH)
    list(APPEND configure_args "-DCMAKE_PREFIX_PATH=${PREFIX_PATH}")
  endif()
  set(build_config "")
  set(test_config "")
  if(CONFIG)
    set(build_config --config "${CONFIG}")
    set(test_config -C "${CONFIG}")
  endif()
  get_filename_component(name "${SOURCE_DIR}" NAME)
  run_step("configure the ${name} consumer" "${CMAKE_COMMAND}" ${configure_args})
  run_step("build the ${name} consumer" "${CMAKE_COMMAND}" --build "${BINARY_DIR}" ${build_config})
  run_step("run the ${name} consumer"
    "${CMAKE_CTEST_COMMAND}" --test-dir "${BINARY_DIR}" ${test_config} --verbose --no-tests=error)

elseif(MODE STREQUAL "bare")
  require(SOURCE_DIR BINARY_DIR PREFIX INIT_CACHE GENERATOR)
  fresh_dir("${BINARY_DIR}")
  file(REMOVE_RECURSE "${PREFIX}")
  set(configure_args -S "${SOURCE_DIR}" -B "${BINARY_DIR}" -C "${INIT_CACHE}" -G "${GENERATOR}"
    -DCMAKE_DISABLE_FIND_PACKAGE_GTest=ON -DCMAKE_DISABLE_FIND_PACKAGE_benchmark=ON)
  if(PLATFORM)
    list(APPEND configure_args -A "${PLATFORM}")
  endif()
  if(TOOLSET)
    list(APPEND configure_args -T "${TOOLSET}")
  endif()
  message(STATUS "==> configure cudawait without GoogleTest and Google Benchmark")
  execute_process(COMMAND "${CMAKE_COMMAND}" ${configure_args} COMMAND_ECHO STDOUT
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  message("${out}")
  if(NOT rc STREQUAL "0")
    message(FATAL_ERROR "configuring cudawait failed without GoogleTest and Google Benchmark "
      "(exit status ${rc}); neither may be needed by the library, the examples or the install")
  endif()
  # Each package left out is named, with what it costs.
  string(REGEX REPLACE "[ \t\r\n]+" " " flat "${out}")
  foreach(expect "GoogleTest \\(find_package\\(GTest\\)[^)]*\\) was not found, so the unit tests are not built"
      "Google Benchmark \\(find_package\\(benchmark\\)[^)]*\\) was not found, so the benchmarks are not built")
    if(NOT flat MATCHES "${expect}")
      message(FATAL_ERROR "the configure output does not say: ${expect}")
    endif()
  endforeach()
  set(build_config "")
  if(CONFIG)
    set(build_config --config "${CONFIG}")
  endif()
  run_step("build the demo (pipeline example) and cudawait::compiled without GoogleTest and Google Benchmark"
    "${CMAKE_COMMAND}" --build "${BINARY_DIR}" --target pipeline_example cudawait_compiled ${build_config})
  run_step("install without GoogleTest and Google Benchmark"
    "${CMAKE_COMMAND}" --install "${BINARY_DIR}" --prefix "${PREFIX}" ${build_config})
  file(GLOB_RECURSE configs "${PREFIX}/*/cudawaitConfig.cmake")
  if(NOT EXISTS "${PREFIX}/include/cudawait/cudawait.hpp" OR NOT configs)
    message(FATAL_ERROR "the install into ${PREFIX} lacks cudawait.hpp or cudawaitConfig.cmake")
  endif()

elseif(MODE STREQUAL "vendored")
  require(SOURCE_DIR CONSUMER_DIR BINARY_DIR SETTINGS)
  # Sets VENDORED_CXX, VENDORED_NVCC, VENDORED_CUDA_HOST_COMPILER, VENDORED_CUDA_INCLUDE_DIRS,
  # VENDORED_CUDA_LIBRARY_DIR, VENDORED_NVCC_ARCH_FLAGS and VENDORED_VERSION.
  include("${SETTINGS}")
  fresh_dir("${BINARY_DIR}")
  # The consumer's own tree: its sources, and cudawait's include/ dropped into vendor/.
  file(COPY "${SOURCE_DIR}/include" DESTINATION "${BINARY_DIR}/vendor")
  file(COPY "${CONSUMER_DIR}/" DESTINATION "${BINARY_DIR}/src")
  set(vendor_include "${BINARY_DIR}/vendor/include")
  set(version_define "-DCONSUMER_EXPECTED_VERSION=\"${VENDORED_VERSION}\"")
  set(rpath "-Wl,-rpath,${VENDORED_CUDA_LIBRARY_DIR}")

  set(cuda_include_args "")
  foreach(dir IN LISTS VENDORED_CUDA_INCLUDE_DIRS)
    if(dir)
      list(APPEND cuda_include_args "-I${dir}")
    endif()
  endforeach()
  run_step("compile the vendored consumer with the host C++ compiler"
    "${VENDORED_CXX}" -std=c++20 -Wall -Wextra -Werror "-I${vendor_include}" ${cuda_include_args}
    "${version_define}" "${BINARY_DIR}/src/consumer.cpp" -o "${BINARY_DIR}/consumer_host"
    "-L${VENDORED_CUDA_LIBRARY_DIR}" -lcudart "${rpath}")

  set(ccbin_args "")
  if(VENDORED_CUDA_HOST_COMPILER)
    set(ccbin_args -ccbin "${VENDORED_CUDA_HOST_COMPILER}")
  endif()
  run_step("compile the vendored consumer with nvcc"
    "${VENDORED_NVCC}" ${ccbin_args} -std=c++20 -Werror=all-warnings -Xcompiler=-Wall,-Wextra,-Werror
    ${VENDORED_NVCC_ARCH_FLAGS} "-I${vendor_include}" "${version_define}"
    "${BINARY_DIR}/src/consumer.cu" -o "${BINARY_DIR}/consumer_cuda" -lcudart
    "-Xlinker=-rpath,${VENDORED_CUDA_LIBRARY_DIR}")

  run_step("run the vendored consumer built by the host C++ compiler" "${BINARY_DIR}/consumer_host")
  run_step("run the vendored consumer built by nvcc" "${BINARY_DIR}/consumer_cuda")

else()
  message(FATAL_ERROR "run_consumer.cmake: unknown MODE '${MODE}' (install, project, bare or vendored)")
endif()
