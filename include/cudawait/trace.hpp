// SPDX-License-Identifier: Apache-2.0
#pragma once

// Synopsis
//   trace_range r("h2d", chunk);    an NVTX range "cudawait h2d 12" on this thread until r ends
//
// NVTX3 is header-only; the ranges cost nothing unless a profiler (Nsight Systems) is attached.
// Define CUDAWAIT_DISABLE_NVTX to compile them out altogether; without the NVTX3 headers on the
// include path they are compiled out as well.

#include <cstddef>
#include <cstdio>

#if !defined(CUDAWAIT_DISABLE_NVTX) && __has_include(<nvtx3/nvToolsExt.h>)
#include <nvtx3/nvToolsExt.h>
#define CUDAWAIT_HAS_NVTX 1
#else
#define CUDAWAIT_HAS_NVTX 0
#endif

namespace cudawait {

/// A scoped NVTX range named "cudawait <what> <index>".
class trace_range {
public:
    explicit trace_range(const char* what, std::size_t index) noexcept {
#if CUDAWAIT_HAS_NVTX
        char name[64];
        std::snprintf(name, sizeof name, "cudawait %s %zu", what, index);
        nvtxRangePushA(name);
#else
        (void)what;
        (void)index;
#endif
    }
    trace_range(const trace_range&) = delete;
    trace_range& operator=(const trace_range&) = delete;
    ~trace_range() {
#if CUDAWAIT_HAS_NVTX
        nvtxRangePop();
#endif
    }
};

} // namespace cudawait
