// SPDX-License-Identifier: Apache-2.0
#pragma once

// A fake CUDA runtime for host tests: fake_cuda.cpp defines the runtime's entry points
// (extern "C", the names <cuda_runtime_api.h> declares) and a test links it in place of
// libcudart (cudawait_add_fake_test, tests/support/CMakeLists.txt). This header is its control
// panel.
//
// The model. Streams and events are heap tokens, made and checked under one mutex (every entry
// point is thread-safe). Each thread has a current device (0 at first); streams and events belong
// to the device current where they were made. The special handles 0 / cudaStreamLegacy name the
// legacy stream of the calling thread's current device, cudaStreamPerThread the calling thread's
// own stream of it: distinct stream objects per device and per (thread, device).
//
// Work completes at once, unless held back:
//   - hang(s): what is recorded on s from then on stays cudaErrorNotReady until release(s);
//   - cudaStreamWaitEvent(s, e): what is recorded on s afterwards also waits for e's record.
// An event never recorded is complete. cudaEventRecord refuses (cudaErrorInvalidResourceHandle)
// a stream of another device than the event's. cudaEventSynchronize, cudaStreamSynchronize and
// cudaDeviceSynchronize block until a release completes what they wait for. A call that passes
// a destroyed or never-made stream or event returns cudaErrorInvalidResourceHandle and is
// counted (dead_handle_calls). Copies and memsets succeed on a stream of any device.
//
// Kernel launches. A kernel runs in a device's context: a __global__ function's address given to
// cudaLaunchKernel is bound to the calling thread's current device, a CUfunction to the device
// its module was loaded on (cuModuleLoadData). Such a launch on a stream of another device than
// the current one is refused with cudaErrorInvalidResourceHandle, as CUDA refuses it ("a kernel
// launch will fail if it is issued to a stream that is not associated to the current device",
// the programming guide's stream and event behaviour; the runtime reports "invalid resource
// handle", the driver's cuLaunchKernel CUDA_ERROR_INVALID_HANDLE, both 400). A library kernel
// (cudaKernel_t, cudaLibraryGetKernel) takes its context from its stream, as cuLaunchKernel
// documents for a CUkernel: it launches on a stream of any device. Every launch that gets as far
// as these checks is recorded (launches()). A kernel does nothing (an SM copy moves no bytes)
// unless the test defines what a module function does (define_kernel); copies and memsets
// between host addresses are made at once, even on a hung stream (every allocation of the fake,
// device memory included, is host memory).
//
// The driver's entry points (cudaGetDriverEntryPoint*) are found only for cuModuleLoadData,
// cuModuleGetFunction and cuLaunchKernel (what the watchdog's heartbeat uses): no stream memory
// operations, so no doorbell. A call of a chosen entry point can be made to block until the test
// lets it go (block_next), as a slow driver call would. cudaLaunchHostFunc, graphs and stream
// capture are not supported (cudaErrorNotSupported). Failures set the thread's last error
// (cudaGetLastError), except cudaErrorNotReady and the driver functions' failures.

#include <chrono>
#include <cstddef>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <cuda_runtime_api.h>

namespace cudawait::fake_cuda {

/// Starts a test afresh: completes everything held (release_all), unblock(), forgets every
/// stream's waits, the fail_next hooks, the call counts, dead_handle_calls, the recorded launches
/// and the kernels defined (define_kernel); handle reuse off; one device; the calling thread's
/// current device 0 (other threads keep theirs). Streams, events and allocations made before
/// stay valid (destroyed ones stay destroyed): the library keeps some for the process (the copy
/// lanes' streams, the event pools' events), so live_streams() and live_events() count what
/// earlier tests of the process left, and the library sizes its per-device pools at their first
/// use (set_device_count before that, in a test of its own process, as ctest runs them).
void reset();

/// How many devices cudaGetDeviceCount reports (1 until set).
void set_device_count(int n);

/// Holds back the work recorded on `s` from now on (0, cudaStreamLegacy and cudaStreamPerThread
/// resolved as the runtime does, for the calling thread and its current device): events
/// recorded there stay cudaErrorNotReady, and so does the stream, until release(s).
/// @throws std::invalid_argument for a handle the fake never made
void hang(cudaStream_t s);

/// Completes everything recorded on `s` so far and ends its hang. Resolved as hang().
/// @throws std::invalid_argument for a handle the fake never made
void release(cudaStream_t s);

/// release() on every stream, destroyed ones included.
void release_all();

/// Makes the next `times` calls of entry point `api` (e.g. "cudaLaunchKernel",
/// "cudaEventCreateWithFlags") fail with `err`, before they do anything.
void fail_next(std::string_view api, cudaError_t err, int times = 1);

/// Makes the next call of entry point `api` made with `device` current block, before it does
/// anything, until unblock(): a driver call that takes long (a module's loading, say). The fake
/// stays usable meanwhile: every other call goes on, from any thread.
void block_next(std::string_view api, int device);

/// Waits until a call blocks in block_next's hook, at most `timeout`; true if one does.
bool wait_blocked(std::chrono::milliseconds timeout);

/// Lets every call block_next blocked go on, and cancels a block_next no call has met yet.
void unblock();

/// While on, creating a stream (an event) hands out the stream (event) handle destroyed last,
/// if there is one: what a driver may do.
void reuse_handles(bool on);

/// How many times entry point `api` was called since the last reset().
std::size_t calls(std::string_view api);

/// Streams made with cudaStreamCreate* and not destroyed.
std::size_t live_streams();
/// Events made with cudaEventCreate* and not destroyed.
std::size_t live_events();

/// Calls that passed a destroyed (or never-made) stream or event handle; each returned
/// cudaErrorInvalidResourceHandle.
std::size_t dead_handle_calls();

/// The device of stream `s` (special handles resolved as by hang(); destroyed streams keep
/// theirs), or -1 for a handle the fake never made.
int stream_device(cudaStream_t s);

/// Where an event was last recorded.
struct record_info {
    cudaStream_t stream;    ///< the stream object: for a special handle, the one it resolved to
    int device;             ///< that stream's device
    bool per_thread;        ///< recorded through cudaStreamPerThread
    bool legacy;            ///< recorded through 0 or cudaStreamLegacy
    std::thread::id thread; ///< the recording thread
};

/// Where `e` was last recorded; std::nullopt if it never was (or was never made).
std::optional<record_info> last_record(cudaEvent_t e);

/// A kernel launch, as launches() lists it.
struct launch_info {
    std::string api;      ///< "cudaLaunchKernel" or "cuLaunchKernel"
    const void* function; ///< what was launched: the function's address, cudaKernel_t or CUfunction
    std::string name;     ///< a CUfunction's name (cuModuleGetFunction); empty for the others
    int current_device;   ///< the launching thread's current device
    int stream_device;    ///< the device of the stream it was launched on; -1: a dead handle
    cudaError_t result;   ///< what the launch returned (the driver's code as the runtime's)
};

/// The kernel launches since the last reset(), accepted and refused, in order (a failure made by
/// fail_next is not one).
std::vector<launch_info> launches();

/// What a module function named `name` does: from now on, each accepted cuLaunchKernel of it
/// calls `body(kernelParams)` on the launching thread before the launch returns, even on a hung
/// stream (as copies are made at once). An empty `body` makes the function do nothing again.
void define_kernel(std::string_view name, std::function<void(void** params)> body);

} // namespace cudawait::fake_cuda
