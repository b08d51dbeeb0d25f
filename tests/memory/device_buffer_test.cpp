// SPDX-License-Identifier: Apache-2.0
#include <cudawait/memory/device_buffer.hpp>

#include <cstdint>
#include <random>
#include <ranges>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <cuda_runtime.h>

#include "counting_device_resource.hpp"
#include "gpu_fixture.hpp"
#include "test_kernels.hpp"
#include <gtest/gtest.h>

namespace {

using cudawait::device_buffer;
using cudawait::usage_error;

static_assert(!std::is_copy_constructible_v<device_buffer<int>>);
static_assert(std::is_nothrow_move_constructible_v<device_buffer<int>>);
static_assert(std::ranges::contiguous_range<device_buffer<int>>);
template <class B>
concept indexable = requires(const B& b) {
    b[0];
};
// Device memory: the host has nothing to index, so there is no operator[] to misuse.
static_assert(!indexable<device_buffer<int>>);

// Everything that exposes the memory throws on an empty buffer; the message names the type.
template <class T>
void expect_no_access(const device_buffer<T>& b) {
    EXPECT_FALSE(b);
    EXPECT_TRUE(b.empty());
    EXPECT_EQ(b.size(), 0u);
    EXPECT_EQ(b.size_bytes(), 0u);
    EXPECT_THROW((void)b.data(), usage_error);
    EXPECT_THROW((void)b.span(), usage_error);
    EXPECT_THROW((void)b.begin(), usage_error);
    EXPECT_THROW((void)b.end(), usage_error);
    try {
        (void)b.data();
        ADD_FAILURE() << "no exception";
    } catch (const usage_error& e) {
        EXPECT_NE(std::string(e.what()).find("device_buffer"), std::string::npos) << e.what();
    }
}

TEST(device_buffer, zero_elements_is_a_usage_error_before_any_cuda_call) {
    const auto s = cudawait::stream_ref(cudaStreamPerThread);
    EXPECT_THROW(device_buffer<int>(0, s), usage_error);
    EXPECT_THROW(device_buffer<double>(std::size_t(-1) / 4, s), usage_error) << "byte overflow";
    device_buffer<int> empty;
    expect_no_access(empty);
    EXPECT_EQ(empty.stream(), cudawait::stream_ref(cudaStreamPerThread));
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
    EXPECT_EQ(b.size(), 1000u);
    {
        SCOPED_TRACE("moved from");
        expect_no_access(a); // NOLINT(bugprone-use-after-move)
    }
    EXPECT_EQ(a.stream(), cudawait::stream_ref(s1)) << "a moved-from buffer keeps its stream";
    b.set_stream(s2);
    EXPECT_EQ(b.stream(), cudawait::stream_ref(s2));
    device_buffer<float> c(10, s1);
    c = std::move(b);
    EXPECT_EQ(c.data(), p);
    EXPECT_EQ(c.stream(), cudawait::stream_ref(s2)) << "the stream moves with the memory";
    {
        SCOPED_TRACE("move-assigned from");
        expect_no_access(b); // NOLINT(bugprone-use-after-move)
    }
    c.reset();
    {
        SCOPED_TRACE("reset");
        expect_no_access(c);
    }
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

TEST(device_buffer, the_default_resource_is_cuda_malloc_async) {
    cudawait::device_resource def;
    cudawait::device_resource null = nullptr;
    EXPECT_TRUE(def.is_default());
    EXPECT_TRUE(null.is_default());
    EXPECT_TRUE(def == null);
    device_buffer<int> empty;
    EXPECT_TRUE(empty.resource().is_default());
#if CUDAWAIT_HAS_CUDA_MR
    cudawait::testing::device_resource_counts counts;
    cudawait::testing::counting_device_resource counting(counts);
    cudawait::device_resource r = counting;
    cudawait::device_resource copy = r;
    EXPECT_FALSE(r.is_default());
    EXPECT_TRUE(copy == r);
    EXPECT_FALSE(copy == def);
    copy = def;
    EXPECT_TRUE(copy.is_default());
    // A zero count fails before the resource is asked.
    EXPECT_THROW(device_buffer<int>(0, cudaStreamPerThread, r), usage_error);
    EXPECT_EQ(counts.allocations.load(), 0);
#endif
}

TEST_F(device_buffer_gpu, memory_from_a_stream_ordered_resource_goes_back_to_it) {
#if !CUDAWAIT_HAS_CUDA_MR
    GTEST_SKIP() << "cuda::mr is not available";
#else
    cudawait::testing::device_resource_counts counts;
    cudawait::testing::counting_device_resource counting(counts);
    cudawait::device_resource_ref ref = counting;
    cudawait::stream s;
    const std::size_t n = 300'001;
    {
        device_buffer<std::uint32_t> d(n, s, ref);
        EXPECT_EQ(counts.allocations.load(), 1);
        EXPECT_EQ(counts.bytes_allocated.load(), n * 4);
        EXPECT_FALSE(d.resource().is_default());
        std::vector<std::uint32_t> host(n);
        std::mt19937 rng(29);
        for (auto& x : host) {
            x = static_cast<std::uint32_t>(rng());
        }
        std::vector<std::uint32_t> back(n, 0xdeadbeef);
        ASSERT_EQ(cudaMemcpyAsync(d.data(), host.data(), n * 4, cudaMemcpyHostToDevice, s.get()),
                  cudaSuccess);
        ASSERT_EQ(cudawait::testing::launch_mix(d.data(), n, 9, s.get()), cudaSuccess);
        ASSERT_EQ(cudaMemcpyAsync(back.data(), d.data(), n * 4, cudaMemcpyDeviceToHost, s.get()),
                  cudaSuccess);
        s.sync();
        cudawait::testing::mix_on_host(host.data(), n, 9);
        EXPECT_EQ(back, host);
        // A move carries the resource: one free, through it, when the new owner goes.
        device_buffer<std::uint32_t> moved(std::move(d));
        EXPECT_EQ(counts.deallocations.load(), 0);
        EXPECT_FALSE(moved.resource().is_default());
    }
    EXPECT_EQ(counts.allocations.load(), 1);
    EXPECT_EQ(counts.deallocations.load(), 1);
    EXPECT_EQ(counts.bytes_freed.load(), n * 4);
    s.sync();
#endif
}

} // namespace
