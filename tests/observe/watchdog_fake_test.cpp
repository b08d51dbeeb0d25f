// SPDX-License-Identifier: Apache-2.0
// The watchdog against the fake CUDA runtime (tests/support/fake_cuda.hpp): a hung stream, no
// GPU. Runs under AddressSanitizer and ThreadSanitizer in CI.
#include <cudawait/core/scheduler.hpp>
#include <cudawait/core/sync_wait.hpp>
#include <cudawait/core/task.hpp>
#include <cudawait/core/when_all.hpp>
#include <cudawait/observe/watchdog.hpp>
#include <cudawait/runtime/error.hpp>
#include <cudawait/runtime/stream.hpp>

#include <chrono>

#include <cuda_runtime_api.h>

#include "fake_cuda.hpp"
#include <gtest/gtest.h>

namespace {

using namespace std::chrono_literals;
using cudawait::poll_policy;
using cudawait::scheduler;
using cudawait::stall_error;
using cudawait::stream;
using cudawait::sync_wait;
using cudawait::task;
using cudawait::watchdog;
using cudawait::watchdog_options;
namespace fake = cudawait::fake_cuda;

class fake_runtime : public ::testing::Test {
protected:
    void SetUp() override { fake::reset(); }
    void TearDown() override {
        fake::release_all();
        fake::reset();
    }
};

// The coroutine that owns the watchdog is the one whose await it fails: it unwinds and destroys
// the watchdog. That must not happen inside the watchdog's own timer callback (which would then
// go on with freed memory and re-arm a timer pointing at it).
TEST_F(fake_runtime, a_coroutine_owning_the_watchdog_may_destroy_it_when_its_await_fails) {
    scheduler s(poll_policy::sleeping());
    stream st;
    fake::hang(st.get());
    int failed_device = -1;
    auto body = [](scheduler& sched, stream& hung, int& device) -> task<int> {
        watchdog_options o;
        o.window = 20ms;
        o.heartbeat = false;
        o.fail_awaits = true;
        watchdog wd(sched, o);
        try {
            co_await hung;
        } catch (const stall_error& e) {
            device = e.device();
            co_return 1;
        }
        co_return 0;
    };
    EXPECT_EQ(sync_wait(s, body(s, st, failed_device)), 1);
    EXPECT_EQ(failed_device, 0);
    // The failed await's event stays queued until the stream's work completes.
    EXPECT_EQ(s.pending().stream_waits, 1u);
    fake::release(st.get());
    s.run();
    EXPECT_EQ(s.pending().stream_waits, 0u);
    // Nothing the destroyed watchdog left behind fires later.
    sync_wait(s, []() -> task<void> { co_await cudawait::sleep_for(60ms); }());
}

// Two stalled awaits on one device each get a stall_error with that device's record.
TEST_F(fake_runtime, every_failed_await_reads_its_own_stall_record) {
    scheduler s(poll_policy::sleeping());
    stream a;
    stream b;
    fake::hang(a.get());
    fake::hang(b.get());
    watchdog_options o;
    o.window = 20ms;
    o.heartbeat = false;
    o.fail_awaits = true;
    watchdog wd(s, o);
    auto wait_on = [](stream& st) -> task<int> {
        try {
            co_await st;
        } catch (const stall_error& e) {
            co_return e.device() == 0 && e.stalled_for() >= 20ms ? 1 : 0;
        }
        co_return 0;
    };
    auto both = [&]() -> task<int> {
        auto [x, y] = co_await cudawait::when_all(wait_on(a), wait_on(b));
        co_return x + y;
    };
    EXPECT_EQ(sync_wait(s, both()), 2);
    fake::release_all();
    s.run();
}

} // namespace
