// SPDX-License-Identifier: Apache-2.0
// copy_lanes::for_device on the fake CUDA runtime with two devices: making one device's lanes
// holds up no other device's. (On a GPU: tests/copy/copy_lane_test.cpp.) The lanes and the
// bulk-stream registry are process-wide, and the lanes of both devices must be made here for the
// first time: this program has one test.
#include <cudawait/copy/copy.hpp>
#include <cudawait/copy/copy_lane.hpp>
#include <cudawait/copy/detail/bulk_streams.hpp>
#include <cudawait/core/scheduler.hpp>
#include <cudawait/core/sync_wait.hpp>
#include <cudawait/runtime/device.hpp>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <future>
#include <random>
#include <span>

#include <cuda_runtime_api.h>

#include "fake_cuda.hpp"
#include <gtest/gtest.h>

namespace {

using namespace std::chrono_literals;
namespace fake = cudawait::fake_cuda;
using cudawait::copy_lanes;
using cudawait::device_ref;
using cudawait::lane;

/// Lets the fake's blocked call go when it goes out of scope: declared after the futures of the
/// threads that may be blocked, so that a failed assertion unblocks them before their futures
/// wait for them.
struct unblock_at_exit {
    unblock_at_exit() = default;
    unblock_at_exit(const unblock_at_exit&) = delete;
    unblock_at_exit& operator=(const unblock_at_exit&) = delete;
    ~unblock_at_exit() { fake::unblock(); }
};

// Thread A makes device 1's lanes, and the driver takes long to make their first stream (the
// fake blocks it). Meanwhile thread B makes device 0's lanes and copies through device 0's small
// lane, both ways: that must not wait for A. Thread C, asking for device 1's lanes meanwhile,
// waits for A and gets the lanes A made: one set of streams per device, one registration each.
// When the lanes were made under the process-wide registry mutex, B waited until A's stream
// creation returned.
TEST(copy_lanes_fake, making_one_device_s_lanes_holds_up_no_other_device_s) {
    fake::reset();
    fake::set_device_count(2);
    auto& bulk = cudawait::detail::bulk_streams::instance();
    ASSERT_EQ(bulk.count(0), 0u);
    ASSERT_EQ(bulk.count(1), 0u);
    const std::size_t streams = fake::live_streams();

    constexpr std::size_t n = 4096;
    void* dev = nullptr;
    void* host_in = nullptr;
    void* host_out = nullptr;
    ASSERT_EQ(cudaMalloc(&dev, n), cudaSuccess); // device 0 is current
    ASSERT_EQ(cudaHostAlloc(&host_in, n, cudaHostAllocDefault), cudaSuccess);
    ASSERT_EQ(cudaHostAlloc(&host_out, n, cudaHostAllocDefault), cudaSuccess);
    std::span<std::uint8_t> in(static_cast<std::uint8_t*>(host_in), n);
    std::span<std::uint8_t> on_device(static_cast<std::uint8_t*>(dev), n);
    std::span<std::uint8_t> out(static_cast<std::uint8_t*>(host_out), n);
    std::mt19937 rng(20261205);
    for (std::uint8_t& b : in) {
        b = static_cast<std::uint8_t>(rng());
    }
    std::fill(on_device.begin(), on_device.end(), std::uint8_t{0x5a});
    std::fill(out.begin(), out.end(), std::uint8_t{0xa5});

    std::future<const copy_lanes*> a;
    std::future<const copy_lanes*> b;
    std::future<const copy_lanes*> c;
    const unblock_at_exit unblock_on_failure;

    // A: device 1's first stream creation blocks.
    fake::block_next("cudaStreamCreateWithPriority", 1);
    a = std::async(std::launch::async,
                   []() -> const copy_lanes* { return &copy_lanes::for_device(device_ref(1)); });
    ASSERT_TRUE(fake::wait_blocked(10s)) << "device 1's lanes made no stream";

    // B: device 0's lanes and a copy through its small lane, each way.
    b = std::async(std::launch::async, [&]() -> const copy_lanes* {
        const copy_lanes* lanes = &copy_lanes::for_device(device_ref(0));
        cudawait::scheduler sched;
        cudawait::sync_wait(sched, cudawait::copy(on_device, in, lane::small));
        cudawait::sync_wait(sched, cudawait::copy(out, on_device, lane::small));
        return lanes;
    });
    const bool b_done = b.wait_for(5s) == std::future_status::ready;
    EXPECT_TRUE(b_done) << "device 0's lanes and a copy through them waited while another thread "
                           "made device 1's lanes";

    // C: device 1's lanes again, while A makes them.
    c = std::async(std::launch::async,
                   []() -> const copy_lanes* { return &copy_lanes::for_device(device_ref(1)); });
    EXPECT_EQ(c.wait_for(100ms), std::future_status::timeout)
        << "device 1's lanes were returned before they were made";
    EXPECT_EQ(a.wait_for(0s), std::future_status::timeout) << "the fake let A go";

    fake::unblock();
    ASSERT_EQ(a.wait_for(10s), std::future_status::ready) << "device 1's lanes were never made";
    ASSERT_EQ(b.wait_for(10s), std::future_status::ready) << "device 0's copies never completed";
    ASSERT_EQ(c.wait_for(10s), std::future_status::ready) << "device 1's second caller hangs";
    const copy_lanes* lanes1 = a.get();
    const copy_lanes* lanes0 = nullptr;
    ASSERT_NO_THROW(lanes0 = b.get());
    EXPECT_EQ(c.get(), lanes1) << "two sets of lanes for device 1";
    EXPECT_EQ(lanes0->device(), 0);
    EXPECT_EQ(lanes1->device(), 1);
    EXPECT_EQ(lanes0, &copy_lanes::for_device(device_ref(0)));
    EXPECT_EQ(lanes1, &copy_lanes::for_device(device_ref(1)));
    for (const copy_lanes* l : {lanes0, lanes1}) {
        for (lane which : {lane::small, lane::bulk}) {
            for (auto d : {cudawait::copy_direction::h2d, cudawait::copy_direction::d2h}) {
                EXPECT_EQ(fake::stream_device(l->get(which, d).get()), l->device());
            }
        }
    }
    EXPECT_EQ(fake::live_streams(), streams + 8) << "four streams per device";
    EXPECT_EQ(bulk.count(0), 1u);
    EXPECT_EQ(bulk.count(1), 1u);
    for (std::size_t i = 0; i < n; ++i) {
        ASSERT_EQ(out[i], in[i]) << "byte " << i;
    }
    EXPECT_EQ(cudaFreeHost(host_out), cudaSuccess);
    EXPECT_EQ(cudaFreeHost(host_in), cudaSuccess);
    EXPECT_EQ(cudaFree(dev), cudaSuccess);
}

} // namespace
