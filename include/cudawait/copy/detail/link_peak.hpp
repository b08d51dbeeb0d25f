// SPDX-License-Identifier: Apache-2.0
#pragma once

// The link probe behind pipeline_stats::link_peak_gbps and the bandwidth alerts: a few timed
// 64 MiB pinned copies each way, once per device and process.

#include <cudawait/memory/device_buffer.hpp>
#include <cudawait/memory/pinned_buffer.hpp>
#include <cudawait/runtime/device.hpp>
#include <cudawait/runtime/error.hpp>
#include <cudawait/runtime/event.hpp>
#include <cudawait/runtime/stream.hpp>

#include <algorithm>
#include <cstddef>
#include <map>
#include <mutex>

#include <cuda_runtime_api.h>

namespace cudawait {

/// The link's one-way peak in GB/s for `device`: the better of H2D and D2H for 64 MiB pinned
/// copies, measured on first use (a few milliseconds) and cached for the process.
/// @throws cuda_error
/// (A function template, called as `link_peak_gbps(dev)`: only a translation unit that calls it
/// instantiates the measurement, its buffers and the pinned pool behind them.)
template <class Unused = void>
double link_peak_gbps(int device) {
    static std::mutex mutex;
    static std::map<int, double> cache;
    {
        std::lock_guard lock(mutex);
        if (auto it = cache.find(device); it != cache.end()) {
            return it->second;
        }
    }
    device_guard guard{device_ref(device)};
    constexpr std::size_t bytes = std::size_t{64} << 20;
    stream s(device_ref(device), 0);
    pinned_buffer<std::byte> host(bytes);
    device_buffer<std::byte> dev(bytes, s);
    event start(device_ref(device), cudaEventDefault);
    event stop(device_ref(device), cudaEventDefault);
    double best = 0;
    for (int dir = 0; dir < 2; ++dir) {
        for (int rep = 0; rep < 4; ++rep) {
            start.record(s);
            if (dir == 0) {
                check(cudaMemcpyAsync(dev.data(), host.data(), bytes, cudaMemcpyHostToDevice,
                                      s.get()),
                      "cudaMemcpyAsync");
            } else {
                check(cudaMemcpyAsync(host.data(), dev.data(), bytes, cudaMemcpyDeviceToHost,
                                      s.get()),
                      "cudaMemcpyAsync");
            }
            stop.record(s);
            stop.sync();
            float ms = 0;
            check(cudaEventElapsedTime(&ms, start.get(), stop.get()), "cudaEventElapsedTime");
            if (rep > 0 && ms > 0) { // the first of each direction warms up
                best = std::max(best, static_cast<double>(bytes) / (ms * 1e-3) / 1e9);
            }
        }
    }
    host.record_use(s);
    s.sync();
    std::lock_guard lock(mutex);
    cache[device] = best;
    return best;
}

} // namespace cudawait
