// SPDX-License-Identifier: Apache-2.0
// Work on a device that the driving thread does not have current, against the fake CUDA runtime
// (tests/support/fake_cuda.hpp) with two devices: it refuses a kernel launch on a stream of
// another device than the current one, as CUDA does. The watchdog's heartbeat, a pipeline built
// for device 1 and a grouped multi_pipeline over both devices, all driven from a thread with
// device 0 current. Runs under AddressSanitizer and ThreadSanitizer in CI.
//
// Every test makes the two devices before its first use of the library: the library sizes its
// per-device pools at their first use in the process.
#include <cudawait/core/scheduler.hpp>
#include <cudawait/core/sync_wait.hpp>
#include <cudawait/core/task.hpp>
#include <cudawait/core/when_all.hpp>
#include <cudawait/memory/pinned_buffer.hpp>
#include <cudawait/observe/watchdog.hpp>
#include <cudawait/pipeline/multi_pipeline.hpp>
#include <cudawait/pipeline/pipeline.hpp>
#include <cudawait/runtime/device.hpp>
#include <cudawait/runtime/error.hpp>
#include <cudawait/runtime/stream.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <random>
#include <span>
#include <vector>

#include <cuda_runtime_api.h>

#include "fake_cuda.hpp"
#include <gtest/gtest.h>

namespace {

using namespace std::chrono_literals;
using cudawait::device_ref;
using cudawait::pinned_buffer;
using cudawait::poll_policy;
using cudawait::scheduler;
using cudawait::stall_error;
using cudawait::stall_info;
using cudawait::stream;
using cudawait::sync_wait;
using cudawait::task;
using cudawait::watchdog;
using cudawait::watchdog_options;
using u32 = std::uint32_t;
namespace fake = cudawait::fake_cuda;

constexpr u32 poison = 0xdeadbeefu;

class two_devices : public ::testing::Test {
protected:
    void SetUp() override {
        fake::reset();
        fake::set_device_count(2);
    }
    void TearDown() override {
        fake::release_all();
        fake::reset();
    }
};

int current_device() {
    int dev = -1;
    cudawait::check(cudaGetDevice(&dev), "cudaGetDevice");
    return dev;
}

/// The launches of the heartbeat kernel (watchdog.hpp) so far.
std::vector<fake::launch_info> heartbeats() {
    std::vector<fake::launch_info> out;
    for (const fake::launch_info& l : fake::launches()) {
        if (l.api == "cuLaunchKernel" && l.name == "cudawait_heartbeat") {
            out.push_back(l);
        }
    }
    return out;
}

/// Every launch of `l` was accepted, with device `dev` current, on a stream of `dev`.
void expect_all_on(const std::vector<fake::launch_info>& l, int dev) {
    for (std::size_t i = 0; i < l.size(); ++i) {
        EXPECT_EQ(l[i].current_device, dev) << "launch " << i;
        EXPECT_EQ(l[i].stream_device, dev) << "launch " << i;
        EXPECT_EQ(l[i].result, cudaSuccess) << "launch " << i;
    }
}

// ---- the watchdog's heartbeat -----------------------------------------------------------------

// A long kernel on device 1 that leaves SMs free (here: a hung stream beside a heartbeat kernel
// that does run, as define_kernel makes it), awaited from a loop thread with device 0 current:
// the heartbeat is launched on device 1 with device 1 current, beats, and nothing is reported.
// The stream is released after three windows of heartbeats, from inside the heartbeat.
TEST_F(two_devices, the_heartbeat_of_a_device_that_is_not_current_keeps_it_from_being_reported) {
    const auto window = 100ms;
    scheduler s(poll_policy::sleeping());
    stream busy(device_ref(1));
    ASSERT_EQ(current_device(), 0);
    fake::hang(busy.get());
    const auto start = std::chrono::steady_clock::now();
    std::atomic<bool> released{false};
    fake::define_kernel("cudawait_heartbeat", [&](void** params) {
        auto* counter = *static_cast<std::uint64_t**>(params[0]);
        std::atomic_ref<std::uint64_t>(*counter).fetch_add(1, std::memory_order_relaxed);
        if (std::chrono::steady_clock::now() - start >= 3 * window && !released.exchange(true)) {
            fake::release(busy.get());
        }
    });
    std::size_t reported = 0;
    watchdog_options o;
    o.window = window;
    o.fail_awaits = true;
    o.on_stall = [&](const stall_info&) { ++reported; };
    watchdog wd(s, o);
    const bool completed = sync_wait(s, [&]() -> task<bool> {
        try {
            co_await busy;
        } catch (const stall_error&) {
            co_return false;
        }
        co_return true;
    }());
    fake::release(busy.get()); // a failed await's event stays queued until then
    s.run();
    EXPECT_TRUE(completed) << "the await on device 1 failed with stall_error";
    EXPECT_TRUE(released.load()) << "the heartbeat did not run for three windows";
    EXPECT_EQ(reported, 0u);
    EXPECT_EQ(wd.stalls(), 0u);
    const auto beats = heartbeats();
    EXPECT_GE(beats.size(), 2u);
    expect_all_on(beats, 1);
    EXPECT_EQ(current_device(), 0) << "the watchdog left another device current";
}

// The same with a heartbeat kernel that does nothing (fake_cuda.hpp: a kernel does nothing): it
// never beats, so the hung stream is reported (the window's rule, whichever device is current),
// but the heartbeat stays on: launched on device 1, with device 1 current, at every check.
TEST_F(two_devices, the_heartbeat_of_a_device_that_is_not_current_stays_on_until_the_report) {
    scheduler s(poll_policy::sleeping());
    stream busy(device_ref(1));
    fake::hang(busy.get());
    std::vector<stall_info> reports;
    watchdog_options o;
    o.window = 50ms;
    o.on_stall = [&](const stall_info& info) {
        reports.push_back(info);
        fake::release(busy.get()); // lets the await complete
    };
    watchdog wd(s, o);
    sync_wait(s, [&]() -> task<void> { co_await busy; }());
    ASSERT_EQ(reports.size(), 1u);
    EXPECT_EQ(reports[0].device, 1);
    EXPECT_EQ(reports[0].streams, std::vector<cudaStream_t>{busy.get()});
    EXPECT_GE(reports[0].stalled_for, 50ms);
    const auto beats = heartbeats();
    EXPECT_GE(beats.size(), 2u) << "the heartbeat was disabled after its first launch";
    expect_all_on(beats, 1);
    EXPECT_EQ(current_device(), 0);
}

// ---- a pipeline built for device 1 ------------------------------------------------------------

/// A host function whose address the stages launch as their kernel: the fake accepts the launch
/// only with the stream's device current.
void stage_kernel() {}

u32 transform(u32 x, std::size_t i) { return x * 2654435761u + static_cast<u32>(i) + 0x5eed; }

/// The stage's result for `in`, in chunks of `chunk` (the index restarts in each chunk).
std::vector<u32> expected(std::span<const u32> in, std::size_t chunk) {
    std::vector<u32> out(in.size());
    for (std::size_t i = 0; i < in.size(); ++i) {
        out[i] = transform(in[i], i % chunk);
    }
    return out;
}

std::vector<u32> random_words(std::size_t n, std::uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::vector<u32> v(n);
    for (u32& x : v) {
        x = static_cast<u32>(rng());
    }
    return v;
}

/// How a stage was called.
struct stage_call {
    std::size_t first_chunk;
    std::size_t chunks;
    std::size_t in_size;
    std::size_t out_size;
    int current;    ///< the current device in the call
    int ctx_device; ///< the device its context named
};

/// Computes chunk `in` into `out` and launches the stage's kernel on `s`. The fake's device memory
/// is host memory and its copies are made when they are enqueued, so the chunk's input is in
/// `in` now, and what is written to `out` goes out with the D2H copy enqueued after the stage:
/// computed here, at the launch, it is the kernel's result.
void compute_and_launch(std::span<const u32> in, std::span<u32> out, cudawait::stream_ref s) {
    cudawait::check(cudaLaunchKernel(reinterpret_cast<const void*>(&stage_kernel), dim3(1), dim3(1),
                                     nullptr, 0, s.get()),
                    "cudaLaunchKernel");
    for (std::size_t i = 0; i < in.size(); ++i) {
        out[i] = transform(in[i], i);
    }
}

/// The launches of the stages' kernel so far.
std::vector<fake::launch_info> stage_launches() {
    std::vector<fake::launch_info> out;
    for (const fake::launch_info& l : fake::launches()) {
        if (l.function == reinterpret_cast<const void*>(&stage_kernel)) {
            out.push_back(l);
        }
    }
    return out;
}

// A plain pipeline with options.streams.device = 1, driven by a thread with device 0 current: its
// stage is called with device 1 current, and its launches on the chunk's stream (of device 1) are
// accepted, for a batch (pinned and pageable) and streaming; no chunk degrades, and device 0 is
// current again after each call. (Graphs: the fake supports no stream capture.)
TEST_F(two_devices, a_pipeline_on_device_1_calls_its_stages_with_device_1_current) {
    const std::size_t chunk = 1000;
    auto calls = std::make_shared<std::vector<stage_call>>();
    std::size_t degraded = 0;
    cudawait::pipeline_options o;
    o.streams.device = 1;
    o.chunk_elements = chunk;
    o.depth = 2;
    o.recovery.max_retries = 0;
    o.recovery.on_degrade = [&](const cudawait::chunk_failure&) { ++degraded; };
    cudawait::pipeline<u32> p(
        o, {[calls](std::span<u32> in, std::span<u32> out, const cudawait::stage_context& ctx) {
            calls->push_back({ctx.chunk, 1, in.size(), out.size(), current_device(), ctx.device});
            compute_and_launch(in, out, ctx.stream);
        }});
    EXPECT_EQ(current_device(), 0) << "the constructor left another device current";
    scheduler sched;
    // Batches: 9 chunks, the last one short, from pinned and from pageable memory.
    const std::size_t n = chunk * 9 - 77;
    const auto in = random_words(n, 1);
    const auto want = expected(in, chunk);
    pinned_buffer<u32> pin(n);
    pinned_buffer<u32> pout(n);
    std::copy(in.begin(), in.end(), pin.begin());
    std::fill(pout.begin(), pout.end(), poison);
    EXPECT_NO_THROW(sync_wait(sched, p.run(pin.span(), pout.span())));
    EXPECT_TRUE(std::equal(want.begin(), want.end(), pout.begin(), pout.end()));
    EXPECT_EQ(current_device(), 0) << "the batch left another device current";
    std::vector<u32> out(n, poison);
    EXPECT_NO_THROW(sync_wait(sched, p.run(std::span<const u32>(in), std::span<u32>(out))));
    EXPECT_TRUE(out == want);
    EXPECT_EQ(p.stats().gpu_chunks, 9u);
    EXPECT_EQ(calls->size(), 18u);
    // Streaming: 6 chunks through the slots.
    std::vector<std::vector<u32>> chunks;
    for (std::size_t i = 0; i < 6; ++i) {
        chunks.push_back(random_words(chunk - 5 * i, 100 + i));
    }
    std::size_t right = 0;
    std::size_t taken = 0;
    auto produce = [&]() -> task<void> {
        for (const auto& c : chunks) {
            auto slot = co_await p.acquire();
            std::fill(slot.data().begin(), slot.data().end(), poison);
            std::copy(c.begin(), c.end(), slot.data().begin());
            p.submit(std::move(slot), c.size());
            EXPECT_EQ(current_device(), 0) << "submit left another device current";
        }
        p.close();
    };
    // Takes the next result: false at the end. A failed chunk (pipeline_error) is counted as
    // taken and wrong; the chunks after it can still be taken.
    auto take = [&]() -> task<bool> {
        try {
            auto r = co_await p.next();
            if (!r) {
                co_return false;
            }
            if (taken == chunks.size()) {
                ADD_FAILURE() << "more results than chunks";
                co_return false;
            }
            const auto w = expected(chunks[taken++], chunk);
            right += std::equal(w.begin(), w.end(), r->data().begin(), r->data().end()) ? 1 : 0;
        } catch (const cudawait::pipeline_error&) {
            ++taken;
        }
        co_return true;
    };
    auto consume = [&]() -> task<void> {
        while (co_await take()) {
        }
    };
    EXPECT_NO_THROW(sync_wait(sched, cudawait::when_all(produce(), consume())));
    EXPECT_EQ(taken, chunks.size());
    EXPECT_EQ(right, chunks.size());
    EXPECT_EQ(current_device(), 0) << "streaming left another device current";
    EXPECT_EQ(p.stats().gpu_chunks, chunks.size());
    EXPECT_EQ(p.stats().fallback_chunks + p.stats().failed_chunks, 0u);
    EXPECT_EQ(degraded, 0u) << "chunks degraded (a stage's launch failed)";
    EXPECT_EQ(calls->size(), 24u);
    EXPECT_EQ(
        std::count_if(calls->begin(), calls->end(),
                      [](const stage_call& c) { return c.current != 1 || c.ctx_device != 1; }),
        0)
        << "stage calls without device 1 current";
    const auto launches = stage_launches();
    EXPECT_EQ(launches.size(), 24u);
    EXPECT_EQ(std::count_if(launches.begin(), launches.end(),
                            [](const fake::launch_info& l) {
                                return l.current_device != 1 || l.stream_device != 1 ||
                                       l.result != cudaSuccess;
                            }),
              0)
        << "stage launches refused, or not on device 1";
}

// ---- a grouped multi_pipeline over both devices -----------------------------------------------

// A group stage stays one in the shards: called once per group with the whole group (not once
// per chunk with a group of one), with its shard's device current, on both devices.
TEST_F(two_devices, a_multi_pipeline_calls_a_group_stage_once_per_group_on_each_device) {
    using multi_t = cudawait::multi_pipeline<u32>;
    const std::size_t chunk = 1000;
    const std::size_t group = 4;
    const std::size_t chunks = 19; // device 0: 10 chunks, device 1: 9 (the last one short)
    const std::size_t n = chunk * chunks - 250;
    auto calls = std::make_shared<std::vector<stage_call>>();
    cudawait::multi_pipeline_options o;
    o.devices = {0, 1};
    o.per_shard.chunk_elements = chunk;
    o.per_shard.depth = 2;
    o.per_shard.recovery.max_retries = 0;
    o.per_shard.memory.group_bytes = group * chunk * sizeof(u32);
    multi_t m(o, {[calls](std::span<u32> in, std::span<u32> out, const cudawait::group_context& g) {
                  calls->push_back(
                      {g.first_chunk, g.chunks, in.size(), out.size(), current_device(), g.device});
                  for (std::size_t j = 0; j < g.chunks; ++j) {
                      const auto i = g.input_chunk(in, j);
                      const auto r = g.output_chunk(out, j);
                      for (std::size_t k = 0; k < i.size(); ++k) {
                          r[k] = transform(i[k], k);
                      }
                  }
                  cudawait::check(cudaLaunchKernel(reinterpret_cast<const void*>(&stage_kernel),
                                                   dim3(1), dim3(1), nullptr, 0, g.stream.get()),
                                  "cudaLaunchKernel");
              }});
    ASSERT_EQ(m.shard_count(), 2u);
    // A batch over pinned ranges moves whole groups.
    const auto in = random_words(n, 2);
    const auto want = expected(in, chunk);
    pinned_buffer<u32> pin(n);
    pinned_buffer<u32> pout(n);
    std::copy(in.begin(), in.end(), pin.begin());
    std::fill(pout.begin(), pout.end(), poison);
    scheduler sched;
    EXPECT_NO_THROW(sync_wait(sched, m.run(pin.span(), pout.span())));
    EXPECT_TRUE(std::equal(want.begin(), want.end(), pout.begin(), pout.end()));
    EXPECT_EQ(current_device(), 0);
    std::size_t chunks_seen = 0;
    std::size_t largest = 0;
    std::size_t on_device[2] = {0, 0};
    for (const stage_call& c : *calls) {
        chunks_seen += c.chunks;
        largest = std::max(largest, c.chunks);
        EXPECT_LE(c.chunks, group) << "group from chunk " << c.first_chunk;
        // The spans hold every chunk of the group; only the batch's last chunk is short.
        EXPECT_GE(c.in_size, (c.chunks - 1) * chunk + 1) << "group from chunk " << c.first_chunk;
        EXPECT_LE(c.in_size, c.chunks * chunk) << "group from chunk " << c.first_chunk;
        EXPECT_EQ(c.out_size, c.in_size);
        EXPECT_EQ(c.current, c.ctx_device) << "group from chunk " << c.first_chunk;
        ASSERT_TRUE(c.ctx_device == 0 || c.ctx_device == 1);
        on_device[c.ctx_device] += c.chunks;
    }
    EXPECT_EQ(chunks_seen, chunks) << "every chunk in exactly one call";
    EXPECT_EQ(largest, group) << "the stage saw no whole group";
    // 10 chunks in groups of up to 4 on device 0, 9 on device 1: 3 calls each.
    EXPECT_EQ(calls->size(), 6u) << "called per chunk rather than per group";
    EXPECT_EQ(on_device[0], 10u);
    EXPECT_EQ(on_device[1], 9u);
    auto st = m.stats();
    EXPECT_EQ(st.shard_devices, (std::vector<int>{0, 1}));
    EXPECT_EQ(st.combined.gpu_chunks, chunks);
    EXPECT_EQ(st.combined.fallback_chunks + st.combined.failed_chunks, 0u);
    EXPECT_EQ(st.combined.input_bytes, n * sizeof(u32));
    const auto launches = stage_launches();
    EXPECT_EQ(launches.size(), calls->size());
    for (const fake::launch_info& l : launches) {
        EXPECT_EQ(l.current_device, l.stream_device);
        EXPECT_EQ(l.result, cudaSuccess);
    }
}

} // namespace
