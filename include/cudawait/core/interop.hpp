// SPDX-License-Identifier: Apache-2.0
#pragma once

// Synopsis
//   wait_for_stream(s, other);        later work on `s` waits for `other`'s work so far
//   wait_for_legacy_stream(s);        later work on `s` waits for the legacy default stream's
//   legacy_stream_wait_for(s);        later work on the legacy default stream waits for `s`'s
//   co_await after_legacy_stream(s);  wait_for_legacy_stream(s), then resumes once `s` is idle
//
// None of these blocks the host: each records a pooled event on one stream and makes the other
// wait for it. See docs/core.md#interop-the-legacy-default-stream.

#include <cudawait/core/scheduler.hpp>
#include <cudawait/core/task.hpp>
#include <cudawait/runtime/stream.hpp>

#include <source_location>

#include <cuda_runtime_api.h>

namespace cudawait {

/// Makes later work on `s` wait for all work enqueued on `other` before this call: the same as
/// `s.wait(other)` (stream.hpp). `other` may be on another device, or be cudaStreamLegacy or
/// cudaStreamPerThread: those name the current device's stream, so for them `s`'s device is
/// made current. The host does not wait.
/// @throws cuda_error
inline void wait_for_stream(stream_ref s, stream_ref other,
                            std::source_location where = std::source_location::current()) {
    s.wait(other, where);
}

/// Makes later work on `s` wait for all work enqueued on the legacy default stream (of `s`'s
/// device) before this call, such as a kernel launched without a stream.
/// @throws cuda_error
inline void wait_for_legacy_stream(stream_ref s,
                                   std::source_location where = std::source_location::current()) {
    wait_for_stream(s, stream_ref(cudaStreamLegacy), where);
}

/// Makes later work on the legacy default stream (of `s`'s device) wait for all work enqueued on
/// `s` before this call, so that code which uses stream 0 sees what `s` produced.
/// @throws cuda_error
inline void legacy_stream_wait_for(stream_ref s,
                                   std::source_location where = std::source_location::current()) {
    stream_ref(cudaStreamLegacy).wait(s, where);
}

/// `co_await after_legacy_stream(s)`: orders `s` after the legacy default stream's work so far
/// (wait_for_legacy_stream) and resumes once `s` is idle, so that the legacy stream's results
/// are complete and later work on `s` is ordered after them.
/// @throws cuda_error (at the call for the ordering, else from the await)
/// (A function template, called as `after_legacy_stream(s)`: only a translation unit that calls
/// it instantiates the coroutine.)
template <class Unused = void>
[[nodiscard]] task<void>
after_legacy_stream(stream_ref s, std::source_location where = std::source_location::current()) {
    wait_for_legacy_stream(s, where);
    return [](stream_ref st) -> task<void> { co_await st; }(s);
}

} // namespace cudawait
