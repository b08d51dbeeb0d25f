// SPDX-License-Identifier: Apache-2.0
#include <cudawait/runtime/event.hpp>

#include <cstdint>
#include <set>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include <cuda_runtime.h>

#include "gpu_fixture.hpp"
#include "test_kernels.hpp"
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
static_assert(sizeof(event_ref) == sizeof(cudaEvent_t), "the operations add no state");

TEST(event, adopting_a_null_handle_is_a_usage_error) {
    EXPECT_THROW((void)event::from_native_handle(nullptr), usage_error);
    pooled_event empty;
    EXPECT_FALSE(static_cast<bool>(empty));
    EXPECT_THROW((void)empty.get(), usage_error);
}

// Every operation of an empty owner throws before any CUDA call (so this runs without a device,
// and no null event ever reaches the driver).
template <class E>
void expect_every_operation_throws(const E& e) {
    const auto s = cudawait::stream_ref(reinterpret_cast<cudaStream_t>(std::uintptr_t{0x5EED}));
    EXPECT_FALSE(static_cast<bool>(e));
    EXPECT_THROW((void)e.get(), usage_error);
    EXPECT_THROW((void)event_ref(e), usage_error);
    EXPECT_THROW(e.record(s), usage_error);
    EXPECT_THROW((void)e.is_done(), usage_error);
    EXPECT_THROW(e.sync(), usage_error);
}

TEST(event, every_operation_of_a_moved_from_or_released_event_is_a_usage_error) {
    const long before = event::live_count();
    auto fake = reinterpret_cast<cudaEvent_t>(std::uintptr_t{0xE7});
    event owner = event::from_native_handle(fake);
    event moved(std::move(owner));
    {
        SCOPED_TRACE("moved from");
        expect_every_operation_throws(owner); // NOLINT(bugprone-use-after-move)
    }
    EXPECT_EQ(moved.release(), fake);
    {
        SCOPED_TRACE("released");
        expect_every_operation_throws(moved);
    }
    EXPECT_EQ(event::live_count(), before);
}

TEST(event, every_operation_of_an_empty_or_moved_from_pooled_event_is_a_usage_error) {
    pooled_event empty;
    {
        SCOPED_TRACE("default constructed");
        expect_every_operation_throws(empty);
    }
    pooled_event moved(std::move(empty));
    {
        SCOPED_TRACE("moved from");
        expect_every_operation_throws(empty); // NOLINT(bugprone-use-after-move)
    }
    moved.reset();
    {
        SCOPED_TRACE("reset");
        expect_every_operation_throws(moved);
    }
}

class event_gpu : public cudawait::testing::gpu_test {};

TEST_F(event_gpu, records_and_reports_completion) {
    stream s;
    event e;
    EXPECT_TRUE(e.is_done()) << "a never-recorded event counts as complete";
    check(cudawait::testing::launch_spin(30'000'000, nullptr, 0, s.get()), "launch");
    e.record(s);
    EXPECT_FALSE(e.is_done()) << "the kernel spins for 30 ms";
    EXPECT_FALSE(event_ref(e).is_done());
    e.sync();
    EXPECT_TRUE(e.is_done());
    EXPECT_TRUE(event_ref(e).is_done());
}

TEST_F(event_gpu, a_pooled_event_and_a_view_record_wait_and_report_completion) {
    stream s;
    pooled_event pe = event_pool::for_device(0).acquire();
    check(cudawait::testing::launch_spin(30'000'000, nullptr, 0, s.get()), "launch");
    pe.record(s);
    EXPECT_FALSE(pe.is_done()) << "the kernel spins for 30 ms";
    pe.sync();
    EXPECT_TRUE(pe.is_done());
    // Recorded through a view, the owner sees the new capture.
    const event_ref view(pe);
    check(cudawait::testing::launch_spin(30'000'000, nullptr, 0, s.get()), "launch");
    view.record(s);
    EXPECT_FALSE(view.is_done());
    EXPECT_FALSE(pe.is_done());
    view.sync();
    EXPECT_TRUE(view.is_done());
    EXPECT_TRUE(pe.is_done());
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
    EXPECT_THROW((void)a.is_done(), usage_error);
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
    EXPECT_TRUE(again[0].is_done());
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
