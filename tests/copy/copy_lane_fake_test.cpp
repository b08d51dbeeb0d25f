// SPDX-License-Identifier: Apache-2.0
// copy_lane.hpp on the fake CUDA runtime: the lanes and a small-copy kernel that cannot be
// loaded. (The lanes on a GPU are tested in tests/copy/copy_lane_test.cpp.) The lanes, the
// small-copy kernel and the bulk-stream registry are process-wide: this program has one test.
#include <cudawait/copy/copy.hpp>
#include <cudawait/copy/copy_lane.hpp>
#include <cudawait/copy/detail/bulk_streams.hpp>
#include <cudawait/core/scheduler.hpp>
#include <cudawait/core/sync_wait.hpp>
#include <cudawait/runtime/device.hpp>
#include <cudawait/runtime/error.hpp>

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

// The lanes are made without loading the small-copy kernel. A small D2H copy into pinned memory
// beside a busy bulk D2H stream goes by the SMs; where the kernel's code cannot be loaded there
// (an old GPU), the copy takes a copy engine instead of failing, and only live streams are asked
// whether they are busy.
TEST(copy_lanes_fake, a_kernel_that_cannot_be_loaded_sends_small_copies_to_a_copy_engine) {
    fake::reset();
    auto& bulk = cudawait::detail::bulk_streams::instance();
    ASSERT_EQ(bulk.count(0), 0u);
    const std::size_t streams = fake::live_streams();

    const copy_lanes& lanes = copy_lanes::for_device(device_ref(0));
    EXPECT_EQ(fake::live_streams(), streams + 4);
    EXPECT_EQ(bulk.count(0), 1u) << "only the bulk D2H stream is registered";
    EXPECT_EQ(fake::calls("cudaLibraryLoadData"), 0u) << "making the lanes loads no kernel";

    // The bulk D2H stream is busy (work recorded on it is stuck).
    cudaStream_t bulk_d2h = lanes.get(lane::bulk, copy_direction::d2h).get();
    fake::hang(bulk_d2h);
    cudaEvent_t busy = nullptr;
    ASSERT_EQ(cudaEventCreateWithFlags(&busy, cudaEventDisableTiming), cudaSuccess);
    ASSERT_EQ(cudaEventRecord(busy, bulk_d2h), cudaSuccess);
    bulk.note_work(bulk_d2h);

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
    // PTX the driver cannot compile for the device fails at the kernel's lookup.
    fake::fail_next("cudaLibraryGetKernel", cudaErrorInvalidPtx);
    const std::size_t dead = fake::dead_handle_calls();
    cudawait::scheduler sched;
    EXPECT_NO_THROW(cudawait::sync_wait(sched, cudawait::copy(dst, src, lane::small)));
    EXPECT_EQ(fake::calls("cudaLibraryGetKernel"), 1u) << "the SMs were asked to make the copy";
    EXPECT_EQ(fake::calls("cudaLaunchKernel"), 0u) << "no kernel could have made it";
    EXPECT_EQ(fake::dead_handle_calls(), dead) << "a destroyed stream was queried";
    // In the fake a kernel moves nothing: every byte arrived by a copy engine's memcpy.
    for (std::size_t i = 0; i < n; ++i) {
        ASSERT_EQ(dst[i], src[i]) << "byte " << i;
    }
    fake::release(bulk_d2h);
    EXPECT_EQ(cudaEventDestroy(busy), cudaSuccess);
    EXPECT_EQ(cudaFreeHost(host), cudaSuccess);
    EXPECT_EQ(cudaFree(dev), cudaSuccess);
}

} // namespace
