// SPDX-License-Identifier: Apache-2.0
#include <cudawait/core/scheduler.hpp>
#include <cudawait/core/sync_wait.hpp>
#include <cudawait/core/when_all.hpp>
#include <cudawait/memory/device_buffer.hpp>
#include <cudawait/memory/mapped_buffer.hpp>
#include <cudawait/memory/pinned_buffer.hpp>
#include <cudawait/pipeline/detail/multi_pool.hpp>
#include <cudawait/pipeline/detail/multi_stats.hpp>
#include <cudawait/pipeline/multi_pipeline.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <cuda_runtime.h>

#include "counting_device_resource.hpp"
#include "gpu_fixture.hpp"
#include "no_device.hpp"
#include "random_words.hpp"
#include "test_kernels.hpp"
#include <gtest/gtest.h>

namespace {

using namespace std::chrono_literals;
using cudawait::multi_pipeline;
using cudawait::multi_pipeline_options;
using cudawait::pinned_buffer;
using cudawait::pipeline_error;
using cudawait::pipeline_stats;
using cudawait::usage_error;
using u32 = std::uint32_t;
using multi_t = multi_pipeline<u32>;
using clock_type = std::chrono::steady_clock;

constexpr u32 salt = 0x5eed;
constexpr u32 poison = 0xdeadbeefu;

using cudawait::testing::random_words;

/// The host result of the transform stage, chunk by chunk (the index restarts in each chunk).
std::vector<u32> expected(const std::vector<u32>& in, std::size_t chunk) {
    std::vector<u32> out(in.size());
    for (std::size_t off = 0; off < in.size(); off += chunk) {
        std::size_t n = std::min(chunk, in.size() - off);
        cudawait::testing::transform_on_host(in.data() + off, out.data() + off, n, salt);
    }
    return out;
}

std::size_t first_mismatch(std::span<const u32> got, const std::vector<u32>& want) {
    for (std::size_t i = 0; i < want.size(); ++i) {
        if (got[i] != want[i]) {
            return i;
        }
    }
    return want.size();
}

/// The transform on the chunk's stream; records a call made without the context's device
/// current.
multi_t::stage transform_stage(std::shared_ptr<int> wrong_device = nullptr) {
    return
        [wrong_device](std::span<u32> in, std::span<u32> out, const cudawait::stage_context& ctx) {
            if (wrong_device) {
                int dev = -1;
                cudawait::check(cudaGetDevice(&dev), "cudaGetDevice");
                *wrong_device += dev != ctx.device ? 1 : 0;
            }
            cudawait::check(cudawait::testing::launch_transform(in.data(), out.data(), in.size(),
                                                                salt, 0, ctx.stream.get()),
                            "launch_transform");
        };
}

/// The fallback: the same transform on the host.
void host_fallback(std::size_t, std::span<const u32> in, std::span<u32> out) {
    cudawait::testing::transform_on_host(in.data(), out.data(), in.size(), salt);
}

multi_pipeline_options options_for(std::vector<int> devices, unsigned shards_per_device,
                                   std::size_t chunk, unsigned depth = 2) {
    multi_pipeline_options o;
    o.devices = std::move(devices);
    o.shards_per_device = shards_per_device;
    o.per_shard.chunk_elements = chunk;
    o.per_shard.memory.group_bytes = 0; // one chunk per flight
    o.per_shard.depth = depth;
    return o;
}

// ---- without a GPU: argument checks come before any CUDA call ---------------------------------

TEST(multi_pipeline, bad_options_are_usage_errors) {
    multi_pipeline_options o = options_for({0}, 1, 1024);
    EXPECT_THROW(multi_t(o, {}), usage_error) << "no stages";
    EXPECT_THROW(multi_t(o, {multi_t::stage{}}), usage_error) << "an empty stage";
    o.shards_per_device = 0;
    EXPECT_THROW(multi_t(o, {transform_stage()}), usage_error) << "0 shards";
    o.shards_per_device = 1;
    o.per_shard.chunk_elements = 0;
    EXPECT_THROW(multi_t(o, {transform_stage()}), usage_error) << "no chunk size";
    o.per_shard.chunk_elements = 1024;
    o.per_shard.memory.group_bytes = 0; // one chunk per flight
    o.per_shard.depth = 0;
    EXPECT_THROW(multi_t(o, {transform_stage()}), usage_error) << "depth 0";
    o.per_shard.depth = 2;
    o.devices = {0, 1, 0};
    try {
        multi_t m(o, {transform_stage()});
        ADD_FAILURE() << "a device listed twice was accepted";
    } catch (const usage_error& e) {
        EXPECT_NE(std::string(e.what()).find("listed twice"), std::string::npos) << e.what();
    }
}

// multi_pipeline_options::validate() names the field, per_shard's as a path into it, and the
// multi_pipeline calls it before any CUDA call.
TEST(multi_pipeline, validate_names_the_field) {
    const multi_pipeline_options good = options_for({0}, 1, 1024);
    EXPECT_NO_THROW(good.validate());
    auto message = [](const multi_pipeline_options& o) {
        try {
            multi_t m(o, {transform_stage()});
        } catch (const usage_error& e) {
            return std::string(e.what());
        } catch (const cudawait::cuda_error&) {
            // without a device: the options passed
        }
        return std::string();
    };
    multi_pipeline_options o = good;
    o.shards_per_device = 0;
    EXPECT_EQ(message(o).rfind("multi_pipeline_options.shards_per_device must be at least 1", 0),
              0u)
        << message(o);
    o = good;
    o.devices = {0, 1, 0};
    EXPECT_EQ(message(o).rfind("multi_pipeline_options.devices", 0), 0u) << message(o);
    o = good;
    o.per_shard.recovery.chunk_timeout = -1ms;
    EXPECT_EQ(message(o), "multi_pipeline_options.per_shard.recovery.chunk_timeout must be >= 0");
    EXPECT_THROW(o.validate(), usage_error);
    o = good;
    o.per_shard.streams.stage_streams = true;
    o.per_shard.streams.compute_streams = 3;
    EXPECT_EQ(message(o).rfind("multi_pipeline_options.per_shard.streams.compute_streams", 0), 0u)
        << message(o);
}

TEST(multi_pipeline, the_staging_pool_of_every_device_is_the_default_one_for_now) {
    EXPECT_EQ(&cudawait::detail::staging_pool_for_device(0), &cudawait::default_pinned_pool());
    EXPECT_EQ(&cudawait::detail::staging_pool_for_device(3), &cudawait::default_pinned_pool());
}

TEST(multi_pipeline, combined_stats_sum_the_shards_and_count_rescues_as_gpu_chunks) {
    pipeline_stats a;
    a.chunks = 5;
    a.gpu_chunks = 3;
    a.fallback_chunks = 2; // one of them rescued, one failed its rescue without a fallback
    a.retries = 4;
    a.input_bytes = 3000;
    a.output_bytes = 1500;
    a.h2d_seconds = 1.0;
    a.d2h_seconds = 0.5;
    a.compute_seconds = 2.0;
    a.depth = 2;
    a.link_peak_gbps = 50;
    a.gpu_abandoned = true;
    a.latency = {0.010, 0.020, 0.030, 0.040, 5};
    pipeline_stats b;
    b.chunks = 4;
    b.gpu_chunks = 4;
    b.input_bytes = 1000;
    b.output_bytes = 500;
    b.h2d_seconds = 1.0;
    b.d2h_seconds = 1.5;
    b.compute_seconds = 0.5;
    b.depth = 3;
    b.recoveries = 1;
    b.alerts = 2;
    b.link_peak_gbps = 40;
    b.latency = {0.015, 0.018, 0.050, 0.060, 4};
    cudawait::detail::multi_run_counts run{2.0, 1, 1, {}};
    pipeline_stats c = cudawait::detail::combine_stats({a, b}, run);
    EXPECT_EQ(c.chunks, 9u);
    EXPECT_EQ(c.gpu_chunks, 3u + 4u + 1u) << "the rescued chunk is a GPU chunk";
    EXPECT_EQ(c.fallback_chunks, 0u);
    EXPECT_EQ(c.failed_chunks, 1u) << "the chunk no one produced";
    EXPECT_EQ(c.chunks, c.gpu_chunks + c.fallback_chunks + c.failed_chunks);
    EXPECT_EQ(c.retries, 4u);
    EXPECT_EQ(c.input_bytes, 4000u);
    EXPECT_EQ(c.output_bytes, 2000u);
    EXPECT_DOUBLE_EQ(c.h2d_seconds, 2.0);
    EXPECT_DOUBLE_EQ(c.d2h_seconds, 2.0);
    EXPECT_DOUBLE_EQ(c.compute_seconds, 2.5);
    EXPECT_EQ(c.depth, 5u);
    EXPECT_EQ(c.recoveries, 1u);
    EXPECT_EQ(c.alerts, 2u);
    EXPECT_FALSE(c.gpu_abandoned) << "one shard still has its GPU";
    EXPECT_DOUBLE_EQ(c.link_peak_gbps, 40.0);
    EXPECT_DOUBLE_EQ(c.wall_seconds, 2.0);
    EXPECT_DOUBLE_EQ(c.throughput_gbps, 4000.0 / 2.0 / 1e9);
    EXPECT_DOUBLE_EQ(c.h2d_gbps, 4000.0 / 2.0 / 1e9);
    EXPECT_DOUBLE_EQ(c.compute_to_transfer, 2.5 / 2.0);
    EXPECT_DOUBLE_EQ(c.overlap_efficiency, 2.0 / 2.0) << "the busiest shard's longest stage";
    EXPECT_DOUBLE_EQ(c.latency.p50_seconds, 0.015);
    EXPECT_DOUBLE_EQ(c.latency.p90_seconds, 0.020);
    EXPECT_DOUBLE_EQ(c.latency.p99_seconds, 0.050);
    EXPECT_DOUBLE_EQ(c.latency.max_seconds, 0.060);
    EXPECT_EQ(c.latency.samples, 9u);
    // Every shard abandoned: so is the whole.
    b.gpu_abandoned = true;
    EXPECT_TRUE(cudawait::detail::combine_stats({a, b}, run).gpu_abandoned);
}

// A rescued chunk's bytes count once, on the shard whose chunk it was, as its chunk does; the
// copy rates stay those of the shards' own copies.
TEST(multi_pipeline, a_rescued_chunks_bytes_count_on_its_shard_and_in_the_sum) {
    pipeline_stats a; // 4 chunks: 3 on its GPU (3000 bytes in), 1 rescued by b (1000 in)
    a.chunks = 4;
    a.gpu_chunks = 3;
    a.fallback_chunks = 1;
    a.input_bytes = 3000;
    a.output_bytes = 1500;
    a.h2d_seconds = 1.0;
    a.d2h_seconds = 0.5;
    a.wall_seconds = 2.0;
    a.h2d_gbps = 3000.0 / 1.0 / 1e9;
    a.throughput_gbps = 3000.0 / 2.0 / 1e9;
    pipeline_stats b; // 3 chunks on its GPU
    b.chunks = 3;
    b.gpu_chunks = 3;
    b.input_bytes = 2500;
    b.output_bytes = 1250;
    b.h2d_seconds = 1.0;
    b.d2h_seconds = 0.5;
    b.wall_seconds = 2.5;
    const cudawait::detail::byte_counts rescued{1000, 500};
    cudawait::detail::count_rescued(a, rescued);
    EXPECT_EQ(a.input_bytes, 4000u) << "the shard's 4 chunks";
    EXPECT_EQ(a.output_bytes, 2000u);
    EXPECT_DOUBLE_EQ(a.throughput_gbps, 4000.0 / 2.0 / 1e9);
    EXPECT_DOUBLE_EQ(a.h2d_gbps, 3000.0 / 1.0 / 1e9) << "the shard's own copies' rate";
    cudawait::detail::count_rescued(b, {});
    EXPECT_EQ(b.input_bytes, 2500u);
    cudawait::detail::multi_run_counts run{4.0, 1, 0, rescued};
    pipeline_stats c = cudawait::detail::combine_stats({a, b}, run);
    EXPECT_EQ(c.chunks, 7u);
    EXPECT_EQ(c.gpu_chunks, 7u);
    EXPECT_EQ(c.input_bytes, 6500u) << "every chunk's bytes once";
    EXPECT_EQ(c.output_bytes, 3250u);
    EXPECT_DOUBLE_EQ(c.throughput_gbps, 6500.0 / 4.0 / 1e9);
    EXPECT_DOUBLE_EQ(c.h2d_gbps, 5500.0 / 2.0 / 1e9) << "only the bytes the copy stages moved";
    EXPECT_DOUBLE_EQ(c.d2h_gbps, 2750.0 / 1.0 / 1e9);
}

TEST(multi_pipeline, without_a_device_construction_is_a_cuda_error) {
    auto child = [] {
        try {
            multi_t m(options_for({}, 1, 1024), {transform_stage()});
            std::fprintf(stderr, "no exception\n");
            std::exit(1);
        } catch (const cudawait::cuda_error& e) {
            std::fprintf(stderr, "multi_pipeline failed cleanly: %s\n", e.what());
            std::exit(0);
        }
    };
    CUDAWAIT_EXPECT_IN_CHILD_WITHOUT_DEVICE(child(), "multi_pipeline failed cleanly");
}

// ---- with a GPU -------------------------------------------------------------------------------

class multi_gpu : public cudawait::testing::pool_gpu_test {};

TEST_F(multi_gpu, a_device_id_out_of_range_is_the_invalid_device_error) {
    const int n = cudawait::device_count();
    for (int bad : {n, -1}) {
        try {
            multi_t m(options_for({0, bad}, 1, 1024), {transform_stage()});
            ADD_FAILURE() << "device " << bad << " was accepted";
        } catch (const cudawait::cuda_error& e) {
            EXPECT_EQ(e.status(), cudaErrorInvalidDevice) << e.what();
        }
    }
}

TEST_F(multi_gpu, a_batch_over_device_0_is_right_and_is_one_shard) {
    const std::size_t chunk = 64 * 1024 + 3;
    const std::size_t n = chunk * 7 + 999;
    auto in = random_words(n, 1);
    auto want = expected(in, chunk);
    auto wrong_device = std::make_shared<int>(0);
    multi_t m(options_for({0}, 1, chunk), {transform_stage(wrong_device)});
    ASSERT_EQ(m.shard_count(), 1u);
    std::vector<u32> out(n, poison);
    cudawait::scheduler sched;
    cudawait::sync_wait(sched, m.run(in, out));
    EXPECT_EQ(first_mismatch(out, want), n);
    EXPECT_EQ(*wrong_device, 0) << "a stage ran without its device current";
    auto st = m.stats();
    EXPECT_EQ(st.shard_devices, std::vector<int>{0});
    ASSERT_EQ(st.per_shard.size(), 1u);
    EXPECT_EQ(st.per_shard[0].chunks, 8u);
    EXPECT_EQ(st.combined.chunks, 8u);
    EXPECT_EQ(st.combined.gpu_chunks, 8u);
    EXPECT_EQ(st.combined.input_bytes, n * sizeof(u32));
    EXPECT_EQ(st.rescued_chunks, 0u);
    EXPECT_GT(st.combined.wall_seconds, 0.0);
    EXPECT_GT(st.combined.throughput_gbps, 0.0);
}

TEST_F(multi_gpu, a_batch_over_every_device_is_right_in_input_order) {
    const int devices = cudawait::device_count();
    const std::size_t chunk = 50'000;
    const std::size_t n = chunk * (3 * static_cast<std::size_t>(devices) + 2) + 17;
    auto in = random_words(n, 2);
    auto want = expected(in, chunk);
    auto wrong_device = std::make_shared<int>(0);
    multi_t m(options_for({}, 1, chunk), {transform_stage(wrong_device)});
    ASSERT_EQ(m.shard_count(), static_cast<std::size_t>(devices));
    std::vector<u32> out(n, poison);
    cudawait::scheduler sched;
    cudawait::sync_wait(sched, m.run(in, out));
    EXPECT_EQ(first_mismatch(out, want), n);
    EXPECT_EQ(*wrong_device, 0) << "a stage ran without its device current";
    auto st = m.stats();
    for (int d = 0; d < devices; ++d) {
        EXPECT_EQ(st.shard_devices[static_cast<std::size_t>(d)], d);
        EXPECT_GT(st.per_shard[static_cast<std::size_t>(d)].gpu_chunks, 0u) << "device " << d;
    }
    EXPECT_EQ(st.combined.gpu_chunks, (n + chunk - 1) / chunk);
}

struct split_case {
    std::size_t full_chunks; ///< the input: full_chunks chunks and `rest` elements more
    std::size_t rest;
    bool pinned;
};

void PrintTo(const split_case& c, std::ostream* os) {
    *os << c.full_chunks << " chunks + " << c.rest << (c.pinned ? ", pinned" : ", pageable");
}

class multi_split : public multi_gpu, public ::testing::WithParamInterface<split_case> {};

// Two shards on device 0; sizes that are not multiples of the chunk, and fewer chunks than
// shards; every element checked, and the stats summed.
TEST_P(multi_split, two_shards_on_one_device_split_at_chunk_boundaries) {
    const split_case c = GetParam();
    const std::size_t chunk = 40'000;
    const std::size_t n = chunk * c.full_chunks + c.rest;
    const std::size_t chunks = (n + chunk - 1) / chunk;
    auto in = random_words(n, n);
    auto want = expected(in, chunk);
    multi_t m(options_for({0}, 2, chunk, 3), {transform_stage()});
    ASSERT_EQ(m.shard_count(), 2u);
    cudawait::scheduler sched;
    for (int round = 0; round < 2; ++round) { // a second run through the same shards
        if (c.pinned) {
            pinned_buffer<u32> pin(n);
            pinned_buffer<u32> pout(n);
            std::copy(in.begin(), in.end(), pin.begin());
            std::fill(pout.begin(), pout.end(), poison);
            cudawait::sync_wait(sched, m.run(pin.span(), pout.span()));
            ASSERT_EQ(first_mismatch(pout.span(), want), n) << "round " << round;
        } else {
            std::vector<u32> out(n, poison);
            cudawait::sync_wait(sched, m.run(in, out));
            ASSERT_EQ(first_mismatch(out, want), n) << "round " << round;
        }
    }
    auto st = m.stats();
    ASSERT_EQ(st.per_shard.size(), 2u);
    EXPECT_EQ(st.shard_devices, (std::vector<int>{0, 0}));
    // Equal chunk counts, the first part one more when odd.
    EXPECT_EQ(st.per_shard[0].chunks, chunks - chunks / 2);
    EXPECT_EQ(st.per_shard[1].chunks, chunks / 2);
    EXPECT_EQ(st.combined.chunks, chunks);
    EXPECT_EQ(st.combined.gpu_chunks, chunks);
    EXPECT_EQ(st.combined.fallback_chunks + st.combined.failed_chunks, 0u);
    EXPECT_EQ(st.combined.input_bytes, st.per_shard[0].input_bytes + st.per_shard[1].input_bytes);
    EXPECT_EQ(st.combined.input_bytes, n * sizeof(u32));
    EXPECT_EQ(st.combined.output_bytes, n * sizeof(u32));
    EXPECT_EQ(st.combined.depth, st.per_shard[0].depth + st.per_shard[1].depth);
    EXPECT_EQ(st.combined.latency.samples,
              st.per_shard[0].latency.samples + st.per_shard[1].latency.samples);
    EXPECT_GE(st.combined.latency.p99_seconds, st.per_shard[0].latency.p99_seconds);
    EXPECT_GE(st.combined.latency.p99_seconds, st.per_shard[1].latency.p99_seconds);
    EXPECT_GT(st.combined.wall_seconds, 0.0);
}

INSTANTIATE_TEST_SUITE_P(sizes, multi_split,
                         ::testing::Values(split_case{9, 1234, false}, split_case{9, 1234, true},
                                           split_case{2, 5, false}, split_case{0, 777, true},
                                           split_case{4, 0, false}),
                         [](const ::testing::TestParamInfo<split_case>& info) {
                             const split_case& c = info.param;
                             return std::to_string(c.full_chunks) + "_chunks_plus_" +
                                    std::to_string(c.rest) + (c.pinned ? "_pinned" : "_pageable");
                         });

// ---- chunk groups -----------------------------------------------------------------------------

/// One call of a group stage: what it was given, and whether its device was current.
struct group_call {
    std::size_t first_chunk;
    std::size_t chunks;
    std::size_t in_size;
    std::size_t out_size;
    bool device_current;
};

/// A group stage that records each call, then launches the transform once per chunk of the
/// group (the index restarts in each chunk).
multi_t::stage recording_group_stage(std::shared_ptr<std::vector<group_call>> calls) {
    return [calls](std::span<u32> in, std::span<u32> out, const cudawait::group_context& g) {
        int dev = -1;
        cudawait::check(cudaGetDevice(&dev), "cudaGetDevice");
        calls->push_back({g.first_chunk, g.chunks, in.size(), out.size(), dev == g.device});
        for (std::size_t j = 0; j < g.chunks; ++j) {
            const std::span<u32> i = g.input_chunk(in, j);
            cudawait::check(cudawait::testing::launch_transform(i.data(),
                                                                g.output_chunk(out, j).data(),
                                                                i.size(), salt, 0, g.stream.get()),
                            "launch_transform");
        }
    };
}

// A group stage stays one in the shards: called once per group with the whole group (not once
// per chunk with a group of one), with its shard's device current.
TEST_F(multi_gpu, a_group_stage_is_called_once_per_group_with_the_whole_group) {
    const std::size_t chunk = 1000;
    const std::size_t group = 4;
    const std::size_t chunks = 19; // shard 0: 10 chunks, shard 1: 9 (the last one short)
    const std::size_t n = chunk * chunks - 250;
    auto in = random_words(n, 41);
    auto want = expected(in, chunk);
    auto calls = std::make_shared<std::vector<group_call>>();
    multi_pipeline_options o = options_for({0}, 2, chunk, 2);
    o.per_shard.memory.group_bytes = group * chunk * sizeof(u32);
    multi_t m(o, {recording_group_stage(calls)});
    // A batch over pinned ranges moves whole groups.
    pinned_buffer<u32> pin(n);
    pinned_buffer<u32> pout(n);
    std::copy(in.begin(), in.end(), pin.begin());
    std::fill(pout.begin(), pout.end(), poison);
    cudawait::scheduler sched;
    cudawait::sync_wait(sched, m.run(pin.span(), pout.span()));
    EXPECT_EQ(first_mismatch(pout.span(), want), n);
    std::size_t chunks_seen = 0;
    std::size_t largest = 0;
    for (const group_call& c : *calls) {
        chunks_seen += c.chunks;
        largest = std::max(largest, c.chunks);
        EXPECT_LE(c.chunks, group) << "group from chunk " << c.first_chunk;
        // The spans hold every chunk of the group; only the batch's last chunk is short.
        EXPECT_GE(c.in_size, (c.chunks - 1) * chunk + 1) << "group from chunk " << c.first_chunk;
        EXPECT_LE(c.in_size, c.chunks * chunk) << "group from chunk " << c.first_chunk;
        EXPECT_EQ(c.out_size, c.in_size);
        EXPECT_TRUE(c.device_current) << "group from chunk " << c.first_chunk;
    }
    EXPECT_EQ(chunks_seen, chunks) << "every chunk in exactly one call";
    EXPECT_EQ(largest, group) << "the stage saw no whole group";
    EXPECT_LE(calls->size(), 6u) << "called per chunk rather than per group";
    auto st = m.stats();
    EXPECT_EQ(st.combined.gpu_chunks, chunks);
    EXPECT_EQ(st.combined.input_bytes, n * sizeof(u32));
}

// ---- a pipeline on a device the driving thread does not have current ---------------------------

class two_gpus : public multi_gpu {
protected:
    void SetUp() override {
        multi_gpu::SetUp();
        if (!IsSkipped() && cudawait::device_count() < 2) {
            GTEST_SKIP()
                << "needs two devices: a pipeline on device 1 driven with device 0 current";
        }
    }
};

int current_device_id() {
    int dev = -1;
    cudawait::check(cudaGetDevice(&dev), "cudaGetDevice");
    return dev;
}

// A plain pipeline built for device 1 and driven by a thread whose current device is 0: its
// stages run with device 1 current (plain, captured into graphs, per-chunk and group stages;
// batch and streaming), no chunk degrades, and the thread's device is 0 again after each call.
TEST_F(two_gpus, a_pipeline_on_device_1_runs_its_stages_there_while_the_thread_is_on_device_0) {
    const std::size_t chunk = 10'000;
    for (int mode = 0; mode < 3; ++mode) { // plain, graph, group stage in groups of 4 chunks
        SCOPED_TRACE(mode == 0 ? "plain" : mode == 1 ? "graph" : "groups");
        auto wrong_device = std::make_shared<int>(0);
        auto calls = std::make_shared<std::vector<group_call>>();
        int degraded = 0;
        cudawait::pipeline_options o;
        o.memory.group_bytes = 0; // one chunk per flight
        o.streams.device = 1;
        o.chunk_elements = chunk;
        o.depth = 2;
        o.graph = mode == 1;
        o.memory.group_bytes = mode == 2 ? 4 * chunk * sizeof(u32) : 0;
        o.recovery.max_retries = 0;
        o.recovery.on_degrade = [&](const cudawait::chunk_failure&) { ++degraded; };
        ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
        cudawait::pipeline<u32> p(
            o, {mode == 2 ? recording_group_stage(calls) : transform_stage(wrong_device)});
        EXPECT_EQ(current_device_id(), 0) << "the constructor left another device current";
        // A batch over pinned ranges (whole graphs and groups): 9 chunks, the last one short.
        const std::size_t n = chunk * 9 - 77;
        auto in = random_words(n, 50 + static_cast<std::uint64_t>(mode));
        pinned_buffer<u32> pin(n);
        pinned_buffer<u32> pout(n);
        std::copy(in.begin(), in.end(), pin.begin());
        std::fill(pout.begin(), pout.end(), poison);
        cudawait::scheduler sched;
        EXPECT_NO_THROW(cudawait::sync_wait(sched, p.run(pin.span(), pout.span())));
        EXPECT_EQ(first_mismatch(pout.span(), expected(in, chunk)), n);
        EXPECT_EQ(current_device_id(), 0) << "the batch left another device current";
        EXPECT_EQ(p.stats().gpu_chunks, 9u);
        // Streaming: 6 chunks through the pinned slots.
        std::vector<std::vector<u32>> chunks;
        for (std::size_t i = 0; i < 6; ++i) {
            chunks.push_back(random_words(chunk - 5 * i, 900 + i));
        }
        std::size_t right = 0;
        std::size_t consumed = 0;
        auto produce = [&]() -> cudawait::task<void> {
            for (const auto& c : chunks) {
                auto slot = co_await p.acquire();
                std::fill(slot.data().begin(), slot.data().end(), poison);
                std::copy(c.begin(), c.end(), slot.data().begin());
                p.submit(std::move(slot), c.size());
                EXPECT_EQ(current_device_id(), 0) << "submit left another device current";
            }
            p.close();
        };
        auto consume = [&]() -> cudawait::task<void> {
            while (auto r = co_await p.next()) {
                if (consumed == chunks.size()) {
                    ADD_FAILURE() << "more results than chunks";
                    break;
                }
                const auto& c = chunks[consumed++];
                std::vector<u32> want(c.size());
                cudawait::testing::transform_on_host(c.data(), want.data(), c.size(), salt);
                right += std::equal(want.begin(), want.end(), r->data().begin(), r->data().end())
                             ? 1
                             : 0;
            }
        };
        EXPECT_NO_THROW(cudawait::sync_wait(sched, cudawait::when_all(produce(), consume())));
        EXPECT_EQ(consumed, chunks.size());
        EXPECT_EQ(right, chunks.size());
        EXPECT_EQ(current_device_id(), 0) << "streaming left another device current";
        EXPECT_EQ(p.stats().gpu_chunks, chunks.size());
        EXPECT_EQ(degraded, 0) << "chunks degraded (a stage's launch failed)";
        EXPECT_EQ(*wrong_device, 0) << "a stage ran without the pipeline's device current";
        for (const group_call& c : *calls) {
            EXPECT_TRUE(c.device_current) << "group from chunk " << c.first_chunk;
        }
    }
}

// ---- device memory resources -------------------------------------------------------------------

// device_resource_for gives each shard the resource of its device; the shards' device buffers
// come from it (and go back to it), and the results are right.
TEST_F(multi_gpu, device_resource_for_gives_each_shard_its_devices_resource) {
#if !CUDAWAIT_HAS_CUDA_MR
    GTEST_SKIP() << "cuda::mr is not available";
#else
    cudawait::testing::device_resource_counts counts;
    cudawait::testing::counting_device_resource counting(counts);
    std::vector<int> asked;
    const std::size_t chunk = 20'000;
    const std::size_t n = chunk * 7 + 5;
    auto in = random_words(n, 61);
    std::vector<u32> out(n, poison);
    {
        multi_pipeline_options o = options_for({0}, 2, chunk, 2);
        o.device_resource_for = [&](int dev) {
            asked.push_back(dev);
            return cudawait::device_resource(counting);
        };
        multi_t m(o, {transform_stage()});
        EXPECT_EQ(asked, (std::vector<int>{0, 0})) << "once per shard, with its device";
        // Each shard's slots: input and output of depth 2, and the probe.
        EXPECT_GE(counts.allocations.load(), 2 * (2 * 2 + 1));
        EXPECT_EQ(counts.deallocations.load(), 2) << "the probes went back";
        EXPECT_FALSE(m.shard(1).options().memory.device_resource.is_default());
        cudawait::scheduler sched;
        cudawait::sync_wait(sched, m.run(in, out));
    }
    EXPECT_EQ(first_mismatch(out, expected(in, chunk)), n);
    EXPECT_EQ(counts.deallocations.load(), counts.allocations.load());
    EXPECT_EQ(counts.bytes_freed.load(), counts.bytes_allocated.load());
#endif
}

#if CUDAWAIT_HAS_CUDA_MR
/// Device memory of one device whatever the stream's (cudaMalloc with that device current),
/// freed once the stream reached the free: as a resource made for one device behaves.
class one_device_resource {
public:
    explicit one_device_resource(int dev) noexcept : m_dev(dev) {}
    void* allocate_async(std::size_t bytes, std::size_t, ::cuda::stream_ref) {
        cudawait::device_guard on{cudawait::device_ref(m_dev)};
        void* p = nullptr;
        cudawait::check(cudaMalloc(&p, bytes), "cudaMalloc");
        return p;
    }
    void deallocate_async(void* p, std::size_t, std::size_t, ::cuda::stream_ref s) noexcept {
        cudawait::detail::report(cudaStreamSynchronize(s.get()), "cudaStreamSynchronize");
        cudawait::detail::report(cudaFree(p), "cudaFree");
    }
    void* allocate(::cuda::stream_ref s, std::size_t bytes, std::size_t alignment) {
        return allocate_async(bytes, alignment, s);
    }
    void deallocate(::cuda::stream_ref s, void* p, std::size_t bytes,
                    std::size_t alignment) noexcept {
        deallocate_async(p, bytes, alignment, s);
    }
    void* allocate(std::size_t bytes, std::size_t alignment) {
        return allocate_async(bytes, alignment, ::cuda::stream_ref(cudaStreamPerThread));
    }
    void deallocate(void* p, std::size_t bytes, std::size_t alignment) noexcept {
        deallocate_async(p, bytes, alignment, ::cuda::stream_ref(cudaStreamPerThread));
    }
    void* allocate_sync(std::size_t bytes, std::size_t alignment) {
        return allocate(bytes, alignment);
    }
    void deallocate_sync(void* p, std::size_t bytes, std::size_t alignment) noexcept {
        deallocate(p, bytes, alignment);
    }
    bool operator==(const one_device_resource&) const = default;
    friend void get_property(const one_device_resource&, ::cuda::mr::device_accessible) noexcept {}

private:
    int m_dev;
};
static_assert(cudawait::is_device_resource_v<one_device_resource>);
#endif

// A resource made for device 0, shared by shards on devices 0 and 1, would place shard 1's
// buffers on device 0: a usage_error. With device_resource_for each device gets its own.
TEST_F(two_gpus, a_resource_of_one_device_is_refused_for_another_and_taken_per_device) {
#if !CUDAWAIT_HAS_CUDA_MR
    GTEST_SKIP() << "cuda::mr is not available";
#else
    one_device_resource on0(0);
    one_device_resource on1(1);
    const std::size_t chunk = 20'000;
    multi_pipeline_options o = options_for({0, 1}, 1, chunk, 2);
    o.per_shard.memory.device_resource = on0;
    try {
        multi_t m(o, {transform_stage()});
        ADD_FAILURE() << "device 0's resource was taken for a shard on device 1";
    } catch (const usage_error& e) {
        EXPECT_NE(std::string(e.what()).find("device 1 gives memory of device 0"),
                  std::string::npos)
            << e.what();
    }
    o.per_shard.memory.device_resource = {};
    o.device_resource_for = [&](int dev) {
        return dev == 0 ? cudawait::device_resource(on0) : cudawait::device_resource(on1);
    };
    const std::size_t n = chunk * 9 + 123;
    auto in = random_words(n, 62);
    std::vector<u32> out(n, poison);
    auto wrong_device = std::make_shared<int>(0);
    multi_t m(o, {transform_stage(wrong_device)});
    cudawait::scheduler sched;
    cudawait::sync_wait(sched, m.run(in, out));
    EXPECT_EQ(first_mismatch(out, expected(in, chunk)), n);
    EXPECT_EQ(*wrong_device, 0);
    EXPECT_EQ(m.stats().combined.gpu_chunks, 10u);
#endif
}

TEST_F(multi_gpu, bad_batch_ranges_are_usage_errors) {
    const std::size_t chunk = 1000;
    multi_t m(options_for({0}, 2, chunk), {transform_stage()});
    std::vector<u32> in(5000, 1);
    std::vector<u32> out(5000, 0);
    std::vector<u32> shorter(4999, 0);
    EXPECT_THROW((void)m.run({}, out), usage_error) << "empty input";
    EXPECT_THROW((void)m.run(in, shorter), usage_error) << "mis-sized output";
    EXPECT_THROW((void)m.run(in, std::span<u32>()), usage_error) << "no output";
    cudawait::device_buffer<u32> dev(5000, cudawait::stream_ref(cudaStreamPerThread));
    cudawait::scheduler sched;
    EXPECT_THROW(cudawait::sync_wait(sched, m.run(in, dev.span())), usage_error) << "device memory";
    ASSERT_EQ(cudaStreamSynchronize(cudaStreamPerThread), cudaSuccess);
    // A streaming session open: run() is refused until next() returned the end.
    cudawait::sync_wait(sched, [&]() -> cudawait::task<void> {
        auto slot = co_await m.acquire();
        EXPECT_THROW((void)m.run(in, out), usage_error);
        slot = {};
        m.close();
        EXPECT_FALSE(co_await m.next());
    }());
    cudawait::sync_wait(sched, m.run(in, out)); // idle again
    auto want = expected(in, chunk);
    EXPECT_EQ(first_mismatch(out, want), in.size());
}

// ---- streaming --------------------------------------------------------------------------------

struct stream_log {
    std::size_t consumed = 0;
    std::size_t bad = 0;
    std::size_t out_of_order = 0;
    std::size_t wrong_shard = 0;
    std::vector<std::size_t> per_shard = std::vector<std::size_t>(2);
};

cudawait::task<void> producer(multi_t& m, const std::vector<std::vector<u32>>& chunks) {
    for (const auto& c : chunks) {
        auto slot = co_await m.acquire();
        std::fill(slot.data().begin(), slot.data().end(), poison);
        std::copy(c.begin(), c.end(), slot.data().begin());
        m.submit(std::move(slot), c.size());
        co_await cudawait::sleep_for(50us);
    }
    m.close();
}

cudawait::task<void> consumer(multi_t& m, const std::vector<std::vector<u32>>& chunks,
                              stream_log& log) {
    while (auto r = co_await m.next()) {
        if (r->chunk() != log.consumed) {
            ++log.out_of_order;
        }
        if (r->shard() != r->chunk() % 2) {
            ++log.wrong_shard; // round-robin over two healthy shards
        }
        ++log.per_shard[r->shard() % 2];
        const auto& in = chunks[r->chunk()];
        std::vector<u32> want(in.size());
        cudawait::testing::transform_on_host(in.data(), want.data(), in.size(), salt);
        if (!std::equal(want.begin(), want.end(), r->data().begin(), r->data().end()) ||
            r->rescued() || r->by_fallback()) {
            ++log.bad;
        }
        ++log.consumed;
        co_await cudawait::sleep_for(100us);
    }
}

TEST_F(multi_gpu, streaming_over_two_shards_delivers_in_submission_order) {
    const std::size_t chunk = 30'000;
    std::vector<std::vector<u32>> chunks;
    std::mt19937 sizes(7);
    for (std::size_t i = 0; i < 41; ++i) {
        chunks.push_back(random_words(1 + sizes() % chunk, 500 + i));
    }
    multi_t m(options_for({0}, 2, chunk, 2), {transform_stage()});
    cudawait::scheduler sched;
    for (int session = 0; session < 2; ++session) { // a second session after the end
        stream_log log;
        cudawait::sync_wait(sched,
                            cudawait::when_all(producer(m, chunks), consumer(m, chunks, log)));
        EXPECT_EQ(log.consumed, chunks.size()) << "session " << session;
        EXPECT_EQ(log.bad, 0u);
        EXPECT_EQ(log.out_of_order, 0u);
        EXPECT_EQ(log.wrong_shard, 0u);
        EXPECT_EQ(log.per_shard[0], 21u);
        EXPECT_EQ(log.per_shard[1], 20u);
        auto st = m.stats();
        EXPECT_EQ(st.per_shard[0].gpu_chunks, 21u);
        EXPECT_EQ(st.per_shard[1].gpu_chunks, 20u);
        EXPECT_EQ(st.combined.chunks, chunks.size());
        EXPECT_EQ(st.combined.gpu_chunks, chunks.size());
        EXPECT_GT(st.combined.wall_seconds, 0.0);
    }
    // Idle again: a batch may follow.
    std::vector<u32> in = random_words(chunk * 3, 9);
    std::vector<u32> out(in.size(), poison);
    cudawait::sync_wait(sched, m.run(in, out));
    EXPECT_EQ(first_mismatch(out, expected(in, chunk)), in.size());
}

/// A stage whose call number `stuck_call` first spins until *flag (mapped) is set (20 s at most).
multi_t::stage flag_stage(const u32* flag, int stuck_call, std::shared_ptr<int> calls) {
    return [flag, stuck_call, calls](std::span<u32> a, std::span<u32> b,
                                     const cudawait::stage_context& ctx) {
        if ((*calls)++ == stuck_call) {
            cudawait::check(
                cudawait::testing::launch_wait_flag(flag, 20'000'000'000ull, ctx.stream.get()),
                "launch_wait_flag");
        }
        cudawait::check(cudawait::testing::launch_transform(a.data(), b.data(), a.size(), salt, 0,
                                                            ctx.stream.get()),
                        "launch_transform");
    };
}

::testing::AssertionResult right_result(const std::optional<multi_t::result>& r,
                                        const std::vector<std::vector<u32>>& chunks,
                                        std::size_t index) {
    if (!r) {
        return ::testing::AssertionFailure() << "no result where chunk " << index << " was due";
    }
    if (r->chunk() != index) {
        return ::testing::AssertionFailure() << "chunk " << r->chunk() << " instead of " << index;
    }
    const auto& in = chunks[index];
    std::vector<u32> want(in.size());
    cudawait::testing::transform_on_host(in.data(), want.data(), in.size(), salt);
    if (!std::equal(want.begin(), want.end(), r->data().begin(), r->data().end())) {
        return ::testing::AssertionFailure() << "chunk " << index << "'s output is wrong";
    }
    return ::testing::AssertionSuccess();
}

cudawait::task<void> submit_chunk(multi_t& m, const std::vector<u32>& c, std::size_t shard) {
    auto slot = co_await m.acquire();
    EXPECT_EQ(slot.shard(), shard);
    std::copy(c.begin(), c.end(), slot.data().begin());
    m.submit(std::move(slot), c.size());
}

double ms_since(clock_type::time_point t0) {
    return std::chrono::duration<double, std::milli>(clock_type::now() - t0).count();
}

TEST_F(multi_gpu, acquire_and_next_timeouts_take_nothing_and_keep_the_order) {
    const std::size_t chunk = 20'000;
    std::vector<std::vector<u32>> chunks;
    for (std::size_t i = 0; i < 3; ++i) {
        chunks.push_back(random_words(chunk - i, 600 + i));
    }
    cudawait::mapped_buffer<u32> release_flag(1);
    release_flag[0] = 0;
    multi_pipeline_options o = options_for({0}, 2, chunk, 1);
    o.per_shard.memory.queue_capacity = 1;
    // Call 0 is shard 0's first chunk: stuck until the flag.
    multi_t m(o, {flag_stage(release_flag.device_data(), 0, std::make_shared<int>(0))});
    EXPECT_THROW((void)m.acquire(-1ns), usage_error) << "thrown at the call";
    EXPECT_THROW((void)m.next(-1ms), usage_error);
    cudawait::scheduler sched;
    double acquire_waited = 0;
    double next_waited = 0;
    std::int64_t acquire_after = -1;
    std::int64_t next_after = -1;
    cudawait::sync_wait(sched, [&]() -> cudawait::task<void> {
        EXPECT_THROW((void)co_await m.next(0ns), cudawait::timeout_error) << "nothing submitted";
        co_await submit_chunk(m, chunks[0], 0); // stuck on shard 0
        co_await submit_chunk(m, chunks[1], 1);
        // Round-robin: shard 0 is next, and its one slot is taken.
        auto t0 = clock_type::now();
        try {
            (void)co_await m.acquire(80ms);
            ADD_FAILURE() << "acquire returned a slot of a full shard";
        } catch (const cudawait::timeout_error& e) {
            acquire_after = e.after().count();
        }
        acquire_waited = ms_since(t0);
        EXPECT_THROW((void)co_await m.acquire(0ns), cudawait::timeout_error);
        t0 = clock_type::now();
        try {
            (void)co_await m.next(60ms);
            ADD_FAILURE() << "next returned the stuck chunk";
        } catch (const cudawait::timeout_error& e) {
            next_after = e.after().count();
        }
        next_waited = ms_since(t0);
        EXPECT_THROW((void)co_await m.next(clock_type::now() - 1s), cudawait::timeout_error);
        std::atomic_ref<u32>(release_flag[0]).store(1);
        EXPECT_TRUE(right_result(co_await m.next(10s), chunks, 0)) << "still first in line";
        EXPECT_TRUE(right_result(co_await m.next(10s), chunks, 1));
        co_await submit_chunk(m, chunks[2], 0); // shard 0 again: the timeouts took no turn
        EXPECT_TRUE(right_result(co_await m.next(10s), chunks, 2));
        m.close();
        EXPECT_FALSE(co_await m.next(0ns)) << "closed and drained: the end, not a timeout";
    }());
    std::atomic_ref<u32>(release_flag[0]).store(1); // on a failure above, before teardown
    EXPECT_EQ(acquire_after, std::int64_t{80'000'000});
    EXPECT_GE(acquire_waited, 80.0);
    EXPECT_LT(acquire_waited, 80.0 + 150.0);
    EXPECT_EQ(next_after, std::int64_t{60'000'000});
    EXPECT_GE(next_waited, 60.0);
    EXPECT_LT(next_waited, 60.0 + 150.0);
    auto st = m.stats();
    EXPECT_EQ(st.combined.gpu_chunks, 3u);
    EXPECT_EQ(st.combined.retries + st.combined.fallback_chunks + st.combined.failed_chunks, 0u);
}

// on_degrade throws while next() waits again for a chunk past its chunk_timeout: the shard keeps
// the chunk first in line, and so does the multi pipeline, which delivers it in its turn.
TEST_F(multi_gpu, a_chunk_on_degrade_refused_to_wait_for_again_stays_first_in_line) {
    const std::size_t chunk = 20'000;
    std::vector<std::vector<u32>> chunks;
    for (std::size_t i = 0; i < 3; ++i) {
        chunks.push_back(random_words(chunk - i, 640 + i));
    }
    cudawait::mapped_buffer<u32> release_flag(1);
    release_flag[0] = 0;
    multi_pipeline_options o = options_for({0}, 2, chunk, 1);
    o.per_shard.recovery.chunk_timeout = 30ms;
    o.per_shard.recovery.max_retries = 1000;
    struct degrade_refused {};
    int refused = 0;
    o.per_shard.recovery.on_degrade = [&](const cudawait::chunk_failure& f) {
        if (f.action == cudawait::degrade_action::waited_again) {
            ++refused;
            throw degrade_refused{};
        }
    };
    // Call 0 is shard 0's first chunk: stuck until the flag.
    multi_t m(o, {flag_stage(release_flag.device_data(), 0, std::make_shared<int>(0))});
    cudawait::scheduler sched;
    int caught = 0;
    cudawait::sync_wait(sched, [&]() -> cudawait::task<void> {
        co_await submit_chunk(m, chunks[0], 0); // stuck on shard 0
        co_await submit_chunk(m, chunks[1], 1);
        for (int i = 0; i < 3; ++i) {
            try {
                auto r = co_await m.next(5s);
                ADD_FAILURE() << "next returned chunk " << (r ? r->chunk() : 99) << " early";
            } catch (const degrade_refused&) {
                ++caught;
            }
        }
        std::atomic_ref<u32>(release_flag[0]).store(1);
        for (std::size_t c = 0; c < 2; ++c) {
            for (;;) {
                try {
                    EXPECT_TRUE(right_result(co_await m.next(10s), chunks, c));
                    break;
                } catch (const degrade_refused&) {
                    ++caught; // a last wait again before the kernel's end was seen
                }
            }
        }
        co_await submit_chunk(m, chunks[2], 0);
        EXPECT_TRUE(right_result(co_await m.next(10s), chunks, 2));
        m.close();
        EXPECT_FALSE(co_await m.next(0ns));
    }());
    std::atomic_ref<u32>(release_flag[0]).store(1); // on a failure above, before teardown
    EXPECT_GE(caught, 3);
    EXPECT_EQ(caught, refused);
    auto st = m.stats();
    EXPECT_EQ(st.combined.gpu_chunks, 3u);
    EXPECT_EQ(st.combined.fallback_chunks + st.combined.failed_chunks, 0u);
}

TEST_F(multi_gpu, acquire_skips_a_shard_whose_gpu_was_abandoned) {
    const std::size_t chunk = 20'000;
    std::vector<std::vector<u32>> chunks;
    for (std::size_t i = 0; i < 5; ++i) {
        chunks.push_back(random_words(chunk - 11 * i, 650 + i));
    }
    cudawait::mapped_buffer<u32> release_flag(1);
    release_flag[0] = 0;
    {
        // The transform kernel is loaded before the flag kernel spins: loaded lazily at its
        // first launch, behind the spinning kernel, it would wait for that kernel to end.
        cudawait::stream s;
        cudawait::device_buffer<u32> a(64, s);
        cudawait::device_buffer<u32> b(64, s);
        cudawait::check(
            cudawait::testing::launch_transform(a.data(), b.data(), 64, salt, 0, s.get()),
            "launch_transform");
        s.sync();
    }
    multi_pipeline_options o = options_for({0}, 2, chunk, 2);
    // Shard 0's first chunk hangs past chunk_timeout with no retry: the shard reports it failed
    // and gives its GPU up (failed_timed_out).
    o.per_shard.recovery.chunk_timeout = 50ms;
    o.per_shard.recovery.max_retries = 0;
    o.per_shard.recovery.on_degrade = [](const cudawait::chunk_failure&) {};
    multi_t m(o, {flag_stage(release_flag.device_data(), 0, std::make_shared<int>(0))});
    cudawait::scheduler sched;
    std::vector<std::string> seen;
    cudawait::sync_wait(sched, [&]() -> cudawait::task<void> {
        co_await submit_chunk(m, chunks[0], 0);
        co_await submit_chunk(m, chunks[1], 1);
        try {
            auto r = co_await m.next(10s);
            seen.push_back("returned");
        } catch (const pipeline_error& e) {
            seen.push_back(e.failed() == std::vector<std::size_t>{0} ? "failed" : e.what());
        }
        seen.push_back(right_result(co_await m.next(10s), chunks, 1) ? "right" : "wrong");
        for (std::size_t i = 2; i < chunks.size(); ++i) {
            co_await submit_chunk(m, chunks[i], 1); // never shard 0 again
            auto r = co_await m.next(10s);
            seen.push_back(right_result(r, chunks, i) && !r->rescued() ? "right" : "wrong");
        }
        m.close();
        EXPECT_FALSE(co_await m.next());
    }());
    std::atomic_ref<u32>(release_flag[0]).store(1); // the hung kernel ends before teardown
    EXPECT_EQ(seen, (std::vector<std::string>{"failed", "right", "right", "right", "right"}));
    auto st = m.stats();
    EXPECT_TRUE(st.per_shard[0].gpu_abandoned);
    EXPECT_FALSE(st.per_shard[1].gpu_abandoned);
    EXPECT_FALSE(st.combined.gpu_abandoned);
    EXPECT_EQ(st.per_shard[1].gpu_chunks, 4u);
    EXPECT_EQ(st.combined.failed_chunks, 1u);
    EXPECT_EQ(st.combined.gpu_chunks, 4u);
}

// ---- submit refused ---------------------------------------------------------------------------

// A slot submit() refuses with a usage_error stays the caller's: it can be submitted again, or
// dropped, which gives it back.
TEST_F(multi_gpu, a_slot_submit_refuses_stays_the_callers) {
    const std::size_t chunk = 10'000;
    multi_t m(options_for({0}, 2, chunk, 1), {transform_stage()});
    std::vector<std::vector<u32>> chunks{random_words(chunk, 71), random_words(chunk - 9, 72)};
    cudawait::scheduler sched;
    cudawait::sync_wait(sched, [&]() -> cudawait::task<void> {
        auto slot = co_await m.acquire();
        EXPECT_EQ(slot.shard(), 0u);
        std::copy(chunks[0].begin(), chunks[0].end(), slot.data().begin());
        EXPECT_THROW(m.submit(std::move(slot), chunk + 1), usage_error) << "too many elements";
        EXPECT_THROW(m.submit(std::move(slot), 0), usage_error);
        EXPECT_EQ(slot.shard(), 0u);
        EXPECT_EQ(slot.data()[0], chunks[0][0]) << "the slot and its data are still there";
        m.submit(std::move(slot), chunks[0].size());
        EXPECT_THROW((void)slot.data(), usage_error) << "submitted: no longer the caller's";
        EXPECT_TRUE(right_result(co_await m.next(10s), chunks, 0));
        // After close(): refused, still the caller's; dropped, it goes back (depth 1: shard 1's
        // only slot), and the session ends.
        auto held = co_await m.acquire();
        EXPECT_EQ(held.shard(), 1u);
        m.close();
        std::copy(chunks[1].begin(), chunks[1].end(), held.data().begin());
        EXPECT_THROW(m.submit(std::move(held), chunks[1].size()), usage_error);
        EXPECT_EQ(held.data()[0], chunks[1][0]);
        held = {};
        EXPECT_FALSE(co_await m.next(10s));
        // A new session from shard 0 takes shard 1's slot in its turn again.
        auto a = co_await m.acquire(1s);
        auto b = co_await m.acquire(1s);
        EXPECT_EQ(b.shard(), 1u) << "shard 1's slot came back";
        std::copy(chunks[0].begin(), chunks[0].end(), a.data().begin());
        std::copy(chunks[1].begin(), chunks[1].end(), b.data().begin());
        m.submit(std::move(a), chunks[0].size());
        m.submit(std::move(b), chunks[1].size());
        m.close();
        EXPECT_TRUE(right_result(co_await m.next(10s), chunks, 0));
        EXPECT_TRUE(right_result(co_await m.next(10s), chunks, 1));
        EXPECT_FALSE(co_await m.next(10s));
    }());
}

// ---- rescue -----------------------------------------------------------------------------------

/// Fails to launch (a non-sticky launch error) when `fails(ctx)` says so, else the transform.
template <class F>
multi_t::stage failing_stage(F fails, std::shared_ptr<int> failed_calls) {
    return [fails, failed_calls](std::span<u32> in, std::span<u32> out,
                                 const cudawait::stage_context& ctx) {
        if (fails(ctx)) {
            ++*failed_calls;
            cudawait::check(cudawait::testing::launch_bad_config(ctx.stream.get()),
                            "launch_bad_config");
        }
        cudawait::check(cudawait::testing::launch_transform(in.data(), out.data(), in.size(), salt,
                                                            0, ctx.stream.get()),
                        "launch_transform");
    };
}

TEST_F(multi_gpu, a_chunk_shard_0_gives_up_is_rescued_by_shard_1) {
    const std::size_t chunk = 25'000;
    const std::size_t n = chunk * 8 + 100; // 9 chunks: shard 0 has 0..4, shard 1 has 5..8
    const std::size_t k = 2;
    auto in = random_words(n, 31);
    auto want = expected(in, chunk);
    cudaStream_t shard0_stream = nullptr; // set once the pipeline exists
    auto failed_calls = std::make_shared<int>(0);
    multi_pipeline_options o = options_for({0}, 2, chunk, 3);
    o.per_shard.recovery.max_retries = 1;
    o.per_shard.recovery.on_degrade = [](const cudawait::chunk_failure&) {};
    std::vector<std::size_t> fallback_calls;
    multi_t m(o,
              {failing_stage(
                  [&](const cudawait::stage_context& ctx) {
                      return ctx.chunk == k && ctx.stream.get() == shard0_stream;
                  },
                  failed_calls)},
              [&](std::size_t c, std::span<const u32> a, std::span<u32> b) {
                  fallback_calls.push_back(c);
                  host_fallback(c, a, b);
              });
    shard0_stream = m.shard(0).compute_stream(0).get();
    std::vector<u32> out(n, poison);
    cudawait::scheduler sched;
    cudawait::sync_wait(sched, m.run(in, out));
    EXPECT_EQ(first_mismatch(out, want), n);
    EXPECT_EQ(*failed_calls, 2) << "the first try and its one retry";
    EXPECT_TRUE(fallback_calls.empty()) << "the user's fallback was called";
    auto st = m.stats();
    EXPECT_EQ(st.rescued_chunks, 1u);
    EXPECT_EQ(st.per_shard[0].fallback_chunks, 1u) << "the shard's view: its fallback ran";
    EXPECT_FALSE(st.per_shard[0].gpu_abandoned);
    EXPECT_EQ(st.combined.gpu_chunks, 9u) << "a rescued chunk is a GPU chunk";
    EXPECT_EQ(st.combined.fallback_chunks + st.combined.failed_chunks, 0u);
    // Every chunk's bytes once, on the shard whose chunk it was: the rescued one's on shard 0.
    EXPECT_EQ(st.per_shard[0].input_bytes, 5 * chunk * sizeof(u32));
    EXPECT_EQ(st.per_shard[0].output_bytes, 5 * chunk * sizeof(u32));
    EXPECT_EQ(st.per_shard[1].input_bytes, (3 * chunk + 100) * sizeof(u32));
    EXPECT_EQ(st.combined.input_bytes, n * sizeof(u32));
    EXPECT_EQ(st.combined.output_bytes, n * sizeof(u32));
    EXPECT_DOUBLE_EQ(st.combined.throughput_gbps,
                     static_cast<double>(n * sizeof(u32)) / st.combined.wall_seconds / 1e9);
}

TEST_F(multi_gpu, a_streamed_chunk_shard_0_gives_up_is_rescued_in_its_turn) {
    const std::size_t chunk = 10'000;
    std::vector<std::vector<u32>> chunks;
    for (std::size_t i = 0; i < 6; ++i) {
        chunks.push_back(random_words(chunk - 3 * i, 700 + i));
    }
    cudaStream_t shard0_stream = nullptr;
    multi_pipeline_options o = options_for({0}, 2, chunk, 2);
    o.per_shard.recovery.max_retries = 0;
    o.per_shard.recovery.on_degrade = [](const cudawait::chunk_failure&) {};
    std::size_t fallback_calls = 0;
    // Shard 0's submission 1 is global chunk 2 (round-robin over two shards).
    multi_t m(o,
              {failing_stage(
                  [&](const cudawait::stage_context& ctx) {
                      return ctx.chunk == 1 && ctx.stream.get() == shard0_stream;
                  },
                  std::make_shared<int>(0))},
              [&](std::size_t c, std::span<const u32> a, std::span<u32> b) {
                  ++fallback_calls;
                  host_fallback(c, a, b);
              });
    shard0_stream = m.shard(0).compute_stream(0).get();
    cudawait::scheduler sched;
    std::vector<bool> rescued;
    cudawait::sync_wait(sched, [&]() -> cudawait::task<void> {
        for (std::size_t i = 0; i < chunks.size(); ++i) {
            co_await submit_chunk(m, chunks[i], i % 2);
            auto r = co_await m.next(10s);
            EXPECT_TRUE(right_result(r, chunks, i));
            EXPECT_FALSE(r->by_fallback()) << "chunk " << i;
            rescued.push_back(r->rescued());
        }
        m.close();
        EXPECT_FALSE(co_await m.next());
    }());
    EXPECT_EQ(rescued, (std::vector<bool>{false, false, true, false, false, false}));
    EXPECT_EQ(fallback_calls, 0u);
    auto st = m.stats();
    EXPECT_EQ(st.rescued_chunks, 1u);
    EXPECT_EQ(st.combined.gpu_chunks, 6u);
    std::size_t bytes[2] = {0, 0}; // by shard: the even submissions went to shard 0
    for (std::size_t i = 0; i < chunks.size(); ++i) {
        bytes[i % 2] += chunks[i].size() * sizeof(u32);
    }
    EXPECT_EQ(st.per_shard[0].input_bytes, bytes[0]) << "the rescued chunk 2 counts on shard 0";
    EXPECT_EQ(st.per_shard[1].input_bytes, bytes[1]);
    EXPECT_EQ(st.combined.input_bytes, bytes[0] + bytes[1]);
    EXPECT_EQ(st.combined.output_bytes, bytes[0] + bytes[1]);
}

TEST_F(multi_gpu, a_chunk_every_shard_fails_goes_to_the_users_fallback_with_its_global_index) {
    const std::size_t chunk = 25'000;
    const std::size_t n = chunk * 8; // shard 0: chunks 0..3, shard 1: 4..7
    const std::size_t k = 1;
    auto in = random_words(n, 32);
    auto want = expected(in, chunk);
    cudaStream_t shard1_stream = nullptr;
    multi_pipeline_options o = options_for({0}, 2, chunk, 2);
    o.per_shard.recovery.max_retries = 0;
    o.per_shard.recovery.on_degrade = [](const cudawait::chunk_failure&) {};
    // Shard 0's chunk k fails everywhere but on shard 1's own stream, where shard 1's chunk k
    // (global 4 + k) runs: so only global chunk k fails, on shard 0 and in its rescue.
    auto fails = [&](const cudawait::stage_context& ctx) {
        return ctx.chunk == k && ctx.stream.get() != shard1_stream;
    };
    std::vector<std::size_t> fallback_calls;
    multi_t m(o, {failing_stage(fails, std::make_shared<int>(0))},
              [&](std::size_t c, std::span<const u32> a, std::span<u32> b) {
                  fallback_calls.push_back(c);
                  host_fallback(c, a, b);
              });
    shard1_stream = m.shard(1).compute_stream(0).get();
    std::vector<u32> out(n, poison);
    cudawait::scheduler sched;
    cudawait::sync_wait(sched, m.run(in, out));
    EXPECT_EQ(first_mismatch(out, want), n);
    EXPECT_EQ(fallback_calls, std::vector<std::size_t>{k});
    auto st = m.stats();
    EXPECT_EQ(st.rescued_chunks, 0u);
    EXPECT_EQ(st.combined.gpu_chunks, 7u);
    EXPECT_EQ(st.combined.fallback_chunks, 1u);
    EXPECT_EQ(st.combined.input_bytes, 7 * chunk * sizeof(u32)) << "the GPUs' chunks, as pipeline";
}

TEST_F(multi_gpu, without_a_fallback_a_chunk_no_shard_produced_is_named_in_the_error) {
    const std::size_t chunk = 25'000;
    const std::size_t n = chunk * 8;
    const std::size_t k = 1;
    auto in = random_words(n, 33);
    auto want = expected(in, chunk);
    cudaStream_t shard1_stream = nullptr;
    multi_pipeline_options o = options_for({0}, 2, chunk, 2);
    o.per_shard.recovery.max_retries = 0;
    o.per_shard.recovery.on_degrade = [](const cudawait::chunk_failure&) {};
    multi_t m(o, {failing_stage(
                     [&](const cudawait::stage_context& ctx) {
                         return ctx.chunk == k && ctx.stream.get() != shard1_stream;
                     },
                     std::make_shared<int>(0))});
    shard1_stream = m.shard(1).compute_stream(0).get();
    std::vector<u32> out(n, poison);
    cudawait::scheduler sched;
    try {
        cudawait::sync_wait(sched, m.run(in, out));
        ADD_FAILURE() << "no exception";
    } catch (const pipeline_error& e) {
        EXPECT_EQ(e.failed(), std::vector<std::size_t>{k});
        EXPECT_EQ(e.completed(), (std::vector<std::size_t>{0, 2, 3, 4, 5, 6, 7}));
    }
    for (std::size_t i = 0; i < n; ++i) {
        if (i / chunk == k) {
            ASSERT_EQ(out[i], poison) << "the failed chunk's output was written at " << i;
        } else {
            ASSERT_EQ(out[i], want[i]) << "element " << i;
        }
    }
    auto st = m.stats();
    EXPECT_EQ(st.combined.gpu_chunks, 7u);
    EXPECT_EQ(st.combined.failed_chunks, 1u);
    EXPECT_EQ(st.combined.fallback_chunks, 0u);
    // Streaming: next() throws pipeline_error for it in its turn, and the rest still come.
    std::vector<std::vector<u32>> chunks;
    for (std::size_t i = 0; i < 4; ++i) {
        chunks.push_back(random_words(chunk, 800 + i));
    }
    std::vector<std::string> seen;
    cudawait::sync_wait(sched, [&]() -> cudawait::task<void> {
        for (std::size_t i = 0; i < chunks.size(); ++i) {
            co_await submit_chunk(m, chunks[i], i % 2);
        }
        m.close();
        for (std::size_t i = 0; i < chunks.size(); ++i) {
            try {
                auto r = co_await m.next(10s);
                seen.push_back(right_result(r, chunks, i) ? "right" : "wrong");
            } catch (const pipeline_error& e) {
                seen.push_back(e.failed() == std::vector<std::size_t>{i} ? "failed" : e.what());
            }
        }
        EXPECT_FALSE(co_await m.next());
    }());
    // Shard 0's submission k (= 1) is global chunk 2; shard 1's submission 1 runs on its stream.
    EXPECT_EQ(seen, (std::vector<std::string>{"right", "right", "failed", "right"}));
}

} // namespace
