// SPDX-License-Identifier: Apache-2.0
#include <cudawait/event.hpp>

#include "gpu_fixture.hpp"
#include "test_kernels.hpp"

#include <cstdint>
#include <set>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include <cuda_runtime.h>
#include <gtest/gtest.h>

namespace {

using cudawait::check;
using cudawait::event;
using cudawait::event_pool;
using cudawait::event_ref;
using cudawait::pooled_event;
using cudawait::stream;
using cudawait::usage_error;

static_assert(std::is_trivially_copyable_v<event_ref>);
static_assert(!std::is_constructible_v<event_ref, int>);
static_assert(!std::is_constructible_v<event_ref, std::nullptr_t>);
static_assert(!std::is_copy_constructible_v<event>);
static_assert(!std::is_copy_constructible_v<pooled_event>);
static_assert(std::is_nothrow_move_constructible_v<event>);

TEST(event, adopting_a_null_handle_is_a_usage_error) {
    EXPECT_THROW((void)event::from_native_handle(nullptr), usage_error);
    pooled_event empty;
    EXPECT_FALSE(static_cast<bool>(empty));
    EXPECT_THROW((void)empty.get(), usage_error);
}

class event_gpu : public cudawait::testing::gpu_test {};

TEST_F(event_gpu, records_and_reports_completion) {
    stream s;
    event e;
    EXPECT_TRUE(e.ready()) << "a never-recorded event counts as complete";
    check(cudawait::testing::launch_spin(30'000'000, nullptr, 0, s.get()), "launch");
    e.record(s);
    EXPECT_FALSE(e.ready());
    e.sync();
    EXPECT_TRUE(e.ready());
    EXPECT_TRUE(event_ref(e).ready());
}

TEST_F(event_gpu, timing_disabled_by_default) {
    stream s;
    event a;
    event b;
    a.record(s);
    b.record(s);
    b.sync();
    float ms = 0;
    EXPECT_EQ(cudaEventElapsedTime(&ms, a.get(), b.get()), cudaErrorInvalidResourceHandle);
    (void)cudaGetLastError();
    event ta(cudawait::device_ref(0), cudaEventDefault);
    event tb(cudawait::device_ref(0), cudaEventDefault);
    ta.record(s);
    check(cudawait::testing::launch_spin(2'000'000, nullptr, 0, s.get()), "launch");
    tb.record(s);
    tb.sync();
    ASSERT_EQ(cudaEventElapsedTime(&ms, ta.get(), tb.get()), cudaSuccess);
    EXPECT_GE(ms, 1.5f);
}

TEST_F(event_gpu, moves_do_not_leak_and_moved_from_is_a_usage_error) {
    const long before = event::live_count();
    event a;
    event b;
    cudaEvent_t ha = a.get();
    b = std::move(a);
    EXPECT_EQ(event::live_count(), before + 1);
    EXPECT_EQ(b.get(), ha);
    EXPECT_THROW((void)a.get(), usage_error);
    EXPECT_THROW((void)a.ready(), usage_error);
    cudaEvent_t raw = b.release();
    EXPECT_EQ(event::live_count(), before);
    event adopted = event::from_native_handle(raw);
    EXPECT_EQ(event::live_count(), before + 1);
}

TEST_F(event_gpu, pool_recycles_events) {
    event_pool& pool = event_pool::for_device(0);
    const long outstanding = pool.outstanding();
    std::set<cudaEvent_t> first;
    {
        std::vector<pooled_event> v;
        for (int i = 0; i < 16; ++i) {
            v.push_back(pool.acquire());
            first.insert(v.back().get());
        }
        EXPECT_EQ(first.size(), 16u);
        EXPECT_EQ(pool.outstanding(), outstanding + 16);
    }
    EXPECT_EQ(pool.outstanding(), outstanding);
    EXPECT_GE(pool.cached(), 16u);
    const long live = event::live_count();
    std::vector<pooled_event> again;
    for (int i = 0; i < 16; ++i) {
        again.push_back(pool.acquire());
    }
    EXPECT_EQ(event::live_count(), live) << "a warm pool creates no events";
    // Pooled events skip timing and work like any other.
    stream s;
    again[0].record(s);
    s.sync();
    EXPECT_TRUE(again[0].ready());
}

TEST_F(event_gpu, pool_is_thread_safe) {
    event_pool& pool = event_pool::for_device(0);
    const long outstanding = pool.outstanding();
    std::vector<std::thread> threads;
    for (int t = 0; t < 8; ++t) {
        threads.emplace_back([&pool] {
            for (int i = 0; i < 2000; ++i) {
                pooled_event e = pool.acquire();
                ASSERT_TRUE(static_cast<bool>(e));
            }
        });
    }
    for (auto& t : threads) {
        t.join();
    }
    EXPECT_EQ(pool.outstanding(), outstanding);
}

TEST_F(event_gpu, pool_for_a_bad_device_is_a_typed_error) {
    EXPECT_THROW((void)event_pool::for_device(-1), cudawait::cuda_error);
    EXPECT_THROW((void)event_pool::for_device(cudawait::device_count()), cudawait::cuda_error);
}

} // namespace
