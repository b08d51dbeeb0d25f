// SPDX-License-Identifier: Apache-2.0
#pragma once

// detail::idle_watch: the scheduler's host-function sentinels, a private stream per watched wait
// that waits for its event and then runs a host function that wakes the loop.
// See docs/core.md#poll-policies.

#include <cudawait/runtime/detail/fork_guard.hpp>
#include <cudawait/runtime/error.hpp>

#include <cstddef>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>

namespace cudawait::detail {

/// Makes a stream for a sentinel of `device`, restoring the current device: non-blocking (the
/// legacy default stream must not order it) and of the lowest priority (its only work is a
/// wait and a signal: a host function, or a write to a doorbell word). Returns the status.
template <class = void>
cudaError_t make_sentinel_stream(int device, cudaStream_t& out) noexcept {
    int previous = 0;
    if (cudaError_t st = cudaGetDevice(&previous); st != cudaSuccess) {
        return st;
    }
    if (previous != device) {
        if (cudaError_t st = cudaSetDevice(device); st != cudaSuccess) {
            return st;
        }
    }
    int least = 0;
    int greatest = 0;
    cudaError_t st = cudaDeviceGetStreamPriorityRange(&least, &greatest);
    if (st == cudaSuccess) {
        st = cudaStreamCreateWithPriority(&out, cudaStreamNonBlocking, least);
    }
    if (previous != device) {
        report(cudaSetDevice(previous), "cudaSetDevice");
    }
    return st;
}

/// Sentinels that wake their owner when an awaited event completes. Owner's thread only, except
/// for the host functions it launches. A class template (of an unused parameter, always void) so
/// that only a translation unit that arms one instantiates its members; spelled idle_watch.
template <class Unused = void>
class basic_idle_watch {
public:
    /// Called from a CUDA-internal thread when a watched event completed; must not call CUDA.
    using wake_fn = void (*)(void* context) noexcept;

    /// Sentinels in flight at most; past that the owner polls (each holds a stream).
    static constexpr std::size_t max_armed = 64;

    basic_idle_watch(wake_fn wake, void* context) noexcept : m_wake(wake), m_context(context) {}
    basic_idle_watch(const basic_idle_watch&) = delete;
    basic_idle_watch& operator=(const basic_idle_watch&) = delete;
    ~basic_idle_watch() {
        // In a forked child the streams are the parent's, no host function will run, and the
        // target's mutex may have been held by the parent's CUDA thread at the fork: touch none.
        if (!m_target || m_stamp.inherited()) {
            return;
        }
        {
            std::lock_guard lock(m_target->mutex);
            m_target->wake = nullptr;
            m_target->free.clear();
        }
        for (const sentinel_stream& s : m_streams) {
            report(cudaStreamDestroy(s.stream), "cudaStreamDestroy");
        }
    }

    /// Arms a sentinel that wakes the owner once the work `ev` captured so far completed.
    /// `device`: where its stream lives (the event's device; -1: the current device). Returns
    /// cudaSuccess, cudaErrorNotReady when max_armed sentinels are in flight, or the failing
    /// call's error (the sticky last error cleared); the owner then polls instead.
    cudaError_t arm(cudaEvent_t ev, int device) noexcept {
        if (m_stamp.inherited()) {
            return cudaErrorNotPermitted;
        }
        try {
            if (!m_target) {
                m_target = std::make_shared<target>();
                m_target->wake = m_wake;
                m_target->context = m_context;
            }
            if (device < 0) {
                if (cudaError_t st = cudaGetDevice(&device); st != cudaSuccess) {
                    return failed(st);
                }
            }
            cudaStream_t s = take_stream(device);
            if (s == nullptr && armed_count() >= max_armed) {
                return cudaErrorNotReady;
            }
            if (s == nullptr) {
                if (cudaError_t st = create_stream(device, s); st != cudaSuccess) {
                    return failed(st);
                }
            }
            if (cudaError_t st = cudaStreamWaitEvent(s, ev, 0); st != cudaSuccess) {
                give_back(device, s);
                return failed(st);
            }
            auto* tok = new token{m_target, device, s};
            {
                std::lock_guard lock(m_target->mutex);
                ++m_target->armed;
            }
            if (cudaError_t st = cudaLaunchHostFunc(s, &basic_idle_watch::fired, tok);
                st != cudaSuccess) {
                {
                    std::lock_guard lock(m_target->mutex);
                    --m_target->armed;
                }
                delete tok;
                // The stream still waits for `ev`: not reused (a later sentinel behind that wait
                // would be late), destroyed with the others.
                return failed(st);
            }
            return cudaSuccess;
        } catch (...) {
            return cudaErrorMemoryAllocation;
        }
    }

    /// Sentinels armed whose host function has not run yet.
    [[nodiscard]] std::size_t armed_count() const {
        if (!m_target) {
            return 0;
        }
        std::lock_guard lock(m_target->mutex);
        return m_target->armed;
    }
    /// Private streams made so far (each is reused once its host function ran).
    [[nodiscard]] std::size_t stream_count() const noexcept { return m_streams.size(); }

private:
    struct sentinel_stream {
        int device = 0;
        cudaStream_t stream = nullptr;
    };
    /// Shared by the owner and its host functions in flight.
    struct target {
        std::mutex mutex;
        wake_fn wake = nullptr; ///< null once the owner is gone
        void* context = nullptr;
        std::vector<sentinel_stream> free; ///< streams whose host function ran
        std::size_t armed = 0;
    };
    /// One armed sentinel: what its host function needs. Deleted by the host function.
    struct token {
        std::shared_ptr<target> shared;
        int device;
        cudaStream_t stream;
    };

    static void CUDART_CB fired(void* p) noexcept {
        auto* tok = static_cast<token*>(p);
        {
            std::lock_guard lock(tok->shared->mutex);
            --tok->shared->armed;
            if (tok->shared->wake != nullptr) {
                try {
                    tok->shared->free.push_back({tok->device, tok->stream});
                } catch (...) {
                    // Not reused; the owner destroys it with the others.
                }
                tok->shared->wake(tok->shared->context);
            }
        }
        delete tok;
    }

    cudaStream_t take_stream(int device) {
        std::lock_guard lock(m_target->mutex);
        std::vector<sentinel_stream>& free = m_target->free;
        for (std::size_t i = 0; i < free.size(); ++i) {
            if (free[i].device == device) {
                cudaStream_t s = free[i].stream;
                free[i] = free.back();
                free.pop_back();
                return s;
            }
        }
        return nullptr;
    }
    void give_back(int device, cudaStream_t s) {
        std::lock_guard lock(m_target->mutex);
        m_target->free.push_back({device, s});
    }
    cudaError_t create_stream(int device, cudaStream_t& s) {
        m_streams.reserve(m_streams.size() + 1); // no throw once the stream exists
        const cudaError_t st = make_sentinel_stream(device, s);
        if (st == cudaSuccess) {
            m_streams.push_back({device, s});
        }
        return st;
    }
    static cudaError_t failed(cudaError_t st) noexcept {
        (void)cudaGetLastError(); // the owner falls back to polling, which reports what matters
        return st;
    }

    wake_fn m_wake;
    void* m_context;
    std::shared_ptr<target> m_target;       ///< made on the first arm
    std::vector<sentinel_stream> m_streams; ///< every stream made, destroyed with the watch
    fork_stamp m_stamp;                     ///< the process whose context owns the streams
};

using idle_watch = basic_idle_watch<>;

} // namespace cudawait::detail
