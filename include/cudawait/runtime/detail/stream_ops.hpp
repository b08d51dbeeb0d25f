// SPDX-License-Identifier: Apache-2.0
#pragma once

// detail::stream_ops<D>: what stream_ref and stream can do, written once; each operation asks D
// for its handle through get(), which throws usage_error for a moved-from or released owner (a
// null cudaStream_t would name the legacy default stream).

#include <cudawait/runtime/detail/event_pool.hpp>
#include <cudawait/runtime/error.hpp>

#include <source_location>

#include <cuda_runtime_api.h>

namespace cudawait {
class stream_ref;
} // namespace cudawait

namespace cudawait::detail {

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

} // namespace cudawait::detail
