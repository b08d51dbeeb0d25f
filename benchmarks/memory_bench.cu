// SPDX-License-Identifier: Apache-2.0
//
// memory_bench: what the pinned pool and the library's copies cost compared to the CUDA runtime
// calls they replace.
//
//   1. Allocate + free on a warm pool (the hit path), 4 KiB, 1 MiB and 64 MiB:
//        BM_pool_alloc_free/<size>          pool.allocate(n) + pool.deallocate(p) on a pool that
//                                           reserved enough up front; 200 batches of 1000 pairs,
//                                           each batch timed with steady_clock
//        BM_cudaHostAlloc_free/<size>       cudaHostAlloc(n) + cudaFreeHost, each pair timed
//   2. Growth by 1 GiB (5 timed runs of each, interleaved, after one untimed run of each):
//        BM_pool_reserve_1GiB               construct a pinned_pool + reserve(1 GiB); the pool
//                                           is destroyed outside the timing
//        BM_cudaHostAlloc_1GiB              cudaHostAlloc(1 GiB); cudaFreeHost outside the timing
//   3. Pinned copies, pinned_buffer <-> device_buffer, 8 MiB and 512 MiB, H2D and D2H (the two
//      variants alternate copy by copy, the order swapping every round):
//        BM_pinned_copy_cudawait/<size>/<dir>   cudawait::copy_async + cudaStreamSynchronize
//        BM_pinned_copy_raw/<size>/<dir>        cudaMemcpyAsync + cudaStreamSynchronize
//   4. Pageable copies, pre-faulted pageable host memory <-> device_buffer, 64 MiB and 512 MiB,
//      H2D and D2H (interleaved like 3; a round trip through the staged copy is checked
//      byte for byte first, and the program aborts if it is wrong):
//        BM_pageable_copy_cudawait/<size>/<dir> cudawait::copy_async (staged through the
//                                               default pinned pool) + cudaStreamSynchronize
//        BM_pageable_copy_raw/<size>/<dir>      cudaMemcpyAsync on the same pageable memory +
//                                               cudaStreamSynchronize
//   5. Waste on mixed-size workloads (allocation only, no copies; sizes log-uniform in
//      [1 KiB, 64 MiB], seeded), as peak_reserved_bytes / peak_requested_bytes:
//        BM_pool_waste_batches              30 rounds: allocate until 2 GiB are live, then free
//                                           them all in random order (target <= 1.15)
//        BM_pool_waste_churn                20000 random allocate/free operations with live
//                                           bytes held near 2 GiB (target <= 1.25)
//      The workloads are waste_workload.hpp's; pool_waste_host runs them without a GPU.
//
// All comparisons run in one process, on device 0, on the same buffers and the same stream (a
// cudawait::stream, non-blocking). The paired measurements of 2, 3 and 4 are taken together the
// first time either benchmark of a pair runs; each benchmark then replays its own samples to
// Google Benchmark as manual iteration times. After the benchmarks main() prints a summary with
// the medians, the ratios and the targets. Without a CUDA device the program exits with 2.
//
// GB/s means 10^9 bytes per second. Every figure in the summary is a median.

#include <cudawait/cudawait.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <cuda_runtime.h>

#include "bench_support.hpp"
#include "waste_workload.hpp"
#include <benchmark/benchmark.h>
#include <unistd.h>

namespace bench {

using cudawait::check;
using namespace cudawait::literals;

// ---- parameters ------------------------------------------------------------------------------

constexpr std::size_t kAllocSizes[] = {4_KiB, 1_MiB, 64_MiB};
constexpr std::int64_t kPoolBatches = 200;    ///< timed batches per pool size
constexpr std::size_t kPoolBatchPairs = 1000; ///< allocate+free pairs per batch
constexpr double kPoolTargetNs = 100.0;       ///< target: pool pair at most this

constexpr std::size_t kGrowthBytes = 1_GiB;
constexpr std::int64_t kGrowthRuns = 5; ///< timed runs of each growth variant
constexpr double kGrowthTarget = 0.40;  ///< target: pool / cudaHostAlloc at most this

constexpr double kPinnedTarget = 0.98;     ///< target: cudawait / raw at least this
constexpr double kPageableH2dTarget = 3.0; ///< target: cudawait / raw at least this
constexpr double kPageableD2hTarget = 2.0;

enum class direction { h2d, d2h };

/// A copy size and how many rounds (one copy of each variant per round) it is measured for.
struct copy_case {
    std::size_t bytes;
    std::int64_t rounds;
};

constexpr copy_case kPinnedCases[] = {{8_MiB, 200}, {512_MiB, 20}};
constexpr copy_case kPageableCases[] = {{64_MiB, 30}, {512_MiB, 10}};

// ---- results shared with the summary printed by main() ---------------------------------------

std::map<std::string, double> g_alloc_ns;      ///< "pool/<size>", "host/<size>" -> ns per pair
std::map<std::string, double> g_growth_ms;     ///< "pool", "host" -> ms per 1 GiB
std::map<std::string, double> g_pinned_gbps;   ///< "<variant>/<size>/<dir>" -> GB/s
std::map<std::string, double> g_pageable_gbps; ///< "<variant>/<size>/<dir>" -> GB/s

std::map<std::string, waste_result> g_waste; ///< "batches", "churn"

// ---- helpers -----------------------------------------------------------------------------------

const char* dir_name(direction d) { return d == direction::h2d ? "h2d" : "d2h"; }

std::string copy_key(const char* variant, std::size_t bytes, direction d) {
    return std::string(variant) + "/" + size_name(bytes) + "/" + dir_name(d);
}

/// Fills `n` bytes with a deterministic pseudo-random sequence (splitmix64), which also faults
/// every page in.
void fill_random(std::byte* p, std::size_t n, std::uint64_t seed) {
    std::uint64_t x = seed;
    std::size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        x += 0x9e3779b97f4a7c15ULL;
        std::uint64_t z = x;
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
        z ^= z >> 31;
        std::memcpy(p + i, &z, sizeof z);
    }
    for (; i < n; ++i) {
        p[i] = static_cast<std::byte>(i * 131 + 7);
    }
}

/// The two variants of the copy comparisons (3 and 4), in the order of the first round.
constexpr const char* kCopyVariants[] = {"cudawait", "raw"};

/// Seconds per operation of each variant, measured interleaved (bench::interleaved), keyed by
/// comparison; filled by whichever benchmark of a pair runs first. A failed measurement is not
/// stored: the other benchmark tries again and reports its own error.
std::map<std::string, runs_by_variant> g_measured;

// ---- 1. allocate + free, hit path ---------------------------------------------------------------

/// Median ns per pair over kPoolBatches batches; the pool reserved enough first, so no pair
/// grows it (checked through the pool's statistics).
std::vector<double> measure_pool_alloc_free(std::size_t bytes) {
    cudawait::pinned_pool pool;
    pool.reserve(std::max(2 * bytes, 64_MiB));
    for (std::size_t i = 0; i < kPoolBatchPairs; ++i) { // warm-up: the block map, the caches
        void* p = pool.allocate(bytes);
        benchmark::DoNotOptimize(p);
        pool.deallocate(p);
    }
    const cudawait::pinned_pool_stats before = pool.stats();
    std::vector<double> per_pair;
    per_pair.reserve(static_cast<std::size_t>(kPoolBatches));
    for (std::int64_t b = 0; b < kPoolBatches; ++b) {
        const auto t0 = steady::now();
        for (std::size_t i = 0; i < kPoolBatchPairs; ++i) {
            void* p = pool.allocate(bytes);
            benchmark::DoNotOptimize(p);
            pool.deallocate(p);
        }
        const auto t1 = steady::now();
        per_pair.push_back(seconds(t1 - t0) / static_cast<double>(kPoolBatchPairs));
    }
    const cudawait::pinned_pool_stats after = pool.stats();
    if (after.misses != before.misses || after.growth_count != before.growth_count) {
        throw std::runtime_error("the pool grew during the hit-path loop");
    }
    return per_pair;
}

/// Timed cudaHostAlloc + cudaFreeHost pairs: fewer for large sizes, which take milliseconds.
std::int64_t host_alloc_samples(std::size_t bytes) {
    if (bytes <= 64_KiB) {
        return 2000;
    }
    if (bytes <= 4_MiB) {
        return 300;
    }
    return 20;
}

std::vector<double> measure_host_alloc_free(std::size_t bytes, std::int64_t samples) {
    std::vector<double> per_pair;
    per_pair.reserve(static_cast<std::size_t>(samples));
    for (std::int64_t i = -3; i < samples; ++i) { // 3 untimed warm-up pairs
        void* p = nullptr;
        const auto t0 = steady::now();
        check(cudaHostAlloc(&p, bytes, cudaHostAllocDefault), "cudaHostAlloc");
        benchmark::DoNotOptimize(p);
        check(cudaFreeHost(p), "cudaFreeHost");
        const auto t1 = steady::now();
        if (i >= 0) {
            per_pair.push_back(seconds(t1 - t0));
        }
    }
    return per_pair;
}

void BM_pool_alloc_free(benchmark::State& state, std::size_t bytes) {
    guarded(state, [&] {
        const std::vector<double> per_pair = measure_pool_alloc_free(bytes);
        replay(state, per_pair);
        const double ns = median(per_pair) * 1e9;
        state.counters["ns_per_pair"] = ns;
        g_alloc_ns["pool/" + size_name(bytes)] = ns;
    });
}

void BM_cudaHostAlloc_free(benchmark::State& state, std::size_t bytes) {
    guarded(state, [&] {
        const std::vector<double> per_pair =
            measure_host_alloc_free(bytes, host_alloc_samples(bytes));
        replay(state, per_pair);
        const double ns = median(per_pair) * 1e9;
        state.counters["ns_per_pair"] = ns;
        g_alloc_ns["host/" + size_name(bytes)] = ns;
    });
}

// ---- 2. growth by 1 GiB -------------------------------------------------------------------------

/// Pool growth times also kept apart: the pool's own growth_time (upstream only, no bookkeeping).
std::vector<double> g_pool_growth_time_s;

double time_pool_growth() {
    std::optional<cudawait::pinned_pool> pool;
    const auto t0 = steady::now();
    pool.emplace();
    pool->reserve(kGrowthBytes);
    const auto t1 = steady::now();
    const cudawait::pinned_pool_stats s = pool->stats();
    if (s.reserved_bytes != kGrowthBytes || s.growth_count != 1) {
        throw std::runtime_error("pinned_pool::reserve(1 GiB) reserved " +
                                 std::to_string(s.reserved_bytes) + " bytes in " +
                                 std::to_string(s.growth_count) + " growth steps");
    }
    g_pool_growth_time_s.push_back(std::chrono::duration<double>(s.growth_time).count());
    pool.reset(); // untimed: cudaHostUnregister + munmap
    return seconds(t1 - t0);
}

double time_host_alloc_growth() {
    void* p = nullptr;
    const auto t0 = steady::now();
    check(cudaHostAlloc(&p, kGrowthBytes, cudaHostAllocDefault), "cudaHostAlloc");
    const auto t1 = steady::now();
    check(cudaFreeHost(p), "cudaFreeHost"); // untimed
    return seconds(t1 - t0);
}

runs_by_variant measure_growth() {
    (void)time_pool_growth(); // warm-up: fault-in threads, first registration, first allocation
    (void)time_host_alloc_growth();
    g_pool_growth_time_s.clear(); // the warm-up's, which is why the warm-up is done here
    constexpr const char* variants[] = {"pool", "host"};
    return interleaved(
        kGrowthRuns, variants,
        [](std::size_t v) { return v == 0 ? time_pool_growth() : time_host_alloc_growth(); }, 0);
}

void BM_pool_reserve_1GiB(benchmark::State& state) {
    guarded(state, [&] {
        const std::vector<double> runs =
            samples_of(measured_once(g_measured, "growth", measure_growth), "pool");
        replay(state, runs);
        const double ms = median(runs) * 1e3;
        state.counters["ms"] = ms;
        if (!g_pool_growth_time_s.empty()) {
            state.counters["upstream_ms"] = median(g_pool_growth_time_s) * 1e3;
        }
        g_growth_ms["pool"] = ms;
    });
}

void BM_cudaHostAlloc_1GiB(benchmark::State& state) {
    guarded(state, [&] {
        const std::vector<double> runs =
            samples_of(measured_once(g_measured, "growth", measure_growth), "host");
        replay(state, runs);
        const double ms = median(runs) * 1e3;
        state.counters["ms"] = ms;
        g_growth_ms["host"] = ms;
    });
}

// ---- 3. pinned copies ---------------------------------------------------------------------------

/// One library copy between the buffers, waited for with cudaStreamSynchronize.
double time_pinned_cudawait(cudawait::device_buffer<std::byte>& dev,
                            cudawait::pinned_buffer<std::byte>& host, cudaStream_t s, direction d) {
    const auto t0 = steady::now();
    if (d == direction::h2d) {
        cudawait::copy_async(dev, host, s);
    } else {
        cudawait::copy_async(host, dev, s);
    }
    check(cudaStreamSynchronize(s), "cudaStreamSynchronize");
    return seconds(steady::now() - t0);
}

/// The same copy by hand.
double time_pinned_raw(cudawait::device_buffer<std::byte>& dev,
                       cudawait::pinned_buffer<std::byte>& host, cudaStream_t s, direction d) {
    const std::size_t n = dev.size_bytes();
    const auto t0 = steady::now();
    if (d == direction::h2d) {
        check(cudaMemcpyAsync(dev.data(), host.data(), n, cudaMemcpyHostToDevice, s),
              "cudaMemcpyAsync");
    } else {
        check(cudaMemcpyAsync(host.data(), dev.data(), n, cudaMemcpyDeviceToHost, s),
              "cudaMemcpyAsync");
    }
    check(cudaStreamSynchronize(s), "cudaStreamSynchronize");
    return seconds(steady::now() - t0);
}

runs_by_variant measure_pinned_copy(std::size_t bytes, std::int64_t rounds, direction d) {
    cudawait::stream stream;    // destroyed last: the buffers free on it
    cudawait::pinned_pool pool; // destroyed after the buffer, waiting for its recorded uses
    cudawait::pinned_buffer<std::byte> host(bytes, pool);
    fill_random(host.data(), bytes, bytes);
    cudawait::device_buffer<std::byte> dev(bytes, stream);
    const cudaStream_t s = stream.get();
    check(cudaMemcpyAsync(dev.data(), host.data(), bytes, cudaMemcpyHostToDevice, s),
          "cudaMemcpyAsync");
    check(cudaStreamSynchronize(s), "cudaStreamSynchronize");
    return interleaved(
        rounds, kCopyVariants,
        [&](std::size_t v) {
            return v == 0 ? time_pinned_cudawait(dev, host, s, d)
                          : time_pinned_raw(dev, host, s, d);
        },
        2); // two warm-up rounds
}

void BM_pinned_copy(benchmark::State& state, bool library, std::size_t bytes, std::int64_t rounds,
                    direction d) {
    guarded(state, [&] {
        const runs_by_variant runs = measured_once(g_measured, copy_key("pinned", bytes, d), [&] {
            return measure_pinned_copy(bytes, rounds, d);
        });
        const std::vector<double> mine = samples_of(runs, kCopyVariants[library ? 0 : 1]);
        replay(state, mine);
        state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(bytes));
        const double rate = gbps(bytes, median(mine));
        state.counters["GBps"] = rate;
        g_pinned_gbps[copy_key(library ? "cudawait" : "raw", bytes, d)] = rate;
    });
}

// ---- 4. pageable copies -------------------------------------------------------------------------

/// Pageable host memory whose pages are all faulted in: random bytes, or zeros.
std::unique_ptr<std::byte[]> pageable(std::size_t bytes, bool random, std::uint64_t seed) {
    auto p = std::make_unique_for_overwrite<std::byte[]>(bytes);
    if (random) {
        fill_random(p.get(), bytes, seed);
    } else {
        std::memset(p.get(), 0, bytes);
    }
    return p;
}

/// Outside any timing: `src` -> device -> `dst` through the staged copies, then compared byte for
/// byte. A wrong byte is not a benchmark failure but a broken library: the program stops.
void verify_staged_round_trip(std::span<const std::byte> src, std::span<std::byte> dst,
                              cudawait::device_buffer<std::byte>& dev, cudaStream_t s) {
    std::memset(dst.data(), 0, dst.size());
    cudawait::copy_async(dev, src, s);
    cudawait::copy_async(dst, dev, s);
    check(cudaStreamSynchronize(s), "cudaStreamSynchronize");
    if (std::memcmp(src.data(), dst.data(), src.size()) != 0) {
        const auto mismatch = std::mismatch(src.begin(), src.end(), dst.begin());
        const auto at = static_cast<std::size_t>(mismatch.first - src.begin());
        std::fprintf(stderr,
                     "memory_bench: FATAL: staged copy round trip of %zu bytes (pageable -> "
                     "device -> pageable) produced wrong data: first difference at byte %zu "
                     "(sent 0x%02x, got back 0x%02x)\n",
                     src.size(), at, static_cast<unsigned>(*mismatch.first),
                     static_cast<unsigned>(*mismatch.second));
        std::fflush(stderr);
        std::abort();
    }
}

double time_pageable_cudawait(cudawait::device_buffer<std::byte>& dev, std::byte* host,
                              cudaStream_t s, direction d) {
    const std::span<std::byte> h(host, dev.size());
    const auto t0 = steady::now();
    if (d == direction::h2d) {
        cudawait::copy_async(dev, std::span<const std::byte>(h), s);
    } else {
        cudawait::copy_async(h, dev, s);
    }
    check(cudaStreamSynchronize(s), "cudaStreamSynchronize");
    return seconds(steady::now() - t0);
}

double time_pageable_raw(cudawait::device_buffer<std::byte>& dev, std::byte* host, cudaStream_t s,
                         direction d) {
    const std::size_t n = dev.size_bytes();
    const auto t0 = steady::now();
    if (d == direction::h2d) {
        check(cudaMemcpyAsync(dev.data(), host, n, cudaMemcpyHostToDevice, s), "cudaMemcpyAsync");
    } else {
        check(cudaMemcpyAsync(host, dev.data(), n, cudaMemcpyDeviceToHost, s), "cudaMemcpyAsync");
    }
    check(cudaStreamSynchronize(s), "cudaStreamSynchronize");
    return seconds(steady::now() - t0);
}

runs_by_variant measure_pageable_copy(std::size_t bytes, std::int64_t rounds, direction d) {
    cudawait::stream stream; // destroyed last: the device buffer frees on it
    const std::unique_ptr<std::byte[]> src = pageable(bytes, true, bytes ^ 0x5eed);
    const std::unique_ptr<std::byte[]> dst = pageable(bytes, false, 0);
    cudawait::device_buffer<std::byte> dev(bytes, stream);
    const cudaStream_t s = stream.get();
    verify_staged_round_trip({src.get(), bytes}, {dst.get(), bytes}, dev, s);

    // H2D reads `src`, D2H writes `dst`; both are pre-faulted and already touched by the check.
    std::byte* host = d == direction::h2d ? src.get() : dst.get();
    // Two warm-up rounds: staging chunks in the default pool, memcpy threads.
    return interleaved(
        rounds, kCopyVariants,
        [&](std::size_t v) {
            return v == 0 ? time_pageable_cudawait(dev, host, s, d)
                          : time_pageable_raw(dev, host, s, d);
        },
        2);
}

void BM_pageable_copy(benchmark::State& state, bool library, std::size_t bytes, std::int64_t rounds,
                      direction d) {
    guarded(state, [&] {
        const runs_by_variant& runs =
            measured_once(g_measured, copy_key("pageable", bytes, d),
                          [&] { return measure_pageable_copy(bytes, rounds, d); });
        const std::vector<double> mine = samples_of(runs, kCopyVariants[library ? 0 : 1]);
        replay(state, mine);
        state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(bytes));
        const double rate = gbps(bytes, median(mine));
        state.counters["GBps"] = rate;
        g_pageable_gbps[copy_key(library ? "cudawait" : "raw", bytes, d)] = rate;
    });
}

// ---- 5. waste on a mixed-size workload ----------------------------------------------------------

void BM_pool_waste(benchmark::State& state, bool batches) {
    guarded(state, [&] {
        const auto t0 = steady::now();
        const waste_result r = [&] { // the pool's teardown is timed too
            cudawait::pinned_pool pool(waste_pool_options());
            return run_waste_workload(pool, batches);
        }();
        const double secs = seconds(steady::now() - t0);
        for (auto _ : state) {
            state.SetIterationTime(secs);
        }
        const double ratio =
            static_cast<double>(r.peak_reserved) / static_cast<double>(r.peak_live);
        state.counters["waste_ratio"] = ratio;
        state.counters["peak_reserved_GiB"] = static_cast<double>(r.peak_reserved) / 0x1p30;
        state.counters["peak_live_GiB"] = static_cast<double>(r.peak_live) / 0x1p30;
        state.counters["hits"] = static_cast<double>(r.hits);
        state.counters["misses"] = static_cast<double>(r.misses);
        state.counters["growth_count"] = static_cast<double>(r.growth_count);
        g_waste[batches ? "batches" : "churn"] = r;
    });
}
void BM_pool_waste_batches(benchmark::State& state) { BM_pool_waste(state, true); }
void BM_pool_waste_churn(benchmark::State& state) { BM_pool_waste(state, false); }

// ---- setup and summary --------------------------------------------------------------------------

/// Creates the context and the stream-ordered memory pool, so no benchmark pays for them.
void warm_up_device() {
    create_context_and_async_pool();

    add_device_context();
    const long pages = ::sysconf(_SC_PHYS_PAGES);
    const long page = ::sysconf(_SC_PAGESIZE);
    if (pages > 0 && page > 0) {
        benchmark::AddCustomContext(
            "host_memory_GiB",
            std::to_string(static_cast<std::size_t>(pages) * static_cast<std::size_t>(page) >> 30));
    }
}

void register_benchmarks() {
    using benchmark::RegisterBenchmark;
    // 1. Each iteration is fed one measured time per pair (per batch of 1000 for the pool).
    for (std::size_t bytes : kAllocSizes) {
        RegisterBenchmark(("BM_pool_alloc_free/" + size_name(bytes)).c_str(), &BM_pool_alloc_free,
                          bytes)
            ->UseManualTime()
            ->Iterations(kPoolBatches)
            ->Unit(benchmark::kNanosecond);
        RegisterBenchmark(("BM_cudaHostAlloc_free/" + size_name(bytes)).c_str(),
                          &BM_cudaHostAlloc_free, bytes)
            ->UseManualTime()
            ->Iterations(host_alloc_samples(bytes))
            ->Unit(benchmark::kMicrosecond);
    }
    // 2. Each iteration is one growth by 1 GiB.
    for (auto [name, fn] : {std::pair{"BM_pool_reserve_1GiB", &BM_pool_reserve_1GiB},
                            std::pair{"BM_cudaHostAlloc_1GiB", &BM_cudaHostAlloc_1GiB}}) {
        RegisterBenchmark(name, fn)
            ->UseManualTime()
            ->Iterations(kGrowthRuns)
            ->Unit(benchmark::kMillisecond);
    }
    // 3. and 4. Each iteration is one copy (with its synchronisation).
    for (const copy_case& c : kPinnedCases) {
        for (direction d : {direction::h2d, direction::d2h}) {
            for (bool library : {true, false}) {
                const std::string name =
                    std::string(library ? "BM_pinned_copy_cudawait/" : "BM_pinned_copy_raw/") +
                    size_name(c.bytes) + "/" + dir_name(d);
                RegisterBenchmark(name.c_str(), &BM_pinned_copy, library, c.bytes, c.rounds, d)
                    ->UseManualTime()
                    ->Iterations(c.rounds)
                    ->Unit(benchmark::kMicrosecond);
            }
        }
    }
    for (const copy_case& c : kPageableCases) {
        for (direction d : {direction::h2d, direction::d2h}) {
            for (bool library : {true, false}) {
                const std::string name =
                    std::string(library ? "BM_pageable_copy_cudawait/" : "BM_pageable_copy_raw/") +
                    size_name(c.bytes) + "/" + dir_name(d);
                RegisterBenchmark(name.c_str(), &BM_pageable_copy, library, c.bytes, c.rounds, d)
                    ->UseManualTime()
                    ->Iterations(c.rounds)
                    ->Unit(benchmark::kMillisecond);
            }
        }
    }
    // 5. One iteration: the whole workload.
    RegisterBenchmark("BM_pool_waste_batches", &BM_pool_waste_batches)
        ->UseManualTime()
        ->Iterations(1)
        ->Unit(benchmark::kMillisecond);
    RegisterBenchmark("BM_pool_waste_churn", &BM_pool_waste_churn)
        ->UseManualTime()
        ->Iterations(1)
        ->Unit(benchmark::kMillisecond);
}

void print_alloc_summary() {
    std::printf("\nPool allocate+free, hit path (median ns per allocate+free pair; pool: %lld "
                "batches of %zu pairs)\n",
                static_cast<long long>(kPoolBatches), kPoolBatchPairs);
    std::printf("  %-8s %12s %28s %12s   %s\n", "size", "pool ns", "cudaHostAlloc+cudaFreeHost ns",
                "raw / pool", "target pool <= 100 ns");
    for (std::size_t bytes : kAllocSizes) {
        const std::string size = size_name(bytes);
        const auto pool = find(g_alloc_ns, "pool/" + size);
        const auto host = find(g_alloc_ns, "host/" + size);
        if (!pool && !host) {
            continue;
        }
        std::printf("  %-8s", size.c_str());
        print_cell(pool, 12, 1);
        print_cell(host, 28, 0);
        if (pool && host && *pool > 0.0) {
            std::printf(" %11.0fx", *host / *pool);
        } else {
            std::printf(" %12s", "-");
        }
        std::printf("   %s\n", pool ? verdict(*pool <= kPoolTargetNs) : "-");
    }
}

void print_growth_summary() {
    const auto pool = find(g_growth_ms, "pool");
    const auto host = find(g_growth_ms, "host");
    if (!pool && !host) {
        return;
    }
    std::printf("\nGrowth by 1 GiB (median of %lld interleaved runs of each)\n",
                static_cast<long long>(kGrowthRuns));
    if (pool) {
        std::printf("  pinned_pool + reserve(1 GiB)   %9.1f ms", *pool);
        if (!g_pool_growth_time_s.empty()) {
            std::printf("   (upstream slab source: %.1f ms)", median(g_pool_growth_time_s) * 1e3);
        }
        std::printf("\n");
    }
    if (host) {
        std::printf("  cudaHostAlloc(1 GiB)           %9.1f ms\n", *host);
    }
    if (pool && host && *host > 0.0) {
        const double ratio = *pool / *host;
        std::printf("  pool / cudaHostAlloc           %9.3f      target <= %.2f: %s\n", ratio,
                    kGrowthTarget, verdict(ratio <= kGrowthTarget));
    }
}

template <std::size_t N>
void print_copy_summary(const char* title, const std::map<std::string, double>& rates,
                        const copy_case (&cases)[N], double h2d_target, double d2h_target,
                        std::size_t only_at = 0) {
    if (rates.empty()) {
        return;
    }
    std::printf("\n%s\n", title);
    std::printf("  %-8s %-4s %7s %14s %14s %14s   %s\n", "size", "dir", "rounds", "cudawait GB/s",
                "raw GB/s", "cudawait / raw", "target");
    for (const copy_case& c : cases) {
        for (direction d : {direction::h2d, direction::d2h}) {
            const auto lib = find(rates, copy_key("cudawait", c.bytes, d));
            const auto raw = find(rates, copy_key("raw", c.bytes, d));
            if (!lib && !raw) {
                continue;
            }
            const double target = d == direction::h2d ? h2d_target : d2h_target;
            std::printf("  %-8s %-4s %7lld", size_name(c.bytes).c_str(), dir_name(d),
                        static_cast<long long>(c.rounds));
            print_cell(lib, 14, 2);
            print_cell(raw, 14, 2);
            const bool targeted = only_at == 0 || only_at == c.bytes;
            if (lib && raw && *raw > 0.0 && !targeted) {
                std::printf(" %14.3f   (for information)\n", *lib / *raw);
            } else if (lib && raw && *raw > 0.0) {
                const double ratio = *lib / *raw;
                std::printf(" %14.3f   >= %.2f: %s\n", ratio, target, verdict(ratio >= target));
            } else {
                std::printf(" %14s   >= %.2f: -\n", "-", target);
            }
        }
    }
}

void print_waste_summary() {
    for (const char* name : {"batches", "churn"}) {
        auto it = g_waste.find(name);
        if (it == g_waste.end()) {
            continue;
        }
        const waste_result& r = it->second;
        const bool batches = std::string(name) == "batches";
        const double ratio =
            static_cast<double>(r.peak_reserved) / static_cast<double>(r.peak_live);
        if (batches) {
            std::printf("\nWaste, %d rounds of: allocate until %s are live, free all; sizes "
                        "log-uniform %s..%s\n",
                        kWasteRounds, size_name(kWasteLiveTarget).c_str(),
                        size_name(kWasteMinBytes).c_str(), size_name(kWasteMaxBytes).c_str());
        } else {
            std::printf("\nWaste under random churn, %d allocate/free operations, live bytes "
                        "held near %s\n",
                        kWasteOps, size_name(kWasteLiveTarget).c_str());
        }
        std::printf("  peak reserved %.3f GiB / peak requested %.3f GiB = %.3f",
                    static_cast<double>(r.peak_reserved) / 0x1p30,
                    static_cast<double>(r.peak_live) / 0x1p30, ratio);
        const double target = batches ? kWasteTarget : kWasteChurnTarget;
        std::printf("   target <= %.2f: %s\n", target, verdict(ratio <= target));
        std::printf("  peak in use (blocks as handed out) / peak requested %.3f\n",
                    static_cast<double>(r.peak_in_use) / static_cast<double>(r.peak_live));
        std::printf("  %zu allocations, %zu frees; pool hits %llu, misses %llu, growth_count "
                    "%llu, growth time %.1f ms\n",
                    r.allocations, r.frees, static_cast<unsigned long long>(r.hits),
                    static_cast<unsigned long long>(r.misses),
                    static_cast<unsigned long long>(r.growth_count), r.growth_ms);
    }
}

void print_summary() {
    std::printf("\n==== memory_bench summary (medians; ratios within this run) ====\n");
    print_alloc_summary();
    print_growth_summary();
    print_copy_summary("Pinned copies, pinned_buffer <-> device_buffer (GB/s = 1e9 bytes/s)",
                       g_pinned_gbps, kPinnedCases, kPinnedTarget, kPinnedTarget);
    print_copy_summary("Pageable copies, pre-faulted pageable memory <-> device_buffer, staged "
                       "copy_async vs\ncudaMemcpyAsync on the same memory (GB/s = 1e9 bytes/s)",
                       g_pageable_gbps, kPageableCases, kPageableH2dTarget, kPageableD2hTarget,
                       512_MiB); // the targets are stated at 512 MiB
    print_waste_summary();
    if (g_failures != 0) {
        std::printf("\n%d benchmark(s) reported an error; see their rows above\n", g_failures);
    }
    std::fflush(stdout);
}

} // namespace bench

int main(int argc, char** argv) {
    return bench::run_main(argc, argv, "memory_bench",
                           "every benchmark here needs a GPU (the pinned pool registers its "
                           "memory with CUDA)",
                           bench::warm_up_device, bench::register_benchmarks, bench::print_summary);
}
