// SPDX-License-Identifier: Apache-2.0
#pragma once

// Synopsis
//   use_token t = tracker.record(s);     a mark at the current end of `s`'s work
//   tracker.done(t) / wait(t)            whether the GPU passed the mark / block until it has
//   tracker.release(t)                   gives the mark back
//
// How a pinned_pool observes that the GPU finished with a block (pinned_pool_options::tracker).
// event_use_tracker, the default, records pooled CUDA events; tests substitute a host-controlled
// tracker. See docs/memory.md#slab-sources-and-use-trackers.

#include <cudawait/runtime/error.hpp>
#include <cudawait/runtime/event.hpp>
#include <cudawait/runtime/stream.hpp>

#include <source_location>

#include <cuda_runtime_api.h>

namespace cudawait {

/// A recorded point in a stream's work, as a use_tracker hands it out.
struct use_token {
    void* handle = nullptr;
    int device = 0;
};

/// Observes when the GPU finished with a block. The default records pooled CUDA events; tests
/// substitute a host-controlled one.
class use_tracker {
public:
    virtual ~use_tracker() = default;
    /// Marks the current end of `s`'s work. @throws cuda_error
    virtual use_token record(stream_ref s) = 0;
    /// True once the work up to the mark completed. @throws cuda_error
    virtual bool done(use_token t) = 0;
    /// Blocks until done(t). @throws cuda_error
    virtual void wait(use_token t) = 0;
    /// Gives the mark back.
    virtual void release(use_token t) noexcept = 0;
};

/// The default tracker: an event from the stream's device's event_pool per record.
class event_use_tracker final : public use_tracker {
public:
    use_token record(stream_ref s) override {
        int dev = s.device();
        event_pool& pool = event_pool::for_device(dev);
        cudaEvent_t ev = pool.acquire_raw();
        cudaError_t st = cudaEventRecord(ev, s.get());
        if (st != cudaSuccess) {
            pool.release_raw(ev);
            check(st, "cudaEventRecord");
        }
        return {ev, dev};
    }
    bool done(use_token t) override {
        return detail::event_ready(static_cast<cudaEvent_t>(t.handle),
                                   std::source_location::current());
    }
    void wait(use_token t) override {
        check(cudaEventSynchronize(static_cast<cudaEvent_t>(t.handle)), "cudaEventSynchronize");
    }
    void release(use_token t) noexcept override {
        event_pool::for_device(t.device).release_raw(static_cast<cudaEvent_t>(t.handle));
    }
};

} // namespace cudawait
