// SPDX-License-Identifier: Apache-2.0
#pragma once

// The part of event.hpp that streams need, below stream.hpp: the per-device event_pool. Include
// <cudawait/runtime/event.hpp>, which includes this.

#include <cudawait/runtime/detail/fork_guard.hpp>
#include <cudawait/runtime/device.hpp>
#include <cudawait/runtime/error.hpp>

#include <atomic>
#include <cstddef>
#include <mutex>
#include <vector>

#include <cuda_runtime_api.h>

namespace cudawait {

namespace detail {
/// Events created by the library and not yet destroyed (leak checks in tests).
inline std::atomic<long> g_live_events{0};
} // namespace detail

class pooled_event;

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
    /// for_device() are templates (of an unused parameter; acquire's names the type it returns,
    /// which event.hpp defines): instantiated only where used.
    /// @throws cuda_error
    template <class Pooled = pooled_event>
    [[nodiscard]] Pooled acquire() {
        return Pooled(this, acquire_raw());
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

} // namespace cudawait
