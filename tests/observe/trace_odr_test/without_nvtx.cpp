// SPDX-License-Identifier: Apache-2.0
// The file of trace_odr_test that compiles NVTX out: it defines CUDAWAIT_DISABLE_NVTX before
// including anything, as docs/observe.md#cudawait_disable_nvtx allows a file to do.
#define CUDAWAIT_DISABLE_NVTX 1

#include <cudawait/observe/trace.hpp>

#include <memory>

#include "both_files.hpp"

namespace cudawait::trace_odr {

layout layout_without_nvtx() {
    return {sizeof(trace_range), alignof(trace_range), sizeof(trace_async_range),
            alignof(trace_async_range), CUDAWAIT_HAS_NVTX != 0};
}

void ranges_without_nvtx(std::size_t index) {
    trace_range r("without nvtx", index);
    trace_async_range a("without nvtx async", index + 1);
    auto h = std::make_shared<trace_async_range>("without nvtx heap", index + 2);
}

std::unique_ptr<trace_async_range> start_without_nvtx(std::size_t index) {
    return std::make_unique<trace_async_range>("started without nvtx", index);
}

void end_without_nvtx(std::unique_ptr<trace_async_range> r) { r.reset(); }

} // namespace cudawait::trace_odr
