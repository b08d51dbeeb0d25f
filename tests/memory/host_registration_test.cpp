// SPDX-License-Identifier: Apache-2.0
#include <cudawait/copy/copy.hpp>
#include <cudawait/core/scheduler.hpp>
#include <cudawait/core/sync_wait.hpp>
#include <cudawait/memory/device_buffer.hpp>
#include <cudawait/memory/host_registration.hpp>
#include <cudawait/memory/memory_kind.hpp>
#include <cudawait/memory/pinned_pool.hpp>
#include <cudawait/runtime/stream.hpp>

#include <cstddef>
#include <cstdint>
#include <random>
#include <ranges>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include <cuda_runtime.h>

#include "gpu_fixture.hpp"
#include <gtest/gtest.h>

namespace {

using cudawait::host_registration;
using cudawait::memory_kind;
using cudawait::registered_span;

std::vector<float> random_floats(std::size_t n, std::uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::uniform_real_distribution<float> d(-1000.0f, 1000.0f);
    std::vector<float> v(n);
    for (float& x : v) {
        x = d(rng);
    }
    return v;
}

// ---- without a device ---------------------------------------------------------------------------

static_assert(cudawait::memory_kind_of<registered_span<float>> == memory_kind::pinned);
static_assert(cudawait::memory_kind_of<const registered_span<const int>&> == memory_kind::pinned);
static_assert(std::ranges::contiguous_range<registered_span<float>>);
static_assert(std::ranges::sized_range<registered_span<float>>);
static_assert(std::ranges::borrowed_range<registered_span<float>>);
static_assert(!std::is_copy_constructible_v<host_registration<float>>);
static_assert(std::is_nothrow_move_constructible_v<host_registration<float>>);
static_assert(std::is_nothrow_move_assignable_v<host_registration<float>>);
// pipeline::run takes std::span: a registered_span, temporary or not, converts to both.
static_assert(std::is_convertible_v<registered_span<float>, std::span<const float>>);
static_assert(std::is_convertible_v<registered_span<float>, std::span<float>>);
static_assert(
    cudawait::detail::copyable_pair<cudawait::device_buffer<float>&, registered_span<const float>>);
static_assert(
    cudawait::detail::copyable_pair<registered_span<float>, const cudawait::device_buffer<float>&>);
// Class template argument deduction from a span and from a container.
static_assert(std::is_same_v<decltype(host_registration(std::declval<std::span<int>>())),
                             host_registration<int>>);
static_assert(std::is_same_v<decltype(host_registration(std::declval<std::vector<int>&>())),
                             host_registration<int>>);
static_assert(std::is_same_v<decltype(host_registration(std::declval<const std::vector<int>&>())),
                             host_registration<const int>>);

// Checked before any CUDA call, so these hold without a device.
TEST(host_registration, empty_or_null_ranges_are_usage_errors) {
    std::vector<float> none;
    EXPECT_THROW(host_registration<float>(std::span<float>(none)), cudawait::usage_error);
    EXPECT_THROW(host_registration<float>(std::span<float>()), cudawait::usage_error);
    float x = 0;
    EXPECT_THROW(host_registration<float>(std::span<float>(&x, std::size_t{0})),
                 cudawait::usage_error);
}

TEST(host_registration, an_empty_registration_has_no_span) {
    host_registration<float> reg;
    EXPECT_FALSE(reg);
    EXPECT_EQ(reg.data(), nullptr);
    EXPECT_EQ(reg.size(), 0u);
    EXPECT_THROW((void)reg.span(), cudawait::usage_error);
    reg.reset(); // nothing to unregister: no CUDA call
    host_registration<float> moved(std::move(reg));
    EXPECT_FALSE(moved);
}

// ---- with a GPU -------------------------------------------------------------------------------

class host_registration_gpu : public cudawait::testing::pool_gpu_test {};

TEST_F(host_registration_gpu, the_driver_calls_a_registered_range_pinned_and_copy_does_not_stage) {
    constexpr std::size_t n = (std::size_t{24} << 20) / sizeof(float) + 7; // several 8 MiB chunks
    std::vector<float> host = random_floats(n, 1);
    std::vector<float> back(n, -1.0f);
    ASSERT_EQ(cudawait::classify(host.data()), memory_kind::pageable);
    host_registration reg_in(host);
    host_registration reg_back(back);
    EXPECT_TRUE(reg_in);
    EXPECT_EQ(reg_in.size(), n);
    EXPECT_EQ(reg_in.bytes(), n * sizeof(float));
    // Registered memory is pinned to the driver, at its start and inside it: a plain span over
    // it takes the pinned path too.
    EXPECT_EQ(cudawait::classify(host.data()), memory_kind::pinned);
    EXPECT_EQ(cudawait::classify(host.data() + n / 2), memory_kind::pinned);

    cudawait::stream s;
    cudawait::device_buffer<float> dev(n, s);
    const auto before = cudawait::default_pinned_pool().stats();
    auto plan = cudawait::detail::make_plan(dev, reg_in.span(), cudawait::copy_options{});
    EXPECT_EQ(plan.src_kind, memory_kind::pinned);
    EXPECT_FALSE(plan.staged());
    plan = cudawait::detail::make_plan(dev, std::span<const float>(host), {});
    EXPECT_EQ(plan.src_kind, memory_kind::pinned) << "asked of the driver";
    EXPECT_FALSE(plan.staged());

    // Up with copy_async on the registered span, back with an awaited copy into a plain span.
    cudawait::copy_async(dev, reg_in.span(), s);
    cudawait::scheduler sched;
    cudawait::sync_wait(sched, cudawait::copy(std::span<float>(back), dev, s));
    for (std::size_t i = 0; i < n; ++i) {
        ASSERT_EQ(back[i], host[i]) << "element " << i;
    }
    // And a registered span as the destination, from poisoned memory.
    std::fill(back.begin(), back.end(), -2.0f);
    cudawait::sync_wait(sched, cudawait::copy(reg_back.span(), dev, s));
    for (std::size_t i = 0; i < n; ++i) {
        ASSERT_EQ(back[i], host[i]) << "element " << i;
    }
    // Nothing was staged: no chunk was taken from the staging pool.
    const auto after = cudawait::default_pinned_pool().stats();
    EXPECT_EQ(after.hits + after.misses, before.hits + before.misses) << "a copy was staged";
    s.sync();
}

TEST_F(host_registration_gpu, registering_twice_is_a_cuda_error_that_leaves_no_error_behind) {
    std::vector<float> v(1 << 16, 1.0f);
    host_registration first(v);
    try {
        host_registration second(v);
        ADD_FAILURE() << "no exception";
    } catch (const cudawait::cuda_error& e) {
        EXPECT_EQ(e.status(), cudaErrorHostMemoryAlreadyRegistered) << e.what();
    }
    // Part of the range also counts.
    try {
        host_registration part(std::span<float>(v).subspan(1024, 4096));
        ADD_FAILURE() << "no exception for a part of the range";
    } catch (const cudawait::cuda_error& e) {
        EXPECT_EQ(e.status(), cudaErrorHostMemoryAlreadyRegistered) << e.what();
    }
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
    EXPECT_EQ(cudawait::classify(v.data()), memory_kind::pinned) << "the first one still holds";
}

TEST_F(host_registration_gpu, moves_keep_one_registration_and_destruction_unregisters) {
    std::vector<float> v(1 << 16, 2.0f);
    {
        host_registration a(v);
        host_registration b(std::move(a));
        EXPECT_FALSE(a); // NOLINT(bugprone-use-after-move): moved-from is empty by contract
        EXPECT_TRUE(b);
        EXPECT_EQ(b.data(), v.data());
        host_registration<float> c;
        c = std::move(b);
        EXPECT_FALSE(b); // NOLINT(bugprone-use-after-move)
        EXPECT_EQ(c.size(), v.size());
        EXPECT_EQ(cudawait::classify(v.data()), memory_kind::pinned);
    } // only c unregisters; a double unregister would report on stderr and leave an error
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
    EXPECT_EQ(cudawait::classify(v.data()), memory_kind::pageable);
    // Registering again works once the first is gone; so does reset() and a move-assignment
    // over a live registration (which unregisters the old range).
    host_registration again(v);
    EXPECT_EQ(cudawait::classify(v.data()), memory_kind::pinned);
    again.reset();
    EXPECT_FALSE(again);
    EXPECT_EQ(cudawait::classify(v.data()), memory_kind::pageable);
    std::vector<float> w(1 << 16, 3.0f);
    host_registration on_v(v);
    on_v = host_registration(w);
    EXPECT_EQ(cudawait::classify(v.data()), memory_kind::pageable);
    EXPECT_EQ(cudawait::classify(w.data()), memory_kind::pinned);
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

} // namespace
