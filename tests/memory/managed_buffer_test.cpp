// SPDX-License-Identifier: Apache-2.0
#include <cudawait/copy/copy.hpp>
#include <cudawait/core/scheduler.hpp>
#include <cudawait/core/sync_wait.hpp>
#include <cudawait/memory/device_buffer.hpp>
#include <cudawait/memory/managed_buffer.hpp>
#include <cudawait/memory/memory_kind.hpp>
#include <cudawait/pipeline/pipeline.hpp>
#include <cudawait/runtime/stream.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <random>
#include <span>
#include <stdexcept>
#include <type_traits>
#include <utility>
#include <vector>

#include <cuda_runtime.h>

#include "gpu_fixture.hpp"
#include "host_pool.hpp"
#include "random_words.hpp"
#include "test_kernels.hpp"
#include <gtest/gtest.h>

namespace {

using cudawait::managed_buffer;
using cudawait::memory_kind;
using cudawait::usage_error;
using u32 = std::uint32_t;

static_assert(cudawait::memory_kind_of<managed_buffer<int>> == memory_kind::managed);
static_assert(!std::is_copy_constructible_v<managed_buffer<int>>);
static_assert(!std::is_copy_assignable_v<managed_buffer<int>>);
static_assert(std::is_nothrow_move_constructible_v<managed_buffer<int>>);
static_assert(std::is_nothrow_move_assignable_v<managed_buffer<int>>);
static_assert(std::ranges::contiguous_range<managed_buffer<int>&>);

using cudawait::testing::random_words;

/// A view whose type states managed memory, as managed_buffer does.
template <class T>
struct managed_view {
    static constexpr memory_kind memory = memory_kind::managed;
    T* p;
    std::size_t n;
    T* begin() const { return p; }
    T* end() const { return p + n; }
};
template <class T>
struct pageable_view {
    static constexpr memory_kind memory = memory_kind::pageable;
    T* p;
    std::size_t n;
    T* begin() const { return p; }
    T* end() const { return p + n; }
};

// ---- without a GPU ----------------------------------------------------------------------------

TEST(managed_buffer, an_empty_buffer_throws_on_every_access) {
    managed_buffer<int> b;
    EXPECT_FALSE(static_cast<bool>(b));
    EXPECT_TRUE(b.empty());
    EXPECT_EQ(b.size(), 0u);
    EXPECT_THROW((void)b.data(), usage_error);
    EXPECT_THROW((void)b.span(), usage_error);
    EXPECT_THROW((void)b.begin(), usage_error);
    EXPECT_THROW((void)b[0], usage_error);
    managed_buffer<int> moved = std::move(b);
    EXPECT_THROW((void)moved.data(), usage_error);
}

TEST(managed_buffer, zero_or_overflowing_counts_are_usage_errors_before_any_cuda_call) {
    EXPECT_THROW(managed_buffer<int>(0), usage_error);
    EXPECT_THROW(managed_buffer<std::uint64_t>(std::size_t(-1) / 4), usage_error);
}

TEST(managed_buffer, prefetching_an_empty_range_is_a_usage_error_at_the_call) {
    std::span<int> none;
    auto s = cudawait::stream_ref(cudaStreamPerThread);
    EXPECT_THROW(cudawait::prefetch_to_host_async(none, s), usage_error);
    EXPECT_THROW((void)cudawait::prefetch_to_host(none, s), usage_error);
}

TEST(managed_buffer, copies_of_managed_memory_are_never_staged) {
    std::vector<int> a(10);
    std::vector<int> b(10);
    // A staging pool on plain heap memory, and kinds from the types: no device is needed.
    cudawait::testing::host_pool h;
    cudawait::pinned_pool staging(h.options());
    const cudawait::copy_options opt{&staging};
    auto plan = cudawait::detail::make_plan(managed_view<int>{a.data(), 10},
                                            pageable_view<const int>{b.data(), 10}, opt);
    EXPECT_EQ(plan.dst_kind, memory_kind::managed);
    EXPECT_EQ(plan.src_kind, memory_kind::pageable);
    EXPECT_FALSE(plan.staged());
    plan = cudawait::detail::make_plan(pageable_view<int>{a.data(), 10},
                                       managed_view<const int>{b.data(), 10}, opt);
    EXPECT_FALSE(plan.staged());
    EXPECT_FALSE(plan.peer());
}

// ---- GPU --------------------------------------------------------------------------------------

class managed_gpu : public cudawait::testing::pool_gpu_test {};

TEST_F(managed_gpu, the_driver_and_the_type_agree_it_is_managed) {
    managed_buffer<u32> m(1000);
    EXPECT_EQ(cudawait::classify(m.data()), memory_kind::managed);
    EXPECT_EQ(cudawait::kind_of(m, m.data()), memory_kind::managed);
}

TEST_F(managed_gpu, host_write_prefetch_kernel_prefetch_back_host_read) {
    const std::size_t n = (std::size_t{24} << 20) / 4 + 17; // some 24 MiB, not a page multiple
    cudawait::stream s;
    managed_buffer<u32> m(n);
    auto want = random_words(n, 11);
    std::copy(want.begin(), want.end(), m.begin()); // first touch on the host
    cudawait::scheduler sched;
    auto work = [&]() -> cudawait::task<void> {
        co_await cudawait::prefetch(m, cudawait::device_ref(s.device()), s);
        cudawait::check(cudawait::testing::launch_mix(m.data(), n, 0x77, s.get()), "launch_mix");
        co_await cudawait::prefetch_to_host(m.span(), s);
    };
    cudawait::sync_wait(sched, work());
    cudawait::testing::mix_on_host(want.data(), n, 0x77);
    std::size_t bad = n;
    for (std::size_t i = 0; i < n; ++i) {
        if (m[i] != want[i]) {
            bad = i;
            break;
        }
    }
    EXPECT_EQ(bad, n) << "first wrong word";
}

TEST_F(managed_gpu, enqueue_only_prefetches_keep_stream_order) {
    const std::size_t n = 1 << 20;
    cudawait::stream s;
    managed_buffer<u32> m(n);
    auto want = random_words(n, 12);
    std::copy(want.begin(), want.end(), m.begin());
    cudawait::prefetch_async(m, cudawait::device_ref(s.device()), s);
    cudawait::check(cudawait::testing::launch_spin(5'000'000, nullptr, 0, s.get()), "launch_spin");
    cudawait::check(cudawait::testing::launch_mix(m.data(), n, 5, s.get()), "launch_mix");
    cudawait::prefetch_to_host_async(std::span<const u32>(m.data(), n), s);
    s.sync();
    cudawait::testing::mix_on_host(want.data(), n, 5);
    EXPECT_TRUE(std::equal(want.begin(), want.end(), m.begin()));
}

TEST_F(managed_gpu, copy_to_a_device_buffer_and_back_is_exact) {
    const std::size_t n = (std::size_t{9} << 20) / 4 + 3;
    cudawait::stream s;
    managed_buffer<u32> src(n);
    managed_buffer<u32> back(n);
    auto want = random_words(n, 13);
    std::copy(want.begin(), want.end(), src.begin());
    std::fill(back.begin(), back.end(), 0xdeadbeefu);
    cudawait::device_buffer<u32> dev(n, s);
    std::vector<u32> host_back(n, 0xfeedfaceu);
    cudawait::scheduler sched;
    auto work = [&]() -> cudawait::task<void> {
        co_await cudawait::copy(dev, src, s);
        // The device copy changes on the GPU, so the way back must carry the kernel's result.
        cudawait::check(cudawait::testing::launch_mix(dev.data(), n, 9, s.get()), "launch_mix");
        co_await cudawait::copy(back, dev, s);
        co_await cudawait::copy(host_back, back, s); // managed -> pageable: direct as well
    };
    cudawait::sync_wait(sched, work());
    cudawait::testing::mix_on_host(want.data(), n, 9);
    EXPECT_TRUE(std::equal(want.begin(), want.end(), back.begin())) << "managed back";
    EXPECT_EQ(host_back, want) << "pageable from managed";

    // copy_async too, pageable -> managed.
    std::vector<u32> again = random_words(n, 14);
    cudawait::copy_async(src, again, s);
    s.sync();
    EXPECT_TRUE(std::equal(again.begin(), again.end(), src.begin()));
}

TEST_F(managed_gpu, a_pipeline_batch_over_managed_ranges_is_exact) {
    using pipe_t = cudawait::pipeline<u32>;
    const std::size_t chunk = 100'000;
    const std::size_t n = chunk * 5 + 321;
    const u32 salt = 0x5eed;
    managed_buffer<u32> in(n);
    managed_buffer<u32> out(n);
    auto words = random_words(n, 15);
    std::copy(words.begin(), words.end(), in.begin());
    std::fill(out.begin(), out.end(), 0xdeadbeefu);
    cudawait::pipeline_options o;
    o.memory.group_bytes = 0; // one chunk per flight
    o.chunk_elements = chunk;
    o.depth = 3;
    cudawait::scheduler sched;
    {
        pipe_t p(o, {[salt](std::span<u32> i, std::span<u32> r, cudawait::stream_ref s) {
                     cudawait::check(cudawait::testing::launch_transform(
                                         i.data(), r.data(), i.size(), salt, 0, s.get()),
                                     "launch_transform");
                 }});
        cudawait::sync_wait(sched, p.run(std::span<const u32>(in.data(), n), out.span()));
    }
    std::vector<u32> want(n);
    for (std::size_t off = 0; off < n; off += chunk) {
        std::size_t k = std::min(chunk, n - off);
        cudawait::testing::transform_on_host(words.data() + off, want.data() + off, k, salt);
    }
    EXPECT_TRUE(std::equal(want.begin(), want.end(), out.begin()));
}

} // namespace
