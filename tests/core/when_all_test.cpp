// SPDX-License-Identifier: Apache-2.0
#include <cudawait/core/scheduler.hpp>
#include <cudawait/core/sync_wait.hpp>
#include <cudawait/core/task.hpp>
#include <cudawait/core/when_all.hpp>

#include <chrono>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <variant>
#include <vector>

#include "host_signal.hpp"
#include <gtest/gtest.h>

namespace {

using namespace std::chrono_literals;
using cudawait::scheduler;
using cudawait::sync_wait;
using cudawait::task;
using cudawait::when_all;

task<int> after(std::chrono::milliseconds d, int v, std::vector<int>* finished = nullptr) {
    co_await cudawait::sleep_for(d);
    if (finished != nullptr) {
        finished->push_back(v);
    }
    co_return v;
}

task<> fail_after(std::chrono::milliseconds d, std::string msg, std::vector<int>* finished) {
    co_await cudawait::sleep_for(d);
    finished->push_back(-1);
    throw std::runtime_error(msg);
}

TEST(when_all, variadic_returns_every_result_in_argument_order) {
    scheduler s;
    auto str = []() -> task<std::string> { co_return "x"; };
    auto nothing = []() -> task<> { co_return; };
    auto result = sync_wait(s, when_all(after(20ms, 1), str(), nothing(), after(1ms, 4)));
    static_assert(
        std::is_same_v<decltype(result), std::tuple<int, std::string, std::monostate, int>>);
    EXPECT_EQ(std::get<0>(result), 1);
    EXPECT_EQ(std::get<1>(result), "x");
    EXPECT_EQ(std::get<3>(result), 4);
}

TEST(when_all, children_run_concurrently) {
    scheduler s;
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<task<int>> ts;
    for (int i = 0; i < 50; ++i) {
        ts.push_back(after(40ms, i));
    }
    auto values = sync_wait(s, when_all(std::move(ts)));
    const auto took = std::chrono::steady_clock::now() - t0;
    ASSERT_EQ(values.size(), 50u);
    for (int i = 0; i < 50; ++i) {
        EXPECT_EQ(values[i], i);
    }
    EXPECT_LT(took, 40ms * 10) << "50 sleeps of 40 ms must overlap";
}

TEST(when_all, range_of_void_tasks) {
    scheduler s;
    int count = 0;
    auto bump = [&count]() -> task<> {
        co_await cudawait::sleep_for(1ms);
        ++count;
    };
    std::vector<task<>> ts;
    for (int i = 0; i < 10; ++i) {
        ts.push_back(bump());
    }
    static_assert(std::is_same_v<decltype(when_all(std::move(ts))), task<void>>);
    std::vector<task<>> ts2;
    for (int i = 0; i < 10; ++i) {
        ts2.push_back(bump());
    }
    sync_wait(s, when_all(std::move(ts2)));
    EXPECT_EQ(count, 10);
}

TEST(when_all, first_exception_propagates_after_all_children_finished) {
    scheduler s;
    std::vector<int> finished;
    auto body = [&]() -> task<> {
        co_await when_all(fail_after(5ms, "first", &finished), after(40ms, 7, &finished),
                          fail_after(20ms, "second", &finished));
    };
    try {
        sync_wait(s, body());
        FAIL() << "no exception";
    } catch (const std::runtime_error& e) {
        EXPECT_STREQ(e.what(), "first");
    }
    // The slow, successful child had finished before the exception surfaced.
    EXPECT_EQ(finished, (std::vector<int>{-1, -1, 7}));
}

TEST(when_all, empty_inputs_complete_at_once) {
    scheduler s;
    auto empty = sync_wait(s, when_all());
    static_assert(std::is_same_v<decltype(empty), std::tuple<>>);
    std::vector<task<int>> none;
    EXPECT_TRUE(sync_wait(s, when_all(std::move(none))).empty());
}

TEST(when_all, synchronously_completing_children) {
    scheduler s;
    auto now = [](int v) -> task<int> { co_return v; };
    std::vector<task<int>> ts;
    for (int i = 0; i < 1000; ++i) {
        ts.push_back(now(i));
    }
    auto v = sync_wait(s, when_all(std::move(ts)));
    ASSERT_EQ(v.size(), 1000u);
    for (int i = 0; i < 1000; ++i) {
        ASSERT_EQ(v[i], i);
    }
}

TEST(when_all, children_completed_from_other_threads) {
    scheduler s;
    std::vector<std::unique_ptr<cudawait::testing::host_signal>> sigs;
    for (int i = 0; i < 8; ++i) {
        sigs.push_back(std::make_unique<cudawait::testing::host_signal>(s));
    }
    auto wait_for = [](cudawait::testing::host_signal* sig, int v) -> task<int> {
        co_await *sig;
        co_return v* v;
    };
    std::vector<task<int>> ts;
    for (int i = 0; i < 8; ++i) {
        ts.push_back(wait_for(sigs[i].get(), i));
    }
    std::vector<std::jthread> firers;
    for (int i = 0; i < 8; ++i) {
        firers.emplace_back([&sigs, i] {
            std::this_thread::sleep_for(std::chrono::milliseconds(1 + i));
            sigs[i]->fire();
        });
    }
    auto v = sync_wait(s, when_all(std::move(ts)));
    for (int i = 0; i < 8; ++i) {
        EXPECT_EQ(v[i], i * i);
    }
}

TEST(when_all, accepts_plain_awaitables) {
    scheduler s;
    auto r = sync_wait(s, when_all(cudawait::sleep_for(2ms), after(1ms, 9)));
    EXPECT_EQ(std::get<1>(r), 9);
}

} // namespace
