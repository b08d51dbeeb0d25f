// SPDX-License-Identifier: Apache-2.0
//
// pipeline_bench: what cudawait::pipeline<float> achieves on H2D -> kernel -> D2H work, against
// the limits of the PCIe/C2C link and against the same work written by hand.
//
// Two kernels (bench_pipeline_work.hpp, with the input, the references and the checks), both
// float -> float maps over the chunk, grid-stride:
//   light   out[i] = fma(in[i], a, b): memory-bound, negligible next to the chunk's transfer
//   heavy   K dependent FMAs per element, K calibrated at startup (cudaEvent timing) so that the
//           kernel on one 64 MiB chunk takes as long as one 64 MiB pinned H2D copy
//
//   1. Light kernel, 4 GiB of float, 64 MiB chunks, pinned input and output (one warm-up run of
//      each variant, then 5 rounds with one run of each, the order rotating every round):
//        BM_light/library_depth2, _depth3   co_await pipeline::run(in, out) via sync_wait; the
//                                           pipeline is built outside the timing
//        BM_light/serial                    one stream: per chunk H2D, kernel, D2H,
//                                           cudaStreamSynchronize (what a naive user writes)
//        BM_light/raw_ring2, _ring3         hand-written pipeline (bench_raw_pipeline.hpp):
//                                           H2D / compute / D2H streams, a ring of 2 or 3
//                                           device slots, cudaStreamWaitEvent for slot reuse,
//                                           all 64 chunks enqueued up front, then one
//                                           synchronisation
//        BM_light/bidirectional_bound       no kernel: the 4 GiB H2D and a 4 GiB D2H running
//                                           at once on two streams, 64 MiB copies
//        BM_light/library_depth2_traced     library_depth2 with a cudawait::timeline attached
//                                           (timing events, GPU and host spans recorded)
//      Summary ratios (the better library depth): library / bound (>= 0.98), library / the
//      better raw ring (>= 1.00), library / serial (>= 1.7); and the cost of tracing:
//      library_depth2_traced / library_depth2 (traced / untraced, >= 0.98).
//   2. Heavy kernel, 4 GiB, 64 MiB chunks (same round structure):
//        BM_heavy/library_depth3            the pipeline with the heavy stage
//        BM_heavy/raw_ring3                 the hand-written pipeline (for information)
//        BM_heavy/h2d_alone, kernel_alone, d2h_alone   64 chunks of one stage on one stream
//        BM_heavy/bidirectional             as in 1 (for information)
//      Summary: efficiency = max-stage bound / library (>= 0.95), where the bound is
//      max(bidirectional, kernel alone): in steady state one chunk's H2D and another's D2H share
//      the link, so the copy stages are timed together. The same against the one-way stage
//      times, max(h2d, kernel, d2h alone), is printed for information.
//   2b. Heavy kernel by poll policy (bench_policy.hpp), 4 GiB, 64 MiB chunks, pinned; per depth
//      2, 3 and 4 one warm-up run of each variant, then 5 rounds, the order rotating:
//        BM_heavy_policy/<policy>_depth<d>  the heavy pipeline at depth d (otherwise default
//                                           options) on a scheduler built with that preset
//                                           poll_policy: balanced, sentinels, sleeping, yielding,
//                                           spinning (a scheduler per preset, a pipeline per
//                                           preset and depth, built once)
//        BM_heavy_policy/raw_ring<d>        the hand-written pipeline with a ring of d slots
//      Summary per depth and preset: library / raw_ring<d> (>= 0.99) and library / the max-stage
//      bound of 2, max(bidirectional, kernel alone) (>= 0.95), from 2's runs (measured first
//      when 2 did not run), as throughputs; a last line names every miss.
//   3. Chunk size, light kernel, pinned: 64 KiB and 256 KiB chunks over 512 MiB, 1, 8 and
//      64 MiB chunks over 4 GiB; graph mode off and on; depths 2, 3, 4, 6 and 8 (one warm-up run
//      per pipeline, 5 rounds alternating graph off/on per depth):
//        BM_chunk/<size>/plain, /graph      replay the runs at the specified depth (4 for chunks
//                                           of 1 MiB or less, 3 above); the counters name the
//                                           best depth
//      Summary table and target: at 1 MiB the better of plain and graph >= 0.85 x the 64 MiB
//      throughput (both at the specified depths); the same with the best depths for information.
//      Chunks of 1 MiB or less also run in chunk groups
//      (pipeline_options::memory_options::group_bytes = default_group_bytes, 4 MiB: 64, 16 and 4
//      chunks per group), at the specified depth, in their own interleaved rounds after the table's
//      (one warm-up run each):
//        BM_chunk/<size>/grouped            the light per-chunk stage, groups of chunks: one
//                                           copy each way per group, a launch per chunk
//        BM_chunk/<size>/grouped_graph      the same in graph mode: one graph (the group's
//                                           copies and per-chunk launches) per group
//        BM_chunk/<size>/group_stage        a group stage: one light launch over the group
//        BM_chunk/<size>/group_stage_16MiB  the same with group_bytes = 16 MiB (256, 64 and 16
//                                           chunks per group)
//      Summary: per size, the best of these four (named) / the 64 MiB figure (the better of
//      plain and graph at the specified depth): 1 MiB >= 0.95, 256 KiB >= 0.85, 64 KiB >= 0.5.
//      The table's runs move one chunk per flight (group_bytes = 0). What default options give,
//      in their own interleaved rounds (pipeline_options{} with the chunk size: depth 2, groups
//      and graph mode chosen by the pipeline, the light per-chunk stage):
//        BM_chunk/<size>/default             the stage as it is: groups, a launch per chunk
//        BM_chunk/<size>/default_replayable  the stage marked replayable(): groups replayed as
//                                            graphs
//      each / the same 64 MiB figure: 1 MiB >= 0.97, 256 KiB >= 0.95, 64 KiB >= 0.85.
//   4. Host memory, light kernel, 64 MiB chunks, depth 3, 4 GiB (one pipeline, runs alternating):
//        BM_host_memory/pinned              the pinned input and output of 1
//        BM_host_memory/pageable            std::vector input and output, pre-touched
//        BM_host_memory/registered          std::vector input and output registered once with
//                                           cudawait::host_registration (before the runs, timed
//                                           apart), passed as plain spans
//        BM_host_memory/host_copy_bound     no GPU: the 4 GiB pageable -> pinned and 4 GiB
//                                           pinned -> pageable at once, in 64 MiB copies on the
//                                           library's own stage-in and stage-out workers, into
//                                           and out of rings of depth + 2 pinned chunks (what a
//                                           pageable batch's staging does without the GPU)
//      Summary: GB/s of each; pageable / pinned (for information); pageable / host-copy bound
//      (>= 0.85); registered / pinned (>= 0.9); and the registration's cost ("registration: Y
//      ms for Z GiB").
//   5. Stage statistics, depth 3, 64 MiB chunks, options.monitoring.timing = true (a separate
//   pipeline; one
//      warm-up run, then one run whose stats() are printed; not used in any ratio):
//        BM_stats_timing/light, /heavy      h2d_gbps, d2h_gbps, compute_to_transfer,
//                                           overlap_efficiency, link_peak_gbps,
//                                           suggest_chunk_size()
//   6. Devices, light kernel, 4 GiB, 64 MiB chunks, pinned, depth 3 (one warm-up run of each
//      variant, then 5 rounds with one run of each, the order rotating every round):
//        BM_devices/plain_device0           a pipeline<float> on device 0
//        BM_devices/multi_device0           a multi_pipeline<float> over {0} (one shard)
//        BM_devices/multi_all_devices       a multi_pipeline<float> over every visible device
//                                           (registered only where more than one is visible)
//      Summary: multi_device0 / plain_device0 (>= 0.98: one shard costs nothing), "devices: N",
//      and with N > 1 multi_all_devices / (N x plain_device0) (for information).
//
//   7. Streaming small items, light kernel, 64 KiB items over 512 MiB, pinned input and output
//      (one warm-up run per variant, 5 interleaved rounds): a producer coroutine acquires a slot,
//      copies its item in (host memcpy) and submits it; a consumer coroutine takes the results
//      with next() and copies each out; both run on one scheduler (when_all).
//        BM_stream_small/depth<d>           depth d (16 and 64), queue_capacity 2 x d, one item
//                                           per flight (group_bytes = 0)
//        BM_stream_small/default_options    pipeline_options{} with the item size only (depth 2,
//                                           the default queue_capacity, the groups the pipeline
//                                           chooses: 64 items per slot group)
//        BM_stream_small/grouped_depth<d>   chunk groups (group_bytes = default_group_bytes:
//                                           64 items per slot group), depth d (4 and 8) slot
//                                           groups, queue_capacity 2 x d groups; the light
//                                           per-chunk stage (one launch per item, one copy
//                                           each way per run of items)
//        BM_stream_small/group_stage_depth8 the same at depth 8 with a group stage: one light
//                                           launch per run of items
//        BM_stream_small/host_fill_bound    no GPU: the producer's and consumer's memcpy of every
//                                           item alone, on one thread, through 32 MiB pinned rings
//                                           (the bound of this producer and consumer)
//        BM_stream_small/view_depth16       as depth16, but the producer submits views of the
//                                           pinned input and output (submit(slot, in + off,
//                                           out + off)): no host copy, the GPU copies from and to
//                                           the caller's memory; the consumer only drops results
//        BM_stream_small/view_grouped_depth8, view_group_stage_depth8
//                                           as grouped_depth8 and group_stage_depth8 with views:
//                                           a run's copies are one cudaMemcpyBatchAsync each way
//                                           over its items' spans
//      Summary: the best variant of all (named) / the 64 MiB batch figure of 3 (>= 0.35); the
//      best view variant (named) / the same (>= 0.35); default_options / host_fill_bound (>= 0.9);
//      the best variant / host_fill_bound, and host_fill_bound / the 64 MiB figure, for
//      information.
//
// GB/s means 10^9 input bytes per second of host wall time (steady_clock around the whole
// batch, including its synchronisation); every figure in the summary is a median. All variants
// run in one process on device 0, on the same pinned input and output (from one pinned_pool,
// reserved and filled with random floats before anything is timed). Every run of every variant
// that computes is checked against a host reference computed once (light: the first and last
// chunk in full plus a strided sample of about 1M elements, poisoned before each run; heavy: a
// strided sample of 64K elements plus the first and last 4096); a wrong value aborts the
// program. After the benchmarks main() prints a summary with the medians, the ratios and the
// targets. Without a CUDA device the program exits with 2; when a benchmark reported an error,
// with 1.
//
// Every comparison is measured by bench::interleaved (bench_support.hpp) the first time one of
// its benchmarks runs; each benchmark then replays its own variant's samples. The hand-written
// variants are in bench_raw_pipeline.hpp.
//
// Every coroutine here is a free function in namespace `bench` and takes its state through
// parameters: lambdas kept in a coroutine frame (or coroutines in an anonymous namespace) make
// g++ raise -Wsubobject-linkage in nvcc's host pass. Pipeline stages are named function objects
// for the same reason.

#include <cudawait/copy/detail/parallel_memcpy.hpp>
#include <cudawait/cudawait.hpp>
#include <cudawait/pipeline/multi_pipeline.hpp>
#include <cudawait/pipeline/pipeline.hpp>

#include <algorithm>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <cuda_runtime.h>

#include "bench_pipeline_work.hpp"
#include "bench_policy.hpp"
#include "bench_raw_pipeline.hpp"
#include "bench_support.hpp"
#include <benchmark/benchmark.h>
namespace bench {

using cudawait::check;
using namespace cudawait::literals;
using float_pipeline = cudawait::pipeline<float>;
using float_multi = cudawait::multi_pipeline<float>;

// ---- parameters ------------------------------------------------------------------------------

constexpr std::size_t kTotalBytes = 4_GiB; ///< input bytes of the 4 GiB runs
constexpr std::size_t kTotal = kTotalBytes / sizeof(float);
constexpr std::size_t kChunkBytes = 64_MiB; ///< chunk of 1, 2, 4 and 5
constexpr std::size_t kChunk = kChunkBytes / sizeof(float);
constexpr std::int64_t kRounds = 5; ///< timed runs of every variant

constexpr unsigned kLibraryDepths[] = {2, 3};
constexpr unsigned kRawRings[] = {2, 3};
constexpr unsigned kHeavyDepth = 3;
constexpr unsigned kHostMemoryDepth = 3;
constexpr unsigned kStatsDepth = 3;
constexpr unsigned kDevicesDepth = 3;
constexpr unsigned kSlots = 3; ///< device slots of the hand-written variants (the largest ring)

/// A chunk size of the table in 3, the input bytes each run moves and the specified depth.
struct chunk_case {
    std::size_t bytes;
    std::size_t total;
    unsigned depth;
};
constexpr chunk_case kChunkCases[] = {{64_KiB, 512_MiB, 4},
                                      {256_KiB, 512_MiB, 4},
                                      {1_MiB, 4_GiB, 4},
                                      {8_MiB, 4_GiB, 3},
                                      {64_MiB, 4_GiB, 3}};
constexpr unsigned kSweepDepths[] = {2, 3, 4, 6, 8};
constexpr std::size_t kTargetChunkBytes = 1_MiB;     ///< the row the target of 3 applies to
constexpr std::size_t kReferenceChunkBytes = 64_MiB; ///< the row it is compared with

constexpr double kBoundTarget = 0.98;  ///< library / bidirectional bound, at least
constexpr double kRawTarget = 1.00;    ///< library / hand-written pipeline, at least
constexpr double kSerialTarget = 1.7;  ///< library / serial, at least
constexpr double kHeavyTarget = 0.95;  ///< max-stage bound time / library time, at least
constexpr double kChunkTarget = 0.85;  ///< 1 MiB / 64 MiB throughput, at least
constexpr double kTracedTarget = 0.98; ///< traced / untraced library throughput, at least

/// 3, chunk groups: the best grouped variant / the 64 MiB figure, at least, per chunk size.
struct group_target {
    std::size_t bytes;
    double target;
};
constexpr group_target kGroupTargets[] = {{64_KiB, 0.5}, {256_KiB, 0.85}, {1_MiB, 0.95}};
/// 3, default options (pipeline_options{} with the chunk size: depth 2, groups and graph mode as
/// the pipeline chooses them) and the per-chunk light stage / the 64 MiB figure, at least, per
/// chunk size; for the stage as it is ("default") and marked replayable ("default_replayable").
constexpr group_target kDefaultTargets[] = {{64_KiB, 0.85}, {256_KiB, 0.95}, {1_MiB, 0.97}};
constexpr const char* kDefaultVariants[] = {"default", "default_replayable"};
constexpr const char* kGroupVariants[] = {"grouped", "grouped_graph", "group_stage",
                                          "group_stage_16MiB"};
/// The group size of the group_stage_16MiB variant (64 KiB chunks: max_group_chunks).
constexpr std::size_t kLargeGroupBytes = 16_MiB;

/// 7. Streaming small items.
constexpr std::size_t kStreamItemBytes = 64_KiB;
constexpr std::size_t kStreamTotalBytes = 512_MiB;
constexpr unsigned kStreamDepths[] = {16, 64};
/// 7, in chunk groups: depth (slot groups) and whether the stage is a group stage.
struct stream_group_case {
    unsigned depth;
    bool group_stage;
};
constexpr stream_group_case kStreamGroupCases[] = {{4, false}, {8, false}, {8, true}};
std::string stream_group_name(const stream_group_case& c) {
    return std::string(c.group_stage ? "group_stage_depth" : "grouped_depth") +
           std::to_string(c.depth);
}
constexpr double kStreamTarget = 0.35; ///< streaming / the 64 MiB batch figure, at least
/// 7, with views of the caller's pinned memory: depth16 and the grouped depth-8 cases.
constexpr unsigned kStreamViewDepth = 16;
constexpr unsigned kStreamViewGroupDepth = 8;
constexpr const char* kStreamViewPrefix = "view_";
/// The names of 7's view variants, in the order they are registered and printed.
std::vector<std::string> stream_view_names() {
    std::vector<std::string> v = {kStreamViewPrefix + ("depth" + std::to_string(kStreamViewDepth))};
    for (const stream_group_case& c : kStreamGroupCases) {
        if (c.depth == kStreamViewGroupDepth) {
            v.push_back(kStreamViewPrefix + stream_group_name(c));
        }
    }
    return v;
}
/// 7, the host copies alone: the producer's and consumer's memcpy per item, one thread.
constexpr const char* kStreamFillBound = "host_fill_bound";
/// 7, default options: pipeline_options{} with the item size only, items copied into slots.
constexpr const char* kStreamDefault = "default_options";
constexpr double kStreamDefaultTarget = 0.9; ///< default_options / host_fill_bound, at least
constexpr std::size_t kStreamFillRingBytes = 32_MiB;
/// Section 4: pageable / host-copy bound, and registered / pinned, at least.
constexpr double kPageableTarget = 0.85;
constexpr double kRegisteredTarget = 0.90;

/// multi_pipeline over {0} / pipeline on device 0, at least: one shard costs nothing.
constexpr double kOneShardTarget = 0.98;

constexpr const char* kLightVariants[] = {
    "library_depth2",      "library_depth3",       "serial", "raw_ring2", "raw_ring3",
    "bidirectional_bound", "library_depth2_traced"};
constexpr const char* kHeavyVariants[] = {"library_depth3", "raw_ring3", "h2d_alone",
                                          "kernel_alone",   "d2h_alone", "bidirectional"};
constexpr const char* kHostVariants[] = {"pinned", "pageable", "registered", "host_copy_bound"};
constexpr const char* kDeviceVariants[] = {"plain_device0", "multi_device0", "multi_all_devices"};

// ---- results shared with the summary printed by main() ---------------------------------------

std::map<std::string, double> g_light_gbps; ///< light variant -> GB/s
std::map<std::string, double> g_heavy_s;    ///< heavy variant -> seconds per 4 GiB
std::map<std::string, double> g_chunk_gbps; ///< "<size>/<plain|graph>/d<depth>" -> GB/s
std::map<std::string, double> g_host_gbps;  ///< kHostVariants -> GB/s
/// Section 4: registering the registered variant's input and output, once.
struct registration_cost {
    double seconds = 0;
    std::size_t bytes = 0;
};
std::optional<registration_cost> g_registration;

std::map<std::string, double> g_device_gbps; ///< section 6: devices variant -> GB/s
int g_devices = 1;                           ///< visible devices, counted at registration

std::map<std::string, double> g_stream_gbps; ///< section 7: "depth<d>" -> GB/s

/// One run with options.monitoring.timing = true.
struct timed_stats {
    cudawait::pipeline_stats stats;
    std::size_t suggested_elements = 0;
    double wall_seconds = 0;
};
std::map<std::string, timed_stats> g_stats; ///< "light", "heavy"

// ---- helpers -----------------------------------------------------------------------------------

std::string chunk_key(bool graph, unsigned depth) {
    return std::string(graph ? "graph" : "plain") + "/d" + std::to_string(depth);
}

/// Interleaved measurements, keyed by comparison; filled by whichever of its benchmarks runs
/// first. A failed measurement is not stored: the next benchmark tries again and reports its
/// own error.
std::map<std::string, runs_by_variant> g_measured;

/// Replays `variant`'s samples of the comparison `key` (measured by `measure` if this is the
/// comparison's first benchmark), `bytes` per run, and returns their median.
template <class Measure>
double replay_variant(benchmark::State& state, const std::string& key, Measure&& measure,
                      const std::string& variant, std::size_t bytes) {
    const std::vector<double> mine = samples_of(measured_once(g_measured, key, measure), variant);
    replay(state, mine);
    state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(bytes));
    const double secs = median(mine);
    state.counters["GBps"] = gbps(bytes, secs);
    return secs;
}

/// Built by the first benchmark that needs it; reset by main() before the CUDA runtime goes.
std::unique_ptr<workload> g_work;

workload& work_data() {
    if (!g_work) {
        g_work = std::make_unique<workload>(kTotal);
    }
    return *g_work;
}

// ---- the library --------------------------------------------------------------------------------

std::unique_ptr<float_pipeline> make_pipeline(work w, unsigned depth, std::size_t chunk, bool graph,
                                              bool timing, cudawait::timeline* tl = nullptr) {
    cudawait::pipeline_options o;
    o.monitoring.timeline = tl;
    o.depth = depth;
    o.chunk_elements = chunk;
    o.graph = graph;
    o.memory.group_bytes = 0; // one chunk per flight: section 3's table measures chunks alone
    o.monitoring.timing = timing;
    std::vector<float_pipeline::stage> stages;
    if (w == work::light) {
        stages.emplace_back(light_stage{});
    } else {
        stages.emplace_back(heavy_stage{g_cal.k});
    }
    return std::make_unique<float_pipeline>(std::move(o), std::move(stages));
}

/// The light kernel as a group stage: one launch over the whole chunk group (the kernel is an
/// element-wise map, so one launch over the group computes what one per chunk would).
struct light_group_stage {
    void operator()(std::span<float> in, std::span<float> out,
                    const cudawait::group_context& g) const {
        launch_light(in.data(), out.data(), in.size(), g.stream.get());
    }
};

/// A light pipeline in chunk groups of default_group_bytes: variant 0 grouped (per-chunk
/// stage), 1 grouped_graph, 2 group_stage; 3 group_stage_16MiB (groups of kLargeGroupBytes).
std::unique_ptr<float_pipeline> make_grouped_pipeline(std::size_t variant, unsigned depth,
                                                      std::size_t chunk) {
    cudawait::pipeline_options o;
    o.depth = depth;
    o.chunk_elements = chunk;
    o.memory.group_bytes =
        variant == 3 ? kLargeGroupBytes : cudawait::pipeline_options::default_group_bytes;
    o.graph = variant == 1;
    std::vector<float_pipeline::stage> stages;
    if (variant >= 2) {
        stages.emplace_back(light_group_stage{});
    } else {
        stages.emplace_back(light_stage{});
    }
    return std::make_unique<float_pipeline>(std::move(o), std::move(stages));
}

/// Default options with the chunk size (section 3's default variants): the light per-chunk
/// stage, marked replayable or not; the pipeline chooses groups and graph mode.
std::unique_ptr<float_pipeline> make_default_pipeline(bool replayable, std::size_t chunk) {
    cudawait::pipeline_options o;
    o.chunk_elements = chunk;
    std::vector<float_pipeline::stage> stages;
    if (replayable) {
        stages.emplace_back(cudawait::replayable(light_stage{}));
    } else {
        stages.emplace_back(light_stage{});
    }
    return std::make_unique<float_pipeline>(std::move(o), std::move(stages));
}

/// What user code writes: one batch through the pipeline.
cudawait::task<void> run_batch(float_pipeline* pipe, std::span<const float> in,
                               std::span<float> out) {
    co_await pipe->run(in, out);
}

/// One batch over the first n elements of `in` into `out`, poisoned before and checked after
/// (outside the timing).
double checked_library_run(work w, cudawait::scheduler& sched, float_pipeline& pipe,
                           const float* in, float* out, std::size_t n, const std::string& what) {
    const std::size_t chunk = pipe.options().chunk_elements;
    poison(work_data(), w, out, n, chunk);
    // Timed from the call to sync_wait's return.
    const double secs = time_host([&] {
        cudawait::sync_wait(sched, run_batch(&pipe, {in, n}, {out, n}));
    });
    check_output(work_data(), w, out, n, chunk, what);
    return secs;
}

// ---- the hand-written variants ------------------------------------------------------------------

/// The hand-written variants' resources (bench_raw_pipeline.hpp), created once per comparison:
/// the ring with `slots` slots, and a stream of default priority for the serial variant.
struct hand_written {
    explicit hand_written(unsigned slots = kSlots) : ring(kChunk, slots) {}
    raw_pipeline ring;
    cudawait::stream serial{cudawait::device_ref(0), 0}; // destroyed (synchronised) first

    void sync_all() const {
        ring.sync_all();
        serial.sync();
    }
};

/// A hand-written run over the first n elements (ring 0: the serial variant), poisoned before
/// and checked after (outside the timing).
double checked_hand_run(hand_written& hw, work w, unsigned ring, const float* in, float* out,
                        std::size_t n, const std::string& what) {
    poison(work_data(), w, out, n, kChunk);
    const double secs = time_host([&] {
        if (ring == 0) {
            run_serial(hw.ring, hw.serial.get(), in, out, n, work_kernel{w});
        } else {
            hw.ring.run(in, out, n, ring, work_kernel{w});
        }
    });
    check_output(work_data(), w, out, n, kChunk, what);
    return secs;
}

// ---- 1. light kernel: library, serial, hand-written, bound -------------------------------------

runs_by_variant measure_light() {
    workload& w = work_data();
    cudawait::scheduler sched; // declared first: outlives the pipelines
    hand_written hw;
    const std::unique_ptr<float_pipeline> library[] = {
        make_pipeline(work::light, kLibraryDepths[0], kChunk, false, false),
        make_pipeline(work::light, kLibraryDepths[1], kChunk, false, false)};
    // Tracing on: every run's spans are recorded (and kept) as a user of the timeline would.
    cudawait::timeline tl; // outlives the pipeline
    const std::unique_ptr<float_pipeline> traced =
        make_pipeline(work::light, 2, kChunk, false, false, &tl);
    const float* in = w.in.data();
    float* out = w.out.data();
    // The warm-up runs are checked like every run.
    runs_by_variant runs = interleaved(kRounds, kLightVariants, [&](std::size_t v) {
        const std::string what = std::string("light/") + kLightVariants[v];
        switch (v) {
        case 0:
        case 1:
            return checked_library_run(work::light, sched, *library[v], in, out, kTotal, what);
        case 2:
            return checked_hand_run(hw, work::light, 0, in, out, kTotal, what);
        case 3:
        case 4:
            return checked_hand_run(hw, work::light, kRawRings[v - 3], in, out, kTotal, what);
        case 6:
            return checked_library_run(work::light, sched, *traced, in, out, kTotal, what);
        default:
            return time_host([&] { copy_both_ways(hw.ring, in, out, kTotal); });
        }
    });
    hw.sync_all();
    return runs;
}

void BM_light(benchmark::State& state, std::string variant) {
    guarded(state, [&] {
        const double secs = replay_variant(state, "light", measure_light, variant, kTotalBytes);
        g_light_gbps[variant] = gbps(kTotalBytes, secs);
    });
}

// ---- 2. heavy kernel: library against the max-stage bound ---------------------------------------

runs_by_variant measure_heavy() {
    workload& w = work_data();
    cudawait::scheduler sched;
    hand_written hw;
    const std::unique_ptr<float_pipeline> library =
        make_pipeline(work::heavy, kHeavyDepth, kChunk, false, false);
    const float* in = w.in.data();
    float* out = w.out.data();
    // In the warm-up, the raw run fills the device slots.
    runs_by_variant runs = interleaved(kRounds, kHeavyVariants, [&](std::size_t v) {
        const std::string what = std::string("heavy/") + kHeavyVariants[v];
        switch (v) {
        case 0:
            return checked_library_run(work::heavy, sched, *library, in, out, kTotal, what);
        case 1:
            return checked_hand_run(hw, work::heavy, 3, in, out, kTotal, what);
        case 2:
        case 3:
        case 4:
            return time_host([&] {
                const stage st = v == 2 ? stage::h2d : v == 3 ? stage::kernel : stage::d2h;
                run_one_stage(hw.ring, st, in, out, kTotal, work_kernel{work::heavy});
            });
        default:
            return time_host([&] { copy_both_ways(hw.ring, in, out, kTotal); });
        }
    });
    hw.sync_all();
    return runs;
}

void BM_heavy(benchmark::State& state, std::string variant) {
    guarded(state, [&] {
        g_heavy_s[variant] = replay_variant(state, "heavy", measure_heavy, variant, kTotalBytes);
        state.counters["heavy_K"] = g_cal.k;
    });
}

// ---- 2b. heavy kernel by poll policy ------------------------------------------------------------

/// Per depth of kPolicyDepths, the heavy pipeline on a scheduler of every preset policy and the
/// ring of that depth, side by side (bench_policy.hpp). A scheduler per preset, kept across the
/// depths; the pipelines of a depth are built before its runs.
runs_by_variant measure_heavy_policy() {
    workload& w = work_data();
    std::vector<std::unique_ptr<cudawait::scheduler>> scheds; // outlive the pipelines
    for (const policy_preset& p : kPolicyPresets) {
        scheds.push_back(std::make_unique<cudawait::scheduler>(p.policy));
    }
    hand_written hw(std::ranges::max(kPolicyDepths));
    runs_by_variant runs;
    for (unsigned depth : kPolicyDepths) {
        std::vector<std::unique_ptr<float_pipeline>> pipes;
        for (std::size_t p = 0; p < scheds.size(); ++p) {
            pipes.push_back(make_pipeline(work::heavy, depth, kChunk, false, false));
        }
        const std::vector<std::string> names = policy_variants(depth);
        runs.merge(interleaved(kRounds, names, [&](std::size_t v) {
            const std::string what = "heavy_policy/" + names[v];
            if (v == pipes.size()) {
                return checked_hand_run(hw, work::heavy, depth, w.in.data(), w.out.data(), kTotal,
                                        what);
            }
            return checked_library_run(work::heavy, *scheds[v], *pipes[v], w.in.data(),
                                       w.out.data(), kTotal, what);
        }));
    }
    hw.sync_all();
    return runs;
}

void BM_heavy_policy(benchmark::State& state, std::string variant) {
    guarded(state, [&] {
        // The bound comes from section 2's runs, measured here when 2 did not run.
        set_policy_bounds(measured_once(g_measured, "heavy", measure_heavy));
        g_policy.seconds[variant] =
            replay_variant(state, "heavy_policy", measure_heavy_policy, variant, kTotalBytes);
    });
}

// ---- 3. chunk size table ------------------------------------------------------------------------

/// Every depth of kSweepDepths, graph off and on, over the case's prefix of the workload. The
/// two pipelines of one depth exist together; their runs alternate, the order swapping every
/// round. The graph pipeline records its graphs in the warm-up.
runs_by_variant measure_chunk_case(chunk_case c) {
    workload& w = work_data();
    cudawait::scheduler sched;
    const std::size_t n = c.total / sizeof(float);
    const std::size_t chunk = c.bytes / sizeof(float);
    runs_by_variant runs;
    for (unsigned depth : kSweepDepths) {
        const std::unique_ptr<float_pipeline> pipes[] = {
            make_pipeline(work::light, depth, chunk, false, false),
            make_pipeline(work::light, depth, chunk, true, false)};
        const std::string keys[] = {chunk_key(false, depth), chunk_key(true, depth)};
        runs.merge(interleaved(kRounds, keys, [&](std::size_t v) {
            return checked_library_run(work::light, sched, *pipes[v], w.in.data(), w.out.data(), n,
                                       "chunk/" + size_name(c.bytes) + "/" + keys[v]);
        }));
    }
    if (c.bytes <= kTargetChunkBytes) {
        // The grouped variants at the specified depth, side by side.
        const std::unique_ptr<float_pipeline> grouped[] = {
            make_grouped_pipeline(0, c.depth, chunk), make_grouped_pipeline(1, c.depth, chunk),
            make_grouped_pipeline(2, c.depth, chunk), make_grouped_pipeline(3, c.depth, chunk)};
        runs.merge(interleaved(kRounds, kGroupVariants, [&](std::size_t v) {
            return checked_library_run(work::light, sched, *grouped[v], w.in.data(), w.out.data(),
                                       n, "chunk/" + size_name(c.bytes) + "/" + kGroupVariants[v]);
        }));
        // Default options (depth 2, groups and graph mode chosen by the pipeline).
        const std::unique_ptr<float_pipeline> defaults[] = {make_default_pipeline(false, chunk),
                                                            make_default_pipeline(true, chunk)};
        runs.merge(interleaved(kRounds, kDefaultVariants, [&](std::size_t v) {
            return checked_library_run(work::light, sched, *defaults[v], w.in.data(), w.out.data(),
                                       n,
                                       "chunk/" + size_name(c.bytes) + "/" + kDefaultVariants[v]);
        }));
    }
    return runs;
}

/// 3, a grouped variant: replays its samples (measured with the case's table).
void BM_chunk_grouped(benchmark::State& state, chunk_case c, std::string variant) {
    guarded(state, [&] {
        const std::string key = "chunk/" + size_name(c.bytes);
        const auto measure = [&] { return measure_chunk_case(c); };
        const double secs = replay_variant(state, key, measure, variant, c.total);
        g_chunk_gbps[size_name(c.bytes) + "/" + variant] = gbps(c.total, secs);
    });
}

void BM_chunk(benchmark::State& state, chunk_case c, bool graph) {
    guarded(state, [&] {
        const std::string key = "chunk/" + size_name(c.bytes);
        const auto measure = [&] { return measure_chunk_case(c); };
        (void)replay_variant(state, key, measure, chunk_key(graph, c.depth), c.total);
        double best = 0;
        unsigned best_depth = 0;
        for (unsigned depth : kSweepDepths) {
            const double rate =
                gbps(c.total, median(samples_of(g_measured.at(key), chunk_key(graph, depth))));
            g_chunk_gbps[size_name(c.bytes) + "/" + chunk_key(graph, depth)] = rate;
            if (rate > best) {
                best = rate;
                best_depth = depth;
            }
        }
        state.counters["best_GBps"] = best;
        state.counters["best_depth"] = best_depth;
    });
}

// ---- 4. pinned versus pageable host memory ------------------------------------------------------

/// The host-copy bound: `chunks` copies of kChunkBytes pageable -> pinned (from `in`) on the
/// library's stage-in workers and as many pinned -> pageable (into `out`) on its stage-out
/// workers, all at once, each direction through a ring of pinned chunks that a copy reuses only
/// after the previous copy from or into it finished, as a pageable batch's staging does.
/// Returns the wall time; checks the last copy through every ring chunk (a wrong byte aborts).
double host_copy_bound_run(const float* in, float* out, std::size_t chunks,
                           std::vector<cudawait::pinned_buffer<float>>& in_ring,
                           std::vector<cudawait::pinned_buffer<float>>& out_ring) {
    using cudawait::detail::memcpy_workers;
    memcpy_workers& stage_in = memcpy_workers::stage_in_workers();
    memcpy_workers& stage_out = memcpy_workers::stage_out_workers();
    const std::size_t ring = in_ring.size();
    std::mutex m;
    std::condition_variable cv;
    std::vector<bool> in_busy(ring, false);
    std::vector<bool> out_busy(ring, false);
    std::size_t in_done = 0;
    std::size_t out_done = 0;
    const double secs = time_host([&] {
        std::size_t in_next = 0;
        std::size_t out_next = 0;
        std::unique_lock lock(m);
        while (in_done < chunks || out_done < chunks) {
            // Start every copy whose ring chunk is free (the callbacks take the lock).
            while (in_next < chunks && !in_busy[in_next % ring]) {
                const std::size_t c = in_next++;
                in_busy[c % ring] = true;
                lock.unlock();
                stage_in.copy_async(in_ring[c % ring].data(), in + c * kChunk, kChunkBytes, [&, c] {
                    std::lock_guard g(m);
                    in_busy[c % ring] = false;
                    ++in_done;
                    cv.notify_one();
                });
                lock.lock();
            }
            while (out_next < chunks && !out_busy[out_next % ring]) {
                const std::size_t c = out_next++;
                out_busy[c % ring] = true;
                lock.unlock();
                stage_out.copy_async(out + c * kChunk, out_ring[c % ring].data(), kChunkBytes,
                                     [&, c] {
                                         std::lock_guard g(m);
                                         out_busy[c % ring] = false;
                                         ++out_done;
                                         cv.notify_one();
                                     });
                lock.lock();
            }
            const std::size_t seen = in_done + out_done;
            cv.wait(lock, [&] { return in_done + out_done != seen; });
        }
    });
    for (std::size_t r = 0; r < ring && r < chunks; ++r) {
        const std::size_t last = (chunks - 1 - r) / ring * ring + r; // the last chunk through r
        if (std::memcmp(in_ring[r].data(), in + last * kChunk, kChunkBytes) != 0 ||
            std::memcmp(out + last * kChunk, out_ring[r].data(), kChunkBytes) != 0) {
            std::fprintf(stderr, "host_memory/host_copy_bound: chunk %zu was not copied\n", last);
            std::abort();
        }
    }
    return secs;
}

runs_by_variant measure_host_memory() {
    workload& w = work_data();
    cudawait::scheduler sched;
    const std::unique_ptr<float_pipeline> pipe =
        make_pipeline(work::light, kHostMemoryDepth, kChunk, false, false);
    // Pageable copies of the input and zeroed output, every page touched before any timing; the
    // registered variant has its own, registered once here (timed apart).
    const std::vector<float> pageable_in(w.in.begin(), w.in.end());
    std::vector<float> pageable_out(kTotal);
    const std::vector<float> registered_in(w.in.begin(), w.in.end());
    std::vector<float> registered_out(kTotal);
    cudawait::host_registration<const float> reg_in;
    cudawait::host_registration<float> reg_out;
    const double reg_secs = time_host([&] {
        reg_in = cudawait::host_registration(registered_in);
        reg_out = cudawait::host_registration(registered_out);
    });
    g_registration = registration_cost{reg_secs, reg_in.bytes() + reg_out.bytes()};
    // The bound's rings: as many chunks as a pageable batch's staging holds per direction.
    const std::size_t ring = kHostMemoryDepth + 2;
    std::vector<cudawait::pinned_buffer<float>> in_ring;
    std::vector<cudawait::pinned_buffer<float>> out_ring;
    for (std::size_t r = 0; r < ring; ++r) {
        in_ring.emplace_back(kChunk, w.pool);
        out_ring.emplace_back(kChunk, w.pool);
        std::copy(w.in.begin() + r * kChunk, w.in.begin() + (r + 1) * kChunk, out_ring[r].begin());
    }
    std::vector<float> bound_out(kTotal); // touched: zeroed
    const float* ins[] = {w.in.data(), pageable_in.data(), registered_in.data()};
    float* outs[] = {w.out.data(), pageable_out.data(), registered_out.data()};
    // The warm-up creates the staging buffers and the memcpy threads.
    return interleaved(kRounds, kHostVariants, [&](std::size_t v) {
        if (std::string(kHostVariants[v]) == "host_copy_bound") {
            return host_copy_bound_run(pageable_in.data(), bound_out.data(), kTotal / kChunk,
                                       in_ring, out_ring);
        }
        return checked_library_run(work::light, sched, *pipe, ins[v], outs[v], kTotal,
                                   std::string("host_memory/") + kHostVariants[v]);
    });
}

void BM_host_memory(benchmark::State& state, std::string variant) {
    guarded(state, [&] {
        const double secs =
            replay_variant(state, "host_memory", measure_host_memory, variant, kTotalBytes);
        g_host_gbps[variant] = gbps(kTotalBytes, secs);
    });
}

// ---- 5. stage statistics with options.monitoring.timing
// ----------------------------------------------------

timed_stats measure_stats(work wk) {
    workload& w = work_data();
    cudawait::scheduler sched;
    const std::unique_ptr<float_pipeline> pipe =
        make_pipeline(wk, kStatsDepth, kChunk, false, true);
    const std::string what = wk == work::light ? "stats/light" : "stats/heavy";
    (void)checked_library_run(wk, sched, *pipe, w.in.data(), w.out.data(), kTotal, what);
    timed_stats r;
    r.wall_seconds = checked_library_run(wk, sched, *pipe, w.in.data(), w.out.data(), kTotal, what);
    r.stats = pipe->stats();
    r.suggested_elements = pipe->suggest_chunk_size();
    return r;
}

void BM_stats_timing(benchmark::State& state, work wk) {
    guarded(state, [&] {
        const timed_stats r = measure_stats(wk);
        for (auto _ : state) {
            state.SetIterationTime(r.wall_seconds);
        }
        state.counters["GBps"] = gbps(kTotalBytes, r.wall_seconds);
        state.counters["h2d_GBps"] = r.stats.h2d_gbps;
        state.counters["d2h_GBps"] = r.stats.d2h_gbps;
        state.counters["compute_to_transfer"] = r.stats.compute_to_transfer;
        state.counters["overlap_efficiency"] = r.stats.overlap_efficiency;
        g_stats[wk == work::light ? "light" : "heavy"] = r;
    });
}

// ---- 6. devices: multi_pipeline over one device and over all of them -------------------------

std::unique_ptr<float_multi> make_multi(std::vector<int> devices) {
    cudawait::multi_pipeline_options o;
    o.devices = std::move(devices);
    o.per_shard.depth = kDevicesDepth;
    o.per_shard.chunk_elements = kChunk;
    std::vector<float_multi::stage> stages;
    stages.emplace_back(light_stage{});
    return std::make_unique<float_multi>(std::move(o), std::move(stages));
}

/// What user code writes: one batch through the multi pipeline.
cudawait::task<void> run_multi_batch(float_multi* mp, std::span<const float> in,
                                     std::span<float> out) {
    co_await mp->run(in, out);
}

/// One batch of the light work over all of `in` into `out`, poisoned before and checked after
/// (outside the timing).
double checked_multi_run(cudawait::scheduler& sched, float_multi& mp, const float* in, float* out,
                         const std::string& what) {
    poison(work_data(), work::light, out, kTotal, kChunk);
    const double secs = time_host([&] {
        cudawait::sync_wait(sched, run_multi_batch(&mp, {in, kTotal}, {out, kTotal}));
    });
    check_output(work_data(), work::light, out, kTotal, kChunk, what);
    return secs;
}

runs_by_variant measure_devices() {
    workload& w = work_data();
    cudawait::scheduler sched; // declared first: outlives the pipelines
    const std::unique_ptr<float_pipeline> plain =
        make_pipeline(work::light, kDevicesDepth, kChunk, false, false);
    const std::unique_ptr<float_multi> one = make_multi({0});
    const std::unique_ptr<float_multi> all = g_devices > 1 ? make_multi({}) : nullptr;
    const std::size_t variants = all ? 3 : 2;
    const std::span<const char* const> names(kDeviceVariants, variants);
    return interleaved(kRounds, names, [&](std::size_t v) {
        const std::string what = std::string("devices/") + kDeviceVariants[v];
        switch (v) {
        case 0:
            return checked_library_run(work::light, sched, *plain, w.in.data(), w.out.data(),
                                       kTotal, what);
        case 1:
            return checked_multi_run(sched, *one, w.in.data(), w.out.data(), what);
        default:
            return checked_multi_run(sched, *all, w.in.data(), w.out.data(), what);
        }
    });
}

void BM_devices(benchmark::State& state, std::string variant) {
    guarded(state, [&] {
        const double secs = replay_variant(state, "devices", measure_devices, variant, kTotalBytes);
        g_device_gbps[variant] = gbps(kTotalBytes, secs);
    });
}

// ---- 7. streaming small items ------------------------------------------------------------------

/// The producer: the first n elements of `in`, item by item into acquired slots, submitted in
/// order; then close().
cudawait::task<void> stream_produce(float_pipeline* pipe, const float* in, std::size_t n,
                                    std::size_t item) {
    for (std::size_t off = 0; off < n; off += item) {
        auto slot = co_await pipe->acquire();
        const std::size_t k = std::min(item, n - off);
        std::memcpy(slot.data().data(), in + off, k * sizeof(float));
        pipe->submit(std::move(slot), k);
    }
    pipe->close();
}

/// The consumer: each result, in submission order, copied to its place in `out`.
cudawait::task<void> stream_consume(float_pipeline* pipe, float* out, std::size_t item) {
    while (auto r = co_await pipe->next()) {
        const std::span<const float> d = r->data();
        std::memcpy(out + r->chunk() * item, d.data(), d.size_bytes());
    }
}

/// One streamed run: producer and consumer on one scheduler.
cudawait::task<void> stream_run(float_pipeline* pipe, const float* in, float* out, std::size_t n,
                                std::size_t item) {
    (void)co_await cudawait::when_all(stream_produce(pipe, in, n, item),
                                      stream_consume(pipe, out, item));
}

/// The producer with views: item by item, each submitted as views of `in` and `out` at its
/// offset (no host copy); then close().
cudawait::task<void> stream_produce_views(float_pipeline* pipe, const float* in, float* out,
                                          std::size_t n, std::size_t item) {
    for (std::size_t off = 0; off < n; off += item) {
        auto slot = co_await pipe->acquire();
        const std::size_t k = std::min(item, n - off);
        pipe->submit(std::move(slot), std::span<const float>(in + off, k),
                     std::span<float>(out + off, k));
    }
    pipe->close();
}

/// The consumer with views: the outputs are in place already; each result is dropped, which
/// gives its slot back.
cudawait::task<void> stream_drain(float_pipeline* pipe) {
    while (auto r = co_await pipe->next()) {
    }
}

/// One streamed run with views.
cudawait::task<void> stream_run_views(float_pipeline* pipe, const float* in, float* out,
                                      std::size_t n, std::size_t item) {
    (void)co_await cudawait::when_all(stream_produce_views(pipe, in, out, n, item),
                                      stream_drain(pipe));
}

runs_by_variant measure_stream_small() {
    workload& w = work_data();
    cudawait::scheduler sched;
    const std::size_t item = kStreamItemBytes / sizeof(float);
    const std::size_t n = kStreamTotalBytes / sizeof(float);
    std::vector<std::unique_ptr<float_pipeline>> pipes;
    std::vector<std::string> names;
    std::vector<bool> views; // per pipeline: the producer submits views
    auto plain_pipe = [&](unsigned d) {
        cudawait::pipeline_options o;
        o.depth = d;
        o.chunk_elements = item;
        o.memory.group_bytes = 0; // one item per flight
        o.memory.queue_capacity = 2 * std::size_t{d};
        std::vector<float_pipeline::stage> stages;
        stages.emplace_back(light_stage{});
        return std::make_unique<float_pipeline>(std::move(o), std::move(stages));
    };
    auto grouped_pipe = [&](const stream_group_case& c) {
        cudawait::pipeline_options o;
        o.depth = c.depth;
        o.chunk_elements = item;
        o.memory.group_bytes = cudawait::pipeline_options::default_group_bytes;
        o.memory.queue_capacity = 2 * std::size_t{c.depth}; // groups
        std::vector<float_pipeline::stage> stages;
        if (c.group_stage) {
            stages.emplace_back(light_group_stage{});
        } else {
            stages.emplace_back(light_stage{});
        }
        return std::make_unique<float_pipeline>(std::move(o), std::move(stages));
    };
    for (unsigned d : kStreamDepths) {
        pipes.push_back(plain_pipe(d));
        names.push_back("depth" + std::to_string(d));
        views.push_back(false);
    }
    {
        cudawait::pipeline_options o;
        o.chunk_elements = item;
        std::vector<float_pipeline::stage> stages;
        stages.emplace_back(light_stage{});
        pipes.push_back(std::make_unique<float_pipeline>(std::move(o), std::move(stages)));
        names.push_back(kStreamDefault);
        views.push_back(false);
    }
    for (const stream_group_case& c : kStreamGroupCases) {
        pipes.push_back(grouped_pipe(c));
        names.push_back(stream_group_name(c));
        views.push_back(false);
    }
    // The same pipelines fed with views (their own, so that each variant keeps its slots warm).
    pipes.push_back(plain_pipe(kStreamViewDepth));
    names.push_back(kStreamViewPrefix + ("depth" + std::to_string(kStreamViewDepth)));
    views.push_back(true);
    for (const stream_group_case& c : kStreamGroupCases) {
        if (c.depth == kStreamViewGroupDepth) {
            pipes.push_back(grouped_pipe(c));
            names.push_back(kStreamViewPrefix + stream_group_name(c));
            views.push_back(true);
        }
    }
    // The bound of this producer and consumer: their host copies alone, on one thread, through
    // pinned rings as large as the grouped variants' slots (no GPU work).
    const std::size_t ring_items = kStreamFillRingBytes / kStreamItemBytes;
    cudawait::pinned_buffer<float> ring_in(ring_items * item, w.pool);
    cudawait::pinned_buffer<float> ring_out(ring_items * item, w.pool);
    std::memset(ring_out.data(), 0x5a, ring_out.size() * sizeof(float));
    names.push_back(kStreamFillBound);
    return interleaved(kRounds, names, [&](std::size_t v) {
        if (v == pipes.size()) {
            return time_host([&] {
                std::size_t slot = 0;
                for (std::size_t off = 0; off < n; off += item, slot = (slot + 1) % ring_items) {
                    const std::size_t k = std::min(item, n - off);
                    std::memcpy(ring_in.data() + slot * item, w.in.data() + off, k * sizeof(float));
                    std::memcpy(w.out.data() + off, ring_out.data() + slot * item,
                                k * sizeof(float));
                }
            });
        }
        poison(w, work::light, w.out.data(), n, item);
        const double secs = time_host([&] {
            if (views[v]) {
                cudawait::sync_wait(
                    sched, stream_run_views(pipes[v].get(), w.in.data(), w.out.data(), n, item));
            } else {
                cudawait::sync_wait(sched,
                                    stream_run(pipes[v].get(), w.in.data(), w.out.data(), n, item));
            }
        });
        check_output(w, work::light, w.out.data(), n, item, "stream_small/" + names[v]);
        return secs;
    });
}

void BM_stream_small(benchmark::State& state, std::string v) {
    guarded(state, [&] {
        const double secs =
            replay_variant(state, "stream_small", measure_stream_small, v, kStreamTotalBytes);
        g_stream_gbps[v] = gbps(kStreamTotalBytes, secs);
    });
}

// ---- setup and summary --------------------------------------------------------------------------

/// Creates the context and the stream-ordered memory pool, so no benchmark pays for them.
void warm_up_device() {
    create_context_and_async_pool();

    g_sm_count = add_device_context().multiProcessorCount;
}

/// Registers a benchmark that reports manual times in milliseconds.
template <class... Args>
void register_manual(const std::string& name, std::int64_t iterations, Args&&... args) {
    benchmark::RegisterBenchmark(name.c_str(), std::forward<Args>(args)...)
        ->UseManualTime()
        ->Iterations(iterations)
        ->Unit(benchmark::kMillisecond);
}

void register_benchmarks() {
    // 1. and 2. Each iteration is one 4 GiB run (measured, for all variants at once, by the
    // first benchmark of the group).
    for (const char* v : kLightVariants) {
        register_manual(std::string("BM_light/") + v, kRounds, &BM_light, std::string(v));
    }
    for (const char* v : kHeavyVariants) {
        register_manual(std::string("BM_heavy/") + v, kRounds, &BM_heavy, std::string(v));
    }
    // 2b. Each iteration is one 4 GiB run.
    for (unsigned d : kPolicyDepths) {
        for (const std::string& v : policy_variants(d)) {
            register_manual("BM_heavy_policy/" + v, kRounds, &BM_heavy_policy, v);
        }
    }
    // 3. Each iteration is one run at the case's specified depth.
    for (const chunk_case& c : kChunkCases) {
        for (bool graph : {false, true}) {
            register_manual("BM_chunk/" + size_name(c.bytes) + (graph ? "/graph" : "/plain"),
                            kRounds, &BM_chunk, c, graph);
        }
        if (c.bytes <= kTargetChunkBytes) {
            for (const char* v : kGroupVariants) {
                register_manual("BM_chunk/" + size_name(c.bytes) + "/" + v, kRounds,
                                &BM_chunk_grouped, c, std::string(v));
            }
            for (const char* v : kDefaultVariants) {
                register_manual("BM_chunk/" + size_name(c.bytes) + "/" + v, kRounds,
                                &BM_chunk_grouped, c, std::string(v));
            }
        }
    }
    // 4. Each iteration is one 4 GiB run.
    for (const char* v : kHostVariants) {
        register_manual(std::string("BM_host_memory/") + v, kRounds, &BM_host_memory,
                        std::string(v));
    }
    // 5. One iteration: the timed run.
    register_manual("BM_stats_timing/light", 1, &BM_stats_timing, work::light);
    register_manual("BM_stats_timing/heavy", 1, &BM_stats_timing, work::heavy);
    // 6. Each iteration is one 4 GiB run; all devices only where there are several.
    g_devices = std::max(1, cudawait::try_device_count());
    for (const char* v : kDeviceVariants) {
        if (g_devices > 1 || std::string(v) != "multi_all_devices") {
            register_manual(std::string("BM_devices/") + v, kRounds, &BM_devices, std::string(v));
        }
    }
    // 7. Each iteration is one 512 MiB streamed run.
    for (unsigned d : kStreamDepths) {
        const std::string v = "depth" + std::to_string(d);
        register_manual("BM_stream_small/" + v, kRounds, &BM_stream_small, v);
    }
    register_manual(std::string("BM_stream_small/") + kStreamDefault, kRounds, &BM_stream_small,
                    std::string(kStreamDefault));
    for (const stream_group_case& c : kStreamGroupCases) {
        const std::string v = stream_group_name(c);
        register_manual("BM_stream_small/" + v, kRounds, &BM_stream_small, v);
    }
    register_manual(std::string("BM_stream_small/") + kStreamFillBound, kRounds, &BM_stream_small,
                    std::string(kStreamFillBound));
    for (const std::string& v : stream_view_names()) {
        register_manual("BM_stream_small/" + v, kRounds, &BM_stream_small, v);
    }
}

void print_calibration() {
    if (g_cal.k == 0) {
        return;
    }
    std::printf("\nHeavy kernel calibration, one 64 MiB chunk (cudaEvent timing, median of %d)\n",
                kCalibrationReps);
    std::printf("  H2D %.3f ms (%.1f GB/s), D2H %.3f ms (%.1f GB/s), light kernel %.3f ms\n",
                g_cal.h2d_ms, gbps(kChunkBytes, g_cal.h2d_ms * 1e-3), g_cal.d2h_ms,
                gbps(kChunkBytes, g_cal.d2h_ms * 1e-3), g_cal.light_ms);
    std::printf("  heavy kernel: K = %d FMAs per element, %.3f ms (%.2f x the H2D time)\n", g_cal.k,
                g_cal.heavy_ms, g_cal.heavy_ms / g_cal.h2d_ms);
}

/// The better of two variants: its GB/s and name, or no GB/s and `none` when neither was measured.
struct best_variant {
    std::optional<double> gbps;
    std::string name;
};
best_variant best_of(const char* a, const char* b, const char* none) {
    const auto va = find(g_light_gbps, a);
    const auto vb = find(g_light_gbps, b);
    if (va && (!vb || *va >= *vb)) {
        return {va, a};
    }
    return vb ? best_variant{vb, b} : best_variant{std::nullopt, none};
}

void print_light_summary() {
    if (g_light_gbps.empty()) {
        return;
    }
    std::printf("\n1. Light kernel, 4 GiB of float, 64 MiB chunks, pinned input and output\n"
                "   (GB/s = input bytes / wall time, median of %lld interleaved rounds)\n",
                static_cast<long long>(kRounds));
    for (const char* v : kLightVariants) {
        const auto rate = find(g_light_gbps, v);
        const auto ms = map_value(rate, [](double r) { return kTotalBytes / r * 1e-6; });
        print_row(v, 22, {{rate, 8, 2, " GB/s"}, {ms, 9, 1, " ms"}});
    }
    const auto bound = find(g_light_gbps, "bidirectional_bound");
    const auto serial = find(g_light_gbps, "serial");
    const best_variant raw = best_of("raw_ring2", "raw_ring3", "raw");
    std::printf("  ratios per depth (for information): %-16s %10s %10s\n", "/ bound", "/ raw best",
                "/ serial");
    for (const char* v : {"library_depth2", "library_depth3"}) {
        const auto lib = find(g_light_gbps, v);
        print_row(std::string("  ") + v, 36,
                  {{ratio_of(lib, bound), 10, 3},
                   {ratio_of(lib, raw.gbps), 10, 3},
                   {ratio_of(lib, serial), 10, 3}});
    }
    const best_variant lib = best_of("library_depth2", "library_depth3", "library");
    print_ratio(lib.name + " / bidirectional_bound", lib.gbps, bound, kBoundTarget);
    print_ratio(lib.name + " / " + raw.name, lib.gbps, raw.gbps, kRawTarget);
    print_ratio(lib.name + " / serial", lib.gbps, serial, kSerialTarget);
    print_ratio("traced / untraced (library_depth2)", find(g_light_gbps, "library_depth2_traced"),
                find(g_light_gbps, "library_depth2"), kTracedTarget);
}

void print_heavy_summary() {
    if (g_heavy_s.empty()) {
        return;
    }
    std::printf("\n2. Heavy kernel (K = %d), 4 GiB, 64 MiB chunks, library depth %u\n"
                "   (median wall time of %lld interleaved rounds; GB/s = 4 GiB / that time)\n",
                g_cal.k, kHeavyDepth, static_cast<long long>(kRounds));
    for (const char* v : kHeavyVariants) {
        const auto s = find(g_heavy_s, v);
        print_row(v, 22,
                  {{map_value(s, [](double x) { return x * 1e3; }), 9, 1, " ms"},
                   {map_value(s, [](double x) { return gbps(kTotalBytes, x); }), 8, 2, " GB/s"}});
    }
    const auto lib = find(g_heavy_s, "library_depth3");
    const auto h2d = find(g_heavy_s, "h2d_alone");
    const auto kernel = find(g_heavy_s, "kernel_alone");
    const auto d2h = find(g_heavy_s, "d2h_alone");
    const auto bidir = find(g_heavy_s, "bidirectional");
    const auto raw = find(g_heavy_s, "raw_ring3");
    if (h2d && kernel && d2h) {
        const double bound = std::max({*h2d, *kernel, *d2h});
        const char* which = bound == *h2d ? "h2d" : bound == *kernel ? "kernel" : "d2h";
        std::printf("  max-stage bound = max(h2d, kernel, d2h alone) = %.1f ms (%s)\n", bound * 1e3,
                    which);
        print_ratio("efficiency vs one-way stage times (for information)", bound, lib,
                    std::nullopt);
        if (bidir) {
            // In steady state the H2D of one chunk and the D2H of another share the link, so the
            // copy stages cannot both run at their one-way speed: the max-stage bound takes the
            // two copy directions together (measured concurrently) against the kernel.
            const double shared = std::max(*bidir, *kernel);
            std::printf("  max-stage bound = max(h2d and d2h together, kernel alone) = %.1f ms\n",
                        shared * 1e3);
            print_ratio("efficiency = max-stage bound / library", shared, lib, kHeavyTarget);
        }
    }
    // Times: raw / library > 1 means the library is faster.
    print_ratio("raw_ring3 time / library time (for information)", raw, lib, std::nullopt);
}

void print_chunk_summary() {
    if (g_chunk_gbps.empty()) {
        return;
    }
    std::printf("\n3. Chunk size, light kernel, pinned (GB/s, median of %lld runs each; specified "
                "depth: 4 for chunks\n   <= 1 MiB, 3 above; best: the best of depths",
                static_cast<long long>(kRounds));
    for (unsigned d : kSweepDepths) {
        std::printf(" %u", d);
    }
    std::printf(")\n");
    std::printf("  %-8s %6s %5s %9s %9s %9s | %14s %14s %9s\n", "chunk", "total", "depth", "plain",
                "graph", "best/64M", "best plain", "best graph", "best/64M");

    // The better of plain and graph at one depth (specified) or over all depths (best).
    struct row_figures {
        std::optional<double> plain, graph, best;
        unsigned plain_depth = 0, graph_depth = 0;
    };
    auto figures = [](const chunk_case& c, bool sweep) {
        row_figures r;
        for (bool graph : {false, true}) {
            std::optional<double>& slot = graph ? r.graph : r.plain;
            unsigned& at = graph ? r.graph_depth : r.plain_depth;
            for (unsigned d : kSweepDepths) {
                if (!sweep && d != c.depth) {
                    continue;
                }
                const auto v = find(g_chunk_gbps, size_name(c.bytes) + "/" + chunk_key(graph, d));
                if (v && (!slot || *v > *slot)) {
                    slot = v;
                    at = d;
                }
            }
        }
        if (r.plain || r.graph) {
            r.best = std::max(r.plain.value_or(0.0), r.graph.value_or(0.0));
        }
        return r;
    };
    std::optional<double> ref_specified;
    std::optional<double> ref_best;
    std::optional<double> target_specified;
    std::optional<double> target_best;
    for (const chunk_case& c : kChunkCases) {
        if (c.bytes == kReferenceChunkBytes) {
            ref_specified = figures(c, false).best;
            ref_best = figures(c, true).best;
        }
    }
    for (const chunk_case& c : kChunkCases) {
        const row_figures spec = figures(c, false);
        const row_figures best = figures(c, true);
        if (!spec.best && !best.best) {
            continue;
        }
        if (c.bytes == kTargetChunkBytes) {
            target_specified = spec.best;
            target_best = best.best;
        }
        std::printf("  %-8s %6s %5u", size_name(c.bytes).c_str(), size_name(c.total).c_str(),
                    c.depth);
        print_cell(spec.plain, 9, 2);
        print_cell(spec.graph, 9, 2);
        print_cell(ratio_of(spec.best, ref_specified), 9, 3);
        std::printf(" |");
        for (auto [v, d] :
             {std::pair{best.plain, best.plain_depth}, std::pair{best.graph, best.graph_depth}}) {
            if (v) {
                std::printf(" %8.2f (d%u)", *v, d);
            } else {
                std::printf(" %14s", "-");
            }
        }
        print_cell(ratio_of(best.best, ref_best), 9, 3);
        std::printf("\n");
    }
    print_ratio("1 MiB / 64 MiB, better of plain and graph, specified depths", target_specified,
                ref_specified, kChunkTarget);
    print_ratio("1 MiB / 64 MiB, better of plain and graph, best depths", target_best, ref_best,
                kChunkTarget);
    // Default options, per-chunk stage: what a user who sets only the chunk size gets.
    for (const group_target& t : kDefaultTargets) {
        for (const char* v : kDefaultVariants) {
            print_ratio(size_name(t.bytes) + " / 64 MiB, default options (" + v + ")",
                        find(g_chunk_gbps, size_name(t.bytes) + "/" + v), ref_specified, t.target);
        }
    }
    // Chunk groups: the best grouped variant of each size against the 64 MiB figure.
    for (const group_target& t : kGroupTargets) {
        std::optional<double> best;
        std::string name = "grouped";
        for (const char* v : kGroupVariants) {
            const auto r = find(g_chunk_gbps, size_name(t.bytes) + "/" + v);
            if (r && (!best || *r > *best)) {
                best = r;
                name = v;
            }
        }
        if (!best) {
            continue;
        }
        std::printf("  %s in groups of %s (16MiB: %s):", size_name(t.bytes).c_str(),
                    size_name(cudawait::pipeline_options::default_group_bytes).c_str(),
                    size_name(kLargeGroupBytes).c_str());
        for (const char* v : kGroupVariants) {
            print_cell(find(g_chunk_gbps, size_name(t.bytes) + "/" + v), 0, 2);
            std::printf(" GB/s %s ", v);
        }
        std::printf("\n");
        print_ratio(size_name(t.bytes) + " / 64 MiB, best grouped (" + name + ")", best,
                    ref_specified, t.target);
    }
}

void print_host_memory_summary() {
    if (g_host_gbps.empty()) {
        return;
    }
    std::printf("\n4. Host memory, light kernel, 4 GiB, 64 MiB chunks, library depth %u (median "
                "of %lld interleaved runs)\n",
                kHostMemoryDepth, static_cast<long long>(kRounds));
    for (const char* v : kHostVariants) {
        print_row(v, 22, {{find(g_host_gbps, v), 8, 2, " GB/s"}});
    }
    print_ratio("pageable / pinned (for information)", find(g_host_gbps, "pageable"),
                find(g_host_gbps, "pinned"), std::nullopt);
    print_ratio("pageable / host-copy bound", find(g_host_gbps, "pageable"),
                find(g_host_gbps, "host_copy_bound"), kPageableTarget);
    print_ratio("registered / pinned", find(g_host_gbps, "registered"), find(g_host_gbps, "pinned"),
                kRegisteredTarget);
    if (g_registration) {
        std::printf("  registration: %.1f ms for %.1f GiB (%.1f GB/s; cudaHostRegister of the "
                    "registered\n  variant's input and output, once)\n",
                    g_registration->seconds * 1e3,
                    static_cast<double>(g_registration->bytes) / double(1_GiB),
                    gbps(g_registration->bytes, g_registration->seconds));
    }
}

void print_stats_summary() {
    if (g_stats.empty()) {
        return;
    }
    std::printf(
        "\n5. pipeline::stats() with options.monitoring.timing = true, depth %u, 64 MiB chunks, "
        "one run after a warm-up\n   (a separate pipeline; not used in any ratio above)\n",
        kStatsDepth);
    for (const char* k : {"light", "heavy"}) {
        auto it = g_stats.find(k);
        if (it == g_stats.end()) {
            continue;
        }
        const cudawait::pipeline_stats& s = it->second.stats;
        std::printf("  %s: wall %.1f ms (%.2f GB/s; stats: wall %.1f ms, throughput %.2f GB/s), "
                    "%zu chunks, %zu on the GPU, %zu alerts\n",
                    k, it->second.wall_seconds * 1e3, gbps(kTotalBytes, it->second.wall_seconds),
                    s.wall_seconds * 1e3, s.throughput_gbps, s.chunks, s.gpu_chunks, s.alerts);
        std::printf("    h2d_gbps %.2f  d2h_gbps %.2f  link_peak_gbps %.2f\n", s.h2d_gbps,
                    s.d2h_gbps, s.link_peak_gbps);
        std::printf("    stage sums: h2d %.1f ms, compute %.1f ms, d2h %.1f ms\n",
                    s.h2d_seconds * 1e3, s.compute_seconds * 1e3, s.d2h_seconds * 1e3);
        std::printf("    compute_to_transfer %.3f  overlap_efficiency %.3f\n",
                    s.compute_to_transfer, s.overlap_efficiency);
        std::printf("    suggest_chunk_size() %zu elements (%s; current %s)\n",
                    it->second.suggested_elements,
                    size_name(it->second.suggested_elements * sizeof(float)).c_str(),
                    size_name(kChunkBytes).c_str());
    }
}

void print_devices_summary() {
    if (g_device_gbps.empty()) {
        return;
    }
    std::printf("\n6. Devices, light kernel, 4 GiB, 64 MiB chunks, pinned, depth %u (GB/s, median "
                "of %lld\n   interleaved rounds)\n",
                kDevicesDepth, static_cast<long long>(kRounds));
    for (const char* v : kDeviceVariants) {
        const auto rate = find(g_device_gbps, v);
        if (!rate) {
            continue;
        }
        const auto ms = map_value(rate, [](double r) { return kTotalBytes / r * 1e-6; });
        print_row(v, 22, {{rate, 8, 2, " GB/s"}, {ms, 9, 1, " ms"}});
    }
    const auto plain = find(g_device_gbps, "plain_device0");
    print_ratio("multi_device0 / plain_device0", find(g_device_gbps, "multi_device0"), plain,
                kOneShardTarget);
    std::printf("  devices: %d\n", g_devices);
    if (g_devices > 1) {
        print_ratio("multi_all_devices / (" + std::to_string(g_devices) +
                        " x plain_device0) (for information)",
                    find(g_device_gbps, "multi_all_devices"),
                    map_value(plain, [](double r) { return r * g_devices; }), std::nullopt);
    }
}

/// Section 3's 64 MiB figure: the better of plain and graph at the specified depth.
std::optional<double> reference_64mib() {
    std::optional<double> ref;
    for (const chunk_case& c : kChunkCases) {
        if (c.bytes != kReferenceChunkBytes) {
            continue;
        }
        for (bool graph : {false, true}) {
            const auto v = find(g_chunk_gbps, size_name(c.bytes) + "/" + chunk_key(graph, c.depth));
            if (v && (!ref || *v > *ref)) {
                ref = v;
            }
        }
    }
    return ref;
}

void print_stream_summary() {
    if (g_stream_gbps.empty()) {
        return;
    }
    std::printf("\n7. Streaming small items, light kernel, %s items over %s, pinned (median of "
                "%lld interleaved runs)\n",
                size_name(kStreamItemBytes).c_str(), size_name(kStreamTotalBytes).c_str(),
                static_cast<long long>(kRounds));
    std::optional<double> best;
    std::string name = "streaming";
    std::vector<std::string> variants;
    for (unsigned d : kStreamDepths) {
        variants.push_back("depth" + std::to_string(d));
    }
    variants.push_back(kStreamDefault);
    for (const stream_group_case& c : kStreamGroupCases) {
        variants.push_back(stream_group_name(c));
    }
    const std::vector<std::string> view_variants = stream_view_names();
    variants.insert(variants.end(), view_variants.begin(), view_variants.end());
    std::optional<double> best_view;
    std::string view_name = "views";
    for (const std::string& v : variants) {
        const auto r = find(g_stream_gbps, v);
        print_row(v, 24, {{r, 8, 2, " GB/s"}});
        if (r && (!best || *r > *best)) {
            best = r;
            name = v;
        }
        const bool is_view =
            std::find(view_variants.begin(), view_variants.end(), v) != view_variants.end();
        if (is_view && r && (!best_view || *r > *best_view)) {
            best_view = r;
            view_name = v;
        }
    }
    const auto bound = find(g_stream_gbps, kStreamFillBound);
    print_row(kStreamFillBound, 24, {{bound, 8, 2, " GB/s"}});
    print_ratio("streaming " + size_name(kStreamItemBytes) + " items (" + name + ") / 64 MiB batch",
                best, reference_64mib(), kStreamTarget);
    print_ratio("streaming " + size_name(kStreamItemBytes) + " views (" + view_name +
                    ") / 64 MiB batch",
                best_view, reference_64mib(), kStreamTarget);
    print_ratio("streaming, default options / host_fill_bound", find(g_stream_gbps, kStreamDefault),
                bound, kStreamDefaultTarget);
    print_ratio("streaming (" + name + ") / host_fill_bound (for information)", best, bound,
                std::nullopt);
    print_ratio("host_fill_bound / 64 MiB batch (for information)", bound, reference_64mib(),
                std::nullopt);
}

void print_summary() {
    std::printf("\n==== pipeline_bench summary (medians; ratios within this run) ====\n");
    print_calibration();
    print_light_summary();
    print_heavy_summary();
    print_policy_summary(kTotalBytes, kRounds);
    print_chunk_summary();
    print_host_memory_summary();
    print_stats_summary();
    print_devices_summary();
    print_stream_summary();
    std::printf("\n%zu runs had their output checked against the host reference; all matched\n",
                g_checked_runs);
    if (g_failures != 0) {
        std::printf("\n%d benchmark(s) reported an error; see their rows above\n", g_failures);
    }
    std::fflush(stdout);
}

} // namespace bench

int main(int argc, char** argv) {
    return bench::run_main(
        argc, argv, "pipeline_bench", "every benchmark here moves data to and from a GPU",
        [] {
            bench::warm_up_device();
            bench::calibrate_heavy(bench::kChunk);
        },
        bench::register_benchmarks,
        [] {
            bench::print_summary();
            bench::g_work.reset(); // unregisters the pinned memory while the runtime is still up
        });
}
