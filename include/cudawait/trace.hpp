// SPDX-License-Identifier: Apache-2.0
#pragma once

// Synopsis
//   trace_range r("h2d", chunk);        an NVTX push/pop range "h2d" in the "cudawait" domain,
//                                       the chunk index as its payload, on this thread until r
//                                       ends; for code that does not suspend while r lives
//   trace_async_range w("wait", chunk); an NVTX start/end range: may span co_await, and may end
//                                       on another thread than it started on
//
// A push/pop range belongs to its thread's stack: a pop closes whatever range the thread pushed
// last. Held across a suspension, a trace_range would be closed by the pop of another coroutine
// that ran on the thread meanwhile, and a profiler would show both mis-nested. So a range that
// spans a co_await is a trace_async_range, which ends by the id its start returned; trace_range
// is for the synchronous stretches between suspensions, where it nests with the ranges around
// it on the thread's timeline.
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

namespace detail {
#if CUDAWAIT_HAS_NVTX
/// The "cudawait" NVTX domain, created on first use.
inline nvtxDomainHandle_t trace_domain() noexcept {
    static const nvtxDomainHandle_t d = nvtxDomainCreateA("cudawait");
    return d;
}

/// Message `what`, payload `index`.
inline nvtxEventAttributes_t trace_attributes(const char* what, std::size_t index) noexcept {
    nvtxEventAttributes_t attr{};
    attr.version = NVTX_VERSION;
    attr.size = NVTX_EVENT_ATTRIB_STRUCT_SIZE;
    attr.messageType = NVTX_MESSAGE_TYPE_ASCII;
    attr.message.ascii = what;
    attr.payloadType = NVTX_PAYLOAD_TYPE_UNSIGNED_INT64;
    attr.payload.ullValue = static_cast<std::uint64_t>(index);
    return attr;
}
#endif
} // namespace detail

/// A scoped NVTX push/pop range in the "cudawait" domain: message `what` (a string that outlives
/// the range, such as a literal), payload `index`. It must not span a suspension (co_await):
/// use trace_async_range there.
class trace_range {
public:
    explicit trace_range(const char* what, std::size_t index) noexcept {
#if CUDAWAIT_HAS_NVTX
        nvtxEventAttributes_t attr = detail::trace_attributes(what, index);
        nvtxDomainRangePushEx(detail::trace_domain(), &attr);
#else
        (void)what;
        (void)index;
#endif
    }
    trace_range(const trace_range&) = delete;
    trace_range& operator=(const trace_range&) = delete;
    ~trace_range() {
#if CUDAWAIT_HAS_NVTX
        nvtxDomainRangePop(detail::trace_domain());
#endif
    }
};

/// A scoped NVTX start/end range in the "cudawait" domain: message `what` (a string that
/// outlives the range, such as a literal), payload `index`. It ends by its own id, so it may
/// span co_await while other coroutines open and close ranges on the same thread, and may end
/// on another thread.
class trace_async_range {
public:
    explicit trace_async_range(const char* what, std::size_t index) noexcept {
#if CUDAWAIT_HAS_NVTX
        nvtxEventAttributes_t attr = detail::trace_attributes(what, index);
        m_id = nvtxDomainRangeStartEx(detail::trace_domain(), &attr);
#else
        (void)what;
        (void)index;
#endif
    }
    trace_async_range(const trace_async_range&) = delete;
    trace_async_range& operator=(const trace_async_range&) = delete;
    ~trace_async_range() {
#if CUDAWAIT_HAS_NVTX
        nvtxDomainRangeEnd(detail::trace_domain(), m_id);
#endif
    }

private:
#if CUDAWAIT_HAS_NVTX
    nvtxRangeId_t m_id = 0;
#endif
};

} // namespace cudawait
