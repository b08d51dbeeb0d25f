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

#include <cudawait/runtime/detail/stream_ops.hpp>
#include <cudawait/runtime/device.hpp>
#include <cudawait/runtime/error.hpp>

#include <atomic>
#include <concepts>
#include <cstddef>
#include <source_location>
#include <type_traits>
#include <utility>

#include <cuda_runtime_api.h>

#if __has_include(<cuda/stream_ref>)
#include <cuda/stream_ref>
#define CUDAWAIT_HAS_CUDA_STREAM_REF 1
#else
#define CUDAWAIT_HAS_CUDA_STREAM_REF 0
#endif

namespace cudawait {

namespace detail {
/// Streams created by the library and not yet destroyed (leak checks in tests).
inline std::atomic<long> g_live_streams{0};
} // namespace detail

namespace detail {
template <class T>
concept has_stream_member = requires(const T& t) {
    requires std::same_as<std::remove_cvref_t<decltype(t.stream())>, cudaStream_t>;
};
template <class T>
concept has_value_member = requires(const T& t) {
    requires std::same_as<std::remove_cvref_t<decltype(t.value())>, cudaStream_t>;
};
template <class T>
concept has_stream_get = requires(const T& t) {
    requires std::same_as<std::remove_cvref_t<decltype(t.get())>, cudaStream_t>;
};
// Class types only: a void* or a nullptr would otherwise pass for a stream through static_cast.
template <class T>
concept converts_to_stream = std::is_class_v<T> && requires(const T& t) {
    static_cast<cudaStream_t>(t);
};
} // namespace detail

/// A stream type of another library, or cudaStream_t itself: a class explicitly convertible to
/// cudaStream_t, or one whose `.stream()`, `.value()` or `.get()` returns one (asked in that
/// order; PyTorch's c10::cuda::CUDAStream has `.stream()` and a conversion, rmm's
/// cuda_stream_view `.value()` and a conversion, cuda::stream_ref `.get()`).
template <class T>
concept stream_like = std::same_as<std::remove_cvref_t<T>, cudaStream_t> ||
    detail::converts_to_stream<std::remove_cvref_t<T>> ||
    detail::has_stream_member<std::remove_cvref_t<T>> ||
    detail::has_value_member<std::remove_cvref_t<T>> ||
    detail::has_stream_get<std::remove_cvref_t<T>>;

/// The cudaStream_t that `x` names (see stream_like for the order in which it is asked).
/// @throws what x's accessor throws (cudawait::stream: usage_error when moved from)
template <stream_like S>
[[nodiscard]] constexpr cudaStream_t native_stream(const S& x) {
    using plain = std::remove_cvref_t<S>;
    if constexpr (std::same_as<plain, cudaStream_t> || detail::converts_to_stream<plain>) {
        return static_cast<cudaStream_t>(x);
    } else if constexpr (detail::has_stream_member<plain>) {
        return x.stream();
    } else if constexpr (detail::has_value_member<plain>) {
        return x.value();
    } else {
        return x.get();
    }
}

class stream_ref;
namespace detail {
/// A stream_like type that stream_ref's own constructors do not already take.
template <class S>
concept foreign_stream = stream_like<S> && !std::same_as<std::remove_cvref_t<S>, stream_ref> &&
                         !std::same_as<std::remove_cvref_t<S>, cudaStream_t>;
} // namespace detail

/// A non-owning view of a CUDA stream. Cheap to copy; never destroys the stream.
class stream_ref : public detail::stream_ops<stream_ref> {
public:
    /// Wraps a raw handle. `cudaStreamPerThread` is accepted; the legacy default stream has to
    /// be named explicitly with `cudaStreamLegacy` (an int or nullptr will not convert).
    constexpr stream_ref(cudaStream_t handle) noexcept : m_handle(handle) {}
    stream_ref(int) = delete;
    stream_ref(std::nullptr_t) = delete;
    /// Views the stream of another library's stream type. Implicit where that type converts
    /// implicitly to cudaStream_t: it says it is a stream handle, so a view surprises no one, and
    /// without this constructor the two conversions in a row (to cudaStream_t, then to
    /// stream_ref) are ones the language never chains. Explicit where only a member names the
    /// stream: `.get()` and `.value()` also belong to owners (a std::unique_ptr<CUstream_st, D>,
    /// a std::optional<cudaStream_t>), and a silent view of a temporary owner would dangle.
    /// @throws what the type's accessor throws
    template <detail::foreign_stream S>
    constexpr explicit(!std::is_convertible_v<const S&, cudaStream_t>) stream_ref(const S& s)
        : m_handle(native_stream(s)) {}
#if CUDAWAIT_HAS_CUDA_STREAM_REF
    constexpr stream_ref(::cuda::stream_ref s) noexcept : m_handle(s.get()) {}
    constexpr operator ::cuda::stream_ref() const noexcept { return ::cuda::stream_ref(m_handle); }
#endif

    /// The raw handle; never throws (a view has no moved-from state).
    [[nodiscard]] constexpr cudaStream_t get() const noexcept { return m_handle; }
    constexpr operator cudaStream_t() const noexcept { return m_handle; }

    // is_done / sync / wait / device / priority: detail::stream_ops.

    // Spelled out: a defaulted == would also compare the (empty) stream_ops base, which has none.
    friend constexpr bool operator==(stream_ref a, stream_ref b) noexcept {
        return a.m_handle == b.m_handle;
    }

private:
    cudaStream_t m_handle;
};

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
