// SPDX-License-Identifier: Apache-2.0
#pragma once

// detail::event_ops<D>: what event, pooled_event and event_ref can do, written once; each
// operation asks D for its handle through get(), which throws usage_error for an empty owner.

#include <cudawait/runtime/error.hpp>
#include <cudawait/runtime/stream.hpp>

#include <source_location>

#include <cuda_runtime_api.h>

namespace cudawait::detail {

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

} // namespace cudawait::detail
