// SPDX-License-Identifier: Apache-2.0
#pragma once

// Synopsis
//   trace_range r("h2d", chunk);        an NVTX push/pop range in the "cudawait" domain, on this
//                                       thread until r ends: no co_await while r lives
//   trace_async_range w("wait", chunk); an NVTX start/end range: may span co_await
//
// CUDAWAIT_DISABLE_NVTX may differ between the files of one program: no type, layout or inline
// function here depends on it. See docs/observe.md#cudawait_disable_nvtx.

#include <atomic>
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

/// The calls that open and close ranges in a tracer (NVTX's "cudawait" domain).
struct trace_calls {
    std::uint64_t (*start)(const char* what, std::size_t index) noexcept;
    void (*end)(std::uint64_t id) noexcept;
    void (*push)(const char* what, std::size_t index) noexcept;
    void (*pop)() noexcept;
};

/// The program's tracer: null until a file that includes NVTX starts (then NVTX's calls).
inline std::atomic<const trace_calls*> g_trace_calls{nullptr};

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

static_assert(sizeof(nvtxRangeId_t) == sizeof(std::uint64_t));

inline std::uint64_t nvtx_trace_start(const char* what, std::size_t index) noexcept {
    nvtxEventAttributes_t attr = trace_attributes(what, index);
    return nvtxDomainRangeStartEx(trace_domain(), &attr);
}
inline void nvtx_trace_end(std::uint64_t id) noexcept { nvtxDomainRangeEnd(trace_domain(), id); }
inline void nvtx_trace_push(const char* what, std::size_t index) noexcept {
    nvtxEventAttributes_t attr = trace_attributes(what, index);
    nvtxDomainRangePushEx(trace_domain(), &attr);
}
inline void nvtx_trace_pop() noexcept { nvtxDomainRangePop(trace_domain()); }

/// NVTX as the program's tracer.
inline constexpr trace_calls nvtx_trace_calls{&nvtx_trace_start, &nvtx_trace_end, &nvtx_trace_push,
                                              &nvtx_trace_pop};

// Installs NVTX at this file's static initialisation. Internal linkage: the one thing that
// differs between files with and without NVTX is a variable no other file can name.
[[maybe_unused]] static const bool g_nvtx_trace_installed =
    (g_trace_calls.store(&nvtx_trace_calls, std::memory_order_release), true);
#endif
} // namespace detail

/// A scoped NVTX push/pop range in the "cudawait" domain: message `what` (a string that outlives
/// the range, such as a literal), payload `index`. It must not span a suspension (co_await):
/// use trace_async_range there.
class trace_range {
public:
    explicit trace_range(const char* what, std::size_t index) noexcept
        : m_calls(detail::g_trace_calls.load(std::memory_order_acquire)) {
        if (m_calls != nullptr) {
            m_calls->push(what, index);
        }
    }
    trace_range(const trace_range&) = delete;
    trace_range& operator=(const trace_range&) = delete;
    ~trace_range() {
        if (m_calls != nullptr) {
            m_calls->pop();
        }
    }

private:
    const detail::trace_calls* m_calls; // the tracer that opened the range closes it
};

/// A scoped NVTX start/end range in the "cudawait" domain: message `what` (a string that
/// outlives the range, such as a literal), payload `index`. It ends by its own id, so it may
/// span co_await while other coroutines open and close ranges on the same thread, and may end
/// on another thread.
class trace_async_range {
public:
    explicit trace_async_range(const char* what, std::size_t index) noexcept
        : m_calls(detail::g_trace_calls.load(std::memory_order_acquire)) {
        if (m_calls != nullptr) {
            m_id = m_calls->start(what, index);
        }
    }
    trace_async_range(const trace_async_range&) = delete;
    trace_async_range& operator=(const trace_async_range&) = delete;
    ~trace_async_range() {
        if (m_calls != nullptr) {
            m_calls->end(m_id);
        }
    }

private:
    const detail::trace_calls* m_calls; // the tracer that opened the range closes it
    std::uint64_t m_id = 0;
};

} // namespace cudawait
