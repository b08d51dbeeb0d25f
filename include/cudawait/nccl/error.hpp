// SPDX-License-Identifier: Apache-2.0
#pragma once

// Synopsis (namespace cudawait::nccl; link the CMake target cudawait::nccl)
//   catch (const nccl::error& e)         a failed NCCL call, an asynchronous NCCL error or a
//                                        timed-out wait: e.result(), e.timed_out(), e.api()
//
// what() names the call, NCCL's result and NCCL's last error text. See
// docs/nccl.md#errors-and-timeouts.

#include <cudawait/runtime/detail/chrono.hpp>

#include <cstdio>
#include <stdexcept>
#include <string>
#include <string_view>

#include <nccl.h>

namespace cudawait::nccl {

namespace detail {

inline std::string format_error(ncclResult_t result, const char* api, std::string_view detail) {
    std::string msg = api ? api : "NCCL call";
    msg += " failed: ";
    msg += ncclGetErrorString(result);
    msg += " (";
    msg += std::to_string(static_cast<int>(result));
    msg += ')';
    if (!detail.empty()) {
        msg += ": ";
        msg += detail;
    }
    return msg;
}

} // namespace detail

/// A failed NCCL call, an asynchronous error a wait observed, or a wait that timed out.
class error : public std::runtime_error {
public:
    /// `detail`: what NCCL said beyond the result's name (ncclGetLastError), if anything.
    error(ncclResult_t result, const char* api, std::string_view detail = {})
        : std::runtime_error(detail::format_error(result, api, detail)), m_result(result),
          m_api(api ? api : "NCCL call") {}

    /// A wait (or an init) that did not finish within `after`. result() is ncclInProgress.
    [[nodiscard]] static error timeout(const char* api, std::chrono::nanoseconds after,
                                       std::string_view detail = {}) {
        return error(api, after, detail);
    }

    /// What NCCL returned or reported (ncclInProgress for a timeout).
    [[nodiscard]] ncclResult_t result() const noexcept { return m_result; }
    /// True when the error is a timeout, not a failure NCCL reported.
    [[nodiscard]] bool timed_out() const noexcept { return m_timed_out; }
    /// The NCCL function (or library call) concerned, e.g. "ncclAllReduce".
    [[nodiscard]] const char* api() const noexcept { return m_api; }

private:
    error(const char* api, std::chrono::nanoseconds after, std::string_view detail)
        : std::runtime_error(std::string(api ? api : "NCCL call") + " timed out after " +
                             std::to_string(after.count()) + " ns" + (detail.empty() ? "" : "; ") +
                             std::string(detail)),
          m_result(ncclInProgress), m_api(api ? api : "NCCL call"), m_timed_out(true) {}

    ncclResult_t m_result;
    const char* m_api;
    bool m_timed_out = false;
};

namespace detail {

/// Throws nccl::error unless `r` is ncclSuccess; the message carries NCCL's last error text.
/// @throws error
inline void check(ncclResult_t r, const char* api, ncclComm_t comm = nullptr) {
    if (r != ncclSuccess) [[unlikely]] {
        const char* last = ncclGetLastError(comm);
        throw error(r, api, last ? std::string_view(last) : std::string_view());
    }
}

/// For destructors and other noexcept paths: a failure goes to stderr. ncclInProgress is no
/// failure here: a non-blocking communicator finishes its teardown in NCCL's background.
inline void report(ncclResult_t r, const char* api) noexcept {
    if (r == ncclSuccess || r == ncclInProgress) {
        return;
    }
    std::fprintf(stderr, "cudawait: %s failed in a noexcept path: %s (%d)\n", api,
                 ncclGetErrorString(r), static_cast<int>(r));
}

} // namespace detail

} // namespace cudawait::nccl
