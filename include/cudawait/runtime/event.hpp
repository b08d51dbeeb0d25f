// SPDX-License-Identifier: Apache-2.0
#pragma once

// Synopsis
//   class event;        owning cudaEvent_t (timing disabled unless asked)
//   class event_pool;   per-device cache of recycled cudaEventDisableTiming events
//   class pooled_event; an event borrowed from a pool, given back when it goes out of scope
//   class event_ref;    trivially copyable view of any of the above or of a raw cudaEvent_t
//   e.record(stream)  e.is_done()  e.sync()   on event, pooled_event and event_ref
//   concept event_like<T>;  native_event(x)   an event type of another library
//
// `co_await ev` resumes once the work captured by the event's last record finished. See
// docs/runtime.md#events.

#include <cudawait/runtime/detail/event_pool.hpp>
#include <cudawait/runtime/detail/refs.hpp>
#include <cudawait/runtime/device.hpp>
#include <cudawait/runtime/error.hpp>
#include <cudawait/runtime/stream.hpp>

#include <atomic>
#include <concepts>
#include <cstddef>
#include <source_location>
#include <type_traits>
#include <utility>

#include <cuda_runtime_api.h>

namespace cudawait {

/// An owning CUDA event. Move-only; using a moved-from event throws `usage_error`.
class event : public detail::event_ops<event> {
public:
    /// Events made for waiting skip timing (cheaper to record and query).
    static constexpr unsigned default_flags = cudaEventDisableTiming;

    /// Creates an event on `dev` (a device_ref or a plain device id) with `flags`
    /// (cudaEventDefault for a timing event).
    /// @throws cuda_error
    explicit event(device_ref dev, unsigned flags = default_flags,
                   std::source_location where = std::source_location::current()) {
        device_guard guard(dev, where);
        check(cudaEventCreateWithFlags(&m_handle, flags), "cudaEventCreateWithFlags", where);
        detail::g_live_events.fetch_add(1, std::memory_order_relaxed);
    }
    /// Creates a timing-disabled event on the current device.
    /// @throws cuda_error
    explicit event(std::source_location where = std::source_location::current())
        : event(current_device(where), default_flags, where) {}

    event(const event&) = delete;
    event& operator=(const event&) = delete;
    event(event&& other) noexcept : m_handle(std::exchange(other.m_handle, nullptr)) {}
    event& operator=(event&& other) noexcept {
        if (this != &other) {
            destroy();
            m_handle = std::exchange(other.m_handle, nullptr);
        }
        return *this;
    }
    ~event() { destroy(); }

    /// Takes ownership of `handle`.
    /// @throws usage_error for a null handle
    [[nodiscard]] static event from_native_handle(cudaEvent_t handle) {
        if (handle == nullptr) {
            throw usage_error("event::from_native_handle: null handle");
        }
        detail::g_live_events.fetch_add(1, std::memory_order_relaxed);
        return event(adopt, handle);
    }
    /// Gives up ownership: the caller destroys the returned handle.
    [[nodiscard]] cudaEvent_t release() noexcept {
        if (m_handle != nullptr) {
            detail::g_live_events.fetch_sub(1, std::memory_order_relaxed);
        }
        return std::exchange(m_handle, nullptr);
    }

    /// @throws usage_error on a moved-from event
    [[nodiscard]] cudaEvent_t get() const {
        if (m_handle == nullptr) {
            throw usage_error("cudawait::event used after it was moved from or released");
        }
        return m_handle;
    }
    [[nodiscard]] explicit operator bool() const noexcept { return m_handle != nullptr; }

    // record / is_done / sync: detail::event_ops, through get().

    /// Events owned by the library and not yet destroyed (pooled ones included).
    [[nodiscard]] static long live_count() noexcept {
        return detail::g_live_events.load(std::memory_order_relaxed);
    }

private:
    // A tag, not a plain cudaEvent_t parameter: `event e(0)` must pick the device constructor,
    // and 0 converts to a null handle more readily than to a device_ref.
    struct adopt_t {};
    static constexpr adopt_t adopt{};
    event(adopt_t, cudaEvent_t adopted) noexcept : m_handle(adopted) {}
    void destroy() noexcept {
        if (m_handle != nullptr) {
            detail::report(cudaEventDestroy(m_handle), "cudaEventDestroy");
            detail::g_live_events.fetch_sub(1, std::memory_order_relaxed);
            m_handle = nullptr;
        }
    }
    cudaEvent_t m_handle = nullptr;
};

/// An event borrowed from an `event_pool`; returned to it on destruction. Move-only.
class pooled_event : public detail::event_ops<pooled_event> {
public:
    pooled_event() noexcept = default;
    pooled_event(const pooled_event&) = delete;
    pooled_event& operator=(const pooled_event&) = delete;
    pooled_event(pooled_event&& o) noexcept
        : m_pool(std::exchange(o.m_pool, nullptr)), m_handle(std::exchange(o.m_handle, nullptr)) {}
    pooled_event& operator=(pooled_event&& o) noexcept {
        if (this != &o) {
            reset();
            m_pool = std::exchange(o.m_pool, nullptr);
            m_handle = std::exchange(o.m_handle, nullptr);
        }
        return *this;
    }
    ~pooled_event() { reset(); }

    /// @throws usage_error when empty
    [[nodiscard]] cudaEvent_t get() const {
        if (m_handle == nullptr) {
            throw usage_error("cudawait::pooled_event is empty");
        }
        return m_handle;
    }
    [[nodiscard]] explicit operator bool() const noexcept { return m_handle != nullptr; }

    // record / is_done / sync: detail::event_ops, through get().

    /// Gives the event back to its pool now.
    inline void reset() noexcept;

private:
    friend class event_pool;
    pooled_event(event_pool* pool, cudaEvent_t h) noexcept : m_pool(pool), m_handle(h) {}
    event_pool* m_pool = nullptr;
    cudaEvent_t m_handle = nullptr;
};

inline event_ref::event_ref(const event& e) : m_handle(e.get()) {}
inline event_ref::event_ref(const pooled_event& e) : m_handle(e.get()) {}

inline void pooled_event::reset() noexcept {
    if (m_pool != nullptr && m_handle != nullptr) {
        m_pool->release_raw(m_handle);
    }
    m_pool = nullptr;
    m_handle = nullptr;
}

} // namespace cudawait
