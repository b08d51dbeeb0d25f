// SPDX-License-Identifier: Apache-2.0
#include <cudawait/core/scheduler.hpp>
#include <cudawait/core/sync_wait.hpp>
#include <cudawait/core/task.hpp>
#include <cudawait/observe/watchdog.hpp>
#include <cudawait/runtime/device.hpp>
#include <cudawait/runtime/error.hpp>
#include <cudawait/runtime/stream.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include <cuda_runtime.h>

#include "gpu_fixture.hpp"
#include "mapped_words.hpp"
#include "test_kernels.hpp"
#include <gtest/gtest.h>

namespace {

using namespace std::chrono_literals;
using cudawait::check;
using cudawait::scheduler;
using cudawait::sleep_for;
using cudawait::stall_error;
using cudawait::stall_info;
using cudawait::stream;
using cudawait::sync_wait;
using cudawait::task;
using cudawait::watchdog;
using cudawait::watchdog_options;
using cudawait::testing::mapped_words;
using clock_type = std::chrono::steady_clock;

// ---- host logic (runs without a GPU) --------------------------------------------------------

TEST(watchdog, stall_error_carries_device_and_duration) {
    static_assert(std::is_base_of_v<std::runtime_error, stall_error>);
    stall_error e(3, 250ms);
    EXPECT_EQ(e.device(), 3);
    EXPECT_EQ(e.stalled_for(), 250ms);
    EXPECT_NE(std::string(e.what()).find("device 3"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("250000000 ns"), std::string::npos);
}

TEST(watchdog, rejects_a_window_that_is_not_positive) {
    scheduler s;
    watchdog_options o;
    o.window = 0ns;
    EXPECT_THROW(watchdog(s, o), cudawait::usage_error);
}

TEST(watchdog, its_timer_is_no_pending_work) {
    // The periodic check must not keep run() going nor count as a pending timer.
    scheduler s;
    std::atomic<int> calls{0};
    watchdog_options o;
    o.window = 8ms;
    o.on_stall = [&](const stall_info&) { ++calls; };
    watchdog wd(s, o);
    EXPECT_EQ(s.pending().timers, 0u);
    bool done = false;
    s.spawn([](bool& d) -> task<void> {
        co_await sleep_for(40ms); // ticks every 250 us meanwhile
        d = true;
    }(done));
    const auto t0 = clock_type::now();
    s.run();
    EXPECT_TRUE(done);
    EXPECT_LT(clock_type::now() - t0, 2s);
    EXPECT_EQ(s.pending().timers, 0u);
    // No GPU work was pending: nothing to report, and no CUDA call was needed.
    EXPECT_EQ(wd.stalls(), 0u);
    EXPECT_EQ(calls.load(), 0);
}

TEST(watchdog, destroyed_before_its_scheduler_runs_again) {
    scheduler s;
    { watchdog wd(s, {}); }
    int v = 0;
    s.spawn([](int& out) -> task<void> {
        co_await sleep_for(1ms);
        out = 7;
    }(v));
    s.run();
    EXPECT_EQ(v, 7);
}

// ---- on a GPU -------------------------------------------------------------------------------

using watchdog_gpu = cudawait::testing::gpu_test;

constexpr auto kWindow = 200ms;
constexpr std::uint64_t kSafetyNs = 20'000'000'000ull; // kernels give up after 20 s regardless
// How late a report may come, measured from the launch. The watchdog counts a stall from the
// first check that sees the await pending (stalled_for stays within 1.1 windows); that check can
// come late where the loop's first driver calls of the wait (the sentinel stream it creates)
// block behind other processes' context creation, as under a parallel ctest: up to 37 ms seen.
constexpr double kLateReport = 1.25;

double ms(clock_type::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

TEST_F(watchdog_gpu, reports_a_kernel_spinning_on_a_flag_once_within_the_window) {
    mapped_words flag(1);
    flag.host[0] = 0;
    stream st;
    std::vector<stall_info> stalls;
    clock_type::time_point reported_at{};
    {
        scheduler s;
        watchdog_options o;
        o.window = kWindow;
        o.heartbeat = false; // a one-block kernel: only completions count as progress
        o.on_stall = [&](const stall_info& info) {
            reported_at = clock_type::now();
            stalls.push_back(info);
            flag.host[0] = 1; // lets the kernel end: the await then completes normally
        };
        watchdog wd(s, o);
        clock_type::time_point launched{};
        auto body = [&]() -> task<bool> {
            check(cudawait::testing::launch_wait_flag(flag.device, kSafetyNs, st.get()),
                  "launch_wait_flag");
            // After the launch: its first call loads the kernel's module, which is no stall.
            launched = clock_type::now();
            co_await st;
            co_return true;
        };
        EXPECT_TRUE(sync_wait(s, body()));
        ASSERT_EQ(stalls.size(), 1u);
        EXPECT_EQ(wd.stalls(), 1u);
        const double after = ms(reported_at - launched);
        EXPECT_GE(after, ms(kWindow));
        EXPECT_LE(after, kLateReport * ms(kWindow));
        EXPECT_EQ(stalls[0].device, 0);
        EXPECT_EQ(stalls[0].pending_awaits, 1u);
        ASSERT_EQ(stalls[0].streams.size(), 1u);
        EXPECT_EQ(stalls[0].streams[0], st.get());
        EXPECT_GE(stalls[0].stalled_for, kWindow);
        EXPECT_LE(ms(stalls[0].stalled_for), 1.1 * ms(kWindow));
        // Quiet afterwards: progress re-armed it and nothing is pending.
        sync_wait(s, []() -> task<void> { co_await sleep_for(2 * kWindow); }());
        EXPECT_EQ(wd.stalls(), 1u);
    }
    EXPECT_EQ(cudaStreamSynchronize(st.get()), cudaSuccess);
}

TEST_F(watchdog_gpu, fails_the_await_of_a_stalled_kernel_with_stall_error) {
    mapped_words flag(1);
    flag.host[0] = 0;
    stream st;
    std::size_t reports = 0;
    {
        scheduler s;
        {
            watchdog_options o;
            o.window = kWindow;
            o.heartbeat = false; // a one-block kernel: only completions count as progress
            o.fail_awaits = true;
            o.on_stall = [&](const stall_info&) { ++reports; };
            watchdog wd(s, o);
            clock_type::time_point launched{};
            clock_type::time_point failed_at{};
            int device = -1;
            std::chrono::nanoseconds stalled_for{0};
            auto body = [&]() -> task<bool> {
                check(cudawait::testing::launch_wait_flag(flag.device, kSafetyNs, st.get()),
                      "launch_wait_flag");
                launched = clock_type::now(); // after the module's load, as above
                try {
                    co_await st;
                } catch (const stall_error& e) {
                    failed_at = clock_type::now();
                    device = e.device();
                    stalled_for = e.stalled_for();
                    co_return true;
                }
                co_return false;
            };
            EXPECT_TRUE(sync_wait(s, body()));
            EXPECT_EQ(reports, 1u);
            EXPECT_EQ(device, 0);
            EXPECT_GE(stalled_for, kWindow);
            EXPECT_GE(ms(failed_at - launched), ms(kWindow));
            EXPECT_LE(ms(failed_at - launched), kLateReport * ms(kWindow));
            // The failed await's event is still tracked: the kernel has not finished.
            EXPECT_EQ(s.pending().stream_waits, 1u);
            EXPECT_EQ(cudaStreamQuery(st.get()), cudaErrorNotReady);
            flag.host[0] = 1;
            s.run(); // drains the failed await's event
            EXPECT_EQ(s.pending().stream_waits, 0u);
            EXPECT_EQ(wd.stalls(), 1u);
        } // the heartbeat may still be in flight: a task on `s` keeps it until it ran
        s.run();
    }
    EXPECT_EQ(cudaStreamSynchronize(st.get()), cudaSuccess);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

TEST_F(watchdog_gpu, heartbeat_keeps_a_long_one_block_kernel_from_being_reported) {
    mapped_words out(1);
    stream st;
    const std::uint32_t value = 0x5EED1234u;
    {
        scheduler s;
        watchdog_options o;
        o.window = kWindow;
        o.heartbeat = true;
        o.fail_awaits = true;
        std::size_t reports = 0;
        o.on_stall = [&](const stall_info&) { ++reports; };
        {
            watchdog wd(s, o);
            auto body = [&]() -> task<bool> {
                const auto spin_ns = static_cast<std::uint64_t>(
                    std::chrono::duration_cast<std::chrono::nanoseconds>(2 * kWindow).count());
                check(cudawait::testing::launch_spin(spin_ns, out.device, value, st.get()),
                      "launch_spin");
                co_await st; // would throw stall_error if reported
                co_return true;
            };
            EXPECT_TRUE(sync_wait(s, body()));
            EXPECT_EQ(out.host[0], value);
            EXPECT_EQ(reports, 0u);
            EXPECT_EQ(wd.stalls(), 0u);
        }
        s.run();
    }
}

// The heartbeat of a device other than the loop thread's current one: launched with its own
// device current, it keeps a long one-block kernel there from being reported.
TEST_F(watchdog_gpu, heartbeat_on_a_device_that_is_not_current_keeps_its_kernel_unreported) {
    if (cudawait::device_count() < 2) {
        GTEST_SKIP() << "needs two devices (the watched one must not be the current one)";
    }
    const cudawait::device_ref watched(1);
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
    mapped_words out(1);
    stream st(watched);
    const std::uint32_t value = 0x1DE7A11u;
    const std::uint64_t beats_before = cudawait::detail::heartbeat_kernel::for_device(1).beats();
    std::size_t reports = 0;
    {
        scheduler s;
        watchdog_options o;
        o.window = kWindow;
        o.heartbeat = true;
        o.fail_awaits = true;
        o.on_stall = [&](const stall_info&) { ++reports; };
        {
            watchdog wd(s, o);
            auto body = [&]() -> task<bool> {
                const auto spin_ns = static_cast<std::uint64_t>(
                    std::chrono::duration_cast<std::chrono::nanoseconds>(2 * kWindow).count());
                {
                    cudawait::device_guard on(watched); // the runtime launches on the current one
                    check(cudawait::testing::launch_spin(spin_ns, out.device, value, st.get()),
                          "launch_spin");
                }
                EXPECT_EQ(cudawait::current_device().get(), 0);
                co_await st; // would throw stall_error if reported
                co_return true;
            };
            EXPECT_TRUE(sync_wait(s, body()));
            EXPECT_EQ(out.host[0], value);
            EXPECT_EQ(reports, 0u);
            EXPECT_EQ(wd.stalls(), 0u);
            EXPECT_EQ(cudawait::current_device().get(), 0) << "the watchdog restored it";
        }
        s.run();
    }
    EXPECT_GT(cudawait::detail::heartbeat_kernel::for_device(1).beats(), beats_before)
        << "device 1's heartbeat ran";
    EXPECT_EQ(cudaStreamSynchronize(st.get()), cudaSuccess);
}

} // namespace
