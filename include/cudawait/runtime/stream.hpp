// SPDX-License-Identifier: Apache-2.0
#pragma once

// Synopsis
//   class stream_ref;  trivially copyable view of a cudaStream_t (and cuda::stream_ref)
//   class stream;      owning, non-blocking stream with a priority; synchronised before it is
//                      destroyed; release() / from_native_handle() hand ownership across
//   stream s(dev, priority)   s.is_done()  s.sync()  s.device()  s.priority()
//   s.wait(ev)  s.wait(other)  later work on s waits for an event_like ev, or another stream
//   concept stream_like<T>;  native_stream(x)   a stream type of another library
//
// `co_await s` resumes once all work enqueued on `s` before the await finished. Streams made here
// do not wait for the legacy default stream: order the two with an event. See
// docs/runtime.md#streams.

#include <cudawait/runtime/detail/event_pool.hpp>
#include <cudawait/runtime/detail/refs.hpp>
#include <cudawait/runtime/device.hpp>
#include <cudawait/runtime/error.hpp>

#include <atomic>
#include <concepts>
#include <cstddef>
#include <source_location>
#include <type_traits>
#include <utility>

#include <cuda_runtime_api.h>

namespace cudawait {

namespace detail {
/// Streams created by the library and not yet destroyed (leak checks in tests).
inline std::atomic<long> g_live_streams{0};
} // namespace detail

template <class D>
void detail::stream_ops<D>::wait(stream_ref other, std::source_location where) const {
    const cudaStream_t self = handle();
    // The event is recorded with `other`'s device current; the special handles have no device
    // of their own, so this stream's is used for them.
    const bool special = other.get() == cudaStreamLegacy || other.get() == cudaStreamPerThread;
    int dev = 0;
    check(cudaStreamGetDevice(special ? self : other.get(), &dev), "cudaStreamGetDevice", where);
    device_guard guard(device_ref(dev, where), where);
    // Given back at once: cudaStreamWaitEvent waits for the record made before it, and a later
    // record of the same event does not change what it waits for.
    event_pool& pool = event_pool::for_device(dev);
    const cudaEvent_t ev = pool.acquire_raw();
    const char* api = "cudaEventRecord";
    cudaError_t st = cudaEventRecord(ev, other.get());
    if (st == cudaSuccess) {
        api = "cudaStreamWaitEvent";
        st = cudaStreamWaitEvent(self, ev, 0);
    }
    pool.release_raw(ev);
    check(st, api, where);
}

/// The highest stream priority `dev` supports (numerically the lowest value).
/// @throws cuda_error
[[nodiscard]] inline int priority_high(device_ref dev) { return dev.stream_priorities().greatest; }
/// The lowest stream priority `dev` supports; also the default priority.
/// @throws cuda_error
[[nodiscard]] inline int priority_low(device_ref dev) { return dev.stream_priorities().least; }

/// An owning CUDA stream, always created with `cudaStreamNonBlocking` so that it never
/// synchronises implicitly with the legacy default stream.
///
/// Move-only. Destruction synchronises the stream first, so work still in flight never outlives
/// the handle it runs on. Using a moved-from stream throws `usage_error`.
class stream : public detail::stream_ops<stream> {
public:
    /// Creates a non-blocking stream on `dev` (a device_ref or a plain device id: `stream s(1)`)
    /// with `priority` (clamped by the driver to the device's range; see priority_high /
    /// priority_low).
    /// @throws cuda_error
    explicit stream(device_ref dev, int priority = 0,
                    std::source_location where = std::source_location::current()) {
        device_guard guard(dev, where);
        check(cudaStreamCreateWithPriority(&m_handle, cudaStreamNonBlocking, priority),
              "cudaStreamCreateWithPriority", where);
        detail::g_live_streams.fetch_add(1, std::memory_order_relaxed);
    }

    /// Creates a non-blocking stream on the current device.
    /// @throws cuda_error
    explicit stream(std::source_location where = std::source_location::current())
        : stream(current_device(where), 0, where) {}

    stream(const stream&) = delete;
    stream& operator=(const stream&) = delete;
    stream(stream&& other) noexcept : m_handle(std::exchange(other.m_handle, nullptr)) {}
    stream& operator=(stream&& other) noexcept {
        if (this != &other) {
            destroy();
            m_handle = std::exchange(other.m_handle, nullptr);
        }
        return *this;
    }
    ~stream() { destroy(); }

    /// Takes ownership of `handle`, which must have been created by cudaStreamCreate*.
    [[nodiscard]] static stream from_native_handle(cudaStream_t handle) {
        if (handle == nullptr) {
            throw usage_error("stream::from_native_handle: null handle");
        }
        detail::g_live_streams.fetch_add(1, std::memory_order_relaxed);
        return stream(adopt, handle);
    }

    /// Gives up ownership: the caller destroys the returned handle.
    [[nodiscard]] cudaStream_t release() noexcept {
        if (m_handle != nullptr) {
            detail::g_live_streams.fetch_sub(1, std::memory_order_relaxed);
        }
        return std::exchange(m_handle, nullptr);
    }

    /// @throws usage_error on a moved-from stream
    [[nodiscard]] cudaStream_t get() const {
        if (m_handle == nullptr) {
            throw usage_error("cudawait::stream used after it was moved from or released");
        }
        return m_handle;
    }
    /// @throws usage_error on a moved-from stream
    [[nodiscard]] stream_ref ref() const { return stream_ref(get()); }
    /// @throws usage_error on a moved-from stream
    operator stream_ref() const { return ref(); }
#if CUDAWAIT_HAS_CUDA_STREAM_REF
    operator ::cuda::stream_ref() const { return ::cuda::stream_ref(get()); }
#endif
    [[nodiscard]] explicit operator bool() const noexcept { return m_handle != nullptr; }

    // is_done / sync / wait / device / priority: detail::stream_ops, through get().

    /// Streams created through this class (or adopted) and not yet destroyed or released.
    [[nodiscard]] static long live_count() noexcept {
        return detail::g_live_streams.load(std::memory_order_relaxed);
    }

private:
    // A tag, not a plain cudaStream_t parameter: `stream s(0)` must pick the device constructor,
    // and 0 converts to a null handle more readily than to a device_ref.
    struct adopt_t {};
    static constexpr adopt_t adopt{};
    stream(adopt_t, cudaStream_t adopted) noexcept : m_handle(adopted) {}

    void destroy() noexcept {
        if (m_handle == nullptr) {
            return;
        }
        detail::report(cudaStreamSynchronize(m_handle), "cudaStreamSynchronize");
        detail::report(cudaStreamDestroy(m_handle), "cudaStreamDestroy");
        detail::g_live_streams.fetch_sub(1, std::memory_order_relaxed);
        m_handle = nullptr;
    }

    cudaStream_t m_handle = nullptr;
};

} // namespace cudawait
