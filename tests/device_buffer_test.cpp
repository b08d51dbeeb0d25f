// SPDX-License-Identifier: Apache-2.0
#include <cudawait/device_buffer.hpp>

#include "gpu_fixture.hpp"
#include "test_kernels.hpp"

#include <cstdint>
#include <random>
#include <type_traits>
#include <utility>
#include <vector>

#include <cuda_runtime.h>
#include <gtest/gtest.h>

namespace {

using cudawait::device_buffer;
using cudawait::usage_error;

static_assert(!std::is_copy_constructible_v<device_buffer<int>>);
static_assert(std::is_nothrow_move_constructible_v<device_buffer<int>>);

TEST(device_buffer, zero_elements_is_a_usage_error_before_any_cuda_call) {
    EXPECT_THROW(device_buffer<int>(0, cudawait::stream_ref(cudaStreamPerThread)), usage_error);
    device_buffer<int> empty;
    EXPECT_THROW((void)empty.data(), usage_error);
    EXPECT_TRUE(empty.empty());
}

class device_buffer_gpu : public cudawait::testing::gpu_test {};

TEST_F(device_buffer_gpu, holds_device_memory_in_stream_order) {
    cudawait::stream s;
    const std::size_t n = 1 << 20;
    device_buffer<std::uint32_t> d(n, s);
    EXPECT_EQ(d.size(), n);
    EXPECT_EQ(d.stream(), cudawait::stream_ref(s));
    cudaPointerAttributes attr{};
    ASSERT_EQ(cudaPointerGetAttributes(&attr, d.data()), cudaSuccess);
    EXPECT_EQ(attr.type, cudaMemoryTypeDevice);
    std::vector<std::uint32_t> host(n);
    std::mt19937 rng(17);
    for (auto& x : host) {
        x = static_cast<std::uint32_t>(rng());
    }
    std::vector<std::uint32_t> back(n, 0xdeadbeef);
    ASSERT_EQ(cudaMemcpyAsync(d.data(), host.data(), n * 4, cudaMemcpyHostToDevice, s.get()),
              cudaSuccess);
    ASSERT_EQ(cudawait::testing::launch_mix(d.data(), n, 5, s.get()), cudaSuccess);
    ASSERT_EQ(cudaMemcpyAsync(back.data(), d.data(), n * 4, cudaMemcpyDeviceToHost, s.get()),
              cudaSuccess);
    s.sync();
    cudawait::testing::mix_on_host(host.data(), n, 5);
    EXPECT_EQ(back, host);
}

TEST_F(device_buffer_gpu, moves_and_set_stream_keep_one_owner) {
    cudawait::stream s1;
    cudawait::stream s2;
    device_buffer<float> a(1000, s1);
    float* p = a.data();
    device_buffer<float> b(std::move(a));
    EXPECT_EQ(b.data(), p);
    EXPECT_THROW((void)a.data(), usage_error); // NOLINT(bugprone-use-after-move)
    b.set_stream(s2);
    EXPECT_EQ(b.stream(), cudawait::stream_ref(s2));
    device_buffer<float> c(10, s1);
    c = std::move(b);
    EXPECT_EQ(c.data(), p);
    c.reset();
    EXPECT_TRUE(c.empty());
    s1.sync();
    s2.sync();
}

TEST_F(device_buffer_gpu, an_impossible_size_is_a_cuda_error) {
    cudawait::stream s;
    try {
        device_buffer<std::uint8_t> huge(std::size_t{1} << 50, s);
        ADD_FAILURE() << "allocated a petabyte";
    } catch (const cudawait::cuda_error& e) {
        EXPECT_EQ(e.status(), cudaErrorMemoryAllocation);
        EXPECT_FALSE(e.sticky());
    }
    device_buffer<int> fine(16, s); // the stream and device are still usable
    s.sync();
}

} // namespace
