// SPDX-License-Identifier: Apache-2.0
// pipeline_test: streaming, and streaming that cannot hang (timeouts, depth that recovers).
#include <cudawait/core/detail/wait_list.hpp>

#include "pipeline_checks.hpp"

// ---- allocation probes: this program's operator new counts, and can refuse, the calling
// thread's allocations while an allocation_probe lives ----------------------------------------

namespace {
thread_local bool t_probing = false;
thread_local bool t_refusing = false;
thread_local std::size_t t_allocations = 0;
} // namespace

// Not inlined: g++ would then see free() meet a pointer from operator new and warn.
[[gnu::noinline]] void* operator new(std::size_t n) {
    if (t_probing) {
        ++t_allocations;
        if (t_refusing) {
            throw std::bad_alloc();
        }
    }
    if (void* p = std::malloc(n == 0 ? 1 : n)) {
        return p;
    }
    throw std::bad_alloc();
}
[[gnu::noinline]] void* operator new[](std::size_t n) { return ::operator new(n); }
[[gnu::noinline]] void operator delete(void* p) noexcept { std::free(p); }
[[gnu::noinline]] void operator delete[](void* p) noexcept { std::free(p); }
[[gnu::noinline]] void operator delete(void* p, std::size_t) noexcept { std::free(p); }
[[gnu::noinline]] void operator delete[](void* p, std::size_t) noexcept { std::free(p); }

namespace {

using namespace cudawait::testing::pipeline_checks;

/// Counts the allocations the calling thread makes while it lives; with `refuse`, each throws
/// std::bad_alloc instead. No gtest assertion inside its scope (they allocate).
class allocation_probe {
public:
    explicit allocation_probe(bool refuse = false) noexcept {
        t_allocations = 0;
        t_refusing = refuse;
        t_probing = true;
    }
    allocation_probe(const allocation_probe&) = delete;
    allocation_probe& operator=(const allocation_probe&) = delete;
    ~allocation_probe() {
        t_probing = false;
        t_refusing = false;
    }
    [[nodiscard]] std::size_t count() const noexcept { return t_allocations; }
};

// ---- streaming --------------------------------------------------------------------------------

TEST_F(pipeline_gpu, streaming_delivers_in_order_with_back_pressure) {
    const std::size_t chunk = 40'000;
    std::vector<std::vector<u32>> chunks;
    std::mt19937 sizes(1);
    for (std::size_t i = 0; i < 40; ++i) {
        chunks.push_back(random_words(1 + sizes() % chunk, i));
    }
    for (bool graph : {false, true}) {
        pipeline_options o;
        o.memory.group_bytes = 0; // one chunk per flight
        o.chunk_elements = chunk;
        o.depth = 3;
        o.graph = graph;
        pipe_t p(o, {transform_stage(100'000)});
        stream_log log;
        cudawait::scheduler sched;
        cudawait::sync_wait(sched,
                            cudawait::when_all(producer(p, chunks, log), consumer(p, chunks, log)));
        EXPECT_EQ(log.consumed, chunks.size()) << "graph " << graph;
        EXPECT_EQ(log.bad, 0u);
        EXPECT_EQ(log.out_of_order, 0u);
        EXPECT_LE(log.max_outstanding, 3u + 1u) << "more chunks in flight than slots";
    }
}

// ---- streaming that cannot hang, and depth that recovers --------------------------------------

using clock_type = std::chrono::steady_clock;

double ms_since(clock_type::time_point t0) {
    return std::chrono::duration<double, std::milli>(clock_type::now() - t0).count();
}

TEST(pipeline_wait_list, wait_until_ends_at_the_deadline_or_at_a_notify_never_both) {
    cudawait::scheduler sched;
    cudawait::detail::wait_list list;
    std::vector<std::pair<bool, double>> woke; // (notified, ms waited)
    auto waiter = [&](std::chrono::milliseconds d) -> cudawait::task<void> {
        cudawait::scheduler& s = co_await cudawait::this_scheduler();
        auto t0 = clock_type::now();
        bool notified = co_await list.wait_until(s, t0 + d);
        woke.emplace_back(notified, ms_since(t0));
    };
    auto notifier = [&]() -> cudawait::task<void> {
        co_await cudawait::sleep_for(40ms);
        list.notify_all(); // wakes the 500 ms waiter; the 10 ms one timed out already
        co_await cudawait::sleep_for(600ms); // past the woken one's deadline: no second resume
        list.notify_all();                   // nobody waits: nothing happens
    };
    cudawait::sync_wait(sched, cudawait::when_all(waiter(10ms), waiter(500ms), notifier()));
    ASSERT_EQ(woke.size(), 2u);
    EXPECT_FALSE(woke[0].first) << "the 10 ms waiter timed out";
    EXPECT_GE(woke[0].second, 10.0);
    EXPECT_LT(woke[0].second, 150.0);
    EXPECT_TRUE(woke[1].first) << "the 500 ms waiter was notified";
    EXPECT_GE(woke[1].second, 40.0);
    EXPECT_LT(woke[1].second, 400.0);
    // A deadline already passed does not suspend.
    woke.clear();
    auto late = [&]() -> cudawait::task<void> {
        cudawait::scheduler& s = co_await cudawait::this_scheduler();
        auto t0 = clock_type::now();
        bool notified = co_await list.wait_until(s, t0 - 1ms);
        woke.emplace_back(notified, ms_since(t0));
    };
    cudawait::sync_wait(sched, late());
    ASSERT_EQ(woke.size(), 1u);
    EXPECT_FALSE(woke[0].first);
    EXPECT_LT(woke[0].second, 5.0);
}

// A notify on a noexcept path (a slot given back) whose resumes the scheduler cannot queue for
// want of memory neither throws nor drops the waiters: the next notify resumes them.
TEST(pipeline_wait_list, a_notify_that_cannot_queue_a_resume_keeps_its_waiters) {
    cudawait::scheduler sched;
    cudawait::detail::wait_list list;
    std::vector<bool> woke; // notified, per waiter resumed
    auto waiter = [&]() -> cudawait::task<void> {
        cudawait::scheduler& s = co_await cudawait::this_scheduler();
        woke.push_back(co_await list.wait_until(s, clock_type::now() + 5s));
    };
    std::size_t refused = 0;
    bool threw = false;
    std::size_t woke_before = 99;
    auto notifier = [&]() -> cudawait::task<void> {
        co_await cudawait::sleep_for(20ms); // both wait by now
        {
            allocation_probe probe(true);
            try {
                list.notify_all();
            } catch (...) {
                threw = true;
            }
            refused = probe.count();
        }
        co_await cudawait::sleep_for(20ms);
        woke_before = woke.size();
        list.notify_all();
    };
    const auto t0 = clock_type::now();
    cudawait::sync_wait(sched, cudawait::when_all(waiter(), waiter(), notifier()));
    ASSERT_GT(refused, 0u) << "queueing the resumes allocated nothing: no failure to test";
    EXPECT_FALSE(threw);
    EXPECT_EQ(woke_before, 0u) << "a resume that could not be queued happened";
    EXPECT_EQ(woke, (std::vector<bool>{true, true})) << "both notified, neither timed out";
    EXPECT_LT(ms_since(t0), 2000.0);
}

/// Fills a slot with `c` and submits it.
cudawait::task<void> submit_chunk(pipe_t& p, const std::vector<u32>& c) {
    auto slot = co_await p.acquire();
    std::copy(c.begin(), c.end(), slot.data().begin());
    p.submit(std::move(slot), c.size());
}

/// The result is chunk `index` of `chunks`, transformed right.
::testing::AssertionResult right_result(const std::optional<pipe_t::result>& r,
                                        const std::vector<std::vector<u32>>& chunks,
                                        std::size_t index) {
    if (!r) {
        return ::testing::AssertionFailure() << "no result where chunk " << index << " was due";
    }
    if (r->chunk() != index) {
        return ::testing::AssertionFailure() << "chunk " << r->chunk() << " instead of " << index;
    }
    const auto& in = chunks[index];
    std::vector<u32> want(in.size());
    cudawait::testing::transform_on_host(in.data(), want.data(), in.size(), salt);
    if (!std::equal(want.begin(), want.end(), r->data().begin(), r->data().end())) {
        return ::testing::AssertionFailure() << "chunk " << index << "'s output is wrong";
    }
    return ::testing::AssertionSuccess();
}

/// A stage whose call number `stuck_call` first spins until *flag (mapped) is set (20 s at most).
pipe_t::stage flag_stage(const u32* flag, int stuck_call, std::shared_ptr<int> calls) {
    return [flag, stuck_call, calls](std::span<u32> a, std::span<u32> b, cudawait::stream_ref s) {
        if ((*calls)++ == stuck_call) {
            cudawait::check(cudawait::testing::launch_wait_flag(flag, 20'000'000'000ull, s.get()),
                            "launch_wait_flag");
        }
        cudawait::check(
            cudawait::testing::launch_transform(a.data(), b.data(), a.size(), salt, 0, s.get()),
            "launch_transform");
    };
}

TEST_F(pipeline_gpu, a_timeout_is_a_usage_error_when_negative_and_a_poll_when_zero) {
    pipeline_options o;
    o.memory.group_bytes = 0; // one chunk per flight
    o.chunk_elements = 1000;
    o.depth = 2;
    pipe_t p(o, {transform_stage()});
    EXPECT_THROW((void)p.acquire(-1ns), usage_error) << "thrown at the call";
    EXPECT_THROW((void)p.next(-1ms), usage_error);
    std::vector<std::vector<u32>> chunks{random_words(1000, 70)};
    cudawait::scheduler sched;
    cudawait::sync_wait(sched, [&]() -> cudawait::task<void> {
        // Nothing submitted: a zero timeout (and a deadline already passed) fails at once.
        auto t0 = clock_type::now();
        EXPECT_THROW((void)co_await p.next(0ns), cudawait::timeout_error);
        EXPECT_THROW((void)co_await p.next(clock_type::now() - 1s), cudawait::timeout_error);
        EXPECT_LT(ms_since(t0), 50.0);
        // A slot is free: a zero timeout takes it.
        auto slot = co_await p.acquire(0ns);
        std::copy(chunks[0].begin(), chunks[0].end(), slot.data().begin());
        p.submit(std::move(slot), chunks[0].size());
        EXPECT_TRUE(right_result(co_await p.next(5s), chunks, 0));
        p.close();
        EXPECT_FALSE(co_await p.next(0ns)) << "closed and drained: the end, not a timeout";
    }());
}

TEST_F(pipeline_gpu, next_with_a_timeout_fails_on_time_and_the_chunk_stays_in_line) {
    const std::size_t chunk = 30'000;
    std::vector<std::vector<u32>> chunks;
    for (std::size_t i = 0; i < 5; ++i) {
        chunks.push_back(random_words(chunk - i * 7, 80 + i));
    }
    cudawait::mapped_buffer<u32> release_flag(1);
    release_flag[0] = 0;
    pipeline_options o;
    o.memory.group_bytes = 0; // one chunk per flight
    o.chunk_elements = chunk;
    o.depth = 3;
    std::vector<cudawait::chunk_failure> log;
    o.recovery.on_degrade = [&](const cudawait::chunk_failure& f) { log.push_back(f); };
    pipe_t p(o, {flag_stage(release_flag.device_data(), 1, std::make_shared<int>(0))},
             host_fallback);
    cudawait::scheduler sched;
    std::vector<double> waited; // ms: next(100ms), next(0ns), next(now + 50ms)
    std::vector<std::int64_t> after_ns;
    std::vector<std::size_t> delivered;
    cudawait::sync_wait(sched, [&]() -> cudawait::task<void> {
        for (std::size_t i = 0; i < 3; ++i) {
            co_await submit_chunk(p, chunks[i]);
        }
        {
            auto r = co_await p.next();
            EXPECT_TRUE(right_result(r, chunks, 0));
            delivered.push_back(r->chunk());
        }
        // Chunk 1 waits for the flag: each timed call gives up on time and takes nothing.
        for (int call = 0; call < 3; ++call) {
            auto t0 = clock_type::now();
            try {
                if (call == 0) {
                    (void)co_await p.next(100ms);
                } else if (call == 1) {
                    (void)co_await p.next(0ns);
                } else {
                    (void)co_await p.next(clock_type::now() + 50ms);
                }
                ADD_FAILURE() << "call " << call << " returned";
            } catch (const cudawait::timeout_error& e) {
                after_ns.push_back(e.after().count());
            }
            waited.push_back(ms_since(t0));
        }
        std::atomic_ref<u32>(release_flag[0]).store(1);
        for (std::size_t i = 1; i < 5; ++i) {
            if (i >= 3) {
                co_await submit_chunk(p, chunks[i]);
            }
            auto r = co_await p.next(10s);
            EXPECT_TRUE(right_result(r, chunks, i));
            delivered.push_back(r->chunk());
        }
        p.close();
        EXPECT_FALSE(co_await p.next());
    }());
    std::atomic_ref<u32>(release_flag[0]).store(1); // on a failure above, before teardown
    ASSERT_EQ(waited.size(), 3u);
    EXPECT_GE(waited[0], 100.0);
    EXPECT_LT(waited[0], 100.0 + 150.0) << "next(100ms) gave up late";
    EXPECT_LT(waited[1], 20.0) << "next(0ns) polls";
    EXPECT_GE(waited[2], 45.0);
    EXPECT_LT(waited[2], 50.0 + 150.0);
    ASSERT_EQ(after_ns.size(), 3u);
    EXPECT_EQ(after_ns[0], std::int64_t{100'000'000});
    EXPECT_EQ(after_ns[1], 0);
    EXPECT_EQ(delivered, (std::vector<std::size_t>{0, 1, 2, 3, 4})) << "in order, once each";
    auto st = p.stats();
    EXPECT_EQ(st.chunks, 5u);
    EXPECT_EQ(st.gpu_chunks, 5u);
    EXPECT_EQ(st.fallback_chunks + st.failed_chunks + st.retries, 0u);
    EXPECT_TRUE(log.empty()) << "a caller's timeout is no degradation";
}

TEST_F(pipeline_gpu, acquire_with_a_timeout_fails_on_time_while_slots_and_queue_are_full) {
    const std::size_t chunk = 20'000;
    std::vector<std::vector<u32>> chunks;
    for (std::size_t i = 0; i < 3; ++i) {
        chunks.push_back(random_words(chunk, 90 + i));
    }
    cudawait::mapped_buffer<u32> release_flag(1);
    release_flag[0] = 0;
    pipeline_options o;
    o.memory.group_bytes = 0; // one chunk per flight
    o.chunk_elements = chunk;
    o.depth = 2;
    o.memory.queue_capacity = 2;
    pipe_t p(o, {flag_stage(release_flag.device_data(), 0, std::make_shared<int>(0))});
    cudawait::scheduler sched;
    double waited = 0;
    std::int64_t after = -1;
    cudawait::sync_wait(sched, [&]() -> cudawait::task<void> {
        co_await submit_chunk(p, chunks[0]); // stuck until the flag
        co_await submit_chunk(p, chunks[1]);
        auto t0 = clock_type::now();
        try {
            (void)co_await p.acquire(80ms);
            ADD_FAILURE() << "acquire returned a slot while every slot was busy";
        } catch (const cudawait::timeout_error& e) {
            after = e.after().count();
        }
        waited = ms_since(t0);
        EXPECT_THROW((void)co_await p.acquire(0ns), cudawait::timeout_error);
        std::atomic_ref<u32>(release_flag[0]).store(1);
        EXPECT_TRUE(right_result(co_await p.next(10s), chunks, 0));
        // Chunk 0's result is gone: its slot and a queue place are free again.
        auto slot = co_await p.acquire(10s);
        std::copy(chunks[2].begin(), chunks[2].end(), slot.data().begin());
        p.submit(std::move(slot), chunks[2].size());
        EXPECT_TRUE(right_result(co_await p.next(10s), chunks, 1));
        EXPECT_TRUE(right_result(co_await p.next(10s), chunks, 2));
        p.close();
        EXPECT_FALSE(co_await p.next());
    }());
    std::atomic_ref<u32>(release_flag[0]).store(1);
    EXPECT_GE(waited, 80.0);
    EXPECT_LT(waited, 80.0 + 150.0) << "acquire(80ms) gave up late";
    EXPECT_EQ(after, std::int64_t{80'000'000});
    EXPECT_EQ(p.stats().gpu_chunks, 3u);
}

// While next() waits for the chunk at the front of the queue, that chunk keeps its place: with
// queue_capacity 1, a producer cannot submit behind it even though a slot is free, and once
// next() times out the queue holds one chunk, not two.
TEST_F(pipeline_gpu, a_chunk_that_next_waits_for_keeps_its_place_in_the_queue) {
    const std::size_t chunk = 20'000;
    std::vector<std::vector<u32>> chunks;
    for (std::size_t i = 0; i < 2; ++i) {
        chunks.push_back(random_words(chunk, 120 + i));
    }
    cudawait::mapped_buffer<u32> release_flag(1);
    release_flag[0] = 0;
    pipeline_options o;
    o.memory.group_bytes = 0; // one chunk per flight
    o.chunk_elements = chunk;
    o.depth = 2;
    o.memory.queue_capacity = 1;
    pipe_t p(o, {flag_stage(release_flag.device_data(), 0, std::make_shared<int>(0))});
    cudawait::scheduler sched;
    bool next_timed_out = false;
    bool acquire_timed_out = false;
    cudawait::sync_wait(sched, [&]() -> cudawait::task<void> {
        co_await submit_chunk(p, chunks[0]); // stuck until the flag
        auto consumer = [&]() -> cudawait::task<void> {
            try {
                (void)co_await p.next(150ms);
            } catch (const cudawait::timeout_error&) {
                next_timed_out = true;
            }
        };
        auto producer = [&]() -> cudawait::task<void> {
            co_await cudawait::sleep_for(20ms); // next() is waiting by now
            try {
                auto slot = co_await p.acquire(60ms);
                ADD_FAILURE() << "a slot was handed out while the queue was full";
                std::copy(chunks[1].begin(), chunks[1].end(), slot.data().begin());
                p.submit(std::move(slot), chunks[1].size());
            } catch (const cudawait::timeout_error&) {
                acquire_timed_out = true;
            }
        };
        co_await cudawait::when_all(consumer(), producer());
        std::atomic_ref<u32>(release_flag[0]).store(1);
        EXPECT_TRUE(right_result(co_await p.next(10s), chunks, 0));
        co_await submit_chunk(p, chunks[1]);
        EXPECT_TRUE(right_result(co_await p.next(10s), chunks, 1));
        p.close();
        EXPECT_FALSE(co_await p.next(10s)) << "no chunk beyond the two submitted";
    }());
    std::atomic_ref<u32>(release_flag[0]).store(1);
    EXPECT_TRUE(next_timed_out);
    EXPECT_TRUE(acquire_timed_out);
    EXPECT_EQ(p.stats().gpu_chunks, 2u);
}

// Every slot holds a hung chunk that was given up: the producer still gets slots (with fresh
// pinned buffers, the old ones kept while the GPU may write them) and the fallback produces
// the chunks that follow; nothing waits for the hung kernel.
TEST_F(pipeline_gpu, slots_of_given_up_chunks_serve_the_producer_again) {
    const std::size_t chunk = 20'000;
    std::vector<std::vector<u32>> chunks;
    for (std::size_t i = 0; i < 5; ++i) {
        chunks.push_back(random_words(chunk, 130 + i));
    }
    cudawait::mapped_buffer<u32> release_flag(1);
    release_flag[0] = 0;
    pipeline_options o;
    o.memory.group_bytes = 0; // one chunk per flight
    o.chunk_elements = chunk;
    o.depth = 2;
    o.memory.queue_capacity = 2;
    o.recovery.chunk_timeout = 30ms;
    o.recovery.max_retries = 0;
    o.recovery.on_degrade = [](const cudawait::chunk_failure&) {};
    pipe_t p(o, {flag_stage(release_flag.device_data(), 0, std::make_shared<int>(0))},
             host_fallback);
    cudawait::scheduler sched;
    std::vector<std::vector<std::size_t>> failed;
    std::vector<std::size_t> by_fallback;
    std::vector<const u32*> old_inputs;
    cudawait::sync_wait(sched, [&]() -> cudawait::task<void> {
        for (std::size_t i = 0; i < 2; ++i) {
            auto slot = co_await p.acquire(1s);
            old_inputs.push_back(slot.data().data());
            std::copy(chunks[i].begin(), chunks[i].end(), slot.data().begin());
            p.submit(std::move(slot), chunks[i].size());
        }
        for (int i = 0; i < 2; ++i) { // chunk 0 hangs, chunk 1 is behind it
            try {
                (void)co_await p.next(10s);
                ADD_FAILURE() << "a hung chunk was delivered";
            } catch (const pipeline_error& e) {
                failed.push_back(e.failed());
            }
        }
        for (std::size_t i = 2; i < 5; ++i) {
            auto slot = co_await p.acquire(2s); // timed: a slot that never comes fails the test
            for (const u32* old : old_inputs) {
                EXPECT_NE(slot.data().data(), old) << "the GPU may still read the old buffer";
            }
            std::copy(chunks[i].begin(), chunks[i].end(), slot.data().begin());
            p.submit(std::move(slot), chunks[i].size());
            auto r = co_await p.next(10s);
            EXPECT_TRUE(right_result(r, chunks, i));
            if (r && r->by_fallback()) {
                by_fallback.push_back(r->chunk());
            }
        }
        p.close();
        EXPECT_FALSE(co_await p.next(10s));
    }());
    std::atomic_ref<u32>(release_flag[0]).store(1); // the hung kernel ends before teardown
    EXPECT_EQ(failed, (std::vector<std::vector<std::size_t>>{{0}, {1}}));
    EXPECT_EQ(by_fallback, (std::vector<std::size_t>{2, 3, 4}));
    auto st = p.stats();
    EXPECT_TRUE(st.gpu_abandoned);
    EXPECT_EQ(st.chunks, 5u);
    EXPECT_EQ(st.failed_chunks, 2u);
    EXPECT_EQ(st.fallback_chunks, 3u);
}

// Giving a slot back (an input_slot dropped, a result destroyed: noexcept destructors) makes no
// allocation, however often it happens.
TEST_F(pipeline_gpu, giving_slots_back_allocates_nothing) {
    const std::size_t chunk = 1000;
    pipeline_options o;
    o.memory.group_bytes = 0; // one chunk per flight
    o.chunk_elements = chunk;
    o.depth = 2;
    pipe_t p(o, {transform_stage()}, host_fallback);
    std::vector<std::vector<u32>> chunks{random_words(chunk, 560)};
    cudawait::scheduler sched;
    std::size_t allocations = 0;
    std::size_t wrong = 0;
    cudawait::sync_wait(sched, [&]() -> cudawait::task<void> {
        for (int i = 0; i < 200; ++i) {
            auto slot = co_await p.acquire();
            if (i % 2 == 0) {
                allocation_probe probe;
                { pipe_t::input_slot dropped = std::move(slot); }
                allocations += probe.count();
                continue;
            }
            std::copy(chunks[0].begin(), chunks[0].end(), slot.data().begin());
            p.submit(std::move(slot), chunk);
            auto r = co_await p.next();
            if (!r || r->by_fallback() ||
                !std::equal(r->data().begin(), r->data().end(),
                            expected(chunks[0], chunk).begin())) {
                ++wrong;
            }
            allocation_probe probe;
            r.reset();
            allocations += probe.count();
        }
        p.close();
        EXPECT_FALSE(co_await p.next());
    }());
    EXPECT_EQ(allocations, 0u);
    EXPECT_EQ(wrong, 0u);
}

// The last chunk of a slot group given up after chunk_timeout, given back: the group's pinned
// buffers move to the abandoned ones without an allocation.
TEST_F(pipeline_gpu, giving_back_a_slot_group_given_up_allocates_nothing) {
    const std::size_t chunk = 1000;
    cudawait::mapped_buffer<u32> release_flag(1);
    release_flag[0] = 0;
    pipeline_options o;
    o.memory.group_bytes = 0; // one chunk per flight
    o.chunk_elements = chunk;
    o.depth = 2;
    o.memory.group_bytes = 2 * chunk * sizeof(u32); // two chunks per slot group
    o.recovery.chunk_timeout = 30ms;
    o.recovery.max_retries = 0;
    o.recovery.on_degrade = [](const cudawait::chunk_failure&) {};
    pipe_t p(o, {flag_stage(release_flag.device_data(), 0, std::make_shared<int>(0))},
             host_fallback);
    auto in = random_words(chunk, 570);
    cudawait::scheduler sched;
    std::size_t allocations = 99;
    std::vector<std::size_t> failed;
    cudawait::sync_wait(sched, [&]() -> cudawait::task<void> {
        auto first = co_await p.acquire(1s);
        auto second = co_await p.acquire(1s); // the group's second chunk
        std::copy(in.begin(), in.end(), first.data().begin());
        p.submit(std::move(first), chunk);
        try {
            (void)co_await p.next(5s); // the first chunk hangs: given up
            ADD_FAILURE() << "a hung chunk was delivered";
        } catch (const pipeline_error& e) {
            failed = e.failed();
        }
        {
            allocation_probe probe;
            { pipe_t::input_slot dropped = std::move(second); }
            allocations = probe.count();
        }
        p.close();
        EXPECT_FALSE(co_await p.next(5s));
    }());
    std::atomic_ref<u32>(release_flag[0]).store(1); // the hung kernel ends before teardown
    EXPECT_EQ(failed, (std::vector<std::size_t>{0}));
    EXPECT_EQ(allocations, 0u);
    EXPECT_TRUE(p.stats().gpu_abandoned);
}

/// Streams `chunks` with a producer and a consumer; the consumer's log.
stream_log stream_all(pipe_t& p, const std::vector<std::vector<u32>>& chunks) {
    stream_log log;
    cudawait::scheduler sched;
    cudawait::sync_wait(sched,
                        cudawait::when_all(producer(p, chunks, log), consumer(p, chunks, log)));
    return log;
}

TEST_F(pipeline_gpu, streaming_retries_a_launch_error_with_less_depth_and_the_gpu_delivers) {
    cudaError_t bad_launch = cudaSuccess;
    {
        cudawait::stream probe;
        bad_launch = cudawait::testing::launch_bad_config(probe.get());
    }
    ASSERT_NE(bad_launch, cudaSuccess);
    const std::size_t chunk = 10'000;
    std::vector<std::vector<u32>> chunks;
    for (std::size_t i = 0; i < 8; ++i) {
        chunks.push_back(random_words(chunk - i, 300 + i));
    }
    pipeline_options o;
    o.memory.group_bytes = 0; // one chunk per flight
    o.chunk_elements = chunk;
    o.depth = 3;
    o.recovery.recover_after = 0; // the depth stays lowered
    std::vector<cudawait::chunk_failure> log;
    o.recovery.on_degrade = [&](const cudawait::chunk_failure& f) { log.push_back(f); };
    std::vector<std::size_t> fallback_calls;
    auto fails = std::make_shared<std::vector<int>>(std::vector<int>{2}); // chunk 2, first try
    pipe_t p(o, {flaky_stage(fails, std::make_shared<int>(0))},
             [&](std::size_t c, std::span<const u32> a, std::span<u32> b) {
                 fallback_calls.push_back(c);
                 host_fallback(c, a, b);
             });
    stream_log got = stream_all(p, chunks);
    EXPECT_EQ(got.consumed, chunks.size());
    EXPECT_EQ(got.bad, 0u);
    EXPECT_EQ(got.out_of_order, 0u);
    EXPECT_TRUE(fallback_calls.empty()) << "the retry on the GPU produced chunk 2";
    ASSERT_EQ(log.size(), 1u);
    EXPECT_EQ(log[0].chunk, 2u);
    EXPECT_EQ(log[0].level, cudawait::degrade_level::retry);
    EXPECT_EQ(log[0].action, cudawait::degrade_action::retried_with_less_depth);
    EXPECT_EQ(log[0].error.status, bad_launch);
    EXPECT_FALSE(log[0].error.sticky);
    EXPECT_EQ(log[0].depth, 2u);
    auto st = p.stats();
    EXPECT_EQ(st.gpu_chunks, chunks.size());
    EXPECT_EQ(st.retries, 1u);
    EXPECT_EQ(st.depth, 2u);
    EXPECT_EQ(st.recoveries, 0u);
}

TEST_F(pipeline_gpu, streaming_waits_again_for_a_slow_chunk_with_less_depth) {
    const std::size_t chunk = 10'000;
    std::vector<std::vector<u32>> chunks;
    for (std::size_t i = 0; i < 6; ++i) {
        chunks.push_back(random_words(chunk, 400 + i));
    }
    auto calls = std::make_shared<int>(0);
    pipeline_options o;
    o.memory.group_bytes = 0; // one chunk per flight
    o.chunk_elements = chunk;
    o.depth = 3;
    o.recovery.chunk_timeout = 60ms;
    o.recovery.max_retries = 10;
    o.recovery.recover_after = 0;
    std::vector<cudawait::chunk_failure> log;
    o.recovery.on_degrade = [&](const cudawait::chunk_failure& f) { log.push_back(f); };
    // Chunk 2's kernel takes 300 ms: several timeouts, then it finishes.
    pipe_t p(o, {[calls](std::span<u32> a, std::span<u32> b, cudawait::stream_ref s) {
                 std::uint64_t spin = (*calls)++ == 2 ? 300'000'000 : 0;
                 cudawait::check(cudawait::testing::launch_transform(a.data(), b.data(), a.size(),
                                                                     salt, spin, s.get()),
                                 "launch_transform");
             }},
             host_fallback);
    stream_log got = stream_all(p, chunks);
    EXPECT_EQ(got.consumed, chunks.size());
    EXPECT_EQ(got.bad, 0u);
    EXPECT_EQ(got.out_of_order, 0u);
    auto st = p.stats();
    EXPECT_EQ(st.gpu_chunks, chunks.size()) << "the slow chunk is the GPU's";
    EXPECT_EQ(st.fallback_chunks + st.failed_chunks, 0u);
    EXPECT_GE(st.retries, 2u);
    EXPECT_EQ(st.retries, log.size());
    EXPECT_EQ(st.depth, 1u);
    for (const cudawait::chunk_failure& f : log) {
        EXPECT_EQ(f.chunk, 2u);
        EXPECT_EQ(f.level, cudawait::degrade_level::retry);
        EXPECT_EQ(f.action, cudawait::degrade_action::waited_again);
        EXPECT_TRUE(f.error.timed_out);
        EXPECT_EQ(f.error.status, cudaSuccess);
    }
}

// on_degrade throwing when next() waits again for a slow chunk: the caller gets the exception,
// the chunk stays first in line (a later next() delivers it, once), and its slot comes back.
TEST_F(pipeline_gpu, streaming_keeps_a_chunk_waited_for_again_when_on_degrade_throws) {
    const std::size_t chunk = 10'000;
    std::vector<std::vector<u32>> chunks;
    for (std::size_t i = 0; i < 4; ++i) {
        chunks.push_back(random_words(chunk, 540 + i));
    }
    struct degrade_refused {};
    std::size_t thrown = 0;
    auto calls = std::make_shared<int>(0);
    pipeline_options o;
    o.memory.group_bytes = 0; // one chunk per flight
    o.chunk_elements = chunk;
    o.depth = 2;
    o.recovery.chunk_timeout = 40ms;
    o.recovery.max_retries = 50;
    o.recovery.on_degrade = [&](const cudawait::chunk_failure& f) {
        if (f.action == cudawait::degrade_action::waited_again) {
            ++thrown;
            throw degrade_refused{};
        }
    };
    // Chunk 1's kernel takes 300 ms: several chunk_timeouts, then it finishes.
    pipe_t p(o, {[calls](std::span<u32> a, std::span<u32> b, cudawait::stream_ref s) {
                 std::uint64_t spin = (*calls)++ == 1 ? 300'000'000 : 0;
                 cudawait::check(cudawait::testing::launch_transform(a.data(), b.data(), a.size(),
                                                                     salt, spin, s.get()),
                                 "launch_transform");
             }},
             host_fallback);
    cudawait::scheduler sched;
    std::vector<std::size_t> delivered;
    std::size_t caught = 0;
    auto take = [&]() -> cudawait::task<bool> { // false: no chunk within 2 s
        try {
            auto r = co_await p.next(2s);
            EXPECT_TRUE(right_result(r, chunks, delivered.size()));
            EXPECT_TRUE(r && !r->by_fallback());
            if (r) {
                delivered.push_back(r->chunk());
            }
        } catch (const degrade_refused&) {
            ++caught;
        } catch (const cudawait::timeout_error&) {
            co_return false;
        }
        co_return true;
    };
    cudawait::sync_wait(sched, [&]() -> cudawait::task<void> {
        for (std::size_t i = 0; i < 2; ++i) {
            co_await submit_chunk(p, chunks[i]);
        }
        while (delivered.size() < 2 && caught < 100) {
            if (!co_await take()) {
                ADD_FAILURE() << "chunk " << delivered.size() << " was not delivered";
                break;
            }
        }
        // Both slots serve the producer again, at once.
        std::vector<pipe_t::input_slot> slots;
        for (std::size_t i = 2; i < 4; ++i) {
            try {
                slots.push_back(co_await p.acquire(1s));
            } catch (const cudawait::timeout_error&) {
                ADD_FAILURE() << "slot " << i << " did not come back";
                co_return;
            }
        }
        for (std::size_t i = 2; i < 4; ++i) {
            auto& slot = slots[i - 2];
            std::copy(chunks[i].begin(), chunks[i].end(), slot.data().begin());
            p.submit(std::move(slot), chunks[i].size());
        }
        while (delivered.size() < 4 && co_await take()) {
        }
        p.close();
        EXPECT_FALSE(co_await p.next(2s));
    }());
    EXPECT_GE(caught, 1u);
    EXPECT_EQ(caught, thrown) << "every throw of on_degrade reached next()'s caller";
    EXPECT_EQ(delivered, (std::vector<std::size_t>{0, 1, 2, 3}));
    auto st = p.stats();
    EXPECT_EQ(st.gpu_chunks, 4u);
    EXPECT_EQ(st.fallback_chunks + st.failed_chunks, 0u);
    EXPECT_EQ(st.retries, thrown);
}

TEST_F(pipeline_gpu, streaming_gives_up_a_hung_chunk_and_the_ones_behind_it_in_order) {
    const std::size_t chunk = 10'000;
    std::vector<std::vector<u32>> chunks;
    for (std::size_t i = 0; i < 4; ++i) {
        chunks.push_back(random_words(chunk, 500 + i));
    }
    cudawait::mapped_buffer<u32> release_flag(1);
    release_flag[0] = 0;
    pipeline_options o;
    o.memory.group_bytes = 0; // one chunk per flight
    o.chunk_elements = chunk;
    o.depth = 3;
    o.recovery.chunk_timeout = 30ms;
    o.recovery.max_retries = 1;
    std::vector<cudawait::chunk_failure> log;
    o.recovery.on_degrade = [&](const cudawait::chunk_failure& f) { log.push_back(f); };
    pipe_t p(o, {flag_stage(release_flag.device_data(), 1, std::make_shared<int>(0))},
             host_fallback);
    cudawait::scheduler sched;
    std::vector<std::vector<std::size_t>> failed; // what each pipeline_error named
    cudawait::sync_wait(sched, [&]() -> cudawait::task<void> {
        for (std::size_t i = 0; i < 3; ++i) {
            co_await submit_chunk(p, chunks[i]);
        }
        EXPECT_TRUE(right_result(co_await p.next(), chunks, 0));
        for (int i = 0; i < 2; ++i) { // chunk 1 hangs; chunk 2 is queued behind it
            try {
                (void)co_await p.next();
                ADD_FAILURE() << "a hung chunk was delivered";
            } catch (const pipeline_error& e) {
                failed.push_back(e.failed());
            }
        }
        co_await submit_chunk(p, chunks[3]); // chunk 0's slot; the GPU is given up
        auto r = co_await p.next();
        EXPECT_TRUE(right_result(r, chunks, 3));
        EXPECT_TRUE(r && r->by_fallback());
        r.reset();
        p.close();
        EXPECT_FALSE(co_await p.next());
    }());
    std::atomic_ref<u32>(release_flag[0]).store(1); // let the kernel finish before teardown
    EXPECT_EQ(failed, (std::vector<std::vector<std::size_t>>{{1}, {2}}));
    std::vector<std::pair<std::size_t, cudawait::degrade_action>> steps;
    for (const cudawait::chunk_failure& f : log) {
        steps.emplace_back(f.chunk, f.action);
    }
    EXPECT_EQ(steps, (std::vector<std::pair<std::size_t, cudawait::degrade_action>>{
                         {1, cudawait::degrade_action::waited_again},
                         {1, cudawait::degrade_action::failed_timed_out},
                         {2, cudawait::degrade_action::failed_timed_out},
                         {3, cudawait::degrade_action::fallback}}));
    auto st = p.stats();
    EXPECT_TRUE(st.gpu_abandoned);
    EXPECT_EQ(st.chunks, 4u);
    EXPECT_EQ(st.gpu_chunks, 1u);
    EXPECT_EQ(st.failed_chunks, 2u);
    EXPECT_EQ(st.fallback_chunks, 1u);
}

// Streaming, as a_wait_that_cannot_be_set_up_leaves_the_chunk_to_the_gpu: next() delivers the
// GPU's output, which nothing writes after it was delivered, and the slot goes back only then.
TEST_F(pipeline_gpu, streaming_delivers_the_gpu_output_when_a_wait_cannot_be_set_up) {
    const std::size_t chunk = 10'000;
    std::vector<std::vector<u32>> chunks;
    for (std::size_t i = 0; i < 3; ++i) {
        chunks.push_back(random_words(chunk, 520 + i));
    }
    std::vector<std::size_t> fallback_calls;
    std::vector<cudawait::chunk_failure> log;
    pipeline_options o;
    o.memory.group_bytes = 0; // one chunk per flight
    o.chunk_elements = chunk;
    o.depth = 3;
    o.recovery.chunk_timeout = 10s;
    o.recovery.on_degrade = [&](const cudawait::chunk_failure& f) { log.push_back(f); };
    pipe_t p(o, {transform_stage(150'000'000)},
             [&](std::size_t c, std::span<const u32>, std::span<u32> b) {
                 fallback_calls.push_back(c);
                 std::fill(b.begin(), b.end(), fallback_mark);
             });
    cudawait::scheduler sched;
    int not_failed = -1;
    cudawait::sync_wait(sched, [&]() -> cudawait::task<void> {
        for (std::size_t i = 0; i < 3; ++i) {
            co_await submit_chunk(p, chunks[i]);
        }
        cudawait::detail::g_failing_relay_acquires = 1; // chunk 0's timed wait
        for (std::size_t i = 0; i < 3; ++i) {
            auto r = co_await p.next();
            if (i == 0) {
                not_failed = cudawait::detail::g_failing_relay_acquires.exchange(0);
            }
            EXPECT_TRUE(right_result(r, chunks, i));
            EXPECT_TRUE(r && !r->by_fallback()) << "chunk " << i;
            if (i == 0 && r) {
                std::vector<u32> delivered(r->data().begin(), r->data().end());
                co_await cudawait::sleep_for(400ms); // a copy still in flight lands meanwhile
                EXPECT_TRUE(std::equal(delivered.begin(), delivered.end(), r->data().begin(),
                                       r->data().end()))
                    << "the result changed after next() delivered it";
            }
        }
        p.close();
        EXPECT_FALSE(co_await p.next());
    }());
    ASSERT_EQ(not_failed, 0) << "no wait was set up";
    EXPECT_TRUE(fallback_calls.empty())
        << "chunk " << fallback_calls.front() << " went to the fallback while the GPU ran it";
    EXPECT_TRUE(log.empty()) << to_string(log.front().action) << ": " << log.front().error.what;
    auto st = p.stats();
    EXPECT_FALSE(st.gpu_abandoned);
    EXPECT_EQ(st.gpu_chunks, 3u);
    EXPECT_EQ(st.fallback_chunks + st.failed_chunks + st.retries, 0u);
}

TEST_F(pipeline_gpu, depth_recovers_after_clean_chunks_in_a_batch_and_in_streaming) {
    const std::size_t chunk = 10'000;
    const std::size_t count = 12;
    for (int mode = 0; mode < 3; ++mode) { // batch pageable, batch pinned, streaming
        SCOPED_TRACE(mode == 0 ? "batch, pageable" : mode == 1 ? "batch, pinned" : "streaming");
        pipeline_options o;
        o.memory.group_bytes = 0; // one chunk per flight
        o.chunk_elements = chunk;
        o.depth = 3;
        o.recovery.recover_after = 4;
        std::vector<cudawait::chunk_failure> log;
        o.recovery.on_degrade = [&](const cudawait::chunk_failure& f) { log.push_back(f); };
        // The first try of chunk 1 fails to launch: depth 3 -> 2, then 4 clean chunks: 3.
        auto fails = std::make_shared<std::vector<int>>(std::vector<int>{1});
        pipe_t p(o, {flaky_stage(fails, std::make_shared<int>(0))}, host_fallback);
        if (mode < 2) {
            auto in = random_words(chunk * count, 600 + mode);
            std::vector<u32> out(in.size(), 0xdeadbeefu);
            pinned_buffer<u32> pin(in.size());
            pinned_buffer<u32> pout(in.size());
            cudawait::scheduler sched;
            if (mode == 0) {
                cudawait::sync_wait(sched, p.run(in, out));
            } else {
                copy_into(pin, in);
                std::fill(pout.begin(), pout.end(), 0xdeadbeefu);
                cudawait::sync_wait(sched, p.run(pin.span(), pout.span()));
                out.assign(pout.begin(), pout.end());
            }
            EXPECT_EQ(first_mismatch(out, expected(in, chunk)), in.size());
        } else {
            std::vector<std::vector<u32>> chunks;
            for (std::size_t i = 0; i < count; ++i) {
                chunks.push_back(random_words(chunk, 700 + i));
            }
            stream_log got = stream_all(p, chunks);
            EXPECT_EQ(got.consumed, count);
            EXPECT_EQ(got.bad, 0u);
            EXPECT_EQ(got.out_of_order, 0u);
        }
        ASSERT_EQ(log.size(), 1u);
        EXPECT_EQ(log[0].action, cudawait::degrade_action::retried_with_less_depth);
        EXPECT_EQ(log[0].depth, 2u) << "lowered first";
        auto st = p.stats();
        EXPECT_EQ(st.gpu_chunks, count);
        EXPECT_EQ(st.retries, 1u);
        EXPECT_EQ(st.recoveries, 1u);
        EXPECT_EQ(st.depth, 3u) << "back to the configured depth";
    }
}

} // namespace
