// SPDX-License-Identifier: Apache-2.0
#include <cudawait/core/scheduler.hpp>
#include <cudawait/core/sync_wait.hpp>
#include <cudawait/core/task.hpp>
#include <cudawait/core/timeout.hpp>
#include <cudawait/runtime/event.hpp>
#include <cudawait/runtime/stream.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <stdexcept>
#include <stop_token>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include <cuda_runtime.h>

#include "gpu_fixture.hpp"
#include "mapped_words.hpp"
#include "no_device.hpp"
#include "test_kernels.hpp"
#include <gtest/gtest.h>

namespace {

using namespace std::chrono_literals;
using cudawait::check;
using cudawait::cuda_error;
using cudawait::scheduler;
using cudawait::sleep_for;
using cudawait::stream;
using cudawait::sync_wait;
using cudawait::task;
using cudawait::timeout_error;
using cudawait::with_timeout;
using cudawait::testing::mapped_words;
using clock_type = std::chrono::steady_clock;

// ---- host logic (runs without a GPU) --------------------------------------------------------

TEST(timeout, with_timeout_throws_and_keeps_tracking_the_work) {
    scheduler s;
    auto flag = std::make_shared<std::atomic<bool>>(false);
    auto slow = [](std::shared_ptr<std::atomic<bool>> f) -> task<int> {
        co_await sleep_for(150ms);
        f->store(true);
        co_return 5;
    };
    auto body = [&]() -> task<bool> {
        const auto t0 = clock_type::now();
        try {
            (void)co_await with_timeout(slow(flag), 20ms);
        } catch (const timeout_error& e) {
            const auto waited = clock_type::now() - t0;
            co_return e.after() == 20ms && waited >= 20ms && waited < 140ms && !flag->load();
        }
        co_return false;
    };
    EXPECT_TRUE(sync_wait(s, body()));
    // The slow work goes on under the scheduler's care.
    EXPECT_FALSE(flag->load());
    EXPECT_GE(s.pending().timers, 1u);
    s.run();
    EXPECT_TRUE(flag->load());
    EXPECT_EQ(s.pending().timers, 0u);
}

TEST(timeout, with_timeout_passes_values_and_exceptions_through) {
    scheduler s;
    auto quick = []() -> task<int> {
        co_await sleep_for(1ms);
        co_return 11;
    };
    auto failing = []() -> task<int> {
        co_await sleep_for(1ms);
        throw std::invalid_argument("bad");
    };
    auto body = [&]() -> task<int> {
        int v = co_await with_timeout(quick(), 5s);
        try {
            (void)co_await with_timeout(failing(), 5s);
        } catch (const std::invalid_argument&) {
            v += 100;
        }
        co_await with_timeout(sleep_for(1ms), 5s);
        co_return v;
    };
    const auto t0 = clock_type::now();
    EXPECT_EQ(sync_wait(s, body()), 111);
    EXPECT_LT(clock_type::now() - t0, 2s) << "a cancelled timeout timer must not hold the loop";
    EXPECT_EQ(s.pending().timers, 0u);
}

TEST(timeout, with_timeout_of_work_that_finishes_on_another_thread) {
    scheduler home;
    scheduler away;
    std::stop_source stop;
    std::jthread driver([&] { away.run(stop.get_token()); });
    auto wander = [&]() -> task<int> {
        co_await away.schedule();
        co_await sleep_for(1ms);
        co_return 3;
    };
    auto body = [&]() -> task<bool> {
        const int v = co_await with_timeout(wander(), 5s);
        // The result is handed back to this scheduler's thread, where the timer lives.
        co_return v == 3 && cudawait::detail::scheduler_access::on_loop_thread(home);
    };
    EXPECT_TRUE(sync_wait(home, body()));
    stop.request_stop();
}

// The outcome handed back from the other thread is the last thing keeping `home` busy: `home`
// may be destroyed as soon as sync_wait returns, while that thread may still be in its hand-off
// (AddressSanitizer and ThreadSanitizer see a hand-off that touches `home` after publishing).
TEST(timeout, the_scheduler_may_go_as_soon_as_work_finished_on_another_thread_was_handed_back) {
    scheduler away;
    std::stop_source stop;
    std::jthread driver([&] { away.run(stop.get_token()); });
    const auto until = clock_type::now() + 1500ms;
    int rounds = 0;
    int sum = 0;
    for (; rounds < 100000 && clock_type::now() < until; ++rounds) {
        auto* home = new scheduler;
        sum += sync_wait(*home, [](scheduler& there) -> task<int> {
            co_return co_await with_timeout(
                [](scheduler& t) -> task<int> {
                    co_await t.schedule();
                    co_return 2;
                }(there),
                5s);
        }(away));
        delete home;
    }
    stop.request_stop();
    EXPECT_EQ(sum, 2 * rounds);
    EXPECT_GT(rounds, 100);
}

// Every form with_timeout documents compiles, with the documented result; a task variable has to
// be moved in (it runs on after a timeout, so the caller gives it up).
template <class A>
concept timeout_form = requires(A&& a) {
    with_timeout(std::forward<A>(a), 2s);
};
template <class A, class R>
constexpr bool timeout_yields =
    std::is_same_v<decltype(with_timeout(std::declval<A>(), 2s)), task<R>>;
static_assert(timeout_yields<stream&, void>);
static_assert(timeout_yields<const stream&, void>);
static_assert(timeout_yields<cudawait::stream_ref, void>);
static_assert(timeout_yields<cudaStream_t, void>);
static_assert(timeout_yields<cudawait::event&, void>);
static_assert(timeout_yields<const cudawait::event&, void>);
static_assert(timeout_yields<cudawait::pooled_event&, void>);
static_assert(timeout_yields<cudawait::event_ref, void>);
static_assert(timeout_yields<cudaEvent_t, void>);
static_assert(timeout_yields<task<int>, int>);
static_assert(timeout_yields<task<>, void>);
static_assert(timeout_yields<cudawait::detail::sleep_request, void>);
static_assert(!timeout_form<task<int>&>);

TEST(timeout, with_timeout_of_a_stream_or_event_with_no_device_fails_at_the_call) {
    // A stream or event form records at the call, so where no device can be used the call
    // itself throws cuda_error, before anything is awaited; a task form is lazy and does not.
    auto child = [] {
        int clean = 0;
        try {
            auto t = with_timeout(cudawait::stream_ref(cudaStreamPerThread), 1s);
        } catch (const cuda_error&) {
            ++clean;
        }
        try {
            auto t = with_timeout(reinterpret_cast<cudaEvent_t>(std::uintptr_t{0x40}), 1s);
        } catch (const cuda_error&) {
            ++clean;
        }
        auto lazy = []() -> task<int> { co_return 4; };
        auto t = with_timeout(lazy(), 1s);
        std::fprintf(stderr, "%s\n", clean == 2 ? "failed cleanly at the call" : "no error");
        std::exit(clean == 2 && t.valid() ? 0 : 1);
    };
    CUDAWAIT_EXPECT_IN_CHILD_WITHOUT_DEVICE(child(), "failed cleanly at the call");
}

// ---- GPU ------------------------------------------------------------------------------------

class timeout_gpu : public cudawait::testing::gpu_test {};

TEST_F(timeout_gpu, timeout_on_a_spinning_kernel_keeps_its_event_tracked) {
    scheduler s;
    stream st;
    mapped_words flag(1);
    flag.host[0] = 0;
    auto& pool = cudawait::event_pool::for_device(0);
    const long outstanding = pool.outstanding();
    auto body = [&]() -> task<bool> {
        // Spins until the host raises the flag (or 20 s pass, so a broken test cannot hang).
        check(cudawait::testing::launch_wait_flag(flag.device, 20'000'000'000ull, st.get()),
              "launch_wait_flag");
        const auto t0 = clock_type::now();
        try {
            co_await with_timeout(st, 50ms);
        } catch (const timeout_error&) {
            const auto waited = clock_type::now() - t0;
            co_return waited >= 50ms && waited < 5s;
        }
        co_return false;
    };
    EXPECT_TRUE(sync_wait(s, body()));
    EXPECT_FALSE(st.is_done()) << "the kernel must still be running";
    // The scheduler still tracks the abandoned wait (on the event recorded at the call); that
    // event is still out of the pool.
    EXPECT_EQ(s.pending().event_waits, 1u);
    EXPECT_GT(pool.outstanding(), outstanding);
    flag.host[0] = 1;
    s.run(); // drains: the kernel ends, the wait completes, the event is recycled
    EXPECT_EQ(s.pending().event_waits, 0u);
    EXPECT_EQ(pool.outstanding(), outstanding);
    EXPECT_TRUE(st.is_done());
}

// Each form with_timeout documents, on work that finishes: the await returns only once the work
// enqueued before the call wrote its value.
TEST_F(timeout_gpu, with_timeout_accepts_every_documented_form) {
    scheduler s;
    stream st;
    mapped_words out(9);
    cudawait::event ev;
    cudawait::pooled_event pooled = cudawait::event_pool::for_device(0).acquire();
    std::mt19937 rng(20261201);
    std::vector<std::uint32_t> want(out.count);
    for (auto& w : want) {
        w = static_cast<std::uint32_t>(rng()) | 1u;
    }
    // A 2 ms spin on `st` that then writes want[i] to out[i].
    auto launch = [&](std::size_t i) {
        check(cudawait::testing::launch_spin(2'000'000, out.device + i, want[i], st.get()),
              "launch");
    };
    auto body = [&]() -> task<int> {
        int seen = 0;
        auto saw = [&](std::size_t i) { seen += out.read(i) == want[i] ? 1 : 0; };
        launch(0);
        co_await with_timeout(st, 20s); // owning stream, by reference
        saw(0);
        launch(1);
        const stream& const_st = st;
        co_await with_timeout(const_st, 20s);
        saw(1);
        launch(2);
        co_await with_timeout(cudawait::stream_ref(st), 20s);
        saw(2);
        launch(3);
        co_await with_timeout(st.get(), 20s); // cudaStream_t
        saw(3);
        launch(4);
        ev.record(st);
        co_await with_timeout(ev, 20s); // owning event, by reference
        saw(4);
        launch(5);
        pooled.record(st);
        co_await with_timeout(pooled, 20s);
        saw(5);
        launch(6);
        ev.record(st);
        co_await with_timeout(cudawait::event_ref(ev), 20s);
        saw(6);
        launch(7);
        ev.record(st);
        co_await with_timeout(ev.get(), 20s); // cudaEvent_t
        saw(7);
        auto on_stream = [&]() -> task<std::uint32_t> {
            launch(8);
            co_await st;
            co_return out.read(8);
        };
        seen += co_await with_timeout(on_stream(), 20s) == want[8] ? 1 : 0;
        co_return seen;
    };
    EXPECT_EQ(sync_wait(s, body()), 9);
    const auto p = s.pending();
    EXPECT_EQ(p.event_waits + p.stream_waits + p.timers + p.detached, 0u);
}

// A timeout on an owning stream that the caller destroys right away: the wait goes on without
// it, on the event recorded at the call, and completes once the work is done.
TEST_F(timeout_gpu, with_timeout_on_an_owning_stream_destroyed_right_after) {
    scheduler s;
    mapped_words flag(1);
    mapped_words out(1);
    flag.host[0] = 0;
    auto& pool = cudawait::event_pool::for_device(0);
    const long outstanding = pool.outstanding();
    std::atomic<bool> timed_out{false};
    // Lets the kernel finish once the timeout was seen, so that destroying the stream (which
    // synchronises it) returns.
    std::jthread raiser([&] {
        while (!timed_out.load()) {
            std::this_thread::sleep_for(1ms);
        }
        std::this_thread::sleep_for(20ms);
        reinterpret_cast<volatile std::uint32_t*>(flag.host)[0] = 1;
    });
    auto body = [&]() -> task<bool> {
        auto st = std::make_unique<stream>();
        check(cudawait::testing::launch_wait_flag(flag.device, 20'000'000'000ull, st->get()),
              "launch_wait_flag");
        check(cudawait::testing::launch_spin(0, out.device, 0x5EED5u, st->get()), "launch_spin");
        try {
            co_await with_timeout(*st, 30ms);
        } catch (const timeout_error&) {
            timed_out = true;
            st.reset(); // the caller lets go of the stream while the wait is pending
            co_return true;
        }
        co_return false;
    };
    EXPECT_TRUE(sync_wait(s, body()));
    raiser.join();
    s.run(); // the abandoned wait completes without the stream
    EXPECT_EQ(out.read(0), 0x5EED5u);
    const auto p = s.pending();
    EXPECT_EQ(p.event_waits + p.stream_waits + p.detached, 0u);
    EXPECT_EQ(pool.outstanding(), outstanding);
}

// A raw stream destroyed while its work still runs (cudaStreamDestroy returns at once): the wait
// left by the timeout holds only its event, not the stream, so a stream created afterwards
// (which may get the same handle) is awaited on its own, and the abandoned wait completes with
// the old work. CUDA does not promise that the new stream's kernels run beside the old stream's
// blocked one (the two may share a hardware queue), so the flag is raised before the new
// stream's work is awaited; the destroy may come before or after the old work ends.
TEST_F(timeout_gpu, with_timeout_on_a_raw_stream_destroyed_while_its_work_runs) {
    scheduler s;
    mapped_words flag(1);
    mapped_words out(2);
    flag.host[0] = 0;
    auto body = [&]() -> task<bool> {
        cudaStream_t raw = nullptr;
        check(cudaStreamCreateWithFlags(&raw, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
        // Ends by itself after 10 s if the flag never comes, so a failure cannot hang.
        check(cudawait::testing::launch_wait_flag(flag.device, 10'000'000'000ull, raw), "launch");
        check(cudawait::testing::launch_spin(0, out.device, 0x01Du, raw), "launch_spin");
        bool timed_out = false;
        try {
            co_await with_timeout(raw, 30ms);
        } catch (const timeout_error&) {
            timed_out = true;
        }
        // The abandoned wait is an event wait; no stream wait refers to the stream's handle.
        const auto left = s.pending();
        const bool held_by_event = left.event_waits == 1 && left.stream_waits == 0;
        const bool old_work_pending = out.read(0) == 0xBADC0DEu;
        // Raised before the destroy, which compute-sanitizer makes wait for the stream's work.
        reinterpret_cast<volatile std::uint32_t*>(flag.host)[0] = 1;
        check(cudaStreamDestroy(raw), "cudaStreamDestroy");
        stream fresh;
        check(cudawait::testing::launch_spin(1'000'000, out.device + 1, 0xF2E54u, fresh.get()),
              "launch_spin");
        co_await fresh;
        co_return timed_out&& held_by_event&& old_work_pending&& out.read(1) == 0xF2E54u;
    };
    EXPECT_TRUE(sync_wait(s, body()));
    s.run(); // the abandoned wait completes without the stream
    EXPECT_EQ(out.read(0), 0x01Du);
    const auto p = s.pending();
    EXPECT_EQ(p.event_waits + p.stream_waits + p.detached, 0u);
}

// A timeout on an owning event that the caller destroys right away, while the work it captured
// still runs: the wait holds an event of its own (recorded behind the user's on a relay stream),
// so it neither fails nor completes early, and completes once the work is done.
TEST_F(timeout_gpu, with_timeout_on_an_event_destroyed_right_after) {
    scheduler s;
    stream st;
    mapped_words flag(1);
    mapped_words out(1);
    flag.host[0] = 0;
    auto& pool = cudawait::event_pool::for_device(0);
    const long outstanding = pool.outstanding();
    auto body = [&]() -> task<bool> {
        check(cudawait::testing::launch_wait_flag(flag.device, 20'000'000'000ull, st.get()),
              "launch_wait_flag");
        check(cudawait::testing::launch_spin(0, out.device, 0xE4E27u, st.get()), "launch_spin");
        auto ev = std::make_unique<cudawait::event>();
        ev->record(st);
        try {
            co_await with_timeout(*ev, 30ms);
        } catch (const timeout_error&) {
            ev.reset(); // destroyed while its work is pending
            co_return true;
        }
        co_return false;
    };
    EXPECT_TRUE(sync_wait(s, body()));
    for (int i = 0; i < 100; ++i) {
        (void)s.poll();
    }
    EXPECT_EQ(s.pending().event_waits, 1u) << "the wait ended before the work did";
    EXPECT_EQ(out.read(0), 0xBADC0DEu) << "the kernel must still be waiting for the flag";
    reinterpret_cast<volatile std::uint32_t*>(flag.host)[0] = 1;
    s.run();
    EXPECT_EQ(out.read(0), 0xE4E27u);
    EXPECT_EQ(s.pending().event_waits, 0u);
    EXPECT_EQ(pool.outstanding(), outstanding);
}

// A wait on an event whose work never finished does not hold up a later one: the relay stream of
// the first stays out of the cache until that wait completed, so the second wait gets a stream
// of its own. (Whether the GPU then runs the second beside the first is the driver's choice: two
// streams may share a hardware queue. So the flag is raised by a thread after a while, and what
// is asserted is the cache's bookkeeping and that both waits complete with their work.)
TEST_F(timeout_gpu, with_timeout_of_an_event_does_not_wait_behind_an_unfinished_one) {
    scheduler s;
    stream slow;
    stream quick;
    mapped_words flag(1);
    mapped_words out(1);
    flag.host[0] = 0;
    cudawait::event slow_done;
    cudawait::event quick_done;
    auto& relays = cudawait::detail::relay_stream_cache::instance();
    const std::size_t cached_before = relays.cached(0);
    std::atomic<bool> first_done{false};
    std::jthread raiser([&] {
        while (!first_done.load()) {
            std::this_thread::sleep_for(1ms);
        }
        std::this_thread::sleep_for(200ms);
        reinterpret_cast<volatile std::uint32_t*>(flag.host)[0] = 1;
    });
    auto body = [&]() -> task<bool> {
        check(cudawait::testing::launch_wait_flag(flag.device, 20'000'000'000ull, slow.get()),
              "launch_wait_flag");
        slow_done.record(slow);
        bool first_timed_out = false;
        try {
            co_await with_timeout(slow_done, 30ms);
        } catch (const timeout_error&) {
            first_timed_out = true;
        }
        // The first relay still waits for slow_done: it left the cache and is not back.
        const bool busy_not_cached =
            relays.cached(0) == (cached_before > 0 ? cached_before - 1 : 0);
        first_done = true;
        check(cudawait::testing::launch_spin(1'000'000, out.device, 0x9A1u, quick.get()),
              "launch_spin");
        quick_done.record(quick);
        co_await with_timeout(quick_done, 20s);
        co_return first_timed_out&& busy_not_cached&& out.read(0) == 0x9A1u;
    };
    EXPECT_TRUE(sync_wait(s, body()));
    raiser.join();
    s.run();
    EXPECT_EQ(s.pending().event_waits, 0u);
    EXPECT_TRUE(slow.is_done());
    // Two different relays served the two waits, and both are cached again once idle.
    EXPECT_EQ(relays.cached(0), std::max<std::size_t>(cached_before, 2));
}

} // namespace
