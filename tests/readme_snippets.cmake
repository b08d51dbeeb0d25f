# SPDX-License-Identifier: Apache-2.0
# readme.snippets_compile (tests/CMakeLists.txt), run in script mode:
#   cmake -DSETTINGS=<file> -DWORK_DIR=<dir> -P readme_snippets.cmake
# Every ```cpp or ```cuda block of README.md and of every docs/*.md page compiles (the pages are
# globbed when the test runs, so a page added later is covered). Each block is preceded, on the
# lines just above its fence, by an HTML comment (invisible on a rendered page) that says how:
#
#   <!-- check: file examples/readme_example.cu -->  the block is that file (readme_check.cmake
#                                                     compares README.md's first block)
#   <!-- check: excerpt examples/torch_stage.cpp --> each code line of the block is a line of
#                                                     that file, in order (comment lines aside)
#   <!-- check: function     the block is the body of a function, or of a cudawait::task<void>
#   <!-- check: task         coroutine, in a namespace of its own; further lines of the comment:
#   params: T a, U b         the function's parameters: the block's free names (repeatable)
#   before: int helper();    a line at namespace scope before the function (repeatable)
#   include: <cub/cub.cuh>   an extra #include (repeatable)
#   needs: nccl              compiled only where NCCL was found
#   -->
#
# The compiled blocks go into one translation unit, after <cudawait/cudawait.hpp>, each in a
# namespace of its own with #line directives pointing into its page, compiled once by nvcc
# (-std=c++20 -c). A block without a comment, an unknown kind, a file or excerpt that does not
# match, or a compile error fails the test. SETTINGS sets CHECK_SOURCE_DIR,
# CHECK_NVCC, CHECK_CUDA_HOST_COMPILER, CHECK_INCLUDE_DIRS, CHECK_HAS_NCCL and
# CHECK_NCCL_INCLUDE_DIR.
cmake_minimum_required(VERSION 3.25)

include("${SETTINGS}")
file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")

set(failures "")
set(units "")      # the generated namespaces
set(includes "")   # extra #include lines
set(compiled 0)
set(skipped "")
set(use_nccl FALSE)
set(compile_output "")

# Lists of lines: ";" and the brackets are escaped so that list() keeps every line whole.
function(to_lines text out)
  string(REPLACE ";" "<semicolon>" text "${text}")
  string(REPLACE "[" "<lbracket>" text "${text}")
  string(REPLACE "]" "<rbracket>" text "${text}")
  string(REPLACE "\n" ";" text "${text}")
  set(${out} "${text}" PARENT_SCOPE)
endfunction()
function(from_line line out)
  string(REPLACE "<semicolon>" ";" line "${line}")
  string(REPLACE "<lbracket>" "[" line "${line}")
  string(REPLACE "<rbracket>" "]" line "${line}")
  set(${out} "${line}" PARENT_SCOPE)
endfunction()

# check_excerpt(<block> <file> <line>): every line of the block that is not blank and not a
# comment is a line of <file>, in the block's order, leading and trailing blanks aside.
function(check_excerpt block path line)
  if(NOT EXISTS "${CHECK_SOURCE_DIR}/${path}")
    set(failures "${failures}\n  ${doc_name}:${line}: ${path} does not exist" PARENT_SCOPE)
    return()
  endif()
  file(READ "${CHECK_SOURCE_DIR}/${path}" source)
  string(REGEX REPLACE "\n[ \t]+" "\n" source "\n${source}\n")
  string(REGEX REPLACE "[ \t]+\n" "\n" source "${source}")
  set(at 0)
  to_lines("${block}" lines)
  foreach(l IN LISTS lines)
    from_line("${l}" l)
    string(STRIP "${l}" l)
    if(l STREQUAL "" OR l MATCHES "^//")
      continue()
    endif()
    string(SUBSTRING "${source}" ${at} -1 rest)
    string(FIND "${rest}" "\n${l}\n" found)
    if(found EQUAL -1)
      set(failures "${failures}\n  ${doc_name}:${line}: not a line of ${path} (in this order): ${l}"
        PARENT_SCOPE)
      return()
    endif()
    math(EXPR at "${at} + ${found} + 1")
  endforeach()
endfunction()

file(GLOB doc_pages RELATIVE "${CHECK_SOURCE_DIR}" "${CHECK_SOURCE_DIR}/docs/*.md")
list(SORT doc_pages)
set(index 0)
set(pages 0)
foreach(doc_name IN ITEMS README.md ${doc_pages})
  set(doc_path "${CHECK_SOURCE_DIR}/${doc_name}")
  file(READ "${doc_path}" readme)
  math(EXPR pages "${pages} + 1")
  set(pos 0)
  while(TRUE)
    string(SUBSTRING "${readme}" ${pos} -1 rest)
    string(REGEX MATCH "\n[ ]*```(cpp|cuda)\n" fence "${rest}")
    if(NOT fence)
      break()
    endif()
    math(EXPR index "${index} + 1")
    string(FIND "${rest}" "${fence}" fence_at)
    string(LENGTH "${fence}" fence_length)
    string(REGEX MATCH "^\n[ ]*" indent "${fence}")
    string(LENGTH "${indent}" indent_length)
    math(EXPR indent_length "${indent_length} - 1")
    math(EXPR body_at "${pos} + ${fence_at} + ${fence_length}")
    # The page's line of the block's first line.
    string(SUBSTRING "${readme}" 0 ${body_at} before_body)
    string(REGEX MATCHALL "\n" newlines "${before_body}")
    list(LENGTH newlines line)
    math(EXPR line "${line} + 1")
    # The block ends at the next fence line.
    string(SUBSTRING "${readme}" ${body_at} -1 after)
    string(REGEX MATCH "(^|\n)[ ]*```" close "${after}")
    if(NOT close)
      string(APPEND failures "\n  ${doc_name}:${line}: the block is not closed")
      break()
    endif()
    string(FIND "${after}" "${close}" close_at)
    string(SUBSTRING "${after}" 0 ${close_at} body)
    math(EXPR pos "${body_at} + ${close_at} + 1")
    if(indent_length GREATER 0)
      string(REPEAT " " ${indent_length} pad)
      string(REGEX REPLACE "^${pad}" "" body "${body}")
      string(REPLACE "\n${pad}" "\n" body "${body}")
    endif()

    # The comment that ends on the line above the fence.
    string(SUBSTRING "${readme}" 0 ${body_at} head)
    string(FIND "${head}" "<!-- check:" comment_at REVERSE)
    set(comment "")
    if(NOT comment_at EQUAL -1)
      string(SUBSTRING "${head}" ${comment_at} -1 comment)
      string(FIND "${comment}" "-->" comment_end)
      if(comment_end EQUAL -1)
        set(comment "")
      else()
        string(SUBSTRING "${comment}" ${comment_end} -1 between)
        if(NOT between MATCHES "^-->[ ]*\n[ ]*```(cpp|cuda)\n$")
          set(comment "") # an earlier block's comment
        else()
          math(EXPR comment_length "${comment_end} - 4")
          string(SUBSTRING "${comment}" 4 ${comment_length} comment)
        endif()
      endif()
    endif()
    if(comment STREQUAL "")
      string(APPEND failures "\n  ${doc_name}:${line}: no <!-- check: ... --> comment above the block")
      continue()
    endif()

    set(kind "")
    set(params "")
    set(befores "")
    set(needs "")
    to_lines("${comment}" comment_lines)
    foreach(l IN LISTS comment_lines)
      string(STRIP "${l}" l)
      string(REGEX REPLACE "-->$" "" l "${l}")
      string(STRIP "${l}" l)
      if(l MATCHES "^check:[ ]*(.*)$")
        set(kind "${CMAKE_MATCH_1}")
      elseif(l MATCHES "^params:[ ]*(.*)$")
        if(params STREQUAL "")
          set(params "${CMAKE_MATCH_1}")
        else()
          set(params "${params}, ${CMAKE_MATCH_1}")
        endif()
      elseif(l MATCHES "^before:[ ]*(.*)$")
        string(APPEND befores "${CMAKE_MATCH_1}\n")
      elseif(l MATCHES "^include:[ ]*(.*)$")
        string(APPEND includes "#include ${CMAKE_MATCH_1}\n")
      elseif(l MATCHES "^needs:[ ]*(.*)$")
        set(needs "${CMAKE_MATCH_1}")
      elseif(NOT l STREQUAL "")
        string(APPEND failures
          "\n  ${doc_name}:${line}: the check comment has a line it does not know: ${l}")
      endif()
    endforeach()
    from_line("${params}" params)
    from_line("${befores}" befores)

    if(kind MATCHES "^file (.+)$")
      # Compared word for word by readme_check.cmake (readme.example_is_built); here it must exist.
      if(NOT EXISTS "${CHECK_SOURCE_DIR}/${CMAKE_MATCH_1}")
        string(APPEND failures "\n  ${doc_name}:${line}: ${CMAKE_MATCH_1} does not exist")
      endif()
      continue()
    elseif(kind MATCHES "^excerpt (.+)$")
      check_excerpt("${body}" "${CMAKE_MATCH_1}" ${line})
      continue()
    elseif(NOT kind MATCHES "^(function|task)$")
      string(APPEND failures "\n  ${doc_name}:${line}: unknown check kind '${kind}'")
      continue()
    endif()
    if(needs STREQUAL "nccl" AND NOT CHECK_HAS_NCCL)
      list(APPEND skipped "${doc_name}:${line} (needs NCCL)")
      continue()
    elseif(NOT needs STREQUAL "" AND NOT needs STREQUAL "nccl")
      string(APPEND failures "\n  ${doc_name}:${line}: unknown need '${needs}'")
      continue()
    endif()
    if(needs STREQUAL "nccl")
      set(use_nccl TRUE)
    endif()
    if(kind STREQUAL "task")
      set(open "[[maybe_unused]] cudawait::task<void> readme_block(${params}) {")
      set(close_body "    co_return;\n}")
    else()
      set(open "[[maybe_unused]] void readme_block(${params}) {")
      set(close_body "}")
    endif()
    string(APPEND units "namespace readme_block_${index} {\n${befores}${open}\n"
      "#line ${line} \"${doc_path}\"\n${body}\n${close_body}\n} // namespace readme_block_${index}\n\n")
    math(EXPR compiled "${compiled} + 1")
  endwhile()
endforeach()

list(REMOVE_DUPLICATES skipped)
foreach(s IN LISTS skipped)
  message(STATUS "not compiled: ${s}")
endforeach()

if(compiled GREATER 0)
  from_line("${includes}" includes)
  set(nccl_include "")
  if(use_nccl)
    set(nccl_include "#include <cudawait/nccl.hpp>\n")
  endif()
  set(src "${WORK_DIR}/readme_snippets.cu")
  file(WRITE "${src}" "// Generated by tests/readme_snippets.cmake from the C++ blocks of README.md and docs/*.md.
#include <cudawait/cudawait.hpp>
${nccl_include}${includes}
#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <utility>
#include <vector>

using namespace std::chrono_literals;

${units}")
  set(include_args "")
  foreach(dir IN LISTS CHECK_INCLUDE_DIRS)
    if(dir)
      list(APPEND include_args "-I${dir}")
    endif()
  endforeach()
  if(CHECK_HAS_NCCL AND CHECK_NCCL_INCLUDE_DIR)
    list(APPEND include_args "-I${CHECK_NCCL_INCLUDE_DIR}")
  endif()
  set(ccbin_args "")
  if(CHECK_CUDA_HOST_COMPILER)
    set(ccbin_args -ccbin "${CHECK_CUDA_HOST_COMPILER}")
  endif()
  execute_process(COMMAND "${CHECK_NVCC}" ${ccbin_args} -std=c++20 ${include_args}
      -c "${src}" -o "${WORK_DIR}/readme_snippets.o"
    RESULT_VARIABLE status OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT status STREQUAL "0")
    set(compile_output "${out}")
    string(APPEND failures "\n  the blocks do not compile (${src}), nvcc said:")
  else()
    message(STATUS "README.md and docs/*.md (${pages} pages): ${compiled} C++ blocks compiled (${src})")
  endif()
endif()

if(failures)
  message(FATAL_ERROR "C++ blocks of README.md and docs/*.md:${failures}\n${compile_output}")
endif()
