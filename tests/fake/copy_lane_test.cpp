// SPDX-License-Identifier: Apache-2.0
// copy_lane.hpp on the fake CUDA runtime: what a failed construction of a device's lanes leaves
// behind. (The lanes on a GPU are tested in tests/copy_lane_test.cpp.) The lanes, the small-copy
// kernel and the bulk-stream registry are process-wide: this program has one test.
#include <cudawait/copy.hpp>
#include <cudawait/copy_lane.hpp>
#include <cudawait/device.hpp>
#include <cudawait/error.hpp>
#include <cudawait/scheduler.hpp>
#include <cudawait/sync_wait.hpp>

#include <cudawait/detail/bulk_streams.hpp>

#include <cstddef>
#include <cstdint>
#include <random>
#include <span>
#include <vector>

#include <cuda_runtime_api.h>

#include "fake_cuda.hpp"
#include <gtest/gtest.h>

namespace {

namespace fake = cudawait::fake_cuda;
using cudawait::copy_direction;
using cudawait::copy_lanes;
using cudawait::device_ref;
using cudawait::lane;

TEST(copy_lanes_fake, a_failed_preload_leaves_no_stream_registered) {
    fake::reset();
    auto& bulk = cudawait::detail::bulk_streams::instance();
    ASSERT_EQ(bulk.count(0), 0u);
    const std::size_t streams = fake::live_streams();

    // The lanes load the small-copy kernel with a launch over zero bytes.
    fake::fail_next("cudaLaunchKernel", cudaErrorNoKernelImageForDevice);
    EXPECT_THROW((void)copy_lanes::for_device(device_ref(0)), cudawait::cuda_error);
    EXPECT_EQ(fake::calls("cudaLaunchKernel"), 1u) << "the failure came from the preload";
    EXPECT_EQ(fake::live_streams(), streams) << "the four streams are destroyed";
    EXPECT_EQ(bulk.count(0), 0u) << "a destroyed stream stayed registered";

    // A later call makes the lanes; only their bulk D2H stream is registered.
    const copy_lanes& lanes = copy_lanes::for_device(device_ref(0));
    EXPECT_EQ(fake::live_streams(), streams + 4);
    EXPECT_EQ(bulk.count(0), 1u);

    // A small D2H copy into pinned memory asks whether a bulk stream is busy: that must query
    // live streams only. Idle, the copy engine makes it (in the fake: a memcpy).
    constexpr std::size_t n = 4096;
    void* dev = nullptr;
    void* host = nullptr;
    ASSERT_EQ(cudaMalloc(&dev, n), cudaSuccess);
    ASSERT_EQ(cudaHostAlloc(&host, n, cudaHostAllocDefault), cudaSuccess);
    std::span<std::uint8_t> src(static_cast<std::uint8_t*>(dev), n);
    std::span<std::uint8_t> dst(static_cast<std::uint8_t*>(host), n);
    std::mt19937 rng(20261204);
    for (std::uint8_t& b : src) {
        b = static_cast<std::uint8_t>(rng());
    }
    std::fill(dst.begin(), dst.end(), std::uint8_t{0xa5});
    bulk.note_work(lanes.get(lane::bulk, copy_direction::d2h).get()); // ask the streams again
    const std::size_t dead = fake::dead_handle_calls();
    cudawait::scheduler sched;
    EXPECT_NO_THROW(cudawait::sync_wait(sched, cudawait::copy(dst, src, lane::small)));
    EXPECT_EQ(fake::dead_handle_calls(), dead) << "a destroyed stream was queried";
    EXPECT_GE(fake::calls("cudaStreamQuery"), 1u) << "the bulk stream was not asked";
    for (std::size_t i = 0; i < n; ++i) {
        ASSERT_EQ(dst[i], src[i]) << "byte " << i;
    }
    EXPECT_EQ(cudaFreeHost(host), cudaSuccess);
    EXPECT_EQ(cudaFree(dev), cudaSuccess);
}

} // namespace
