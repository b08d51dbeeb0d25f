// SPDX-License-Identifier: Apache-2.0
#pragma once

// What the benchmark programs share: timing and statistics helpers, the summary's cells, error
// handling around a benchmark body, and the program's main().

#include <cudawait/cudawait.hpp>

#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <exception>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <cuda_runtime.h>

namespace bench {

using steady = std::chrono::steady_clock;

/// Benchmarks that reported an error: main() exits with 1 when there are any.
inline int g_failures = 0;

inline double seconds(steady::duration d) { return std::chrono::duration<double>(d).count(); }

/// The middle sample (the lower of the two middle ones for an even count).
inline double median(std::vector<double> v) {
    if (v.empty()) {
        throw std::logic_error("median of no samples");
    }
    std::sort(v.begin(), v.end());
    return v[(v.size() - 1) / 2];
}

/// "64KiB", "8MiB", "4GiB", or bytes.
inline std::string size_name(std::size_t bytes) {
    using namespace cudawait::literals;
    if (bytes % 1_GiB == 0) {
        return std::to_string(bytes / 1_GiB) + "GiB";
    }
    if (bytes % 1_MiB == 0) {
        return std::to_string(bytes / 1_MiB) + "MiB";
    }
    if (bytes % 1_KiB == 0) {
        return std::to_string(bytes / 1_KiB) + "KiB";
    }
    return std::to_string(bytes) + "B";
}

/// Runs `body`, turning an exception into a benchmark error instead of std::terminate.
template <class Body>
void guarded(benchmark::State& state, Body&& body) {
    try {
        body();
    } catch (const std::exception& e) {
        ++g_failures;
        state.SkipWithError(e.what());
    }
}

/// The value under `key`, if it was measured in this run.
inline std::optional<double> find(const std::map<std::string, double>& m, const std::string& key) {
    auto it = m.find(key);
    if (it == m.end()) {
        return std::nullopt;
    }
    return it->second;
}

/// The value `cache` holds under `key`, measured by `measure()` the first time it is asked for.
/// Paired benchmarks share one measurement this way: whichever runs first takes it. A throw
/// stores nothing, so the next benchmark tries again and reports its own error.
template <class V, class Measure>
const V& measured_once(std::map<std::string, V>& cache, const std::string& key,
                       Measure&& measure) {
    auto it = cache.find(key);
    if (it == cache.end()) {
        it = cache.emplace(key, measure()).first;
    }
    return it->second;
}

inline const char* verdict(bool met) { return met ? "ok" : "MISSED"; }

/// Prints `v` right-aligned in `width` columns with `decimals` decimals, or "-" when unmeasured.
inline void print_cell(std::optional<double> v, int width, int decimals) {
    if (v) {
        std::printf(" %*.*f", width, decimals, *v);
    } else {
        std::printf(" %*s", width, "-");
    }
}

/// Creates device 0's context and its stream-ordered memory pool (one small allocation through
/// it), so no benchmark pays for either.
/// @throws cuda_error
inline void create_context_and_async_pool() {
    cudawait::check(cudaSetDevice(0), "cudaSetDevice");
    cudawait::stream s;
    void* p = nullptr;
    cudawait::check(cudaMallocAsync(&p, std::size_t{1} << 20, s.get()), "cudaMallocAsync");
    cudawait::check(cudaFreeAsync(p, s.get()), "cudaFreeAsync");
    s.sync();
}

/// Names device 0, the driver, the runtime and the library in the benchmark's context.
/// @throws cuda_error
inline cudaDeviceProp add_device_context() {
    cudaDeviceProp prop{};
    cudawait::check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
    int driver = 0;
    int runtime = 0;
    cudawait::check(cudaDriverGetVersion(&driver), "cudaDriverGetVersion");
    cudawait::check(cudaRuntimeGetVersion(&runtime), "cudaRuntimeGetVersion");
    benchmark::AddCustomContext("gpu", prop.name);
    benchmark::AddCustomContext("cuda_driver", std::to_string(driver));
    benchmark::AddCustomContext("cuda_runtime", std::to_string(runtime));
    benchmark::AddCustomContext("cudawait", cudawait::version_string);
    return prop;
}

/// The programs' main(): without a usable device it says why and returns 2; otherwise it runs
/// `setup` (warm-up, calibration; a throw returns 1), `register_all`, the benchmarks and
/// `summary`, and returns 1 when any benchmark reported an error.
template <class Setup, class Register, class Summary>
int run_main(int argc, char** argv, const char* program, const char* needs, Setup setup,
             Register register_all, Summary summary) {
    benchmark::Initialize(&argc, argv);
    if (benchmark::ReportUnrecognizedArguments(argc, argv)) {
        return 1;
    }
    if (const std::string why = cudawait::no_device_reason(); !why.empty()) {
        std::fprintf(stderr, "%s: no CUDA device: %s\n%s: %s; nothing was run\n", program,
                     why.c_str(), program, needs);
        return 2;
    }
    try {
        setup();
    } catch (const std::exception& e) {
        std::fprintf(stderr, "%s: device set-up failed: %s\n", program, e.what());
        return 1;
    }
    register_all();
    benchmark::RunSpecifiedBenchmarks();
    summary();
    benchmark::Shutdown();
    return g_failures == 0 ? 0 : 1;
}

} // namespace bench
