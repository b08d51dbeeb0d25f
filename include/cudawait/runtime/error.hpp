// SPDX-License-Identifier: Apache-2.0
#pragma once

// Synopsis
//   class cuda_error;        a failed CUDA runtime call: status, API name, call site, stickiness
//   class timeout_error;     an await that outlived its deadline
//   class stall_error;       an await failed by a watchdog: its device made no progress
//   bool  is_sticky(status); does this status poison the context for the rest of the process?
//   void  check(status, api, where = current());  throws cuda_error unless status is cudaSuccess
//
// Every CUDA call the library makes goes through check() (or a try_ variant on noexcept paths).

// First: fails a build that is not C++20 with a message that says so.
#include <cudawait/runtime/detail/chrono.hpp>
#include <cudawait/runtime/detail/config.hpp>

#include <cstdio>
#include <source_location>
#include <stdexcept>
#include <string>

#include <cuda_runtime_api.h>

namespace cudawait {

/// True when `status` leaves the CUDA context unusable: every later call in the process fails
/// with the same error and only a restart recovers (the runtime documents these as "the process
/// must be terminated and relaunched").
[[nodiscard]] constexpr bool is_sticky(cudaError_t status) noexcept {
    switch (status) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchTimeout:
    case cudaErrorAssert:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorLaunchFailure:
    case cudaErrorTensorMemoryLeak:
    case cudaErrorECCUncorrectable:
        return true;
    default:
        return false;
    }
}

namespace detail {

inline std::string format_cuda_error(cudaError_t status, const char* api,
                                     const std::source_location& where) {
    std::string msg = api ? api : "CUDA call";
    msg += " failed: ";
    msg += cudaGetErrorName(status);
    msg += " (";
    msg += std::to_string(static_cast<int>(status));
    msg += "): ";
    msg += cudaGetErrorString(status);
    if (is_sticky(status)) {
        msg += " [sticky: the CUDA context is unusable for the rest of this process]";
    }
    msg += " at ";
    msg += where.file_name();
    msg += ':';
    msg += std::to_string(where.line());
    return msg;
}

} // namespace detail

/// A CUDA runtime call that did not return `cudaSuccess`.
///
/// Carries the status, the name of the API that reported it and the call site that made the
/// call (or the `co_await` that observed an asynchronous failure).
class cuda_error : public std::runtime_error {
public:
    cuda_error(cudaError_t status, const char* api,
               std::source_location where = std::source_location::current())
        : std::runtime_error(detail::format_cuda_error(status, api, where)), m_status(status),
          m_api(api ? api : "CUDA call"), m_where(where) {}

    /// The status the runtime returned.
    [[nodiscard]] cudaError_t status() const noexcept { return m_status; }
    /// The runtime function that reported the error, e.g. "cudaEventQuery".
    [[nodiscard]] const char* api() const noexcept { return m_api; }
    /// Where the failing call (or the observing `co_await`) is in the source.
    [[nodiscard]] const std::source_location& where() const noexcept { return m_where; }
    /// True when the context is corrupted and CUDA cannot be used again in this process.
    [[nodiscard]] bool sticky() const noexcept { return is_sticky(m_status); }

private:
    cudaError_t m_status;
    const char* m_api;
    std::source_location m_where;
};

/// An await that did not complete before its deadline. The awaited work itself is not
/// cancelled: the GPU goes on, and the scheduler keeps tracking it until it completes.
class timeout_error : public std::runtime_error {
public:
    explicit timeout_error(std::chrono::nanoseconds after)
        : std::runtime_error("await timed out after " + std::to_string(after.count()) + " ns"),
          m_after(after) {}

    /// The timeout that expired.
    [[nodiscard]] std::chrono::nanoseconds after() const noexcept { return m_after; }

private:
    std::chrono::nanoseconds m_after;
};

/// An await that a watchdog (watchdog.hpp) failed because its device made no progress for the
/// watchdog's window. Like a timeout, the awaited work is not cancelled: the GPU may still run
/// it, and the scheduler keeps tracking it until it completes.
class stall_error : public std::runtime_error {
public:
    stall_error(int device, std::chrono::nanoseconds stalled_for)
        : std::runtime_error("device " + std::to_string(device) + " made no progress for " +
                             std::to_string(stalled_for.count()) + " ns"),
          m_device(device), m_stalled_for(stalled_for) {}

    /// The device that stopped making progress.
    [[nodiscard]] int device() const noexcept { return m_device; }
    /// How long it had made none when the watchdog gave up on the await.
    [[nodiscard]] std::chrono::nanoseconds stalled_for() const noexcept { return m_stalled_for; }

private:
    int m_device;
    std::chrono::nanoseconds m_stalled_for;
};

/// Misuse of the library that no CUDA status describes: a moved-from object, a task awaited
/// without a scheduler, a scheduler driven from two threads at once.
class usage_error : public std::logic_error {
public:
    using std::logic_error::logic_error;
};

/// Throws `cuda_error` unless `status` is `cudaSuccess`.
///
/// The runtime's per-thread last error is cleared first, so a non-sticky failure reported here
/// does not resurface from an unrelated later call.
/// @throws cuda_error
inline void check(cudaError_t status, const char* api,
                  std::source_location where = std::source_location::current()) {
    if (status != cudaSuccess) [[unlikely]] {
        (void)cudaGetLastError();
        throw cuda_error(status, api, where);
    }
}

namespace detail {

/// For destructors and other noexcept paths: a failure is written to stderr and execution goes
/// on. `cudaErrorCudartUnloading` at process exit is expected and stays silent.
inline void report(cudaError_t status, const char* api) noexcept {
    if (status == cudaSuccess || status == cudaErrorCudartUnloading) {
        return;
    }
    (void)cudaGetLastError();
    std::fprintf(stderr, "cudawait: %s failed in a noexcept path: %s (%d)\n", api,
                 cudaGetErrorName(status), static_cast<int>(status));
}

} // namespace detail

} // namespace cudawait
