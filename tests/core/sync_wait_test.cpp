// SPDX-License-Identifier: Apache-2.0
#include <cudawait/core/scheduler.hpp>
#include <cudawait/core/sync_wait.hpp>
#include <cudawait/core/task.hpp>

#include <chrono>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>

#include "host_signal.hpp"
#include <gtest/gtest.h>

namespace {

using namespace std::chrono_literals;
using cudawait::scheduler;
using cudawait::sync_wait;
using cudawait::task;

task<std::string> greet(std::string who) {
    co_await cudawait::sleep_for(1ms);
    co_return "hello " + who;
}

TEST(sync_wait, returns_the_value) {
    scheduler s;
    EXPECT_EQ(sync_wait(s, greet("world")), "hello world");
}

TEST(sync_wait, returns_move_only_values) {
    scheduler s;
    auto make = []() -> task<std::unique_ptr<int>> { co_return std::make_unique<int>(3); };
    std::unique_ptr<int> p = sync_wait(s, make());
    ASSERT_TRUE(p);
    EXPECT_EQ(*p, 3);
}

TEST(sync_wait, rethrows_the_exception) {
    scheduler s;
    auto bad = []() -> task<int> {
        co_await cudawait::sleep_for(1ms);
        throw std::out_of_range("nope");
    };
    EXPECT_THROW(sync_wait(s, bad()), std::out_of_range);
}

TEST(sync_wait, accepts_plain_awaitables) {
    scheduler s;
    const auto t0 = std::chrono::steady_clock::now();
    sync_wait(s, cudawait::sleep_for(5ms));
    EXPECT_GE(std::chrono::steady_clock::now() - t0, 5ms);
}

TEST(sync_wait, can_be_called_repeatedly_on_one_scheduler) {
    scheduler s;
    for (int i = 0; i < 100; ++i) {
        EXPECT_EQ(sync_wait(s, greet(std::to_string(i))), "hello " + std::to_string(i));
    }
}

TEST(sync_wait, completes_when_the_task_finishes_on_another_thread) {
    // The task hops to a scheduler driven by another thread and finishes there; sync_wait's
    // thread must wake up and return.
    scheduler home;
    scheduler away;
    std::stop_source stop;
    std::jthread driver([&] { away.run(stop.get_token()); });
    auto wanderer = [&]() -> task<std::thread::id> {
        co_await away.schedule();
        co_return std::this_thread::get_id();
    };
    const auto finished_on = sync_wait(home, wanderer());
    EXPECT_NE(finished_on, std::this_thread::get_id());
    stop.request_stop();
}

TEST(sync_wait, other_work_progresses_meanwhile) {
    scheduler s;
    cudawait::testing::host_signal sig(s);
    bool side_done = false;
    auto side = [&]() -> task<> {
        co_await cudawait::sleep_for(2ms);
        side_done = true;
        sig.fire();
    };
    s.spawn(side());
    auto main_work = [&]() -> task<bool> {
        co_await sig;
        co_return side_done;
    };
    EXPECT_TRUE(sync_wait(s, main_work()));
}

} // namespace
