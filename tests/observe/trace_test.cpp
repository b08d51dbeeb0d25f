// SPDX-License-Identifier: Apache-2.0
// The recorder first: it defines NVTX's static-injection hook, which a file that included the
// NVTX headers before it would define weakly.
#include "nvtx_recorder.hpp"
// The rest.
#include <cudawait/core/scheduler.hpp>
#include <cudawait/core/sync_wait.hpp>
#include <cudawait/core/task.hpp>
#include <cudawait/core/when_all.hpp>
#include <cudawait/observe/trace.hpp>

#include <chrono>
#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include <gtest/gtest.h>

namespace {

using namespace std::chrono_literals;
using cudawait::trace_async_range;
using cudawait::trace_range;
using cudawait::testing::nvtx_range;
using cudawait::testing::nvtx_recorder;

static_assert(!std::is_copy_constructible_v<trace_range>);
static_assert(!std::is_copy_constructible_v<trace_async_range>);

// NVTX (and so the recorder) needs no GPU: everything here runs on the host.
class trace : public ::testing::Test {
protected:
    void SetUp() override {
        ASSERT_EQ(CUDAWAIT_HAS_NVTX, 1) << "the toolkit's NVTX3 headers are on the include path";
        { trace_range first("first", 0); } // NVTX initialises its tool on the first call
        if (!recorder().installed()) {
            GTEST_SKIP() << "another NVTX tool (a profiler's injection) took precedence";
        }
        recorder().clear();
    }
    void TearDown() override {
        if (IsSkipped()) {
            return;
        }
        EXPECT_EQ(recorder().errors(), std::vector<std::string>{});
        EXPECT_EQ(recorder().open_push_count(), 0u) << "push ranges left open";
        EXPECT_TRUE(recorder().open_starts().empty()) << "start ranges left open";
    }
    static nvtx_recorder& recorder() { return nvtx_recorder::instance(); }
};

std::vector<std::string> messages(const std::vector<nvtx_range>& v) {
    std::vector<std::string> m;
    for (const auto& r : v) {
        m.push_back(r.message);
    }
    return m;
}

TEST_F(trace, ranges_push_and_pop_in_the_cudawait_domain_with_the_index_as_payload) {
    const auto self = std::this_thread::get_id();
    {
        trace_range outer("outer", 41);
        ASSERT_EQ(recorder().open_pushes().size(), 1u);
        for (std::size_t i = 0; i < 3; ++i) {
            trace_range inner("inner", 1000 + i);
            auto open = recorder().open_pushes();
            ASSERT_EQ(messages(open), (std::vector<std::string>{"outer", "inner"}));
            EXPECT_EQ(open[1].payload, 1000 + i);
        }
        // A range on another thread is on that thread's stack only.
        std::thread other([] {
            trace_range elsewhere("elsewhere", 7);
            EXPECT_EQ(messages(nvtx_recorder::instance().open_pushes()),
                      std::vector<std::string>{"elsewhere"});
        });
        other.join();
        EXPECT_EQ(messages(recorder().open_pushes()), std::vector<std::string>{"outer"});
    }
    EXPECT_TRUE(recorder().open_pushes().empty());
    auto closed = recorder().closed();
    ASSERT_EQ(messages(closed),
              (std::vector<std::string>{"inner", "inner", "inner", "elsewhere", "outer"}));
    for (std::size_t i = 0; i < closed.size(); ++i) {
        EXPECT_TRUE(closed[i].push_pop) << i;
        EXPECT_EQ(closed[i].domain, "cudawait") << i;
        EXPECT_EQ(closed[i].opened_on, closed[i].closed_on) << i;
    }
    EXPECT_EQ(closed[0].payload, 1000u);
    EXPECT_EQ(closed[2].payload, 1002u);
    EXPECT_NE(closed[3].opened_on, self);
    EXPECT_EQ(closed[4].payload, 41u);
    EXPECT_EQ(closed[4].opened_on, self);
}

TEST_F(trace, async_ranges_end_by_id_in_any_order_and_on_any_thread) {
    auto a = std::make_unique<trace_async_range>("a", 1);
    auto b = std::make_unique<trace_async_range>("b", 2);
    EXPECT_EQ(recorder().open_starts().size(), 2u);
    EXPECT_TRUE(recorder().open_pushes().empty()) << "start/end ranges are not on the stack";
    a.reset(); // not the last one started: a push/pop range could not do this
    std::thread other([&] { b.reset(); });
    other.join();
    auto closed = recorder().closed();
    ASSERT_EQ(messages(closed), (std::vector<std::string>{"a", "b"}));
    EXPECT_FALSE(closed[0].push_pop);
    EXPECT_EQ(closed[0].domain, "cudawait");
    EXPECT_EQ(closed[0].payload, 1u);
    EXPECT_EQ(closed[1].payload, 2u);
    EXPECT_EQ(closed[0].closed_on, std::this_thread::get_id());
    EXPECT_NE(closed[1].closed_on, closed[1].opened_on) << "b ended on the other thread";
}

// Two coroutines on one scheduler thread, each holding an async range across its awaits and
// opening push/pop ranges between them: every end closes its own range, and whenever a
// coroutine resumes the thread's push/pop stack holds nothing of another's.
TEST_F(trace, async_ranges_across_co_await_interleave_cleanly_on_one_thread) {
    cudawait::scheduler sched;
    std::size_t max_open_starts = 0;
    std::size_t stack_violations = 0;
    auto worker = [&](std::size_t id, std::chrono::microseconds nap) -> cudawait::task<> {
        for (std::size_t k = 0; k < 20; ++k) {
            trace_async_range wait("wait", id * 100 + k);
            max_open_starts = std::max(max_open_starts, recorder().open_starts().size());
            co_await cudawait::sleep_for(nap);
            if (!recorder().open_pushes().empty()) {
                ++stack_violations;
            }
            trace_range work("work", id * 100 + k);
            if (recorder().open_pushes().size() != 1) {
                ++stack_violations;
            }
        }
    };
    cudawait::sync_wait(sched, cudawait::when_all(worker(1, 50us), worker(2, 70us)));
    EXPECT_EQ(stack_violations, 0u);
    EXPECT_EQ(max_open_starts, 2u) << "the two coroutines' waits overlapped";
    std::set<std::uint64_t> waits;
    std::size_t works = 0;
    for (const auto& r : recorder().closed()) {
        if (r.message == "wait") {
            EXPECT_FALSE(r.push_pop);
            waits.insert(r.payload);
        } else if (r.message == "work") {
            EXPECT_TRUE(r.push_pop);
            ++works;
        }
    }
    EXPECT_EQ(waits.size(), 40u) << "each wait ended once, by its own id";
    EXPECT_EQ(works, 40u);
}

// The hazard the async range exists for, and the check the pipeline's tests use to catch it:
// push/pop ranges held across co_await by two coroutines on one thread. The first to resume
// finds the other's range on top of the stack, and its pop closes that range, not its own.
TEST_F(trace, push_pop_ranges_held_across_co_await_are_seen_mis_nested) {
    cudawait::scheduler sched;
    std::vector<std::size_t> depth_on_resume;
    auto holder = [&](std::size_t id, std::chrono::milliseconds nap) -> cudawait::task<> {
        trace_range held("held", id);
        co_await cudawait::sleep_for(nap);
        depth_on_resume.push_back(recorder().open_pushes().size());
    };
    cudawait::sync_wait(sched, cudawait::when_all(holder(1, 2ms), holder(2, 20ms)));
    // Coroutine 1 resumed first, with coroutine 2's range open above its own.
    EXPECT_EQ(depth_on_resume, (std::vector<std::size_t>{2, 1}));
    auto closed = recorder().closed();
    ASSERT_EQ(closed.size(), 2u);
    EXPECT_EQ(closed[0].payload, 2u) << "coroutine 1's pop closed coroutine 2's range";
    EXPECT_EQ(closed[1].payload, 1u);
}

} // namespace
