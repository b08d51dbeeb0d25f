// SPDX-License-Identifier: Apache-2.0
#include <cudawait/core/scheduler.hpp>
#include <cudawait/core/scope.hpp>
#include <cudawait/core/sync_wait.hpp>
#include <cudawait/core/task.hpp>

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

namespace {

using namespace std::chrono_literals;
using cudawait::async_scope;
using cudawait::scheduler;
using cudawait::sync_wait;
using cudawait::task;

task<> tick(std::atomic<int>* counter, std::chrono::microseconds d) {
    co_await cudawait::sleep_for(d);
    counter->fetch_add(1);
}

task<> boom(std::string msg, std::chrono::milliseconds d) {
    co_await cudawait::sleep_for(d);
    throw std::runtime_error(msg);
}

TEST(scope, join_waits_for_every_spawned_task) {
    scheduler s;
    async_scope scope(s);
    std::atomic<int> counter{0};
    auto body = [&]() -> task<int> {
        for (int i = 0; i < 100; ++i) {
            scope.spawn(tick(&counter, std::chrono::microseconds(100 * (i % 10))));
        }
        co_await scope.join();
        co_return counter.load();
    };
    EXPECT_EQ(sync_wait(s, body()), 100);
    EXPECT_EQ(scope.active(), 0u);
}

TEST(scope, join_on_an_empty_scope_completes_at_once) {
    scheduler s;
    async_scope scope(s);
    auto body = [&]() -> task<bool> {
        co_await scope.join();
        co_return true;
    };
    EXPECT_TRUE(sync_wait(s, body()));
}

TEST(scope, join_reports_exceptions_after_everything_finished) {
    scheduler s;
    async_scope scope(s);
    std::atomic<int> counter{0};
    auto body = [&]() -> task<std::string> {
        scope.spawn(boom("early", 1ms));
        scope.spawn(tick(&counter, 30ms));
        scope.spawn(boom("late", 10ms));
        try {
            co_await scope.join();
        } catch (const std::runtime_error& e) {
            co_return std::string(e.what()) + "/" + std::to_string(counter.load());
        }
        co_return "no error";
    };
    EXPECT_EQ(sync_wait(s, body()), "early/1");
    ASSERT_EQ(scope.errors().size(), 2u);
    // The scope is reusable, and old errors are not reported again.
    auto again = [&]() -> task<int> {
        scope.spawn(tick(&counter, 1ms));
        co_await scope.join();
        co_return counter.load();
    };
    EXPECT_EQ(sync_wait(s, again()), 2);
}

TEST(scope, spawn_is_thread_safe) {
    scheduler s;
    async_scope scope(s);
    std::atomic<int> counter{0};
    std::atomic<int> spawned{0};
    {
        std::vector<std::jthread> threads;
        for (int t = 0; t < 6; ++t) {
            threads.emplace_back([&] {
                for (int i = 0; i < 200; ++i) {
                    scope.spawn(tick(&counter, std::chrono::microseconds(i % 50)));
                    spawned.fetch_add(1);
                }
            });
        }
    }
    auto body = [&]() -> task<int> {
        co_await scope.join();
        co_return counter.load();
    };
    EXPECT_EQ(sync_wait(s, body()), 1200);
    EXPECT_EQ(spawned.load(), 1200);
}

TEST(scope, destroying_a_busy_scope_does_not_crash) {
    scheduler s;
    std::atomic<int> counter{0};
    {
        async_scope scope(s);
        scope.spawn(tick(&counter, 5ms));
    } // reported on stderr; the work keeps running on the scheduler
    s.run();
    EXPECT_EQ(counter.load(), 1);
}

} // namespace
