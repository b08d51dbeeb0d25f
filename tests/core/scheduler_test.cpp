// SPDX-License-Identifier: Apache-2.0
#include <cudawait/core/detail/scheduler_impl.hpp> // sentinel_streams, idle_doorbell
#include <cudawait/core/scheduler.hpp>
#include <cudawait/core/scope.hpp>
#include <cudawait/core/sync_wait.hpp>
#include <cudawait/core/task.hpp>
#include <cudawait/core/when_all.hpp>
#include <cudawait/runtime/event.hpp>
#include <cudawait/runtime/stream.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <coroutine>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <functional>
#include <memory>
#include <random>
#include <source_location>
#include <stdexcept>
#include <stop_token>
#include <thread>
#include <utility>
#include <vector>

#include <cuda_runtime.h>

#include "gpu_fixture.hpp"
#include "host_signal.hpp"
#include "mapped_words.hpp"
#include "test_kernels.hpp"
#include <gtest/gtest.h>

namespace {

using namespace std::chrono_literals;
using cudawait::async_scope;
using cudawait::check;
using cudawait::cuda_error;
using cudawait::poll_policy;
using cudawait::scheduler;
using cudawait::sleep_for;
using cudawait::stream;
using cudawait::sync_wait;
using cudawait::task;
using cudawait::usage_error;
using cudawait::testing::host_signal;
using cudawait::testing::mapped_words;
using clock_type = std::chrono::steady_clock;

std::chrono::nanoseconds thread_cpu_time() {
    timespec ts{};
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return std::chrono::seconds(ts.tv_sec) + std::chrono::nanoseconds(ts.tv_nsec);
}

// ---- host logic (runs without a GPU) --------------------------------------------------------

TEST(scheduler, post_is_thread_safe) {
    scheduler s;
    constexpr int threads = 8;
    constexpr int per_thread = 2000;
    long count = 0; // touched only on the loop thread
    std::vector<std::jthread> posters;
    for (int t = 0; t < threads; ++t) {
        posters.emplace_back([&s, &count] {
            for (int i = 0; i < per_thread; ++i) {
                s.post([&count] { ++count; });
            }
        });
    }
    s.run_until([&] { return count == threads * per_thread; });
    EXPECT_EQ(count, threads * per_thread);
}

TEST(scheduler, host_completed_awaitables_resume_on_the_loop_thread) {
    scheduler s;
    host_signal sig(s);
    std::thread::id resumed_on;
    auto waiter = [&]() -> task<int> {
        co_await sig;
        resumed_on = std::this_thread::get_id();
        co_return 7;
    };
    std::jthread firer([&] {
        std::this_thread::sleep_for(20ms);
        sig.fire();
    });
    EXPECT_EQ(sync_wait(s, waiter()), 7);
    EXPECT_EQ(resumed_on, std::this_thread::get_id());
}

TEST(scheduler, schedule_hops_between_threads) {
    scheduler main_loop;
    scheduler other;
    std::stop_source stop;
    std::thread::id other_id;
    std::jthread driver([&] {
        other_id = std::this_thread::get_id();
        other.run(stop.get_token());
    });
    auto hopper = [&]() -> task<bool> {
        const auto start = std::this_thread::get_id();
        co_await other.schedule();
        const auto there = std::this_thread::get_id();
        scheduler& bound_ref = co_await cudawait::this_scheduler();
        scheduler* bound = &bound_ref;
        co_await sleep_for(1ms); // timers now belong to `other`
        const auto after_sleep = std::this_thread::get_id();
        co_await main_loop.schedule();
        const auto back = std::this_thread::get_id();
        co_return start != there&& there == after_sleep&& back == start&& bound == &other;
    };
    EXPECT_TRUE(sync_wait(main_loop, hopper()));
    stop.request_stop();
    driver.join();
    EXPECT_NE(other_id, std::thread::id{});
}

TEST(scheduler, timers_fire_in_deadline_order_and_not_early) {
    scheduler s;
    std::vector<int> order;
    auto sleeper = [&](int ms) -> task<> {
        const auto t0 = clock_type::now();
        co_await sleep_for(std::chrono::milliseconds(ms));
        EXPECT_GE(clock_type::now() - t0, std::chrono::milliseconds(ms));
        order.push_back(ms);
    };
    sync_wait(s, cudawait::when_all(sleeper(30), sleeper(10), sleeper(20), sleeper(0)));
    EXPECT_EQ(order, (std::vector<int>{0, 10, 20, 30}));
}

TEST(scheduler, spawn_is_thread_safe_and_run_rethrows_detached_errors) {
    scheduler s;
    std::atomic<int> finished{0};
    auto work = [&](int i) -> task<> {
        co_await sleep_for(std::chrono::microseconds(i % 7));
        finished.fetch_add(1);
        if (i == 123) {
            throw std::runtime_error("detached failure");
        }
    };
    std::vector<std::jthread> spawners;
    for (int t = 0; t < 4; ++t) {
        spawners.emplace_back([&, t] {
            for (int i = t * 100; i < (t + 1) * 100; ++i) {
                s.spawn(work(i));
            }
        });
    }
    spawners.clear(); // joins
    EXPECT_THROW(s.run(), std::runtime_error);
    EXPECT_EQ(finished.load(), 400);
    EXPECT_NO_THROW(s.run()); // the error was reported once
}

// What only the library's awaiters and drivers use is not callable on a scheduler; they reach it
// through detail::scheduler_access. The public members are what a user calls.
template <class S>
concept user_surface = requires(S& s, const S& cs, stream& st, cudawait::event& ev) {
    s.schedule();
    s.post(std::coroutine_handle<>{});
    s.post(std::function<void()>{});
    s.wake();
    s.spawn(std::declval<task<>>());
    s.run();
    s.run(std::stop_token{});
    s.run_until([] { return true; });
    s.poll();
    cs.pending();
    cs.policy();
    s.set_policy(poll_policy{});
    s.wait(st);
    s.wait(ev);
    s.sleep_for(1ms);
};
template <class S>
concept waits_are_public = requires(S& s, cudaError_t& status, const char*& api) {
    s.add_wait(cudaStream_t{}, std::coroutine_handle<>{}, status, api);
}
|| requires(S& s, cudaError_t& status, const char*& api) {
    s.add_wait(cudaEvent_t{}, std::coroutine_handle<>{}, status, api);
};
template <class S>
concept timers_are_public = requires(S& s) {
    s.add_timer(clock_type::now(), std::coroutine_handle<>{});
}
|| requires(S& s) { s.add_timer(clock_type::now(), std::function<void()>{}); }
|| requires(S& s) { s.cancel_timer(nullptr); };
template <class S>
concept loop_internals_are_public = requires(S& s) {
    s.run_from(std::coroutine_handle<>{}, [] { return true; });
}
|| requires(S& s) { s.resume_soon(std::coroutine_handle<>{}); }
|| requires(S& s) { s.child_started(); }
|| requires(S& s) { s.child_finished(); }
|| requires(const S& s) { s.on_loop_thread(); };
static_assert(user_surface<scheduler>);
static_assert(!waits_are_public<scheduler>);
static_assert(!timers_are_public<scheduler>);
static_assert(!loop_internals_are_public<scheduler>);

TEST(scheduler, posted_callables_of_every_size_run_once_and_are_destroyed_once) {
    // What post() keeps: small callables in place, larger ones (and ones that may throw when
    // moved) on the heap; each is called once, moved without copies, destroyed exactly once.
    struct tracked {
        int* calls;
        int* live;
        std::uint64_t pad[4];
        tracked(int* c, int* l, std::uint64_t seed) : calls(c), live(l), pad{seed, ~seed, seed, 1} {
            ++*live;
        }
        tracked(tracked&& o) noexcept
            : calls(o.calls), live(o.live), pad{o.pad[0], o.pad[1], o.pad[2], o.pad[3]} {
            ++*live;
        }
        tracked(const tracked&) = delete;
        ~tracked() { --*live; }
        void operator()() const {
            EXPECT_EQ(pad[1], ~pad[0]);
            ++*calls;
        }
    };
    int calls = 0;
    int live = 0;
    std::mt19937_64 rng(std::random_device{}());
    {
        cudawait::detail::callback small = [&calls] { ++calls; };
        cudawait::detail::callback large = tracked(&calls, &live, rng());
        EXPECT_EQ(live, 1);
        cudawait::detail::callback moved(std::move(large));
        EXPECT_FALSE(large);
        cudawait::detail::callback assigned;
        assigned = std::move(moved);
        assigned = std::move(small); // destroys the tracked one it held
        EXPECT_EQ(live, 0);
        assigned();
        EXPECT_EQ(calls, 1);
    }
    scheduler s;
    for (int i = 0; i < 100; ++i) {
        s.post(tracked(&calls, &live, rng()));
        s.post([&calls, seed = rng()] { calls += seed == 0 ? 2 : 1; });
    }
    s.post(std::function<void()>([&calls] { ++calls; }));
    s.run();
    EXPECT_EQ(calls, 1 + 201);
    EXPECT_EQ(live, 0);
}

TEST(scheduler, internals_are_reached_through_scheduler_access) {
    using access = cudawait::detail::scheduler_access;
    scheduler s;
    EXPECT_FALSE(access::on_loop_thread(s));
    bool on_loop = false;
    std::vector<int> fired;
    s.post([&] {
        on_loop = access::on_loop_thread(s);
        // Two callback timers, the later one cancelled before it is due: only the first fires.
        (void)access::add_timer(s, clock_type::now() + 1ms, [&fired] { fired.push_back(1); });
        cudawait::detail::timer_node* later =
            access::add_timer(s, clock_type::now() + 2ms, [&fired] { fired.push_back(2); });
        access::cancel_timer(s, later);
    });
    s.run();
    EXPECT_TRUE(on_loop);
    EXPECT_EQ(fired, (std::vector<int>{1}));
    EXPECT_EQ(s.pending().timers, 0u);
}

TEST(scheduler, idle_scheduler_blocks_instead_of_polling) {
    scheduler s(poll_policy::spinning());
    std::stop_source stop;
    std::chrono::nanoseconds cpu{};
    std::jthread driver([&] {
        const auto c0 = thread_cpu_time();
        s.run(stop.get_token());
        cpu = thread_cpu_time() - c0;
    });
    std::this_thread::sleep_for(200ms);
    stop.request_stop();
    driver.join();
    // With nothing pending even a spinning policy must not burn the core.
    EXPECT_LT(cpu, 50ms);
}

TEST(scheduler, policies_have_the_documented_shape) {
    constexpr auto spin = poll_policy::spinning();
    constexpr auto yield = poll_policy::yielding();
    constexpr auto sleep = poll_policy::sleeping(10us, 500us);
    constexpr auto balanced = poll_policy::balanced();
    static_assert(spin.spin > 1h && spin.yield == 0ns);
    static_assert(yield.spin == 0ns && yield.yield > 1h);
    static_assert(sleep.spin == 0ns && sleep.yield == 0ns && sleep.sleep_min == 10us &&
                  sleep.sleep_max == 500us);
    static_assert(balanced.spin > 0ns && balanced.yield > 0ns &&
                  balanced.sleep_min <= balanced.sleep_max);
    scheduler s(sleep);
    EXPECT_EQ(s.policy().sleep_max, 500us);
    s.set_policy(spin);
    EXPECT_GT(s.policy().spin, 1h);
}

TEST(scheduler, driving_from_two_threads_is_a_usage_error) {
    scheduler s;
    std::stop_source stop;
    std::atomic<bool> running{false};
    std::jthread driver([&] {
        s.post([&running] { running = true; });
        s.run(stop.get_token());
    });
    while (!running) {
        std::this_thread::yield();
    }
    EXPECT_THROW(s.poll(), usage_error);
    auto nothing = []() -> task<int> { co_return 1; };
    EXPECT_THROW(sync_wait(s, nothing()), usage_error);
    stop.request_stop();
}

TEST(scheduler, sync_wait_from_inside_its_own_loop_is_a_usage_error) {
    scheduler s;
    auto inner = []() -> task<int> { co_return 1; };
    auto outer = [&]() -> task<bool> {
        try {
            (void)sync_wait(s, inner());
        } catch (const usage_error&) {
            co_return true;
        }
        co_return false;
    };
    EXPECT_TRUE(sync_wait(s, outer()));
}

TEST(scheduler, exceptions_from_posted_functions_reach_run) {
    scheduler s;
    s.post([] { throw std::domain_error("posted"); });
    EXPECT_THROW(s.run(), std::domain_error);
}

// A hand-off from another thread (sync_wait's root ending there, a detached task ending there)
// lets the loop finish; the scheduler may be destroyed the moment it returns, while the other
// thread is still inside its hand-off. Under AddressSanitizer or ThreadSanitizer a hand-off that
// touches the scheduler after publishing its work is reported here within a fraction of a second.
TEST(scheduler, may_be_destroyed_as_soon_as_a_task_ending_on_another_thread_returns) {
    scheduler other;
    std::stop_source stop;
    std::jthread driver([&] { other.run(stop.get_token()); });
    const auto until = clock_type::now() + 1500ms;
    int rounds = 0;
    int hopped = 0;
    for (; rounds < 200000 && clock_type::now() < until; ++rounds) {
        auto* s = new scheduler;
        hopped += sync_wait(*s, [&]() -> task<int> {
            co_await other.schedule();
            co_return 1;
        }());
        delete s;
    }
    stop.request_stop();
    EXPECT_EQ(hopped, rounds);
    EXPECT_GT(rounds, 100);
}

TEST(scheduler, may_be_destroyed_as_soon_as_run_returns_after_detached_work_ended_elsewhere) {
    scheduler other;
    std::stop_source stop;
    std::jthread driver([&] { other.run(stop.get_token()); });
    const auto until = clock_type::now() + 1500ms;
    int rounds = 0;
    std::atomic<int> ended{0};
    for (; rounds < 200000 && clock_type::now() < until; ++rounds) {
        auto* s = new scheduler;
        // Parameters, not captures: the lambda object is gone before the task runs.
        s->spawn([](scheduler& there, std::atomic<int>& count) -> task<> {
            co_await there.schedule();
            count.fetch_add(1);
        }(other, ended));
        s->run();
        delete s;
    }
    stop.request_stop();
    EXPECT_EQ(ended.load(), rounds);
    EXPECT_GT(rounds, 100);
}

// An awaitable whose move throws: spawn's copy of it fails before anything runs.
struct throws_when_moved {
    throws_when_moved() = default;
    throws_when_moved(throws_when_moved&&) { throw std::length_error("moved"); }
    bool await_ready() const noexcept { return true; }
    void await_suspend(std::coroutine_handle<>) const noexcept {}
    int await_resume() const noexcept { return 1; }
};

TEST(scheduler, a_spawn_that_throws_leaves_nothing_for_run_to_wait_for) {
    auto* s = new scheduler;
    EXPECT_THROW(s->spawn(throws_when_moved{}), std::length_error);
    EXPECT_EQ(s->pending().detached, 0u);
    // run() returns: nothing is pending.
    auto returned = std::make_shared<std::atomic<bool>>(false);
    std::thread runner([s, returned] {
        s->run();
        *returned = true;
    });
    for (int i = 0; i < 200 && !*returned; ++i) {
        std::this_thread::sleep_for(5ms);
    }
    if (!*returned) {
        runner.detach(); // left running (and the scheduler leaked): the test has failed
        FAIL() << "run() waits for a spawn that never started";
    }
    runner.join();
    delete s;
}

TEST(scheduler, non_task_coroutines_can_await_through_the_scheduler) {
    // A bare coroutine type of the user's own, not derived from the library's promise.
    struct bare {
        struct promise_type {
            bare get_return_object() { return {}; }
            std::suspend_never initial_suspend() noexcept { return {}; }
            std::suspend_never final_suspend() noexcept { return {}; }
            void return_void() {}
            void unhandled_exception() { std::terminate(); }
        };
    };
    scheduler s;
    bool done = false;
    auto body = [](scheduler& sch, bool& flag) -> bare {
        co_await sch.sleep_for(2ms);
        flag = true;
    };
    s.post([&] { body(s, done); });
    s.run_until([&] { return done; });
    EXPECT_TRUE(done);
}

// ---- GPU ------------------------------------------------------------------------------------

class scheduler_gpu : public cudawait::testing::gpu_test {};

TEST_F(scheduler_gpu, stream_await_resumes_after_the_work_before_it) {
    scheduler s;
    stream st;
    mapped_words out(1);
    auto body = [&]() -> task<std::uint32_t> {
        check(cudawait::testing::launch_spin(20'000'000, out.device, 0xA11CEu, st.get()), "launch");
        co_await st;
        co_return out.read(0);
    };
    EXPECT_EQ(sync_wait(s, body()), 0xA11CEu);
    EXPECT_EQ(s.pending().stream_waits, 0u);
}

TEST_F(scheduler_gpu, awaits_on_one_stream_resume_in_enqueue_order) {
    scheduler s;
    stream st;
    mapped_words out(2);
    std::vector<int> order;
    auto first = [&]() -> task<> {
        check(cudawait::testing::launch_spin(10'000'000, out.device, 1, st.get()), "launch");
        co_await st;
        EXPECT_EQ(out.read(0), 1u);
        order.push_back(1);
    };
    auto second = [&]() -> task<> {
        check(cudawait::testing::launch_spin(1'000'000, out.device + 1, 2, st.get()), "launch");
        co_await st;
        EXPECT_EQ(out.read(0), 1u);
        EXPECT_EQ(out.read(1), 2u);
        order.push_back(2);
    };
    sync_wait(s, cudawait::when_all(first(), second()));
    EXPECT_EQ(order, (std::vector<int>{1, 2}));
}

TEST_F(scheduler_gpu, awaits_on_different_streams_resume_as_their_work_finishes) {
    scheduler s;
    stream slow_stream;
    stream fast_stream;
    mapped_words out(2);
    std::vector<int> order;
    auto slow = [&]() -> task<> {
        check(cudawait::testing::launch_spin(60'000'000, out.device, 1, slow_stream.get()),
              "launch");
        co_await slow_stream;
        order.push_back(1);
    };
    auto fast = [&]() -> task<> {
        check(cudawait::testing::launch_spin(1'000'000, out.device + 1, 2, fast_stream.get()),
              "launch");
        co_await fast_stream;
        EXPECT_NE(out.read(0), 1u) << "the slow kernel should still be running";
        order.push_back(2);
    };
    sync_wait(s, cudawait::when_all(slow(), fast()));
    EXPECT_EQ(order, (std::vector<int>{2, 1}));
}

TEST_F(scheduler_gpu, event_awaits) {
    scheduler s;
    stream st;
    mapped_words out(1);
    cudawait::event ev;
    cudawait::event never_recorded;
    auto body = [&]() -> task<std::uint32_t> {
        co_await never_recorded; // complete by definition
        check(cudawait::testing::launch_spin(20'000'000, out.device, 0xE7u, st.get()), "launch");
        ev.record(st);
        co_await ev;
        const std::uint32_t first = out.read(0);
        cudaEvent_t raw = ev.get();
        co_await raw; // raw handles work too
        co_return first;
    };
    EXPECT_EQ(sync_wait(s, body()), 0xE7u);
    EXPECT_EQ(s.pending().event_waits, 0u);
}

TEST_F(scheduler_gpu, events_of_every_device_are_awaited_from_one_scheduler) {
    const int n = cudawait::device_count();
    scheduler s;
    std::vector<stream> streams;
    std::vector<std::unique_ptr<mapped_words>> outs;
    for (int d = 0; d < n; ++d) {
        streams.emplace_back(cudawait::device_ref(d));
        outs.push_back(std::make_unique<mapped_words>(1));
    }
    auto on_device = [&](int d) -> task<std::uint32_t> {
        {
            cudawait::device_guard g{cudawait::device_ref(d)};
            check(cudawait::testing::launch_spin(5'000'000, outs[d]->device, 100u + d,
                                                 streams[d].get()),
                  "launch");
        }
        co_await streams[d];
        co_return outs[d]->read(0);
    };
    std::vector<task<std::uint32_t>> work;
    for (int d = 0; d < n; ++d) {
        work.push_back(on_device(d));
    }
    auto results = sync_wait(s, cudawait::when_all(std::move(work)));
    for (int d = 0; d < n; ++d) {
        EXPECT_EQ(results[d], 100u + d) << "device " << d;
    }
}

// 10,000 coroutines over 64 streams, each awaiting 100 kernels, every element checked after
// every await: a kernel mixes the coroutine's words on the device, a copy brings them back to
// pinned memory, and the coroutine resumes only after both, so its host model must match.
TEST_F(scheduler_gpu, ten_thousand_coroutines_on_64_streams) {
    constexpr int coroutines = 10'000;
    constexpr int nstreams = 64;
    constexpr int rounds = 100;
    constexpr std::size_t words = 32;
    scheduler s;
    std::vector<stream> streams(nstreams);
    std::uint32_t* dev = nullptr;
    std::uint32_t* pinned = nullptr;
    const std::size_t total = static_cast<std::size_t>(coroutines) * words;
    check(cudaMalloc(&dev, total * sizeof(std::uint32_t)), "cudaMalloc");
    check(cudaHostAlloc(&pinned, total * sizeof(std::uint32_t), cudaHostAllocDefault),
          "cudaHostAlloc");
    std::vector<std::uint32_t> model(total);
    std::mt19937 rng(20261129);
    for (auto& w : model) {
        w = rng();
    }
    check(cudaMemcpy(dev, model.data(), total * sizeof(std::uint32_t), cudaMemcpyHostToDevice),
          "cudaMemcpy");
    std::fill(pinned, pinned + total, 0xBADC0DEu);
    std::atomic<long> mismatches{0};
    std::atomic<long> awaits{0};

    auto worker = [&](int id) -> task<> {
        stream& st = streams[id % nstreams];
        std::uint32_t* d = dev + static_cast<std::size_t>(id) * words;
        std::uint32_t* h = pinned + static_cast<std::size_t>(id) * words;
        std::uint32_t* m = model.data() + static_cast<std::size_t>(id) * words;
        for (int r = 0; r < rounds; ++r) {
            const auto salt = static_cast<std::uint32_t>(id * 7919 + r * 104729);
            check(cudawait::testing::launch_mix(d, words, salt, st.get()), "launch_mix");
            check(cudaMemcpyAsync(h, d, words * sizeof(std::uint32_t), cudaMemcpyDeviceToHost,
                                  st.get()),
                  "cudaMemcpyAsync");
            co_await st;
            cudawait::testing::mix_on_host(m, words, salt);
            for (std::size_t i = 0; i < words; ++i) {
                if (h[i] != m[i]) {
                    mismatches.fetch_add(1);
                }
                h[i] = 0xBADC0DEu; // poison again: the next round must overwrite it
            }
            awaits.fetch_add(1);
        }
    };
    std::vector<task<>> all;
    all.reserve(coroutines);
    for (int i = 0; i < coroutines; ++i) {
        all.push_back(worker(i));
    }
    sync_wait(s, cudawait::when_all(std::move(all)));
    EXPECT_EQ(awaits.load(), static_cast<long>(coroutines) * rounds);
    EXPECT_EQ(mismatches.load(), 0);
    const auto p = s.pending();
    EXPECT_EQ(p.stream_waits, 0u);
    EXPECT_EQ(p.streams, 0u);
    check(cudaFree(dev), "cudaFree");
    check(cudaFreeHost(pinned), "cudaFreeHost");
}

// The line of the co_await in fault_child, checked against the error's call site.
unsigned g_fault_await_line = 0;

task<> await_faulting_kernel(stream& st) {
    check(cudawait::testing::launch_fault(st.get()), "launch_fault");
    g_fault_await_line = std::source_location::current().line() + 1;
    co_await st;
}

[[noreturn]] void fault_child() {
    scheduler s;
    stream st;
    try {
        sync_wait(s, await_faulting_kernel(st));
        std::fprintf(stderr, "no error observed\n");
    } catch (const cuda_error& e) {
        const bool ok =
            (e.status() == cudaErrorIllegalAddress || e.status() == cudaErrorLaunchFailure) &&
            e.sticky() && std::string(e.api()) == "cudaEventQuery" &&
            e.where().line() == g_fault_await_line &&
            std::string(e.where().file_name()).find("scheduler_test.cpp") != std::string::npos;
        std::fprintf(stderr, "%s\n%s\n", e.what(),
                     ok ? "fault observed at the co_await" : "wrong details");
        std::fflush(stderr);
        std::_Exit(ok ? 0 : 1);
    }
    std::_Exit(2);
}

TEST_F(scheduler_gpu, a_kernel_fault_is_thrown_at_the_awaiting_co_await) {
    // The fault kills the CUDA context, so it happens in a fresh child process.
    GTEST_FLAG_SET(death_test_style, "threadsafe");
    EXPECT_EXIT(fault_child(), ::testing::ExitedWithCode(0), "fault observed at the co_await");
}

// A wait added from a thread other than the loop's (a coroutine that runs on another scheduler
// and awaits this one's wait()) is handed to the loop thread, which records the stream's work
// there; the coroutine resumes on the loop thread once that work is done. Streams and events
// alike: each kernel spins for 5 ms before it writes its word, so a wait recorded too early, or a
// resume before the work finished, reads the poison.
TEST_F(scheduler_gpu, waits_added_from_another_thread_resume_on_the_loop_thread) {
    scheduler home;
    scheduler away;
    std::jthread driver([&away](std::stop_token stop) { away.run(stop); });
    stream st;
    cudawait::event ev;
    mapped_words out(2);
    auto body = [&]() -> task<int> {
        const auto home_thread = std::this_thread::get_id();
        int passed = 0;
        co_await away.schedule();
        passed += std::this_thread::get_id() != home_thread ? 1 : 0;
        check(cudawait::testing::launch_spin(5'000'000, out.device, 0x57EA3u, st.get()),
              "launch_spin");
        co_await home.wait(st); // added from away's thread
        passed += std::this_thread::get_id() == home_thread && out.read(0) == 0x57EA3u ? 1 : 0;
        co_await away.schedule();
        check(cudawait::testing::launch_spin(5'000'000, out.device + 1, 0xE7E27u, st.get()),
              "launch_spin");
        ev.record(st);
        co_await home.wait(ev); // added from away's thread
        passed += std::this_thread::get_id() == home_thread && out.read(1) == 0xE7E27u ? 1 : 0;
        co_return passed;
    };
    EXPECT_EQ(sync_wait(home, body()), 3);
    const auto p = home.pending();
    EXPECT_EQ(p.stream_waits + p.event_waits + p.streams, 0u);
}

TEST_F(scheduler_gpu, sleeping_policy_still_resumes) {
    scheduler s(poll_policy::sleeping(100us, 2ms));
    stream st;
    mapped_words out(1);
    auto body = [&]() -> task<std::uint32_t> {
        check(cudawait::testing::launch_spin(10'000'000, out.device, 77u, st.get()), "launch");
        co_await st;
        co_return out.read(0);
    };
    const auto c0 = thread_cpu_time();
    const auto t0 = clock_type::now();
    EXPECT_EQ(sync_wait(s, body()), 77u);
    const auto wall = clock_type::now() - t0;
    const auto cpu = thread_cpu_time() - c0;
    EXPECT_LT(cpu, wall / 2) << "a sleeping scheduler should not hold the core";
}

// ---- sentinels and burst completions ---------------------------------------------------------

TEST(scheduler, the_default_arms_host_function_sentinels_and_only_sentinels_rings_a_doorbell) {
    static_assert(poll_policy{}.sentinel && !poll_policy{}.doorbell && poll_policy{}.predict);
    static_assert(poll_policy::sentinels().sentinel && poll_policy::sentinels().doorbell);
    static_assert(poll_policy::sentinels().sentinel_poll > poll_policy::sentinels().sleep_max);
    static_assert(poll_policy::balanced().sentinel_poll > poll_policy::balanced().sleep_max);
    static_assert(poll_policy::sentinels().spin == poll_policy::balanced().spin &&
                  poll_policy::sentinels().yield == poll_policy::balanced().yield);
    static_assert(!poll_policy::spinning().sentinel && !poll_policy::yielding().sentinel &&
                  !poll_policy::sleeping().sentinel);
    static_assert(!poll_policy::spinning().predict && !poll_policy::yielding().predict &&
                  poll_policy::sleeping().predict);
    static_assert(!poll_policy::balanced().doorbell && !poll_policy::spinning().doorbell &&
                  !poll_policy::yielding().doorbell && !poll_policy::sleeping().doorbell);
    scheduler s;
    EXPECT_EQ(cudawait::detail::scheduler_access::sentinel_streams(s), 0u);
}

// ---- predicted wake-ups (detail::wake_history) ------------------------------------------------

using cudawait::detail::wake_history;

TEST(wake_history, predicts_nothing_until_a_period_was_recorded) {
    wake_history h;
    EXPECT_FALSE(h.predict(0ns).has_value());
    h.record(40ms);
    ASSERT_TRUE(h.predict(0ns).has_value());
    EXPECT_EQ(*h.predict(0ns), 40ms);
    h.clear();
    EXPECT_FALSE(h.predict(0ns).has_value());
}

TEST(wake_history, predicts_the_shortest_period_whose_window_is_still_ahead) {
    wake_history h;
    for (auto d : {200ms, 5ms, 50ms}) {
        h.record(d);
    }
    EXPECT_EQ(h.predict(1ms), 5ms);
    // 5 ms's window ends 5 ms + lead(5 ms) after the idle period began.
    EXPECT_EQ(h.predict(5ms + wake_history::lead(5ms) - 1us), 5ms);
    EXPECT_EQ(h.predict(5ms + wake_history::lead(5ms)), 50ms);
    EXPECT_EQ(h.predict(60ms), 200ms);
    EXPECT_FALSE(h.predict(200ms + wake_history::lead(200ms)).has_value());
}

TEST(wake_history, the_window_scales_with_the_period_within_bounds) {
    EXPECT_EQ(wake_history::lead(1ms), 50us);
    EXPECT_EQ(wake_history::lead(25600us), 100us);
    EXPECT_EQ(wake_history::lead(200ms), 500us);
    EXPECT_EQ(wake_history::lead(10s), 500us);
}

TEST(wake_history, keeps_only_the_most_recent_periods) {
    wake_history h;
    h.record(1ms); // the oldest: forgotten after `capacity` more
    for (std::size_t i = 0; i < wake_history::capacity; ++i) {
        h.record(100ms + std::chrono::milliseconds(i));
    }
    EXPECT_EQ(h.size(), wake_history::capacity);
    EXPECT_EQ(h.predict(0ns), 100ms);
}

/// A policy whose only ways out of a sleep are 10 s away (back-off, no sentinels): a wait that
/// ends well within that was woken by its prediction.
poll_policy predict_only() {
    poll_policy p = poll_policy::sleeping(10s, 10s);
    p.predict = true;
    return p;
}

TEST_F(scheduler_gpu, a_repeated_long_wait_is_woken_at_its_predicted_end) {
    stream st;
    mapped_words out(1);
    // The first wait polls every millisecond, so its length (about 100 ms) is measured closely.
    scheduler s(poll_policy::sleeping(1ms, 1ms));
    std::uint32_t tag = 0x9E0;
    auto wait_once = [&](std::uint64_t ns) -> task<std::uint32_t> {
        check(cudawait::testing::launch_spin(ns, out.device, ++tag, st.get()), "launch");
        co_await st;
        co_return out.read(0);
    };
    EXPECT_EQ(sync_wait(s, wait_once(100'000'000)), tag);
    // The next would sleep 10 s without what the first taught. It is shorter (40 ms), so that
    // it has ended by the predicted time even where other programs' kernels delay it on the GPU:
    // the loop wakes there, polls, and finds it done.
    s.set_policy(predict_only());
    const auto t0 = clock_type::now();
    EXPECT_EQ(sync_wait(s, wait_once(40'000'000)), tag);
    const auto wall = clock_type::now() - t0;
    EXPECT_GE(wall, 40ms);
    EXPECT_LT(wall, 2s) << "not woken at the predicted end";
    EXPECT_EQ(s.pending().stream_waits, 0u);
}

/// Sentinels on, and every other way out of the sleep phase 30 s away: a long wait that resumes
/// well within that was woken by its sentinel.
poll_policy sentinel_only() {
    poll_policy p = poll_policy::sentinels();
    p.sleep_min = 30s;
    p.sleep_max = 30s;
    p.sentinel_poll = 30s;
    return p;
}

constexpr auto kSentinelSlack = 5s; // far above a host function's latency, far below 30 s

using cudawait::detail::scheduler_access;
using doorbell_state = cudawait::detail::doorbell::state;

/// While alive, a scheduler's doorbell finds no stream memory operations when it is set up
/// (its first deep idle), so its sentinels are host functions: the path these first tests check.
struct doorbell_hidden {
    doorbell_hidden() { cudawait::detail::g_doorbell_hide_entry_points.store(true); }
    ~doorbell_hidden() { cudawait::detail::g_doorbell_hide_entry_points.store(false); }
    doorbell_hidden(const doorbell_hidden&) = delete;
    doorbell_hidden& operator=(const doorbell_hidden&) = delete;
};

TEST_F(scheduler_gpu, a_long_stream_wait_is_woken_by_its_sentinel_on_the_loop_thread) {
    doorbell_hidden hidden;
    scheduler s(sentinel_only());
    stream st;
    mapped_words out(1);
    std::thread::id resumed_on;
    auto body = [&]() -> task<std::uint32_t> {
        check(cudawait::testing::launch_spin(100'000'000, out.device, 0x5E471u, st.get()),
              "launch");
        co_await st;
        resumed_on = std::this_thread::get_id();
        co_return out.read(0);
    };
    const auto c0 = thread_cpu_time();
    const auto t0 = clock_type::now();
    EXPECT_EQ(sync_wait(s, body()), 0x5E471u);
    const auto wall = clock_type::now() - t0;
    const auto cpu = thread_cpu_time() - c0;
    EXPECT_EQ(resumed_on, std::this_thread::get_id());
    EXPECT_GE(wall, 100ms);
    EXPECT_LT(wall, 100ms + kSentinelSlack) << "not woken by the sentinel";
    EXPECT_LT(cpu, wall / 4) << "the sleep phase should not hold the core";
    EXPECT_GE(cudawait::detail::scheduler_access::sentinel_streams(s), 1u);
    EXPECT_EQ(s.pending().stream_waits, 0u);
}

TEST_F(scheduler_gpu, a_long_user_event_wait_is_woken_by_its_sentinel) {
    doorbell_hidden hidden;
    scheduler s(sentinel_only());
    stream st;
    mapped_words out(1);
    // A blocking-sync event and a plain one: a sentinel works whatever the user's flags.
    for (unsigned flags : {cudawait::event::default_flags,
                           unsigned{cudaEventBlockingSync | cudaEventDisableTiming}}) {
        cudawait::event ev(cudawait::device_ref(0), flags);
        out.write(0, mapped_words::poison);
        const std::uint32_t value = 0xE0E0u + flags;
        auto body = [&]() -> task<std::uint32_t> {
            check(cudawait::testing::launch_spin(60'000'000, out.device, value, st.get()),
                  "launch");
            ev.record(st);
            co_await ev;
            co_return out.read(0);
        };
        const auto t0 = clock_type::now();
        EXPECT_EQ(sync_wait(s, body()), value);
        EXPECT_LT(clock_type::now() - t0, 60ms + kSentinelSlack) << "flags " << flags;
    }
    EXPECT_GE(cudawait::detail::scheduler_access::sentinel_streams(s), 1u);
    EXPECT_EQ(s.pending().event_waits, 0u);
}

// Four streams with kernels of 40, 80, 120 and 160 ms, assigned in a random order: each await
// has its own sentinel, so each resumes as its own kernel finishes (in the order of the
// durations), not when the one sentinel-watched wait or the longest one does. Four, because the
// streams and their sentinels share the device's 8 hardware queues (CUDA_DEVICE_MAX_CONNECTIONS):
// with more, a kernel can wait behind another stream's in its queue and start late.
void many_streams_resume_in_their_kernels_order(scheduler& s) {
    constexpr int n = 4;
    std::vector<stream> streams(n);
    mapped_words out(n);
    std::vector<int> rank(n);
    for (int i = 0; i < n; ++i) {
        rank[i] = i;
    }
    std::shuffle(rank.begin(), rank.end(), std::mt19937(20261214));
    std::vector<int> order;
    auto waiter = [&](int i) -> task<> {
        const auto ns = static_cast<std::uint64_t>(rank[i] + 1) * 40'000'000u;
        check(cudawait::testing::launch_spin(ns, out.device + i, 0x1000u + i, streams[i].get()),
              "launch");
        co_await streams[i];
        EXPECT_EQ(out.read(i), 0x1000u + i) << "waiter " << i;
        order.push_back(rank[i]);
    };
    std::vector<task<>> all;
    for (int i = 0; i < n; ++i) {
        all.push_back(waiter(i));
    }
    const auto t0 = clock_type::now();
    sync_wait(s, cudawait::when_all(std::move(all)));
    EXPECT_LT(clock_type::now() - t0, 160ms + kSentinelSlack);
    std::vector<int> expected(n);
    for (int i = 0; i < n; ++i) {
        expected[i] = i;
    }
    EXPECT_EQ(order, expected) << "each await resumes when its own kernel finishes";
    const auto p = s.pending();
    EXPECT_EQ(p.stream_waits + p.streams, 0u);
}

TEST_F(scheduler_gpu, sentinels_watch_many_streams_at_once) {
    doorbell_hidden hidden;
    scheduler s(sentinel_only());
    many_streams_resume_in_their_kernels_order(s);
    EXPECT_GE(cudawait::detail::scheduler_access::sentinel_streams(s), 4u);
}

task<> long_wait(stream& st, mapped_words& out) {
    check(cudawait::testing::launch_spin(300'000'000, out.device, 0xD0DEu, st.get()), "launch");
    co_await st;
}

// The loop stops while a sentinel watches a pending wait; the scheduler is destroyed then. Its
// destructor drains the wait (woken by the sentinel, not by a 30 s poll), and the sentinel's
// host function, whenever it runs, finds the scheduler gone and does nothing.
TEST_F(scheduler_gpu, a_scheduler_destroyed_while_its_sentinel_waits_drains_and_goes) {
    doorbell_hidden hidden;
    stream st;
    mapped_words out(1);
    auto s = std::make_unique<scheduler>(sentinel_only());
    s->spawn(long_wait(st, out));
    std::stop_source stop;
    std::jthread driver([&] { s->run(stop.get_token()); });
    std::this_thread::sleep_for(50ms); // well past spin + yield: the sentinel is armed
    stop.request_stop();
    driver.join();
    EXPECT_EQ(s->pending().stream_waits, 1u);
    EXPECT_GE(cudawait::detail::scheduler_access::sentinel_streams(*s), 1u);
    const auto t0 = clock_type::now();
    s.reset();
    EXPECT_LT(clock_type::now() - t0, 300ms + kSentinelSlack);
    EXPECT_EQ(out.read(0), 0xD0DEu);
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize"); // every host function ran
}

void count_wake(void* counter) noexcept { static_cast<std::atomic<int>*>(counter)->fetch_add(1); }

// The sentinel machinery on its own: a watch destroyed while its sentinel waits is never called
// back; another watch of the same event is, once, after the record it saw (a later re-record of
// the event does not delay it); each sentinel's stream is reused once its host function ran.
TEST_F(scheduler_gpu, a_sentinel_of_a_destroyed_watch_does_nothing) {
    using cudawait::detail::idle_watch;
    std::atomic<int> kept_wakes{0};
    std::atomic<int> gone_wakes{0};
    stream st;
    cudawait::event ev;
    mapped_words out(2);
    const auto t0 = clock_type::now();
    check(cudawait::testing::launch_spin(100'000'000, out.device, 1u, st.get()), "launch");
    ev.record(st);
    idle_watch kept(&count_wake, &kept_wakes);
    {
        idle_watch gone(&count_wake, &gone_wakes);
        ASSERT_EQ(gone.arm(ev.get(), 0), cudaSuccess);
        EXPECT_EQ(gone.armed_count(), 1u);
        ASSERT_EQ(kept.arm(ev.get(), -1), cudaSuccess);
    } // destroyed while its sentinel waits for the kernel
    check(cudawait::testing::launch_spin(400'000'000, out.device + 1, 2u, st.get()), "launch");
    ev.record(st); // seen by no sentinel
    while (kept_wakes.load() == 0 && clock_type::now() - t0 < 10s) {
        std::this_thread::sleep_for(1ms);
    }
    const auto woke_after = clock_type::now() - t0;
    EXPECT_EQ(kept_wakes.load(), 1);
    EXPECT_EQ(out.read(0), 1u);
    EXPECT_LT(woke_after, 400ms) << "the sentinel waited for the re-record";
    EXPECT_EQ(kept.armed_count(), 0u);
    // Its stream is free again: the next sentinel reuses it.
    ASSERT_EQ(kept.arm(ev.get(), 0), cudaSuccess);
    EXPECT_EQ(kept.stream_count(), 1u);
    st.sync();
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    const auto t1 = clock_type::now();
    while (kept_wakes.load() < 2 && clock_type::now() - t1 < 10s) {
        std::this_thread::sleep_for(1ms);
    }
    EXPECT_EQ(kept_wakes.load(), 2);
    EXPECT_EQ(out.read(1), 2u);
    EXPECT_EQ(gone_wakes.load(), 0);
}

// A burst: 2,000 awaits queue on one stream behind a 50 ms kernel, each behind its own small
// kernel that writes a random word; most complete within microseconds, so the loop finds long
// done prefixes and completes them without querying each event, while every 97th kernel spins
// for 2 ms first, so that prefixes also end part-way (the bisection). Every coroutine must
// resume in enqueue order, after its own kernel and every earlier one wrote.
TEST_F(scheduler_gpu, a_burst_of_completions_on_one_stream_resumes_in_order_after_its_work) {
    constexpr int n = 2000;
    for (const poll_policy policy : {poll_policy::spinning(), poll_policy::balanced()}) {
        scheduler s(policy);
        stream st;
        mapped_words out(n);
        std::vector<std::uint32_t> expected(n);
        std::mt19937 rng(20261215);
        for (auto& v : expected) {
            v = rng() | 1u; // never the poison, which is even
        }
        check(cudawait::testing::launch_spin(50'000'000, nullptr, 0, st.get()), "launch");
        std::vector<int> order;
        long unwritten = 0;
        auto waiter = [&](int i) -> task<> {
            const std::uint64_t ns = i % 97 == 0 ? 2'000'000u : 0u;
            check(cudawait::testing::launch_spin(ns, out.device + i, expected[i], st.get()),
                  "launch");
            co_await st;
            for (int j = 0; j <= i; ++j) {
                unwritten += out.read(j) != expected[j] ? 1 : 0;
            }
            order.push_back(i);
        };
        std::vector<task<>> all;
        all.reserve(n);
        for (int i = 0; i < n; ++i) {
            all.push_back(waiter(i));
        }
        sync_wait(s, cudawait::when_all(std::move(all)));
        EXPECT_EQ(unwritten, 0);
        ASSERT_EQ(order.size(), static_cast<std::size_t>(n));
        for (int i = 0; i < n; ++i) {
            ASSERT_EQ(order[i], i);
        }
        const auto p = s.pending();
        EXPECT_EQ(p.stream_waits + p.streams, 0u);
    }
}

// ---- the doorbell: deep idle blocked in the driver -------------------------------------------
//
// With sentinels on and no timer pending, the loop blocks in cudaEventSynchronize on the
// doorbell's blocking-sync event; sentinels that write the doorbell word, posts and stops end
// that (detail/doorbell.hpp). sentinel_only() leaves the backstop 30 s away, so a wait that
// resumes well within it was woken by the doorbell. These expect a device with the driver's
// stream memory operations (every device of a CUDA 12 driver with unified addressing).

/// Waits up to 5 s for the loop of `s` to block on its doorbell.
bool blocked_on_doorbell(const scheduler& s) {
    const auto until = clock_type::now() + 5s;
    while (!scheduler_access::idle_doorbell(s).blocked()) {
        if (clock_type::now() > until) {
            return false;
        }
        std::this_thread::sleep_for(100us);
    }
    return true;
}

TEST_F(scheduler_gpu, a_long_wait_resumes_through_the_doorbell_on_the_loop_thread) {
    scheduler s(sentinel_only());
    stream st;
    mapped_words out(1);
    std::thread::id resumed_on;
    auto body = [&]() -> task<std::uint32_t> {
        check(cudawait::testing::launch_spin(150'000'000, out.device, 0xD00Bu, st.get()), "launch");
        co_await st;
        resumed_on = std::this_thread::get_id();
        co_return out.read(0);
    };
    const auto c0 = thread_cpu_time();
    const auto t0 = clock_type::now();
    EXPECT_EQ(sync_wait(s, body()), 0xD00Bu);
    const auto wall = clock_type::now() - t0;
    const auto cpu = thread_cpu_time() - c0;
    EXPECT_EQ(resumed_on, std::this_thread::get_id());
    EXPECT_GE(wall, 150ms);
    EXPECT_LT(wall, 150ms + kSentinelSlack) << "not woken by the doorbell";
    EXPECT_LT(cpu, wall / 4) << "blocked in the driver, the loop should not hold the core";
    // A user event, of either kind, rings it alike.
    for (unsigned flags : {cudawait::event::default_flags,
                           unsigned{cudaEventBlockingSync | cudaEventDisableTiming}}) {
        cudawait::event ev(cudawait::device_ref(0), flags);
        out.write(0, mapped_words::poison);
        const std::uint32_t value = 0xB0B0u + flags;
        auto on_event = [&]() -> task<std::uint32_t> {
            check(cudawait::testing::launch_spin(60'000'000, out.device, value, st.get()),
                  "launch");
            ev.record(st);
            co_await ev;
            co_return out.read(0);
        };
        const auto t1 = clock_type::now();
        EXPECT_EQ(sync_wait(s, on_event()), value);
        EXPECT_LT(clock_type::now() - t1, 60ms + kSentinelSlack) << "flags " << flags;
    }
    const auto& bell = scheduler_access::idle_doorbell(s);
    EXPECT_EQ(bell.current_state(), doorbell_state::ready) << "no stream memory operations";
    EXPECT_GE(bell.rounds(), 3u);
    EXPECT_GE(bell.stream_count(), 1u);
    EXPECT_EQ(bell.backstop_rings(), 0u);
    EXPECT_EQ(scheduler_access::sentinel_streams(s), 0u) << "took the host-function path";
    const auto p = s.pending();
    EXPECT_EQ(p.stream_waits + p.event_waits, 0u);
}

// The loop blocks on the doorbell behind a 1 s kernel; posts from this thread must each run on
// the loop thread within 50 ms (a thread wake-up and the GPU seeing the word, not the backstop's
// 30 s), and so must the stop.
TEST_F(scheduler_gpu, a_post_from_another_thread_wakes_a_loop_blocked_on_the_doorbell) {
    stream st;
    mapped_words out(1);
    auto s = std::make_unique<scheduler>(sentinel_only());
    auto one_second = [&]() -> task<> {
        check(cudawait::testing::launch_spin(1'000'000'000, out.device, 0x9057u, st.get()),
              "launch");
        co_await st;
    };
    s->spawn(one_second());
    // Declared before the driver, so that a post still queued when an assertion returns finds
    // them; the driver's own stop token, so that its destructor (on any return) stops the loop.
    std::atomic<bool> ran{false};
    std::thread::id ran_on;
    std::jthread driver([&](std::stop_token stop) { s->run(stop); });
    for (int i = 0; i < 5; ++i) {
        ASSERT_TRUE(blocked_on_doorbell(*s)) << "post " << i;
        ran.store(false);
        const auto t0 = clock_type::now();
        s->post([&] {
            ran_on = std::this_thread::get_id();
            ran.store(true);
        });
        while (!ran.load() && clock_type::now() - t0 < 5s) {
            std::this_thread::sleep_for(20us);
        }
        const auto latency = clock_type::now() - t0;
        ASSERT_TRUE(ran.load()) << "post " << i;
        EXPECT_LT(latency, 50ms) << "post " << i;
        EXPECT_EQ(ran_on, driver.get_id());
    }
    ASSERT_TRUE(blocked_on_doorbell(*s));
    const auto t1 = clock_type::now();
    driver.request_stop();
    driver.join();
    EXPECT_LT(clock_type::now() - t1, 50ms) << "the stop did not ring the doorbell";
    EXPECT_EQ(s->pending().stream_waits, 1u);
    EXPECT_EQ(scheduler_access::idle_doorbell(*s).backstop_rings(), 0u);
    EXPECT_EQ(scheduler_access::sentinel_streams(*s), 0u);
    s.reset();
    EXPECT_EQ(out.read(0), 0x9057u);
}

TEST_F(scheduler_gpu, the_doorbell_resumes_many_streams_in_their_kernels_order) {
    scheduler s(sentinel_only());
    many_streams_resume_in_their_kernels_order(s);
    const auto& bell = scheduler_access::idle_doorbell(s);
    EXPECT_EQ(bell.current_state(), doorbell_state::ready);
    EXPECT_GE(bell.stream_count(), 4u) << "one doorbell sentinel per stream";
    EXPECT_GE(bell.rounds(), 4u);
    EXPECT_EQ(scheduler_access::sentinel_streams(s), 0u);
}

// The loop is stopped while blocked on the doorbell (the stop rings it), with a wait pending and
// its doorbell sentinel armed; the destructor drains the wait, woken by the doorbell again, then
// rings it, synchronises its streams and frees the word before any stream could write it.
TEST_F(scheduler_gpu, a_scheduler_destroyed_after_blocking_on_the_doorbell_drains_and_goes) {
    stream st;
    mapped_words out(1);
    auto s = std::make_unique<scheduler>(sentinel_only());
    s->spawn(long_wait(st, out));
    std::jthread driver([&](std::stop_token stop) { s->run(stop); });
    ASSERT_TRUE(blocked_on_doorbell(*s));
    driver.request_stop();
    driver.join();
    EXPECT_EQ(s->pending().stream_waits, 1u);
    EXPECT_GE(scheduler_access::idle_doorbell(*s).rounds(), 1u);
    EXPECT_GE(scheduler_access::idle_doorbell(*s).stream_count(), 1u);
    const auto t0 = clock_type::now();
    s.reset();
    EXPECT_LT(clock_type::now() - t0, 300ms + kSentinelSlack);
    EXPECT_EQ(out.read(0), 0xD0DEu);
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
}

// A timer pending (here a 1.5 s sleep beside a 100 ms kernel): the loop keeps the host-function
// sentinels and its condition variable, and the kernel's await still resumes long before the
// timer, woken by its sentinel; the doorbell is never set up.
TEST_F(scheduler_gpu, a_pending_timer_keeps_the_host_function_path) {
    scheduler s(sentinel_only());
    stream st;
    mapped_words out(1);
    const auto t0 = clock_type::now();
    clock_type::duration kernel_after{};
    clock_type::duration timer_after{};
    auto gpu = [&]() -> task<> {
        check(cudawait::testing::launch_spin(100'000'000, out.device, 0x71E5u, st.get()), "launch");
        co_await st;
        kernel_after = clock_type::now() - t0;
    };
    auto timer = [&]() -> task<> {
        co_await sleep_for(1500ms);
        timer_after = clock_type::now() - t0;
    };
    std::vector<task<>> both;
    both.push_back(gpu());
    both.push_back(timer());
    sync_wait(s, cudawait::when_all(std::move(both)));
    EXPECT_EQ(out.read(0), 0x71E5u);
    EXPECT_GE(kernel_after, 100ms);
    EXPECT_LT(kernel_after, 1000ms) << "not woken by its host-function sentinel";
    EXPECT_GE(timer_after, 1500ms);
    const auto& bell = scheduler_access::idle_doorbell(s);
    EXPECT_EQ(bell.current_state(), doorbell_state::unused);
    EXPECT_EQ(bell.rounds(), 0u);
    EXPECT_GE(scheduler_access::sentinel_streams(s), 1u);
}

// Where the driver's entry points are missing (injected here), the doorbell is unavailable and
// the same long wait is woken by a host-function sentinel.
TEST_F(scheduler_gpu, without_stream_memory_operations_sentinels_are_host_functions) {
    doorbell_hidden hidden;
    scheduler s(sentinel_only());
    stream st;
    mapped_words out(1);
    auto body = [&]() -> task<std::uint32_t> {
        check(cudawait::testing::launch_spin(100'000'000, out.device, 0xFA11u, st.get()), "launch");
        co_await st;
        co_return out.read(0);
    };
    const auto t0 = clock_type::now();
    EXPECT_EQ(sync_wait(s, body()), 0xFA11u);
    EXPECT_LT(clock_type::now() - t0, 100ms + kSentinelSlack) << "not woken by the sentinel";
    const auto& bell = scheduler_access::idle_doorbell(s);
    EXPECT_EQ(bell.current_state(), doorbell_state::unavailable);
    EXPECT_EQ(bell.rounds(), 0u);
    EXPECT_EQ(bell.stream_count(), 0u);
    EXPECT_GE(scheduler_access::sentinel_streams(s), 1u);
}

} // namespace
