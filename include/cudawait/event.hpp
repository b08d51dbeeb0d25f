// SPDX-License-Identifier: Apache-2.0
#pragma once

// Synopsis
//   class event;        owning cudaEvent_t (timing disabled unless asked)
//   class event_pool;   per-device cache of recycled cudaEventDisableTiming events (for_device
//                       throws usage_error in a child made by fork() after the parent used it)
//   class pooled_event; an event borrowed from a pool, given back when it goes out of scope
//   class event_ref;    trivially copyable view of any of the above or of a raw cudaEvent_t
//   e.record(stream)  e.is_done()  e.sync()   on event, pooled_event and event_ref
//                                             (ready(): the older name of is_done())
//   concept event_like<T>; an event type of another library (cuda::event_ref, ...): a class
//                       explicitly convertible to cudaEvent_t, or one with .event() or .get()
//                       returning it
//   native_event(x)     the cudaEvent_t of an event_like x
//
// Inside a task, `co_await ev` resumes once the work captured by the event's last record
// finished (scheduler.hpp); `ev` may be any event_like type, and event_ref(x) views one.

#include <cudawait/device.hpp>
#include <cudawait/error.hpp>
#include <cudawait/stream.hpp>

#include <cudawait/detail/event_ops.hpp>
#include <cudawait/detail/fork_guard.hpp>

#include <atomic>
#include <concepts>
#include <cstddef>
#include <memory>
#include <mutex>
#include <source_location>
#include <type_traits>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>

namespace cudawait {

namespace detail {
template <class T>
concept has_event_member = requires(const T& t) {
    requires std::same_as<std::remove_cvref_t<decltype(t.event())>, cudaEvent_t>;
};
template <class T>
concept has_event_get = requires(const T& t) {
    requires std::same_as<std::remove_cvref_t<decltype(t.get())>, cudaEvent_t>;
};
// Class types only: a void* or a nullptr would otherwise pass for an event through static_cast.
template <class T>
concept converts_to_event = std::is_class_v<T> && requires(const T& t) {
    static_cast<cudaEvent_t>(t);
};
} // namespace detail

/// An event type of another library, or cudaEvent_t itself: a class explicitly convertible to
/// cudaEvent_t, or one whose `.event()` or `.get()` returns one (asked in that order, the
/// specific name first as for stream_like; cuda::event_ref has `.get()`).
template <class T>
concept event_like = std::same_as<std::remove_cvref_t<T>, cudaEvent_t> ||
    detail::converts_to_event<std::remove_cvref_t<T>> ||
    detail::has_event_member<std::remove_cvref_t<T>> ||
    detail::has_event_get<std::remove_cvref_t<T>>;

/// The cudaEvent_t that `x` names (see event_like for the order in which it is asked).
/// @throws what x's accessor throws (cudawait::event: usage_error when moved from)
template <event_like E>
[[nodiscard]] constexpr cudaEvent_t native_event(const E& x) {
    using plain = std::remove_cvref_t<E>;
    if constexpr (std::same_as<plain, cudaEvent_t> || detail::converts_to_event<plain>) {
        return static_cast<cudaEvent_t>(x);
    } else if constexpr (detail::has_event_member<plain>) {
        return x.event();
    } else {
        return x.get();
    }
}

namespace detail {
/// Events created by the library and not yet destroyed (leak checks in tests).
inline std::atomic<long> g_live_events{0};
} // namespace detail

/// An owning CUDA event. Move-only; using a moved-from event throws `usage_error`.
class event : public detail::event_ops<event> {
public:
    /// Events made for waiting skip timing (cheaper to record and query).
    static constexpr unsigned default_flags = cudaEventDisableTiming;

    /// Creates an event on `dev` with `flags` (cudaEventDefault for a timing event).
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
        return event(handle);
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

    // record / is_done / ready / sync: detail::event_ops, through get().

    /// Events owned by the library and not yet destroyed (pooled ones included).
    [[nodiscard]] static long live_count() noexcept {
        return detail::g_live_events.load(std::memory_order_relaxed);
    }

private:
    explicit event(cudaEvent_t adopted) noexcept : m_handle(adopted) {}
    void destroy() noexcept {
        if (m_handle != nullptr) {
            detail::report(cudaEventDestroy(m_handle), "cudaEventDestroy");
            detail::g_live_events.fetch_sub(1, std::memory_order_relaxed);
            m_handle = nullptr;
        }
    }
    cudaEvent_t m_handle = nullptr;
};

class event_pool;

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

    // record / is_done / ready / sync: detail::event_ops, through get().

    /// Gives the event back to its pool now.
    inline void reset() noexcept;

private:
    friend class event_pool;
    pooled_event(event_pool* pool, cudaEvent_t h) noexcept : m_pool(pool), m_handle(h) {}
    event_pool* m_pool = nullptr;
    cudaEvent_t m_handle = nullptr;
};

/// A cache of timing-disabled events for one device. Event creation costs ~0.5 us and
/// serialises inside the driver, so events used for waiting are recycled instead.
///
/// Thread-safe; no CUDA call is made under the pool's lock.
class event_pool {
public:
    /// The process-wide pool of device `dev`.
    /// @throws cuda_error for an invalid device; usage_error in a child process created by
    ///         fork() after the pools were made (their events belong to the parent's CUDA
    ///         context, which a child cannot use)
    template <class = void>
    [[nodiscard]] static event_pool& for_device(int dev) {
        static const device_pools pools;
        if (pools.count > 0 && pools.pools[0]->m_stamp.inherited()) {
            throw usage_error("cudawait::event_pool::for_device used in a child process after "
                              "fork(); CUDA state cannot be inherited: use CUDA in the child "
                              "only if the parent did not, or exec a new program");
        }
        if (dev < 0 || dev >= pools.count) {
            throw cuda_error(cudaErrorInvalidDevice, "event_pool::for_device");
        }
        return *pools.pools[dev];
    }

    event_pool(const event_pool&) = delete;
    event_pool& operator=(const event_pool&) = delete;
    ~event_pool() {
        if (m_stamp.inherited()) {
            return; // a forked child exiting: the events are the parent's, not to be touched
        }
        for (cudaEvent_t e : m_free) {
            detail::report(cudaEventDestroy(e), "cudaEventDestroy");
            detail::g_live_events.fetch_sub(1, std::memory_order_relaxed);
        }
    }

    /// Borrows an event, creating one when the cache is empty. This member, the next two and
    /// for_device() are templates (of an unused parameter): instantiated only where used.
    /// @throws cuda_error
    template <class = void>
    [[nodiscard]] pooled_event acquire() {
        return pooled_event(this, acquire_raw());
    }

    /// Raw form of acquire() for the scheduler's intrusive bookkeeping; pair with release_raw.
    /// @throws cuda_error
    template <class = void>
    [[nodiscard]] cudaEvent_t acquire_raw() {
        {
            std::lock_guard lock(m_mutex);
            ++m_outstanding;
            if (!m_free.empty()) {
                cudaEvent_t e = m_free.back();
                m_free.pop_back();
                return e;
            }
        }
        cudaEvent_t e = nullptr;
        try {
            device_guard guard{device_ref{m_device}};
            check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreateWithFlags");
        } catch (...) {
            std::lock_guard lock(m_mutex);
            --m_outstanding;
            throw;
        }
        detail::g_live_events.fetch_add(1, std::memory_order_relaxed);
        return e;
    }
    /// Gives back an event from acquire_raw(). Its last record must be complete or abandoned
    /// by every waiter: a later acquire() may record it again.
    template <class = void>
    void release_raw(cudaEvent_t e) noexcept {
        std::lock_guard lock(m_mutex);
        --m_outstanding;
        m_free.push_back(e);
    }

    /// Events borrowed and not yet given back.
    [[nodiscard]] long outstanding() const {
        std::lock_guard lock(m_mutex);
        return m_outstanding;
    }
    /// Events cached for reuse.
    [[nodiscard]] std::size_t cached() const {
        std::lock_guard lock(m_mutex);
        return m_free.size();
    }
    [[nodiscard]] int device() const noexcept { return m_device; }

private:
    explicit event_pool(int dev) : m_device(dev) {}

    // One pool per device, made on first use and destroyed at exit. A plain array rather than a
    // std::vector of std::unique_ptr: every translation unit compiles this function, and those
    // templates' instantiations were a measurable part of its cost.
    struct device_pools {
        device_pools() : count(device_count()) {
            pools = new event_pool*[static_cast<std::size_t>(count)]();
            try {
                for (int i = 0; i < count; ++i) {
                    pools[i] = new event_pool(i);
                }
            } catch (...) {
                release();
                throw;
            }
        }
        device_pools(const device_pools&) = delete;
        device_pools& operator=(const device_pools&) = delete;
        ~device_pools() { release(); }
        void release() noexcept {
            for (int i = 0; i < count; ++i) {
                delete pools[i];
            }
            delete[] pools;
        }

        int count;
        event_pool** pools = nullptr;
    };

    int m_device;
    detail::fork_stamp m_stamp; ///< the process whose CUDA context owns the events
    mutable std::mutex m_mutex;
    std::vector<cudaEvent_t> m_free;
    long m_outstanding = 0;
};

class event_ref;
namespace detail {
/// An event_like type that event_ref's own constructors do not already take.
template <class E>
concept foreign_event = event_like<E> && !std::same_as<std::remove_cvref_t<E>, event_ref> &&
                        !std::same_as<std::remove_cvref_t<E>, cudaEvent_t> &&
                        !std::same_as<std::remove_cvref_t<E>, event> &&
                        !std::same_as<std::remove_cvref_t<E>, pooled_event>;
} // namespace detail

/// A non-owning view of a CUDA event. Inside a task, `co_await ev` resumes once the work the
/// event captured completed; the event must outlive the await.
class event_ref : public detail::event_ops<event_ref> {
public:
    constexpr event_ref(cudaEvent_t handle) noexcept : m_handle(handle) {}
    event_ref(int) = delete;
    event_ref(std::nullptr_t) = delete;
    /// @throws usage_error for a moved-from event
    event_ref(const event& e) : m_handle(e.get()) {}
    /// @throws usage_error for an empty pooled_event
    event_ref(const pooled_event& e) : m_handle(e.get()) {}
    /// Views the event of another library's event type: implicit where that type converts
    /// implicitly to cudaEvent_t, explicit where only a member names the event (an owner such as
    /// a std::unique_ptr<CUevent_st, D> has `.get()` too, and a silent view of a temporary owner
    /// would dangle).
    /// @throws what the type's accessor throws
    template <detail::foreign_event E>
    constexpr explicit(!std::is_convertible_v<const E&, cudaEvent_t>) event_ref(const E& e)
        : m_handle(native_event(e)) {}

    /// The raw handle; never throws (a view has no moved-from state).
    [[nodiscard]] constexpr cudaEvent_t get() const noexcept { return m_handle; }

    // record / is_done / ready / sync: detail::event_ops.

    // Spelled out: a defaulted == would also compare the (empty) event_ops base, which has none.
    friend constexpr bool operator==(event_ref a, event_ref b) noexcept {
        return a.m_handle == b.m_handle;
    }

private:
    cudaEvent_t m_handle;
};

inline void pooled_event::reset() noexcept {
    if (m_pool != nullptr && m_handle != nullptr) {
        m_pool->release_raw(m_handle);
    }
    m_pool = nullptr;
    m_handle = nullptr;
}

} // namespace cudawait
