// SPDX-License-Identifier: Apache-2.0
// The scheduler's stream waits against the fake CUDA runtime (tests/support/fake_cuda.hpp): which
// stream a wait's event is recorded on, per device and per thread, and handles reused by the
// driver. No GPU needed; these run under AddressSanitizer and ThreadSanitizer in CI.
#include <cudawait/core/scheduler.hpp>
#include <cudawait/core/sync_wait.hpp>
#include <cudawait/core/task.hpp>
#include <cudawait/core/when_all.hpp>
#include <cudawait/runtime/error.hpp>
#include <cudawait/runtime/stream.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <coroutine>
#include <cstddef>
#include <exception>
#include <stop_token>
#include <string>
#include <thread>

#include <cuda_runtime_api.h>

#include "fake_cuda.hpp"
#include <gtest/gtest.h>

namespace {

using namespace std::chrono_literals;
using cudawait::cuda_error;
using cudawait::scheduler;
using cudawait::stream_ref;
using cudawait::sync_wait;
using cudawait::task;
namespace fake = cudawait::fake_cuda;

class fake_runtime : public ::testing::Test {
protected:
    void SetUp() override {
        fake::reset();
        fake::set_device_count(2);
    }
    void TearDown() override {
        fake::release_all();
        fake::reset();
    }
};

// A coroutine of the user's own (not a library task): it awaits through sched.wait() on the
// thread it runs on.
struct bare {
    struct promise_type {
        bare get_return_object() { return {}; }
        std::suspend_never initial_suspend() noexcept { return {}; }
        std::suspend_never final_suspend() noexcept { return {}; }
        void return_void() noexcept {}
        void unhandled_exception() noexcept { std::terminate(); }
    };
};

// A thread with device 1 current awaits the legacy stream while the loop thread has device 0:
// the wait must capture the awaiting thread's stream (device 1's, which is hung), not the loop
// thread's, so the coroutine resumes only once device 1's work is released.
TEST_F(fake_runtime, an_await_from_another_thread_is_recorded_on_that_threads_stream) {
    for (cudaStream_t handle : {cudaStreamLegacy, cudaStreamPerThread}) {
        SCOPED_TRACE(handle == cudaStreamLegacy ? "legacy" : "per-thread");
        scheduler s;
        std::stop_source stop;
        std::jthread loop([&] { s.run(stop.get_token()); }); // device 0 current there
        std::atomic<bool> resumed{false};
        std::atomic<bool> threw{false};
        std::thread::id resumed_on;
        std::thread::id loop_id = loop.get_id();
        std::jthread user([&] {
            ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
            fake::hang(handle); // this thread's stream of device 1
            [](scheduler& sched, cudaStream_t h, std::atomic<bool>& done, std::atomic<bool>& err,
               std::thread::id& on) -> bare {
                try {
                    co_await sched.wait(stream_ref(h));
                } catch (const cuda_error&) {
                    err = true;
                }
                on = std::this_thread::get_id();
                done = true;
            }(s, handle, resumed, threw, resumed_on);
            std::this_thread::sleep_for(50ms);
            EXPECT_FALSE(resumed.load()) << "resumed before the awaited stream's work finished";
            fake::release(handle);
        });
        user.join();
        for (int i = 0; i < 400 && !resumed; ++i) {
            std::this_thread::sleep_for(5ms);
        }
        EXPECT_TRUE(resumed.load());
        EXPECT_FALSE(threw.load());
        EXPECT_EQ(resumed_on, loop_id);
        stop.request_stop();
    }
}

// The legacy stream is one handle for every device. Awaited with device 0 current and, while
// that wait is pending, with device 1 current, both awaits work and each resumes after its own
// device's work.
TEST_F(fake_runtime, the_legacy_stream_of_two_devices_is_awaited_as_two_streams) {
    scheduler s;
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
    fake::hang(cudaStreamLegacy); // device 0's
    int order = 0;
    int dev0_done = 0;
    int dev1_done = 0;
    std::string error;
    auto on = [](int dev, int& done, int& counter, std::string& err) -> task<void> {
        cudawait::check(cudaSetDevice(dev), "cudaSetDevice");
        try {
            co_await stream_ref(cudaStreamLegacy);
            done = ++counter;
        } catch (const cuda_error& e) {
            err = e.what(); // a device-0 event recorded on device 1's stream (400)
        }
        if (dev == 1) {
            cudawait::check(cudaSetDevice(0), "cudaSetDevice");
            fake::release(cudaStreamLegacy); // device 0's, now that device 1's await resumed
        }
    };
    sync_wait(s,
              cudawait::when_all(on(0, dev0_done, order, error), on(1, dev1_done, order, error)));
    EXPECT_EQ(error, "");
    EXPECT_EQ(dev1_done, 1);
    EXPECT_EQ(dev0_done, 2);
}

// A coroutine destroys the stream it awaited and creates one on another device, which the
// driver gives the same handle: its await must not find the first stream's queue.
TEST_F(fake_runtime, a_reused_stream_handle_of_another_device_is_a_new_stream) {
    fake::reuse_handles(true);
    scheduler s;
    auto body = []() -> task<bool> {
        cudaStream_t first = nullptr;
        cudawait::check(cudaSetDevice(0), "cudaSetDevice");
        cudawait::check(cudaStreamCreateWithFlags(&first, cudaStreamNonBlocking),
                        "cudaStreamCreateWithFlags");
        co_await stream_ref(first);
        cudawait::check(cudaStreamDestroy(first), "cudaStreamDestroy");
        cudaStream_t second = nullptr;
        cudawait::check(cudaSetDevice(1), "cudaSetDevice");
        cudawait::check(cudaStreamCreateWithFlags(&second, cudaStreamNonBlocking),
                        "cudaStreamCreateWithFlags");
        const bool reused = second == first;
        co_await stream_ref(second); // threw cudaEventRecord (400) with the old queue
        cudawait::check(cudaStreamDestroy(second), "cudaStreamDestroy");
        cudawait::check(cudaSetDevice(0), "cudaSetDevice");
        co_return reused;
    };
    EXPECT_TRUE(sync_wait(s, body())) << "the fake did not reuse the handle";
    EXPECT_EQ(fake::dead_handle_calls(), 0u);
}

// Host-function sentinels are armed only in a long wait (8 ms or more, with the coming sleep):
// while one is pending the device slows other streams' work, so a pipeline whose chunks complete
// every few milliseconds must never arm one. The policy below has its back-off at the longest at
// once, so a loop that armed sentinels by the back-off alone would arm them in the first sleep
// of any wait. The fake runtime refuses host functions: every attempt shows as a call.
cudawait::poll_policy sleeps_at_once() {
    cudawait::poll_policy p = cudawait::poll_policy::balanced();
    p.spin = p.yield = std::chrono::nanoseconds(0);
    p.sleep_min = p.sleep_max = std::chrono::microseconds(500);
    p.predict = false;
    return p;
}

task<void> await_stream(stream_ref s) { co_await s; }

// Host functions the loop tried to arm in one wait of about `d`.
std::size_t host_functions_armed_in_a_wait_of(std::chrono::milliseconds d) {
    const std::size_t before = fake::calls("cudaLaunchHostFunc");
    scheduler s(sleeps_at_once());
    cudawait::stream st;
    fake::hang(st.get());
    std::jthread releaser([&] {
        std::this_thread::sleep_for(d);
        fake::release(st.get());
    });
    sync_wait(s, await_stream(st));
    return fake::calls("cudaLaunchHostFunc") - before;
}

TEST_F(fake_runtime, host_function_sentinels_are_armed_only_in_a_long_wait) {
    // A short wait arms none; the smallest of three trials, so that one late release on a
    // loaded machine does not decide it (a loop arming by the back-off arms in every trial).
    std::size_t fewest = ~std::size_t{0};
    for (int trial = 0; trial < 3; ++trial) {
        fewest = std::min(fewest, host_functions_armed_in_a_wait_of(1ms));
    }
    EXPECT_EQ(fewest, 0u) << "host-function sentinels armed in a 1 ms wait";
    EXPECT_GE(host_functions_armed_in_a_wait_of(60ms), 1u)
        << "no host-function sentinel armed in a 60 ms wait";
}

} // namespace
