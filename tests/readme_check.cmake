# SPDX-License-Identifier: Apache-2.0
# readme.example_is_built (tests/CMakeLists.txt), run in script mode:
#   cmake -DREADME=<README.md> -DEXAMPLE=<examples/readme_example.cu> -P readme_check.cmake
# The README's first ```cpp block must be EXAMPLE word for word, apart from the file's SPDX line:
# the example that is built and run (example.readme) is the one the README shows.
cmake_minimum_required(VERSION 3.25)

file(READ "${README}" readme)
file(READ "${EXAMPLE}" example)

string(FIND "${readme}" "```cpp\n" open)
if(open EQUAL -1)
  message(FATAL_ERROR "${README} has no ```cpp block")
endif()
math(EXPR start "${open} + 7")
string(SUBSTRING "${readme}" ${start} -1 rest)
string(FIND "${rest}" "```" close)
if(close EQUAL -1)
  message(FATAL_ERROR "the first ```cpp block of ${README} is not closed")
endif()
string(SUBSTRING "${rest}" 0 ${close} block)

string(REGEX REPLACE "^// SPDX-License-Identifier:[^\n]*\n" "" example "${example}")

if(NOT block STREQUAL example)
  # Name the first line that differs.
  string(REPLACE ";" "\\;" block_lines "${block}")
  string(REPLACE ";" "\\;" example_lines "${example}")
  string(REPLACE "\n" ";" block_lines "${block_lines}")
  string(REPLACE "\n" ";" example_lines "${example_lines}")
  list(LENGTH block_lines nb)
  list(LENGTH example_lines ne)
  set(line 0)
  while(line LESS nb AND line LESS ne)
    list(GET block_lines ${line} b)
    list(GET example_lines ${line} e)
    if(NOT b STREQUAL e)
      break()
    endif()
    math(EXPR line "${line} + 1")
  endwhile()
  math(EXPR shown "${line} + 1")
  set(b "<end of block>")
  set(e "<end of file>")
  if(line LESS nb)
    list(GET block_lines ${line} b)
  endif()
  if(line LESS ne)
    list(GET example_lines ${line} e)
  endif()
  message(FATAL_ERROR "README.md's first ```cpp block differs from ${EXAMPLE} at line ${shown} "
    "of the block:\n  README:  ${b}\n  example: ${e}\n"
    "Keep them identical (the example file has an SPDX line first, which the README leaves out).")
endif()
message(STATUS "README.md's first example is ${EXAMPLE}")
