// SPDX-License-Identifier: Apache-2.0
#pragma once

// Synopsis
//   trace_range r("h2d", chunk);    an NVTX range "h2d" in the "cudawait" domain, with the chunk
//                                   index as its payload, on this thread until r ends
//
// NVTX3 is header-only; without a profiler (Nsight Systems) attached a range costs a call that
// returns at once, and nothing is formatted: the index travels as the payload, so the pipeline's
// per-chunk path pays no string work. Define CUDAWAIT_DISABLE_NVTX to compile the ranges out
// altogether; without the NVTX3 headers on the include path they are compiled out as well.

#include <cstddef>
#include <cstdint>

#if !defined(CUDAWAIT_DISABLE_NVTX) && __has_include(<nvtx3/nvToolsExt.h>)
#include <nvtx3/nvToolsExt.h>
#define CUDAWAIT_HAS_NVTX 1
#else
#define CUDAWAIT_HAS_NVTX 0
#endif

namespace cudawait {

/// A scoped NVTX range in the "cudawait" domain: message `what` (a string that outlives the
/// range, such as a literal), payload `index`.
class trace_range {
public:
    explicit trace_range(const char* what, std::size_t index) noexcept {
#if CUDAWAIT_HAS_NVTX
        nvtxEventAttributes_t attr{};
        attr.version = NVTX_VERSION;
        attr.size = NVTX_EVENT_ATTRIB_STRUCT_SIZE;
        attr.messageType = NVTX_MESSAGE_TYPE_ASCII;
        attr.message.ascii = what;
        attr.payloadType = NVTX_PAYLOAD_TYPE_UNSIGNED_INT64;
        attr.payload.ullValue = static_cast<std::uint64_t>(index);
        nvtxDomainRangePushEx(domain(), &attr);
#else
        (void)what;
        (void)index;
#endif
    }
    trace_range(const trace_range&) = delete;
    trace_range& operator=(const trace_range&) = delete;
    ~trace_range() {
#if CUDAWAIT_HAS_NVTX
        nvtxDomainRangePop(domain());
#endif
    }

private:
#if CUDAWAIT_HAS_NVTX
    static nvtxDomainHandle_t domain() noexcept {
        static const nvtxDomainHandle_t d = nvtxDomainCreateA("cudawait");
        return d;
    }
#endif
};

} // namespace cudawait
