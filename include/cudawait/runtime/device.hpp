// SPDX-License-Identifier: Apache-2.0
#pragma once

// Synopsis
//   int  device_count();          number of visible devices; throws cuda_error without a driver
//   int  try_device_count() noexcept;   same, 0 on any error
//   class device_ref;             a device id, validated on construction; converts from an int
//   device_ref current_device();
//   class device_guard;           makes a device current for a scope, restores the previous one
//   bool enable_peer_access(a, b);   lets device a access device b's memory, once per pair

#include <cudawait/runtime/error.hpp>

#include <mutex>
#include <source_location>
#include <string>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>

namespace cudawait {

/// Number of CUDA devices visible to this process.
/// @throws cuda_error when there is no driver (cudaErrorInsufficientDriver) or no device
///         (cudaErrorNoDevice): the first CUDA use on such a machine fails here, clearly.
[[nodiscard]] inline int
device_count(std::source_location where = std::source_location::current()) {
    int n = 0;
    check(cudaGetDeviceCount(&n), "cudaGetDeviceCount", where);
    if (n == 0) {
        throw cuda_error(cudaErrorNoDevice, "cudaGetDeviceCount", where);
    }
    return n;
}

/// Number of CUDA devices, or 0 when the driver or the devices are missing. Never throws.
[[nodiscard]] inline int try_device_count() noexcept {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    return n;
}

/// Why this process cannot use a CUDA device (the status's name and text, or "no CUDA device
/// present"), or an empty string when it can: for a clear message before giving up.
[[nodiscard]] inline std::string no_device_reason() {
    int n = 0;
    cudaError_t st = cudaGetDeviceCount(&n);
    if (st != cudaSuccess) {
        (void)cudaGetLastError();
        return std::string(cudaGetErrorName(st)) + ": " + cudaGetErrorString(st);
    }
    return n == 0 ? "no CUDA device present" : "";
}

/// A non-owning, validated device id.
class device_ref {
public:
    /// Implicit, as cuda::device_ref's: whatever takes a device takes a plain id too
    /// (`stream s(1)`, `small_copy_stream(0, dir)`). Views of streams and events still refuse an
    /// int (is 0 a device or the null handle?).
    /// @throws cuda_error (cudaErrorInvalidDevice) when `id` names no visible device.
    device_ref(int id, std::source_location where = std::source_location::current()) : m_id(id) {
        int n = device_count(where);
        if (id < 0 || id >= n) {
            throw cuda_error(cudaErrorInvalidDevice, "device_ref", where);
        }
    }

    [[nodiscard]] int get() const noexcept { return m_id; }

    /// Stream priorities this device supports: `greatest` is the highest priority (numerically
    /// lowest).
    struct priority_range {
        int least;
        int greatest;
    };
    /// @throws cuda_error
    [[nodiscard]] priority_range stream_priorities() const;

    friend bool operator==(device_ref, device_ref) = default;
    /// Compares with a plain id without making a device_ref of it (which would validate it, and
    /// throw for an id that names no device).
    friend bool operator==(device_ref d, int id) noexcept { return d.m_id == id; }

private:
    struct unchecked {};
    device_ref(int id, unchecked) noexcept : m_id(id) {}
    friend device_ref current_device(std::source_location);
    int m_id;
};

/// The calling thread's current device.
/// @throws cuda_error
[[nodiscard]] inline device_ref
current_device(std::source_location where = std::source_location::current()) {
    int id = 0;
    check(cudaGetDevice(&id), "cudaGetDevice", where);
    return device_ref(id, device_ref::unchecked{});
}

/// Makes `dev` current for the guard's lifetime and restores the previous device afterwards.
class device_guard {
public:
    /// @throws cuda_error
    explicit device_guard(device_ref dev,
                          std::source_location where = std::source_location::current()) {
        check(cudaGetDevice(&m_previous), "cudaGetDevice", where);
        if (m_previous != dev.get()) {
            check(cudaSetDevice(dev.get()), "cudaSetDevice", where);
        }
        m_current = dev.get();
    }
    device_guard(const device_guard&) = delete;
    device_guard& operator=(const device_guard&) = delete;
    ~device_guard() {
        if (m_previous != m_current) {
            detail::report(cudaSetDevice(m_previous), "cudaSetDevice");
        }
    }

private:
    int m_previous = 0;
    int m_current = 0;
};

inline device_ref::priority_range device_ref::stream_priorities() const {
    priority_range r{};
    device_guard guard(*this);
    check(cudaDeviceGetStreamPriorityRange(&r.least, &r.greatest),
          "cudaDeviceGetStreamPriorityRange");
    return r;
}

namespace detail {

/// Which ordered device pairs enable_peer_access settled, and how: process-wide. Never
/// destroyed, so that no static destructor can find it gone. A class template (of an unused
/// parameter, always void), like enable_peer_access, so that only a translation unit that
/// enables access instantiates it; spelled peer_access_record.
template <class Unused = void>
struct basic_peer_access_record {
    struct entry {
        int a;
        int b;
        bool on;
    };
    std::mutex mutex;
    /// At most one entry per ordered pair, and few pairs (devices squared): a linear search,
    /// without <map> in every translation unit.
    std::vector<entry> pairs;

    static basic_peer_access_record& instance() {
        static basic_peer_access_record* record = new basic_peer_access_record();
        return *record;
    }
};

using peer_access_record = basic_peer_access_record<>;

} // namespace detail

/// Lets device `a` access the memory of device `b` (cudaDeviceEnablePeerAccess(b) with `a`
/// current; access is one-way, so a copy engine or kernel of `b` reading `a`'s memory needs
/// enable_peer_access(b, a) too). Returns whether the access is on: true for a == b (a device
/// always reaches its own memory), false where cudaDeviceCanAccessPeer says the pair cannot (no
/// common NVLink or PCIe switch; copies between them still work, staged by the driver through
/// host memory). Access enabled earlier outside the library counts as on
/// (cudaErrorPeerAccessAlreadyEnabled is success, and cleared). Each ordered pair is settled
/// once per process, thread-safely; a settled pair is answered without a CUDA call. A failure
/// settles nothing, so a later call tries again. Access applies to memory from cudaMalloc and
/// speeds up copies between the devices; memory from a stream-ordered pool (cudaMallocAsync,
/// device_buffer) is copied between devices either way, but kernels of another device reach it
/// only after cudaMemPoolSetAccess on that pool. cudaDeviceReset ends the access; the record
/// then no longer holds.
/// @throws cuda_error (cudaErrorInvalidDevice for an id that names no visible device; any
///         other error of cudaDeviceCanAccessPeer or cudaDeviceEnablePeerAccess, such as
///         cudaErrorTooManyPeers)
template <class = void>
bool enable_peer_access(int a, int b,
                        std::source_location where = std::source_location::current()) {
    auto& record = detail::peer_access_record::instance();
    std::lock_guard lock(record.mutex);
    for (const detail::peer_access_record::entry& e : record.pairs) {
        if (e.a == a && e.b == b) {
            return e.on; // only valid ids are recorded
        }
    }
    device_ref from(a, where);
    device_ref to(b, where);
    int can = 1;
    if (a != b) {
        check(cudaDeviceCanAccessPeer(&can, from.get(), to.get()), "cudaDeviceCanAccessPeer",
              where);
    }
    if (a != b && can != 0) {
        device_guard guard(from, where);
        cudaError_t st = cudaDeviceEnablePeerAccess(to.get(), 0);
        if (st == cudaErrorPeerAccessAlreadyEnabled) {
            (void)cudaGetLastError(); // the runtime also left it as the thread's last error
        } else {
            check(st, "cudaDeviceEnablePeerAccess", where);
        }
    }
    record.pairs.push_back({a, b, can != 0});
    return can != 0;
}

} // namespace cudawait
