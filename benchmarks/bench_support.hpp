// SPDX-License-Identifier: Apache-2.0
#pragma once

// What the benchmark programs share: timing and statistics helpers, the interleaving harness
// (every comparison measures its variants side by side, then replays the samples to Google
// Benchmark), the checks of a run's output, the summary's cells, error handling around a
// benchmark body, and the program's main().

#include <cudawait/cudawait.hpp>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <initializer_list>
#include <iterator>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include <cuda_runtime.h>

#include <benchmark/benchmark.h>

namespace bench {

using steady = std::chrono::steady_clock;

/// Benchmarks that reported an error: main() exits with 1 when there are any.
inline int g_failures = 0;

/// The program's name, for messages that do not go through Google Benchmark; set by run_main.
inline const char* g_program = "bench";

inline double seconds(steady::duration d) { return std::chrono::duration<double>(d).count(); }

/// Seconds `f()` takes by the host's clock.
template <class F>
double time_host(F&& f) {
    const auto t0 = steady::now();
    f();
    return seconds(steady::now() - t0);
}

/// 10^9 bytes per second.
inline double gbps(std::size_t bytes, double secs) {
    return static_cast<double>(bytes) / secs * 1e-9;
}

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

// ---- interleaved measurements ------------------------------------------------------------------

/// The samples of each variant of one comparison (seconds per run unless the comparison says
/// otherwise), keyed by the variant's name.
using runs_by_variant = std::map<std::string, std::vector<double>>;

/// Measures the variants of one comparison side by side, so that whatever drifts over the
/// process's life (clocks, the link, the allocators' state) drifts for all of them alike:
/// `warm_ups` untimed rounds of every variant in the given order, then `rounds` rounds of one
/// run of each, the order rotating by one every round (round r starts with variant r mod n).
/// `run(i)` runs variant i once and returns its sample, or a vector of samples, which go to
/// `names[i]`. A comparison whose warm-up differs from a plain run does it first and passes 0.
template <class Names, class Run>
runs_by_variant interleaved(std::int64_t rounds, const Names& names, Run&& run, int warm_ups = 1) {
    const std::size_t n = std::size(names);
    for (int w = 0; w < warm_ups; ++w) {
        for (std::size_t i = 0; i < n; ++i) {
            (void)run(i);
        }
    }
    runs_by_variant runs;
    for (std::int64_t round = 0; round < rounds; ++round) {
        for (std::size_t j = 0; j < n; ++j) {
            const std::size_t i = (static_cast<std::size_t>(round) + j) % n;
            std::vector<double>& mine = runs[std::string(names[i])];
            if constexpr (std::is_convertible_v<decltype(run(i)), double>) {
                mine.push_back(run(i));
            } else {
                auto samples = run(i);
                mine.insert(mine.end(), std::begin(samples), std::end(samples));
            }
        }
    }
    return runs;
}

/// A copy of the samples of `variant`. @throws std::runtime_error when there are none
/// (A copy, not a reference: g++ 13's -Wdangling-reference flags every reference returned by a
/// call that has temporaries among its arguments, and a few dozen doubles cost nothing here.)
inline std::vector<double> samples_of(const runs_by_variant& runs, const std::string& variant) {
    auto it = runs.find(variant);
    if (it == runs.end() || it->second.empty()) {
        throw std::runtime_error("no runs of " + variant + " were measured");
    }
    return it->second;
}

/// Feeds measured samples (seconds) to Google Benchmark as manual iteration times, starting
/// over when there are more iterations than samples.
inline void replay(benchmark::State& state, const std::vector<double>& samples) {
    std::size_t i = 0;
    for (auto _ : state) {
        state.SetIterationTime(samples[i % samples.size()]);
        ++i;
    }
}

/// The value `cache` holds under `key`, measured by `measure()` the first time it is asked for.
/// Paired benchmarks share one measurement this way: whichever runs first takes it. A throw
/// stores nothing, so the next benchmark tries again and reports its own error. Returns a copy
/// (see samples_of).
template <class V, class Measure>
V measured_once(std::map<std::string, V>& cache, const std::string& key, Measure&& measure) {
    auto it = cache.find(key);
    if (it == cache.end()) {
        it = cache.emplace(key, measure()).first;
    }
    return it->second;
}

// ---- checking a run's output -------------------------------------------------------------------

/// Outputs are compared bit for bit: a float's bits.
inline std::uint32_t bits(float f) {
    std::uint32_t u = 0;
    std::memcpy(&u, &f, sizeof u);
    return u;
}

/// Sets out[begin, end) to all-ones bits, a NaN no kernel here produces, so that a run which
/// skips an element cannot pass on the value an earlier run left there.
inline void poison(float* out, std::size_t begin, std::size_t end) {
    std::memset(out + begin, 0xff, (end - begin) * sizeof(float));
}

/// A wrong value is a broken library, not a slow one: says where, then ends the program.
[[noreturn]] inline void wrong_result(const std::string& what, std::size_t i, float expected,
                                      float got) {
    std::fprintf(stderr,
                 "%s: FATAL: %s produced a wrong result at element %zu: expected %a (0x%08x), got "
                 "%a (0x%08x)\n",
                 g_program, what.c_str(), i, static_cast<double>(expected), bits(expected),
                 static_cast<double>(got), bits(got));
    std::fflush(stderr);
    std::abort();
}

/// Ends the program (wrong_result) unless out[i] has the bits of `expected`.
inline void expect_at(const float* out, std::size_t i, float expected, const std::string& what) {
    if (bits(expected) != bits(out[i])) {
        wrong_result(what, i, expected, out[i]);
    }
}

/// Ends the program (wrong_result) unless out[begin, end) equals ref[begin, end) bit for bit.
inline void expect_range(const float* ref, const float* out, std::size_t begin, std::size_t end,
                         const std::string& what) {
    if (std::memcmp(ref + begin, out + begin, (end - begin) * sizeof(float)) == 0) {
        return;
    }
    for (std::size_t i = begin; i < end; ++i) {
        expect_at(out, i, ref[i], what);
    }
}

/// The j-th element of a strided sample: one per stride, at a position within it that varies.
inline std::size_t sample_index(std::size_t j, std::size_t stride) {
    return j * stride + (j * 2654435761ULL) % stride;
}

// ---- the summary -------------------------------------------------------------------------------

inline const char* verdict(bool met) { return met ? "ok" : "MISSED"; }

/// f(*v) when `v` holds a value.
template <class F>
std::optional<double> map_value(std::optional<double> v, F&& f) {
    return v ? std::optional<double>(f(*v)) : std::nullopt;
}

/// num / den when both were measured and den is positive.
inline std::optional<double> ratio_of(std::optional<double> num, std::optional<double> den) {
    if (!num || !den || *den <= 0.0) {
        return std::nullopt;
    }
    return *num / *den;
}

/// Prints `v` right-aligned in `width` columns with `decimals` decimals, or "-" when unmeasured.
inline void print_cell(std::optional<double> v, int width, int decimals) {
    if (v) {
        std::printf(" %*.*f", width, decimals, *v);
    } else {
        std::printf(" %*s", width, "-");
    }
}

/// One cell of a summary row: print_cell's value, width and decimals, then `unit`.
struct cell {
    std::optional<double> value;
    int width;
    int decimals;
    const char* unit = "";
};

/// "  <label, left-aligned in label_width columns>" and the cells, one line.
inline void print_row(const std::string& label, int label_width,
                      std::initializer_list<cell> cells) {
    std::printf("  %-*s", label_width, label.c_str());
    for (const cell& c : cells) {
        print_cell(c.value, c.width, c.decimals);
        std::printf("%s", c.unit);
    }
    std::printf("\n");
}

/// "  <label> <num / den>   target >= <t>: ok|MISSED" (no target: the ratio alone), or "-" when
/// either side is missing.
inline void print_ratio(const std::string& label, std::optional<double> num,
                        std::optional<double> den, std::optional<double> target) {
    std::printf("  %-52s", label.c_str());
    const std::optional<double> r = ratio_of(num, den);
    if (!r) {
        std::printf(" %7s\n", "-");
    } else if (target) {
        std::printf(" %7.3f   target >= %.2f: %s\n", *r, *target, verdict(*r >= *target));
    } else {
        std::printf(" %7.3f\n", *r);
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
    g_program = program;
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
