// SPDX-License-Identifier: Apache-2.0
//
// lane_bench: does a small awaited copy wait behind a pipeline's bulk chunks? The latency of a
// 4 KiB copy (H2D, then D2H back), awaited by one coroutine, on an idle link and while a
// pipeline<float> streams 64 MiB chunks in both directions (pinned data, depth 3, a light
// kernel) in the same scheduler; and the pipeline's throughput with and without the small copies.
//
//   Small-copy variants (each measured idle, then under bulk; BM_small/<variant>/<h2d|d2h>_<idle|
//   bulk>, the copy's awaited latency in microseconds):
//     plain                  co_await copy(dst, src, s): s a plain non-blocking stream of
//                            default priority, made by the user
//     high_priority          the same on a stream of the device's greatest priority
//     lane                   co_await copy(dst, src): the library's small copy lane
//                            (copy_lane.hpp), pinned host memory; the library's default (a
//                            D2H copy goes by the SMs while a bulk D2H stream is busy:
//                            copy_options::busy_sm_copy_bytes)
//     lane_engine            the same with busy_sm_copy_bytes = 0: a copy engine always
//     lane_pageable          the same from and into pageable memory: staged through one pinned
//                            block from the pool
//     lane_pageable_direct   cudaMemcpyAsync of the pageable memory on the small lane's stream,
//                            then co_await the stream (the driver's own staging; its D2H
//                            blocks the scheduler's thread until the bytes are in place)
//     sm_copy                a one-block kernel of 16-byte loads and stores over the pinned
//                            memory on the small lane's stream: the SMs copy, no copy engine
//     lane_sm                co_await copy(dst, src, options) with options.sm_copy_bytes =
//                            64 KiB: the library's small lane, its copy made by the SMs
//                            (detail/sm_copy.hpp)
//     round_trip             no copy: an event recorded on the small lane's stream, awaited.
//                            The least any awaited GPU work takes, so its ratio is the floor
//                            under every copy's (printed for information)
//   Bulk (BM_bulk/<setting>, seconds per run of kBulkBytes each way):
//     alone_whole                        the pipeline alone
//     with_<variant>                     the runs made while <variant>'s small copies ran
//
// How a small-copy sample is taken. One coroutine repeats: fill the 4 KiB source with new
// random words, poison the 4 KiB read-back buffer, co_await the H2D copy (timed), co_await the
// D2H copy back (timed), compare every word, sleep kPause. Under bulk, a second coroutine of
// the same scheduler (poll_policy::spinning) runs the pipeline batch after batch; a copy counts
// only if it ran within a batch's steady state (from kRampChunks chunk times after the batch
// began to as many before it ended: both directions busy), and batches continue until each
// direction has kSamples such copies (after kMaxBulkRuns batches, fewer do, kMinSamples at
// least; the counts are printed; a direction with fewer counts the copies that began within a
// steady state, since one that waits for the batch's last chunk ends after it, and a variant
// still short of kMinSamples is reported on what it has, with a line that says so). Each batch's
// output is poisoned (a strided sample and every chunk's first and last element) before and checked
// after; a wrong value ends the program. Latencies are the median and p99 (nearest rank). The
// summary's targets compare medians under bulk from the same run: the default lane against the
// best variant in each direction, and a plain stream's D2H against the lane's; each variant's
// under bulk / idle ratio is printed for information.
//
// Every coroutine here is a free function in namespace `bench` taking its state through
// parameters (see await_bench.cu for why).

#include <cudawait/cudawait.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <iterator>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <cuda_runtime.h>

#include "bench_support.hpp"
#include <benchmark/benchmark.h>

namespace bench {

using cudawait::check;
using namespace cudawait::literals;
using float_pipeline = cudawait::pipeline<float>;

// ---- parameters ------------------------------------------------------------------------------

constexpr std::size_t kSmallBytes = 4_KiB; ///< the small copy
constexpr std::size_t kSmall = kSmallBytes / sizeof(std::uint32_t);
constexpr std::size_t kSamples = 256;            ///< small copies per direction, variant and state
constexpr std::chrono::microseconds kPause{100}; ///< between two small round trips
constexpr std::size_t kChunkBytes = 64_MiB;      ///< the pipeline's chunk
constexpr std::size_t kChunk = kChunkBytes / sizeof(float);
constexpr unsigned kDepth = 3;
constexpr std::size_t kBulkBytes = 1_GiB; ///< one batch, each way
constexpr std::size_t kBulk = kBulkBytes / sizeof(float);
constexpr double kRampChunks = 3; ///< chunk times at either end of a batch that do not count
constexpr int kMaxBulkRuns = 400; ///< batches per variant before settling for fewer
/// Steady small copies per direction below which a variant's figures mean nothing.
constexpr std::size_t kMinSamples = 32;
constexpr std::int64_t kBulkRounds = 5;     ///< interleaved runs of each pipeline alone
constexpr std::size_t kOutputStride = 4096; ///< one checked output element per this many
constexpr float kA = 1.5f;
constexpr float kB = 0.25f;

/// Under bulk, the default lane's median latency over the best variant's, per direction, at most.
constexpr double kBestTarget = 1.1;
/// Under bulk, a plain stream's D2H median latency over the default lane's, at least.
constexpr double kPlainD2hTarget = 50.0;
constexpr double kBulkTarget = 0.98; ///< bulk with small copies / alone, at least

enum class kind {
    plain,
    high_priority,
    lane,
    lane_engine,
    lane_pageable,
    lane_pageable_direct,
    sm_copy,
    lane_sm,
    round_trip
};

struct variant {
    std::string name;
    kind how;
};

std::vector<variant> variants() {
    return {{"plain", kind::plain},
            {"high_priority", kind::high_priority},
            {"lane", kind::lane},
            {"lane_engine", kind::lane_engine},
            {"lane_pageable", kind::lane_pageable},
            {"lane_pageable_direct", kind::lane_pageable_direct},
            {"sm_copy", kind::sm_copy},
            {"lane_sm", kind::lane_sm},
            {"round_trip", kind::round_trip}};
}

// ---- results shared with the summary printed by main() ---------------------------------------

/// "<variant>/<h2d|d2h>_<idle|bulk>" -> latencies in seconds.
std::map<std::string, std::vector<double>> g_latency;
/// "alone_whole", "with_<variant>" -> seconds per batch.
std::map<std::string, std::vector<double>> g_bulk;
bool g_measured = false;
std::string g_measure_error; ///< why the measurement failed, once: not tried again

/// Nearest-rank percentile (`p` in [0, 1]) of `sorted`, which must be sorted and non-empty.
double percentile(const std::vector<double>& sorted, double p) {
    const auto rank = std::clamp<std::size_t>(
        static_cast<std::size_t>(std::ceil(p * static_cast<double>(sorted.size()))), 1,
        sorted.size());
    return sorted[rank - 1];
}

// ---- kernel and data ---------------------------------------------------------------------------

__global__ void light_kernel(const float* in, float* out, std::size_t n, float a, float b) {
    const std::size_t stride = std::size_t{gridDim.x} * blockDim.x;
    for (std::size_t i = std::size_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n; i += stride) {
        out[i] = __fmaf_rn(in[i], a, b);
    }
}

int g_sm_count = 0;

struct light_stage {
    void operator()(std::span<float> in, std::span<float> out, cudawait::stream_ref s) const {
        const unsigned blocks = static_cast<unsigned>(g_sm_count) * 8;
        light_kernel<<<blocks, 256, 0, s.get()>>>(in.data(), out.data(), in.size(), kA, kB);
        check(cudaGetLastError(), "light_kernel");
    }
};

std::uint64_t splitmix(std::uint64_t& x) {
    std::uint64_t z = (x += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

/// The pipeline's data: random floats in [0, 1) in, pinned; the output pinned.
struct bulk_data {
    cudawait::pinned_buffer<float> in{kBulk};
    cudawait::pinned_buffer<float> out{kBulk};
    bulk_data() {
        std::uint64_t x = 12345;
        for (std::size_t i = 0; i < kBulk; ++i) {
            in.data()[i] = static_cast<float>(splitmix(x) >> 40) * 0x1p-24f;
        }
    }
    /// The checked elements: a strided sample and each chunk's first and last.
    template <class F>
    void for_checked(F&& f) const {
        for (std::size_t j = 0; j < kBulk / kOutputStride; ++j) {
            f(sample_index(j, kOutputStride));
        }
        for (std::size_t c = 0; c < kBulk; c += kChunk) {
            f(c);
            f(std::min(c + kChunk, kBulk) - 1);
        }
    }
    void poison_checked() {
        for_checked([&](std::size_t i) { poison(out.data(), i, i + 1); });
    }
    void check(const std::string& what) const {
        for_checked([&](std::size_t i) {
            expect_at(out.data(), i, std::fmaf(in.data()[i], kA, kB), what);
        });
    }
};

std::unique_ptr<float_pipeline> make_pipeline() {
    cudawait::pipeline_options o;
    o.depth = kDepth;
    o.chunk_elements = kChunk;
    return std::make_unique<float_pipeline>(std::move(o),
                                            std::vector<float_pipeline::stage>{light_stage{}});
}

// ---- the small copies --------------------------------------------------------------------------

/// A small copy's resources: the device buffer, host buffers of both kinds, the user streams.
struct small_context {
    cudawait::stream plain{cudawait::device_ref(0),
                           cudawait::priority_low(cudawait::device_ref(0))};
    cudawait::stream high{cudawait::device_ref(0),
                          cudawait::priority_high(cudawait::device_ref(0))};
    cudawait::device_buffer<std::uint32_t> dev{kSmall, plain};
    cudawait::pinned_buffer<std::uint32_t> pinned_src{kSmall};
    cudawait::pinned_buffer<std::uint32_t> pinned_back{kSmall};
    std::vector<std::uint32_t> pageable_src = std::vector<std::uint32_t>(kSmall);
    std::vector<std::uint32_t> pageable_back = std::vector<std::uint32_t>(kSmall);
    std::uint64_t seed = 1;
    small_context() { plain.sync(); }
};

/// One timed copy's start and ends.
struct round_trip {
    steady::time_point start;
    steady::time_point h2d_end;
    steady::time_point d2h_end;
};

/// A lane copy made by hand: cudaMemcpyAsync on the small lane's stream, then co_await it.
cudawait::task<void> direct_on_lane(void* dst, const void* src, cudawait::copy_direction dir) {
    const cudawait::stream_ref s = cudawait::small_copy_stream(cudawait::device_ref(0), dir);
    check(cudaMemcpyAsync(dst, src, kSmallBytes, cudaMemcpyDefault, s.get()), "cudaMemcpyAsync");
    co_await s;
}

/// The copy made by the SMs instead of a copy engine: one block of 16-byte loads and stores
/// over page-locked host memory (device-accessible by its host address), on the small lane.
__global__ void sm_copy_words(const uint4* src, uint4* dst, std::size_t n) {
    for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
        dst[i] = src[i];
    }
}

cudawait::task<void> sm_copy_on_lane(void* dst, const void* src, cudawait::copy_direction dir) {
    const cudawait::stream_ref s = cudawait::small_copy_stream(cudawait::device_ref(0), dir);
    sm_copy_words<<<1, 256, 0, s.get()>>>(static_cast<const uint4*>(src), static_cast<uint4*>(dst),
                                          kSmallBytes / sizeof(uint4));
    check(cudaGetLastError(), "sm_copy_words");
    co_await s;
}

/// The round_trip variant: an event on the small lane's stream, awaited; nothing is copied.
cudawait::task<void> round_trip_on_lane(cudawait::copy_direction dir) {
    const cudawait::stream_ref s = cudawait::small_copy_stream(cudawait::device_ref(0), dir);
    co_await s;
}

/// The lane_engine variant's options: every small-lane copy made by a copy engine.
cudawait::copy_options engine_options() {
    cudawait::copy_options o;
    o.busy_sm_copy_bytes = 0;
    return o;
}

/// The lane_sm variant's options: small-lane copies made by the SMs.
cudawait::copy_options sm_options() {
    cudawait::copy_options o;
    o.sm_copy_bytes = 64_KiB;
    return o;
}

cudawait::task<void> small_h2d(small_context& c, kind how) {
    cudawait::pinned_buffer<std::uint32_t>& pinned = c.pinned_src;
    switch (how) {
    case kind::plain:
        co_await cudawait::copy(c.dev, pinned, c.plain);
        break;
    case kind::high_priority:
        co_await cudawait::copy(c.dev, pinned, c.high);
        break;
    case kind::lane:
        co_await cudawait::copy(c.dev, pinned);
        break;
    case kind::lane_engine:
        co_await cudawait::copy(c.dev, pinned, engine_options());
        break;
    case kind::lane_pageable:
        co_await cudawait::copy(c.dev, c.pageable_src);
        break;
    case kind::lane_pageable_direct:
        co_await direct_on_lane(c.dev.data(), c.pageable_src.data(), cudawait::copy_direction::h2d);
        break;
    case kind::sm_copy:
        co_await sm_copy_on_lane(c.dev.data(), pinned.data(), cudawait::copy_direction::h2d);
        break;
    case kind::lane_sm:
        co_await cudawait::copy(c.dev, pinned, sm_options());
        break;
    case kind::round_trip:
        co_await round_trip_on_lane(cudawait::copy_direction::h2d);
        break;
    }
}

cudawait::task<void> small_d2h(small_context& c, kind how) {
    cudawait::pinned_buffer<std::uint32_t>& pinned = c.pinned_back;
    switch (how) {
    case kind::plain:
        co_await cudawait::copy(pinned, c.dev, c.plain);
        break;
    case kind::high_priority:
        co_await cudawait::copy(pinned, c.dev, c.high);
        break;
    case kind::lane:
        co_await cudawait::copy(pinned, c.dev);
        break;
    case kind::lane_engine:
        co_await cudawait::copy(pinned, c.dev, engine_options());
        break;
    case kind::lane_pageable:
        co_await cudawait::copy(c.pageable_back, c.dev);
        break;
    case kind::lane_pageable_direct:
        co_await direct_on_lane(c.pageable_back.data(), c.dev.data(),
                                cudawait::copy_direction::d2h);
        break;
    case kind::sm_copy:
        co_await sm_copy_on_lane(pinned.data(), c.dev.data(), cudawait::copy_direction::d2h);
        break;
    case kind::lane_sm:
        co_await cudawait::copy(pinned, c.dev, sm_options());
        break;
    case kind::round_trip:
        co_await round_trip_on_lane(cudawait::copy_direction::d2h);
        break;
    }
}

/// Small round trips, each checked word by word, until `want` were made (idle: stop is null)
/// or `stop` is set.
cudawait::task<void> small_copies(small_context* c, kind how, std::size_t want,
                                  const std::atomic<bool>* stop, std::vector<round_trip>* log,
                                  std::string what) {
    const bool pageable = how == kind::lane_pageable || how == kind::lane_pageable_direct;
    std::uint32_t* src = pageable ? c->pageable_src.data() : c->pinned_src.data();
    std::uint32_t* back = pageable ? c->pageable_back.data() : c->pinned_back.data();
    for (std::size_t i = 0; stop != nullptr ? !stop->load() : i < want; ++i) {
        for (std::size_t k = 0; k < kSmall; ++k) {
            src[k] = static_cast<std::uint32_t>(splitmix(c->seed));
        }
        std::memset(back, 0xff, kSmallBytes);
        round_trip r{};
        r.start = steady::now();
        co_await small_h2d(*c, how);
        r.h2d_end = steady::now();
        co_await small_d2h(*c, how);
        r.d2h_end = steady::now();
        if (how == kind::round_trip) {
            std::memcpy(back, src, kSmallBytes); // nothing was copied; the check below holds
        }
        if (std::memcmp(src, back, kSmallBytes) != 0) {
            for (std::size_t k = 0; k < kSmall; ++k) {
                if (src[k] != back[k]) {
                    std::fprintf(stderr,
                                 "%s: FATAL: %s: word %zu of a small copy: expected "
                                 "0x%08x, got 0x%08x\n",
                                 g_program, what.c_str(), k, src[k], back[k]);
                    std::abort();
                }
            }
        }
        log->push_back(r);
        co_await cudawait::sleep_for(kPause);
    }
}

// ---- the bulk ----------------------------------------------------------------------------------

struct window {
    steady::time_point begin;
    steady::time_point end;
};

/// Whether [a, b] lies within a window; with `started`, whether a does (b may be later).
bool inside(const std::vector<window>& ws, steady::time_point a, steady::time_point b,
            bool started = false) {
    return std::any_of(ws.begin(), ws.end(), [&](const window& w) {
        return a >= w.begin && (started ? a <= w.end : b <= w.end);
    });
}

/// The copies of `log` that ran within a steady window: (H2D latencies, D2H latencies). With
/// `started`, those that began within one (a copy that waits for the batch's last chunk ends
/// after the window: it is never within one).
std::pair<std::vector<double>, std::vector<double>>
steady_latencies(const std::vector<round_trip>& log, const std::vector<window>& ws,
                 bool started = false) {
    std::pair<std::vector<double>, std::vector<double>> r;
    for (const round_trip& t : log) {
        if (inside(ws, t.start, t.h2d_end, started)) {
            r.first.push_back(seconds(t.h2d_end - t.start));
        }
        if (inside(ws, t.h2d_end, t.d2h_end, started)) {
            r.second.push_back(seconds(t.d2h_end - t.h2d_end));
        }
    }
    return r;
}

/// Batches through `pipe`, each checked, until the small copies have kSamples steady ones per
/// direction; then sets `stop`. `ramp` is kRampChunks chunk times.
cudawait::task<void> bulk_runs(float_pipeline* pipe, bulk_data* data, steady::duration ramp,
                               const std::vector<round_trip>* log, std::vector<window>* windows,
                               std::vector<double>* run_seconds, std::atomic<bool>* stop,
                               std::string what) {
    for (int r = 0; r < kMaxBulkRuns; ++r) {
        data->poison_checked();
        const auto t0 = steady::now();
        co_await pipe->run(std::span<const float>(data->in.data(), kBulk),
                           std::span<float>(data->out.data(), kBulk));
        const auto t1 = steady::now();
        data->check(what);
        run_seconds->push_back(seconds(t1 - t0));
        windows->push_back({t0 + ramp, t1 - ramp});
        const auto got = steady_latencies(*log, *windows);
        if (got.first.size() >= kSamples && got.second.size() >= kSamples) {
            break;
        }
    }
    stop->store(true);
}

cudawait::task<void> one_batch(float_pipeline* pipe, bulk_data* data) {
    co_await pipe->run(std::span<const float>(data->in.data(), kBulk),
                       std::span<float>(data->out.data(), kBulk));
}

// ---- the measurement ---------------------------------------------------------------------------

void measure_once();

/// Everything is measured together, by the first benchmark that runs; a failure is reported
/// by every benchmark, without measuring again.
void measure_all() {
    if (g_measured) {
        return;
    }
    if (!g_measure_error.empty()) {
        throw std::runtime_error(g_measure_error);
    }
    try {
        measure_once();
    } catch (const std::exception& e) {
        g_measure_error = e.what();
        g_latency.clear();
        g_bulk.clear();
        throw;
    }
}

void measure_once() {
    cudawait::scheduler sched(cudawait::poll_policy::spinning()); // outlives the pipelines
    bulk_data data;
    small_context small;
    std::unique_ptr<float_pipeline> pipe = make_pipeline();

    // The pipeline alone; every run checked.
    const std::vector<std::string> names = {"alone_whole"};
    runs_by_variant alone = interleaved(kBulkRounds, names, [&](std::size_t i) {
        data.poison_checked();
        const double secs =
            time_host([&] { cudawait::sync_wait(sched, one_batch(pipe.get(), &data)); });
        data.check(names[i]);
        return secs;
    });
    for (auto& [k, v] : alone) {
        g_bulk[k] = v;
    }
    const double chunk_seconds = median(alone.at("alone_whole")) / (kBulk / kChunk);
    const auto ramp = std::chrono::duration_cast<steady::duration>(
        std::chrono::duration<double>(kRampChunks * chunk_seconds));

    for (const variant& v : variants()) {
        // Idle: the same round trips, the same pause, nothing else on the link.
        std::vector<round_trip> idle;
        cudawait::sync_wait(sched, small_copies(&small, v.how, 16, nullptr, &idle, v.name));
        idle.clear();
        const unsigned long long sm_before = cudawait::detail::sm_copies_enqueued.load();
        cudawait::sync_wait(sched, small_copies(&small, v.how, kSamples, nullptr, &idle, v.name));
        const unsigned long long sm_idle = cudawait::detail::sm_copies_enqueued.load() - sm_before;
        std::vector<double>& ih = g_latency[v.name + "/h2d_idle"];
        std::vector<double>& id = g_latency[v.name + "/d2h_idle"];
        for (const round_trip& t : idle) {
            ih.push_back(seconds(t.h2d_end - t.start));
            id.push_back(seconds(t.d2h_end - t.h2d_end));
        }

        // Under bulk.
        std::vector<round_trip> log;
        std::vector<window> windows;
        std::vector<double> runs;
        std::atomic<bool> stop{false};
        const unsigned long long sm_bulk_before = cudawait::detail::sm_copies_enqueued.load();
        cudawait::sync_wait(
            sched, cudawait::when_all(bulk_runs(pipe.get(), &data, ramp, &log, &windows, &runs,
                                                &stop, "bulk with " + v.name),
                                      small_copies(&small, v.how, 0, &stop, &log, v.name)));
        auto [h2d, d2h] = steady_latencies(log, windows);
        const unsigned long long sm_bulk =
            cudawait::detail::sm_copies_enqueued.load() - sm_bulk_before;
        std::printf("%s: %zu h2d and %zu d2h small copies within %zu batches' steady state; "
                    "made by the SMs: %llu of %zu idle, %llu of %zu under bulk\n",
                    v.name.c_str(), h2d.size(), d2h.size(), runs.size(), sm_idle, 2 * idle.size(),
                    sm_bulk, 2 * log.size());
        if (h2d.size() < kMinSamples || d2h.size() < kMinSamples) {
            // Copies held until the batch's end (behind every chunk queued on a copy engine)
            // end outside every window: counted by their start instead, and said so.
            auto [h2d_started, d2h_started] = steady_latencies(log, windows, true);
            if (h2d.size() < kMinSamples) {
                h2d = std::move(h2d_started);
                std::printf("%s: h2d counted by start: %zu copies\n", v.name.c_str(), h2d.size());
            }
            if (d2h.size() < kMinSamples) {
                d2h = std::move(d2h_started);
                std::printf("%s: d2h counted by start: %zu copies\n", v.name.c_str(), d2h.size());
            }
        }
        if (h2d.empty() || d2h.empty()) {
            throw std::runtime_error(v.name + ": no small copy within the bulk's steady state");
        }
        if (h2d.size() < kMinSamples || d2h.size() < kMinSamples) {
            // A reference variant whose copies each wait for a whole chunk on both engines
            // (which engine a stream gets varies from process to process) has few: its figures
            // rest on those, and the run goes on.
            std::printf("%s: fewer than %zu copies in a direction; its medians rest on %zu h2d "
                        "and %zu d2h copies\n",
                        v.name.c_str(), kMinSamples, h2d.size(), d2h.size());
        }
        g_latency[v.name + "/h2d_bulk"] = std::move(h2d);
        g_latency[v.name + "/d2h_bulk"] = std::move(d2h);
        g_bulk["with_" + v.name] = std::move(runs);
    }
    g_measured = true;
}

// ---- Google Benchmark ----------------------------------------------------------------------

void BM_small(benchmark::State& state, const std::string& key) {
    guarded(state, [&] {
        measure_all();
        const std::vector<double> s = g_latency.at(key);
        replay(state, s);
        std::vector<double> sorted = s;
        std::sort(sorted.begin(), sorted.end());
        state.counters["p50_us"] = percentile(sorted, 0.5) * 1e6;
        state.counters["p99_us"] = percentile(sorted, 0.99) * 1e6;
    });
}

void BM_bulk(benchmark::State& state, const std::string& key) {
    guarded(state, [&] {
        measure_all();
        const std::vector<double> s = g_bulk.at(key);
        replay(state, s);
        state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(kBulkBytes));
        state.counters["GBps"] = gbps(kBulkBytes, median(s));
    });
}

void register_benchmarks() {
    for (const variant& v : variants()) {
        for (const char* k : {"h2d_idle", "h2d_bulk", "d2h_idle", "d2h_bulk"}) {
            const std::string key = v.name + "/" + k;
            benchmark::RegisterBenchmark(("BM_small/" + key).c_str(), BM_small, key)
                ->UseManualTime()
                ->Iterations(kSamples)
                ->Unit(benchmark::kMicrosecond);
        }
    }
    std::vector<std::string> bulk = {"alone_whole"};
    for (const variant& v : variants()) {
        bulk.push_back("with_" + v.name);
    }
    for (const std::string& key : bulk) {
        benchmark::RegisterBenchmark(("BM_bulk/" + key).c_str(), BM_bulk, key)
            ->UseManualTime()
            ->Iterations(kBulkRounds)
            ->Unit(benchmark::kMillisecond);
    }
}

// ---- setup and summary --------------------------------------------------------------------------

void warm_up_device() {
    create_context_and_async_pool();
    const cudaDeviceProp prop = add_device_context();
    g_sm_count = prop.multiProcessorCount;
    int engines = 0;
    check(cudaDeviceGetAttribute(&engines, cudaDevAttrAsyncEngineCount, 0),
          "cudaDeviceGetAttribute");
    benchmark::AddCustomContext("copy_engines", std::to_string(engines));
}

/// The percentile `p` of key's samples in microseconds, if measured.
std::optional<double> latency_us(const std::string& key, double p) {
    auto it = g_latency.find(key);
    if (it == g_latency.end() || it->second.empty()) {
        return std::nullopt;
    }
    std::vector<double> s = it->second;
    std::sort(s.begin(), s.end());
    return percentile(s, p) * 1e6;
}

/// Median GB/s of key's batches, if measured.
std::optional<double> bulk_gbps(const std::string& key) {
    auto it = g_bulk.find(key);
    if (it == g_bulk.end() || it->second.empty()) {
        return std::nullopt;
    }
    return gbps(kBulkBytes, median(it->second));
}

/// "  <label>: X (target <= T) ok|MISSED", or "-" when unmeasured.
void print_at_most(const std::string& label, std::optional<double> value, double target) {
    if (!value) {
        std::printf("  %s: - (target <= %.2f)\n", label.c_str(), target);
        return;
    }
    std::printf("  %s: %.2f (target <= %.2f) %s\n", label.c_str(), *value, target,
                verdict(*value <= target));
}

void print_summary() {
    std::printf("\n==== lane_bench summary ====\n");
    if (g_latency.empty()) {
        std::fflush(stdout);
        return;
    }
    std::printf("\n%s awaited copies, latency in us (median / p99 of %zu per cell), idle and "
                "under a pipeline's bulk (%s chunks, depth %u, both directions busy)\n",
                size_name(kSmallBytes).c_str(), kSamples, size_name(kChunkBytes).c_str(), kDepth);
    std::printf("  %-26s %17s %17s %17s %17s %9s %9s\n", "variant", "h2d idle", "h2d bulk",
                "d2h idle", "d2h bulk", "h2d x", "d2h x");
    for (const variant& v : variants()) {
        std::printf("  %-26s", v.name.c_str());
        for (const char* k : {"h2d_idle", "h2d_bulk", "d2h_idle", "d2h_bulk"}) {
            const std::string key = v.name + "/" + k;
            print_cell(latency_us(key, 0.5), 8, 1);
            std::printf(" /");
            print_cell(latency_us(key, 0.99), 6, 1);
        }
        for (const char* dir : {"h2d", "d2h"}) {
            print_cell(ratio_of(latency_us(v.name + "/" + dir + "_bulk", 0.5),
                                latency_us(v.name + "/" + dir + "_idle", 0.5)),
                       9, 2);
        }
        std::printf("\n");
    }

    // Under bulk / idle, for information: what the bulk adds to each variant's own latency.
    auto worse = [](const std::string& name) -> std::optional<double> {
        const auto h =
            ratio_of(latency_us(name + "/h2d_bulk", 0.5), latency_us(name + "/h2d_idle", 0.5));
        const auto d =
            ratio_of(latency_us(name + "/d2h_bulk", 0.5), latency_us(name + "/d2h_idle", 0.5));
        if (!h || !d) {
            return std::nullopt;
        }
        return std::max(*h, *d);
    };
    std::printf("\nUnder bulk / idle, median, the worse of the two directions (for information)\n");
    for (const variant& v : variants()) {
        std::printf("  %-26s", v.name.c_str());
        print_cell(worse(v.name), 9, 2);
        std::printf("\n");
    }

    // The targets: under bulk, the default lane against the best copy variant in each direction,
    // and a plain stream's D2H against the lane's.
    std::printf("\nUnder bulk, median latency: the default lane against the best variant, and a "
                "plain stream's D2H against the lane's\n");
    for (const char* dir : {"h2d", "d2h"}) {
        const std::string key = std::string("/") + dir + "_bulk";
        std::optional<double> best;
        std::string best_name;
        for (const variant& v : variants()) {
            const auto us = latency_us(v.name + key, 0.5);
            if (v.how != kind::round_trip && us && (!best || *us < *best)) {
                best = us;
                best_name = v.name;
            }
        }
        print_at_most(std::string("lane / best (") + best_name + "), " + dir,
                      ratio_of(latency_us("lane" + key, 0.5), best), kBestTarget);
    }
    print_ratio("plain / lane, d2h under bulk", latency_us("plain/d2h_bulk", 0.5),
                latency_us("lane/d2h_bulk", 0.5), kPlainD2hTarget);
    // No awaited copy can beat awaited GPU work that copies nothing.
    std::printf("  floor, for information: an awaited event on the small lane, under bulk / "
                "idle: ");
    print_cell(worse("round_trip"), 0, 2);
    std::printf("\n");

    std::printf("\nThe pipeline's throughput, input GB/s (median of its batches of %s)\n",
                size_name(kBulkBytes).c_str());
    print_row("alone_whole", 40, {{bulk_gbps("alone_whole"), 8, 2, " GB/s"}});
    for (const variant& v : variants()) {
        print_row("with_" + v.name, 40, {{bulk_gbps("with_" + v.name), 8, 2, " GB/s"}});
    }
    for (const variant& v : variants()) {
        print_ratio("bulk with small copies (" + v.name + ") / alone", bulk_gbps("with_" + v.name),
                    bulk_gbps("alone_whole"), kBulkTarget);
    }
    std::fflush(stdout);
}

} // namespace bench

int main(int argc, char** argv) {
    return bench::run_main(argc, argv, "lane_bench", "every benchmark here copies to a GPU",
                           bench::warm_up_device, bench::register_benchmarks, bench::print_summary);
}
