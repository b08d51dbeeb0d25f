// SPDX-License-Identifier: Apache-2.0
#pragma once

// The views of streams and events, without their owners, pools or devices: stream_ref,
// event_ref, the stream_like and event_like concepts with native_stream / native_event, and
// detail::stream_ops / event_ops, what views and owners can do, written once (each operation
// asks D for its handle through get(), which throws usage_error for a moved-from or released
// owner: a null cudaStream_t would name the legacy default stream). The core layer awaits views
// and needs nothing more; include <cudawait/runtime/stream.hpp> or event.hpp, which include this.

#include <cudawait/runtime/error.hpp>

#include <concepts>
#include <cstddef>
#include <source_location>
#include <type_traits>

#include <cuda_runtime_api.h>

#if __has_include(<cuda/stream_ref>)
#include <cuda/stream_ref>
#define CUDAWAIT_HAS_CUDA_STREAM_REF 1
#else
#define CUDAWAIT_HAS_CUDA_STREAM_REF 0
#endif

namespace cudawait {

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

class stream_ref;
class event;
class pooled_event;

namespace detail {
/// The stream operations of `D`, which provides `cudaStream_t get() const`.
template <class D>
class stream_ops {
public:
    /// True when all work enqueued so far has completed (libcu++'s name for the query).
    /// @throws cuda_error for any status other than success and cudaErrorNotReady; usage_error
    ///         on a moved-from stream
    [[nodiscard]] bool is_done(std::source_location where = std::source_location::current()) const {
        cudaError_t st = cudaStreamQuery(handle());
        if (st == cudaErrorNotReady) {
            return false;
        }
        check(st, "cudaStreamQuery", where);
        return true;
    }

    /// Blocks the calling thread until the stream is idle. Prefer `co_await` in a task.
    /// @throws cuda_error; usage_error on a moved-from stream
    void sync(std::source_location where = std::source_location::current()) const {
        check(cudaStreamSynchronize(handle()), "cudaStreamSynchronize", where);
    }

    /// Makes later work on this stream wait for the work `event` captured (`cudaStreamWaitEvent`);
    /// the host does not block. `event` is any event_like: a cudawait event, pooled_event or
    /// event_ref, a raw cudaEvent_t, cuda::event_ref.
    /// @throws cuda_error; usage_error on a moved-from stream or an empty event
    template <event_like E>
    void wait(const E& event, std::source_location where = std::source_location::current()) const {
        check(cudaStreamWaitEvent(handle(), native_event(event), 0), "cudaStreamWaitEvent", where);
    }

    /// Makes later work on this stream wait for all work enqueued on `other` before the call
    /// (PyTorch's wait_stream): records a pooled event on `other` and waits for it. `other` may
    /// be on another device, or be cudaStreamLegacy or cudaStreamPerThread, which name the
    /// current device's stream: for them this stream's device is made current. The host does not
    /// block. (Defined in stream.hpp, once stream_ref is complete.)
    /// @throws cuda_error; usage_error on a moved-from stream
    void wait(stream_ref other, std::source_location where = std::source_location::current()) const;

    /// The device the stream belongs to.
    /// @throws cuda_error; usage_error on a moved-from stream
    [[nodiscard]] int device(std::source_location where = std::source_location::current()) const {
        int dev = 0;
        check(cudaStreamGetDevice(handle(), &dev), "cudaStreamGetDevice", where);
        return dev;
    }

    /// The stream's priority (lower numbers run first).
    /// @throws cuda_error; usage_error on a moved-from stream
    [[nodiscard]] int priority(std::source_location where = std::source_location::current()) const {
        int p = 0;
        check(cudaStreamGetPriority(handle(), &p), "cudaStreamGetPriority", where);
        return p;
    }

protected:
    stream_ops() noexcept = default;

private:
    [[nodiscard]] cudaStream_t handle() const { return static_cast<const D&>(*this).get(); }
};
} // namespace detail

namespace detail {
/// A stream_like type that stream_ref's own constructors do not already take.
template <class S>
concept foreign_stream = !std::same_as<std::remove_cvref_t<S>, stream_ref> &&
                         !std::same_as<std::remove_cvref_t<S>, cudaStream_t> && stream_like<S>;
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

namespace detail {
/// Maps cudaErrorNotReady to false and success to true; anything else throws.
inline bool event_ready(cudaEvent_t ev, const std::source_location& where) {
    cudaError_t st = cudaEventQuery(ev);
    if (st == cudaErrorNotReady) {
        return false;
    }
    check(st, "cudaEventQuery", where);
    return true;
}

/// The event operations of `D`, which provides `cudaEvent_t get() const`.
template <class D>
class event_ops {
public:
    /// Captures the work enqueued on `s` so far.
    /// @throws cuda_error; usage_error on an empty event
    void record(stream_ref s, std::source_location where = std::source_location::current()) const {
        check(cudaEventRecord(handle(), s.get()), "cudaEventRecord", where);
    }

    /// True once the captured work completed (also for a never-recorded event); libcu++'s name.
    /// @throws cuda_error for errors other than cudaErrorNotReady; usage_error on an empty event
    [[nodiscard]] bool is_done(std::source_location where = std::source_location::current()) const {
        return event_ready(handle(), where);
    }

    /// Blocks the calling thread until the captured work completed. Prefer `co_await`.
    /// @throws cuda_error; usage_error on an empty event
    void sync(std::source_location where = std::source_location::current()) const {
        check(cudaEventSynchronize(handle()), "cudaEventSynchronize", where);
    }

protected:
    event_ops() noexcept = default;

private:
    [[nodiscard]] cudaEvent_t handle() const { return static_cast<const D&>(*this).get(); }
};
} // namespace detail

class event_ref;
namespace detail {
/// An event_like type that event_ref's own constructors do not already take.
template <class E>
// The library's own types are excluded first: event and pooled_event may be incomplete here, and
// asking event_like of them then would cache a wrong answer.
concept foreign_event = !std::same_as<std::remove_cvref_t<E>, event_ref> &&
                        !std::same_as<std::remove_cvref_t<E>, cudaEvent_t> &&
                        !std::same_as<std::remove_cvref_t<E>, event> &&
                        !std::same_as<std::remove_cvref_t<E>, pooled_event> && event_like<E>;
} // namespace detail

/// A non-owning view of a CUDA event. Inside a task, `co_await ev` resumes once the work the
/// event captured completed; the event must outlive the await.
class event_ref : public detail::event_ops<event_ref> {
public:
    constexpr event_ref(cudaEvent_t handle) noexcept : m_handle(handle) {}
    event_ref(int) = delete;
    event_ref(std::nullptr_t) = delete;
    /// @throws usage_error for a moved-from event (defined in event.hpp)
    event_ref(const event& e);
    /// @throws usage_error for an empty pooled_event (defined in event.hpp)
    event_ref(const pooled_event& e);
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

    // record / is_done / sync: detail::event_ops.

    // Spelled out: a defaulted == would also compare the (empty) event_ops base, which has none.
    friend constexpr bool operator==(event_ref a, event_ref b) noexcept {
        return a.m_handle == b.m_handle;
    }

private:
    cudaEvent_t m_handle;
};

} // namespace cudawait
