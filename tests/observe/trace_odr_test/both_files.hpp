// SPDX-License-Identifier: Apache-2.0
#pragma once

// What the two files of trace_odr_test define for each other. with_nvtx.cpp includes trace.hpp
// with the NVTX3 headers, without_nvtx.cpp with CUDAWAIT_DISABLE_NVTX defined first.

#include <cudawait/observe/trace.hpp>

#include <cstddef>
#include <memory>

namespace cudawait::trace_odr {

/// The ranges' layout and the NVTX switch as one file's compiler saw them.
struct layout {
    std::size_t range_size = 0;
    std::size_t range_align = 0;
    std::size_t async_range_size = 0;
    std::size_t async_range_align = 0;
    bool has_nvtx = false;
};

layout layout_with_nvtx();
layout layout_without_nvtx();

/// Opens and closes, in without_nvtx.cpp: a trace_range `index`, a trace_async_range
/// `index + 1` on the stack, and one `index + 2` on the heap.
void ranges_without_nvtx(std::size_t index);
/// Starts a trace_async_range in without_nvtx.cpp, for the caller to end.
std::unique_ptr<trace_async_range> start_without_nvtx(std::size_t index);
/// Ends, in without_nvtx.cpp, a range the caller started.
void end_without_nvtx(std::unique_ptr<trace_async_range> r);

} // namespace cudawait::trace_odr
