// SPDX-License-Identifier: Apache-2.0
#include <cudawait/core/scheduler.hpp>
#include <cudawait/core/sync_wait.hpp>
#include <cudawait/core/task.hpp>

#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

#include "this_scheduler_cases.hpp"
#include <gtest/gtest.h>

namespace {

using cudawait::scheduler;
using cudawait::sync_wait;
using cudawait::task;
using cudawait::usage_error;

static_assert(!std::is_copy_constructible_v<task<int>>);
static_assert(std::is_nothrow_move_constructible_v<task<int>>);

task<int> answer(int* runs) {
    ++*runs;
    co_return 42;
}

task<int> add(int a, int b) { co_return a + b; }

task<int> sum_of_three() {
    int a = co_await add(1, 2);
    int b = co_await add(a, 3);
    co_return a + b;
}

task<> fails(std::string msg) {
    throw std::runtime_error(msg);
    co_return;
}

task<std::unique_ptr<int>> move_only_result(int v) { co_return std::make_unique<int>(v); }

task<long> chain(int depth) {
    if (depth == 0) {
        co_return 0;
    }
    co_return 1 + co_await chain(depth - 1);
}

TEST(task, is_lazy_until_awaited) {
    scheduler s;
    int runs = 0;
    task<int> t = answer(&runs);
    EXPECT_EQ(runs, 0);
    EXPECT_TRUE(t.valid());
    EXPECT_FALSE(t.done());
    EXPECT_EQ(sync_wait(s, std::move(t)), 42);
    EXPECT_EQ(runs, 1);
}

TEST(task, values_flow_through_nested_awaits) {
    scheduler s;
    EXPECT_EQ(sync_wait(s, sum_of_three()), 9);
    EXPECT_EQ(*sync_wait(s, move_only_result(7)), 7);
}

TEST(task, exceptions_rethrow_at_the_await) {
    scheduler s;
    auto outer = []() -> task<std::string> {
        try {
            co_await fails("inner failure");
        } catch (const std::runtime_error& e) {
            co_return std::string("caught: ") + e.what();
        }
        co_return "not caught";
    };
    EXPECT_EQ(sync_wait(s, outer()), "caught: inner failure");
    EXPECT_THROW(sync_wait(s, fails("to the top")), std::runtime_error);
}

TEST(task, deep_chains_do_not_grow_the_stack) {
    // Symmetric transfer: each completion hands control straight to its awaiter. Without it a
    // chain this deep overflows the stack. Unoptimised and sanitised builds do not turn the
    // transfer into a tail call, so they get a shallower chain.
#if defined(__SANITIZE_ADDRESS__) || !defined(__OPTIMIZE__)
    constexpr int depth = 2'000;
#else
    constexpr int depth = 200'000;
#endif
    scheduler s;
    EXPECT_EQ(sync_wait(s, chain(depth)), depth);
}

TEST(task, awaiting_moved_from_or_twice_is_a_usage_error) {
    scheduler s;
    auto twice = []() -> task<int> {
        task<int> t = add(2, 3);
        int v = co_await t;
        try {
            (void)co_await t;
        } catch (const usage_error&) {
            v += 100;
        }
        task<int> moved = std::move(t);
        try {
            (void)co_await t;
        } catch (const usage_error&) {
            v += 1000;
        }
        co_return v;
    };
    EXPECT_EQ(sync_wait(s, twice()), 1105);
}

TEST(task, children_inherit_the_scheduler) {
    scheduler s;
    auto child = []() -> task<scheduler*> {
        scheduler& mine = co_await cudawait::this_scheduler();
        co_return &mine;
    };
    auto parent = [&]() -> task<bool> {
        scheduler& mine_ref = co_await cudawait::this_scheduler();
        scheduler* mine = &mine_ref;
        scheduler* theirs = co_await child();
        co_return mine == &s&& theirs == &s;
    };
    EXPECT_TRUE(sync_wait(s, parent()));
}

TEST(task, this_scheduler_binds_to_a_scheduler_reference) {
    // The same cases task_cuda_test.cu runs under nvcc.
    EXPECT_EQ(cudawait::testing::run_this_scheduler_cases(), 0);
}

TEST(task, this_scheduler_yields_a_wrapper_that_converts_to_the_reference) {
    scheduler s;
    auto body = [&]() -> task<bool> {
        auto kept = co_await cudawait::this_scheduler();
        static_assert(!std::is_reference_v<decltype(kept)>);
        static_assert(std::is_convertible_v<decltype(kept), scheduler&>);
        scheduler& bound = kept;
        co_return &kept.get() == &s&&& bound == &s;
    };
    EXPECT_TRUE(sync_wait(s, body()));
}

TEST(task, awaiting_gpu_work_without_a_scheduler_is_a_usage_error) {
    // Started by hand, outside any scheduler: awaiting a stream must fail clearly, before any
    // CUDA call is made.
    auto body = []() -> task<int> {
        co_await cudawait::stream_ref(reinterpret_cast<cudaStream_t>(std::uintptr_t{0x10}));
        co_return 1;
    };
    task<int> t = body();
    t.handle().resume();
    ASSERT_TRUE(t.done());
    EXPECT_THROW(t.handle().promise().result().take(), usage_error);
}

/// Counts its live objects; no default constructor and no copies, as some task results have.
struct counted {
    static inline int live = 0;
    std::string text;
    explicit counted(std::string t) : text(std::move(t)) { ++live; }
    counted(counted&& o) noexcept : text(std::move(o.text)) { ++live; }
    counted(const counted&) = delete;
    ~counted() { --live; }
};

TEST(task, a_result_is_built_once_moved_and_destroyed_once) {
    // The outcome of a task lives in raw storage: every value built there is destroyed exactly
    // once, through the moves sync_wait and with_timeout make of it, take() and an exception
    // that replaces it.
    ASSERT_EQ(counted::live, 0);
    {
        cudawait::detail::result_slot<counted> a;
        a.set_value(counted("a value long enough to live on the heap"));
        EXPECT_EQ(counted::live, 1);
        cudawait::detail::result_slot<counted> b(std::move(a));
        EXPECT_EQ(counted::live, 2); // a keeps its moved-from value until it goes
        cudawait::detail::result_slot<counted> c;
        c = std::move(b);
        EXPECT_EQ(counted::live, 3);
        counted v = c.take();
        EXPECT_EQ(v.text, "a value long enough to live on the heap");
        EXPECT_EQ(counted::live, 3); // v in, c's value out
        EXPECT_THROW(c.take(), usage_error);
        b.set_value(counted("second"));
        b.set_exception(std::make_exception_ptr(std::runtime_error("replaced")));
        EXPECT_TRUE(b.has_exception());
        EXPECT_THROW(b.take(), std::runtime_error);
        EXPECT_EQ(counted::live, 2); // a's moved-from value and v
    }
    EXPECT_EQ(counted::live, 0);

    scheduler s;
    auto make = [](std::string t) -> task<counted> { co_return counted(std::move(t)); };
    const std::string text = "through a task and sync_wait " + std::to_string(counted::live + 42);
    counted got = sync_wait(s, make(text));
    EXPECT_EQ(got.text, text);
    EXPECT_EQ(counted::live, 1);
}

TEST(task, default_constructed_task_is_invalid) {
    task<int> t;
    EXPECT_FALSE(t.valid());
    EXPECT_FALSE(t.done());
}

} // namespace
