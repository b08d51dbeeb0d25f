// SPDX-License-Identifier: Apache-2.0
// pipeline_test: degradation and the fallback, the error of a failed batch, the report.
#include <cudawait/pipeline/detail/latency.hpp>
#include <cudawait/pipeline/detail/monitor.hpp>
#include <cudawait/pipeline/report.hpp>

#include <cctype>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "pipeline_checks.hpp"
#include <unistd.h>

namespace {

using namespace cudawait::testing::pipeline_checks;

// ---- degradation ------------------------------------------------------------------------------

TEST_F(pipeline_gpu, streaming_hands_a_failed_chunk_to_the_fallback_in_order) {
    const std::size_t chunk = 10'000;
    std::vector<std::vector<u32>> chunks;
    for (std::size_t i = 0; i < 6; ++i) {
        chunks.push_back(random_words(chunk - i, 100 + i));
    }
    for (bool with_fallback : {true, false}) {
        pipeline_options o;
        o.memory.group_bytes = 0; // one chunk per flight: per-chunk records
        o.chunk_elements = chunk;
        o.depth = 3;
        o.recovery.max_retries = 0; // no level-1 retry (it would succeed): chunk 2 goes to level 2
        o.recovery.on_degrade = [](const cudawait::chunk_failure&) {};
        auto fails = std::make_shared<std::vector<int>>(std::vector<int>{2});
        pipe_t p(o, {flaky_stage(fails, std::make_shared<int>(0))},
                 with_fallback ? pipe_t::fallback(host_fallback) : pipe_t::fallback{});
        cudawait::scheduler sched;
        auto seen = cudawait::sync_wait(sched, stream_chunks(p, chunks));
        ASSERT_EQ(seen.size(), 6u);
        for (std::size_t i = 0; i < 6; ++i) {
            if (i == 2) {
                EXPECT_EQ(seen[i].right, with_fallback) << "chunk 2's output";
                EXPECT_EQ(seen[i].by_fallback, with_fallback) << "chunk 2 came from the fallback";
            } else {
                EXPECT_TRUE(seen[i].right) << "chunk " << i;
                EXPECT_FALSE(seen[i].by_fallback) << "chunk " << i;
            }
        }
        auto st = p.stats();
        EXPECT_EQ(st.gpu_chunks, 5u);
        EXPECT_EQ(st.fallback_chunks + st.failed_chunks, 1u);
    }
}

TEST_F(pipeline_gpu, a_launch_error_is_retried_with_less_concurrency) {
    // The status a bad launch reports (a zero grid: cudaErrorInvalidValue with CUDA 13, which
    // older runtimes called cudaErrorInvalidConfiguration); not sticky, so it is cleared.
    cudaError_t bad_launch = cudaSuccess;
    {
        cudawait::stream probe;
        bad_launch = cudawait::testing::launch_bad_config(probe.get());
    }
    ASSERT_NE(bad_launch, cudaSuccess);
    ASSERT_FALSE(cudawait::is_sticky(bad_launch));
    const std::size_t chunk = 20'000;
    const std::size_t n = chunk * 8;
    auto in = random_words(n, 5);
    std::vector<cudawait::chunk_failure> log;
    pipeline_options o;
    o.memory.group_bytes = 0; // one chunk per flight: per-chunk records
    o.chunk_elements = chunk;
    o.depth = 3;
    o.recovery.on_degrade = [&](const cudawait::chunk_failure& f) { log.push_back(f); };
    auto calls = std::make_shared<int>(0);
    pipe_t p(o, {flaky_stage(std::make_shared<std::vector<int>>(std::vector<int>{3}), calls)},
             host_fallback);
    std::vector<u32> out(n, 0);
    cudawait::scheduler sched;
    cudawait::sync_wait(sched, p.run(in, out));
    EXPECT_EQ(first_mismatch(out, expected(in, chunk)), n);
    auto st = p.stats();
    EXPECT_EQ(st.gpu_chunks, 8u);
    EXPECT_EQ(st.fallback_chunks, 0u);
    EXPECT_EQ(st.retries, 1u);
    EXPECT_EQ(st.depth, 2u);
    ASSERT_EQ(log.size(), 1u);
    const cudawait::chunk_failure& f = log[0];
    EXPECT_EQ(f.level, cudawait::degrade_level::retry);
    EXPECT_EQ(f.action, cudawait::degrade_action::retried_with_less_depth);
    EXPECT_EQ(f.chunk, 3u);
    EXPECT_EQ(f.offset, 3 * chunk);
    EXPECT_EQ(f.elements, chunk);
    EXPECT_EQ(f.output_elements, chunk);
    EXPECT_EQ(f.input_bytes, chunk * sizeof(u32));
    EXPECT_EQ(f.output_bytes, chunk * sizeof(u32));
    EXPECT_EQ(f.depth, 2u) << "the depth after the step";
    EXPECT_EQ(f.compute_streams, 1u);
    EXPECT_EQ(f.device, 0);
    EXPECT_FALSE(f.graph);
    // The typed error: the bad launch's own status, not sticky, not a timeout.
    EXPECT_EQ(f.error.status, bad_launch) << f.error.what;
    EXPECT_FALSE(f.error.sticky);
    EXPECT_FALSE(f.error.timed_out);
    EXPECT_FALSE(f.error.exception);
    EXPECT_NE(f.error.what.find("launch_bad_config"), std::string::npos) << f.error.what;
    // Where it ran and on which data (pageable ranges: the chunk in the caller's vectors).
    EXPECT_EQ(f.h2d_stream, p.h2d_stream().get());
    EXPECT_EQ(f.compute_stream, p.compute_stream(0).get());
    EXPECT_EQ(f.d2h_stream, p.d2h_stream().get());
    EXPECT_EQ(f.host_in, static_cast<const void*>(in.data() + 3 * chunk));
    EXPECT_EQ(f.host_out, static_cast<const void*>(out.data() + 3 * chunk));
    EXPECT_NE(f.device_in, nullptr);
    EXPECT_NE(f.device_out, nullptr);
    EXPECT_NE(f.device_in, f.device_out);
}

TEST_F(pipeline_gpu, a_chunk_that_keeps_failing_goes_to_the_fallback_exactly_once) {
    const std::size_t chunk = 20'000;
    const std::size_t n = chunk * 8 + 10;
    auto in = random_words(n, 6);
    // Chunk 5 is the sixth call; its retries are calls 6 and 7; chunks 6.. follow from call 8.
    auto fails = std::make_shared<std::vector<int>>(std::vector<int>{5, 6, 7});
    std::vector<std::size_t> fallback_calls;
    pipeline_options o;
    o.memory.group_bytes = 0; // one chunk per flight: per-chunk records
    o.chunk_elements = chunk;
    o.depth = 3;
    o.recovery.max_retries = 2;
    o.recovery.on_degrade = [](const cudawait::chunk_failure&) {};
    pipe_t p(o, {flaky_stage(fails, std::make_shared<int>(0))},
             [&](std::size_t c, std::span<const u32> a, std::span<u32> b) {
                 fallback_calls.push_back(c);
                 host_fallback(c, a, b);
             });
    std::vector<u32> out(n, 0xdeadbeefu);
    cudawait::scheduler sched;
    cudawait::sync_wait(sched, p.run(in, out));
    EXPECT_EQ(first_mismatch(out, expected(in, chunk)), n);
    EXPECT_EQ(fallback_calls, std::vector<std::size_t>{5});
    auto st = p.stats();
    EXPECT_EQ(st.gpu_chunks + st.fallback_chunks, 9u) << "every chunk produced exactly once";
    EXPECT_EQ(st.fallback_chunks, 1u);
    EXPECT_EQ(st.depth, 1u);
}

TEST_F(pipeline_gpu, without_a_fallback_the_error_says_which_chunks_completed) {
    const std::size_t chunk = 20'000;
    const std::size_t n = chunk * 6;
    auto in = random_words(n, 8);
    auto fails = std::make_shared<std::vector<int>>(std::vector<int>{2, 3, 4});
    pipeline_options o;
    o.memory.group_bytes = 0; // one chunk per flight: per-chunk records
    o.chunk_elements = chunk;
    o.recovery.max_retries = 2;
    o.recovery.on_degrade = [](const cudawait::chunk_failure&) {};
    pipe_t p(o, {flaky_stage(fails, std::make_shared<int>(0))});
    std::vector<u32> out(n, 0xdeadbeefu);
    cudawait::scheduler sched;
    try {
        cudawait::sync_wait(sched, p.run(in, out));
        ADD_FAILURE() << "no exception";
    } catch (const pipeline_error& e) {
        EXPECT_EQ(e.failed(), std::vector<std::size_t>{2});
        EXPECT_EQ(e.completed(), (std::vector<std::size_t>{0, 1, 3, 4, 5}));
    }
    auto want = expected(in, chunk);
    for (std::size_t c : {0, 1, 3, 4, 5}) {
        for (std::size_t i = c * chunk; i < (c + 1) * chunk; ++i) {
            ASSERT_EQ(out[i], want[i]) << "completed chunk " << c;
        }
    }
    for (std::size_t i = 2 * chunk; i < 3 * chunk; ++i) {
        ASSERT_EQ(out[i], 0xdeadbeefu) << "a failed chunk's output was written";
    }
}

TEST_F(pipeline_gpu, a_timeout_lowers_concurrency_and_the_gpu_still_delivers) {
    const std::size_t chunk = 20'000;
    const std::size_t n = chunk * 6;
    auto in = random_words(n, 9);
    auto calls = std::make_shared<int>(0);
    std::vector<cudawait::chunk_failure> log;
    pipeline_options o;
    o.memory.group_bytes = 0; // one chunk per flight: per-chunk records
    o.chunk_elements = chunk;
    o.depth = 3;
    o.recovery.chunk_timeout = 60ms;
    o.recovery.max_retries = 10;
    o.recovery.on_degrade = [&](const cudawait::chunk_failure& f) { log.push_back(f); };
    // Chunk 2's kernel takes 300 ms: several timeouts, then it finishes.
    pipe_t p(o, {[calls](std::span<u32> a, std::span<u32> b, cudawait::stream_ref s) {
                 std::uint64_t spin = (*calls)++ == 2 ? 300'000'000 : 0;
                 cudawait::check(cudawait::testing::launch_transform(a.data(), b.data(), a.size(),
                                                                     salt, spin, s.get()),
                                 "launch_transform");
             }},
             host_fallback);
    std::vector<u32> out(n, 0);
    cudawait::scheduler sched;
    cudawait::sync_wait(sched, p.run(in, out));
    EXPECT_EQ(first_mismatch(out, expected(in, chunk)), n);
    auto st = p.stats();
    EXPECT_EQ(st.gpu_chunks, 6u) << "the slow chunk is the GPU's, not the fallback's";
    EXPECT_EQ(st.fallback_chunks, 0u);
    EXPECT_GE(st.retries, 2u);
    EXPECT_EQ(st.depth, 1u);
    ASSERT_FALSE(log.empty());
    for (const cudawait::chunk_failure& f : log) {
        EXPECT_EQ(f.level, cudawait::degrade_level::retry);
        EXPECT_EQ(f.action, cudawait::degrade_action::waited_again);
        EXPECT_EQ(f.chunk, 2u);
        EXPECT_TRUE(f.error.timed_out);
        EXPECT_EQ(f.error.status, cudaSuccess) << "no CUDA call failed";
        EXPECT_FALSE(f.error.sticky);
        ASSERT_TRUE(f.error.exception);
        EXPECT_THROW(std::rethrow_exception(f.error.exception), cudawait::timeout_error);
    }
}

TEST_F(pipeline_gpu, a_hung_chunk_is_reported_failed_and_the_rest_go_to_the_fallback) {
    const std::size_t chunk = 20'000;
    const std::size_t n = chunk * 6;
    auto in = random_words(n, 10);
    cudawait::mapped_buffer<u32> release_flag(1);
    auto calls = std::make_shared<int>(0);
    std::vector<std::size_t> fallback_calls;
    pipeline_options o;
    o.memory.group_bytes = 0; // one chunk per flight: per-chunk records
    o.chunk_elements = chunk;
    o.depth = 2;
    o.recovery.chunk_timeout = 30ms;
    o.recovery.max_retries = 1;
    std::vector<cudawait::chunk_failure> log;
    o.recovery.on_degrade = [&](const cudawait::chunk_failure& f) { log.push_back(f); };
    const u32* flag = release_flag.device_data();
    pipe_t p(o, {[calls, flag](std::span<u32> a, std::span<u32> b, cudawait::stream_ref s) {
                 if ((*calls)++ == 1) { // chunk 1 waits for the host: "hangs"
                     cudawait::check(
                         cudawait::testing::launch_wait_flag(flag, 20'000'000'000ull, s.get()),
                         "launch_wait_flag");
                 }
                 cudawait::check(cudawait::testing::launch_transform(a.data(), b.data(), a.size(),
                                                                     salt, 0, s.get()),
                                 "launch_transform");
             }},
             [&](std::size_t c, std::span<const u32> a, std::span<u32> b) {
                 fallback_calls.push_back(c);
                 host_fallback(c, a, b);
             });
    std::vector<u32> out(n, 0xdeadbeefu);
    cudawait::scheduler sched;
    std::vector<std::size_t> failed;
    try {
        cudawait::sync_wait(sched, p.run(in, out));
        ADD_FAILURE() << "no exception";
    } catch (const pipeline_error& e) {
        failed = e.failed();
    }
    // Chunk 1 hung, chunk 2 was queued behind it: both failed; 0 was done; 3.. on the host.
    EXPECT_EQ(failed, (std::vector<std::size_t>{1, 2}));
    EXPECT_EQ(fallback_calls, (std::vector<std::size_t>{3, 4, 5}));
    // One wait again for chunk 1, then chunks 1 and 2 given up as timed out.
    std::vector<std::pair<std::size_t, cudawait::degrade_action>> steps;
    for (const cudawait::chunk_failure& f : log) {
        steps.emplace_back(f.chunk, f.action);
        EXPECT_TRUE(f.error.timed_out) << "chunk " << f.chunk;
        EXPECT_EQ(f.level, f.action == cudawait::degrade_action::waited_again
                               ? cudawait::degrade_level::retry
                               : cudawait::degrade_level::give_up);
    }
    EXPECT_EQ(steps, (std::vector<std::pair<std::size_t, cudawait::degrade_action>>{
                         {1, cudawait::degrade_action::waited_again},
                         {1, cudawait::degrade_action::failed_timed_out},
                         {2, cudawait::degrade_action::failed_timed_out}}));
    auto st = p.stats();
    EXPECT_TRUE(st.gpu_abandoned);
    EXPECT_EQ(st.gpu_chunks + st.fallback_chunks + st.failed_chunks, 6u);
    auto want = expected(in, chunk);
    for (std::size_t c : {0, 3, 4, 5}) {
        for (std::size_t i = c * chunk; i < (c + 1) * chunk; ++i) {
            ASSERT_EQ(out[i], want[i]) << "chunk " << c;
        }
    }
    std::atomic_ref<u32>(release_flag[0]).store(1); // let the kernel finish before teardown
}

// A timed wait that cannot be set up (no relay stream for with_timeout) while the chunks' kernels
// still run is no failure of theirs: no chunk goes to the fallback while its copies may land, the
// output is the GPU's, and it is all in place when run() returns.
TEST_F(pipeline_gpu, a_wait_that_cannot_be_set_up_leaves_the_chunk_to_the_gpu) {
    const std::size_t chunk = 20'000;
    const std::size_t n = chunk * 4;
    auto in = random_words(n, 14);
    pinned_buffer<u32> pin(n);
    pinned_buffer<u32> pout(n);
    copy_into(pin, in);
    std::fill(pout.begin(), pout.end(), 0xdeadbeefu);
    std::vector<std::size_t> fallback_calls;
    std::vector<cudawait::chunk_failure> log;
    pipeline_options o;
    o.memory.group_bytes = 0; // one chunk per flight: per-chunk records
    o.chunk_elements = chunk;
    o.depth = 2;
    o.recovery.chunk_timeout = 10s;
    o.recovery.on_degrade = [&](const cudawait::chunk_failure& f) { log.push_back(f); };
    // 150 ms per kernel, one after the other: the first wait starts while all four are queued.
    pipe_t p(o, {transform_stage(150'000'000)},
             [&](std::size_t c, std::span<const u32>, std::span<u32> b) {
                 fallback_calls.push_back(c);
                 std::fill(b.begin(), b.end(), fallback_mark);
             });
    cudawait::scheduler sched;
    cudawait::detail::g_failing_relay_acquires = 1; // the first timed wait
    cudawait::sync_wait(sched, p.run(pin.span(), pout.span()));
    const int not_failed = cudawait::detail::g_failing_relay_acquires.exchange(0);
    std::vector<u32> at_return(pout.begin(), pout.end());
    std::this_thread::sleep_for(400ms); // a copy still in flight lands meanwhile
    std::vector<u32> later(pout.begin(), pout.end());
    ASSERT_EQ(not_failed, 0) << "no wait was set up";
    EXPECT_TRUE(fallback_calls.empty())
        << "chunk " << fallback_calls.front() << " went to the fallback while the GPU ran it";
    EXPECT_TRUE(log.empty()) << to_string(log.front().action) << ": " << log.front().error.what;
    EXPECT_EQ(first_mismatch(at_return, expected(in, chunk)), n);
    EXPECT_EQ(first_mismatch(later, at_return), n) << "the output changed after run() returned";
    auto st = p.stats();
    EXPECT_FALSE(st.gpu_abandoned);
    EXPECT_EQ(st.gpu_chunks, 4u);
    EXPECT_EQ(st.fallback_chunks + st.failed_chunks + st.retries, 0u);
}

// A kernel fault kills the context: every chunk not yet seen complete goes to the fallback.
[[noreturn]] void sticky_fault_child() {
    const std::size_t chunk = 20'000;
    const std::size_t n = chunk * 8;
    auto in = random_words(n, 12);
    auto calls = std::make_shared<int>(0);
    std::vector<int> produced(8, 0);
    pipeline_options o;
    o.memory.group_bytes = 0; // one chunk per flight: per-chunk records
    o.chunk_elements = chunk;
    o.depth = 3;
    o.recovery.on_degrade = [](const cudawait::chunk_failure&) {};
    int failures = 0;
    try {
        pipe_t p(o, {[calls](std::span<u32> a, std::span<u32> b, cudawait::stream_ref s) {
                     if ((*calls)++ == 4) {
                         cudawait::check(cudawait::testing::launch_fault(s.get()), "launch_fault");
                     }
                     cudawait::check(cudawait::testing::launch_transform(
                                         a.data(), b.data(), a.size(), salt, 0, s.get()),
                                     "launch_transform");
                 }},
                 [&](std::size_t c, std::span<const u32> a, std::span<u32> b) {
                     ++produced[c];
                     host_fallback(c, a, b);
                 });
        std::vector<u32> out(n, 0xdeadbeefu);
        cudawait::scheduler sched;
        cudawait::sync_wait(sched, p.run(in, out));
        auto st = p.stats();
        if (first_mismatch(out, expected(in, chunk)) != n) {
            std::fprintf(stderr, "FAILED: wrong output\n");
            ++failures;
        }
        if (!st.gpu_abandoned || st.fallback_chunks == 0 ||
            st.gpu_chunks + st.fallback_chunks != 8 || st.failed_chunks != 0) {
            std::fprintf(stderr, "FAILED: counts gpu %zu fallback %zu failed %zu\n", st.gpu_chunks,
                         st.fallback_chunks, st.failed_chunks);
            ++failures;
        }
        for (int c = 0; c < 8; ++c) {
            if (produced[static_cast<std::size_t>(c)] > 1) {
                std::fprintf(stderr, "FAILED: chunk %d fell back twice\n", c);
                ++failures;
            }
        }
        if (produced[4] != 1) {
            std::fprintf(stderr, "FAILED: the faulting chunk was not handed to the fallback\n");
            ++failures;
        }
    } catch (const std::exception& e) {
        std::fprintf(stderr, "FAILED: %s\n", e.what());
        ++failures;
    }
    std::fprintf(stderr, failures == 0 ? "sticky fault handled\n" : "sticky fault mishandled\n");
    std::_Exit(failures == 0 ? 0 : 1);
}

TEST_F(pipeline_gpu, a_sticky_fault_hands_every_unfinished_chunk_to_the_fallback) {
    GTEST_FLAG_SET(death_test_style, "threadsafe");
    EXPECT_EXIT(sticky_fault_child(), ::testing::ExitedWithCode(0), "sticky fault handled");
}

// ---- the error of a failed batch --------------------------------------------------------------

TEST_F(pipeline_gpu, a_failed_chunk_count_in_the_batch_error_matches_its_lists) {
    const std::size_t chunk = 20'000;
    const std::size_t n = chunk * 11;
    auto in = random_words(n, 30);
    pipeline_options o;
    o.memory.group_bytes = 0; // one chunk per flight: per-chunk records
    o.chunk_elements = chunk;
    o.recovery.max_retries = 0; // each failed launch is final: chunks 1, 4, 5 and 9 fail
    o.recovery.on_degrade = [](const cudawait::chunk_failure&) {};
    auto fails = std::make_shared<std::vector<int>>(std::vector<int>{1, 4, 5, 9});
    pipe_t p(o, {flaky_stage(fails, std::make_shared<int>(0))});
    std::vector<u32> out(n, 0xdeadbeefu);
    cudawait::scheduler sched;
    try {
        cudawait::sync_wait(sched, p.run(in, out));
        ADD_FAILURE() << "no exception";
    } catch (const pipeline_error& e) {
        EXPECT_EQ(e.failed(), (std::vector<std::size_t>{1, 4, 5, 9}));
        EXPECT_EQ(e.completed(), (std::vector<std::size_t>{0, 2, 3, 6, 7, 8, 10}));
        std::size_t failed = 0;
        std::size_t total = 0;
        ASSERT_EQ(std::sscanf(e.what(), "pipeline: %zu of %zu chunks failed", &failed, &total), 2)
            << e.what();
        EXPECT_EQ(failed, e.failed().size()) << e.what();
        EXPECT_EQ(total, e.failed().size() + e.completed().size()) << e.what();
    }
    auto want = expected(in, chunk);
    for (std::size_t c = 0; c < 11; ++c) {
        bool failed = c == 1 || c == 4 || c == 5 || c == 9;
        for (std::size_t i = c * chunk; i < (c + 1) * chunk; ++i) {
            ASSERT_EQ(out[i], failed ? 0xdeadbeefu : want[i]) << "chunk " << c;
        }
    }
}

// ---- a fallback that throws -------------------------------------------------------------------

TEST_F(pipeline_gpu, a_failed_chunk_whose_fallback_throws_reaches_run_and_leaks_no_event) {
    const std::size_t chunk = 20'000;
    const std::size_t n = chunk * 8;
    auto data = random_words(n, 31);
    auto want = expected(data, chunk);
    pinned_buffer<u32> in(n);
    pinned_buffer<u32> out(n);
    copy_into(in, data);
    std::fill(out.begin(), out.end(), 0xdeadbeefu);
    pipeline_options o;
    o.memory.group_bytes = 0; // one chunk per flight: per-chunk records
    o.chunk_elements = chunk;
    o.depth = 3;
    o.recovery.max_retries = 0;
    o.recovery.on_degrade = [](const cudawait::chunk_failure&) {};
    // Chunk 5's launch fails; chunks 0..4 (slow kernels, pinned ranges: all started) are still in
    // flight when the fallback throws.
    auto calls = std::make_shared<int>(0);
    pipe_t p(o, {[calls](std::span<u32> a, std::span<u32> b, cudawait::stream_ref s) {
                 if ((*calls)++ == 5) {
                     cudawait::check(cudawait::testing::launch_bad_config(s.get()),
                                     "launch_bad_config");
                 }
                 cudawait::check(cudawait::testing::launch_transform(a.data(), b.data(), a.size(),
                                                                     salt, 2'000'000, s.get()),
                                 "launch_transform");
             }},
             [](std::size_t c, std::span<const u32>, std::span<u32>) {
                 throw std::runtime_error("fallback refused chunk " + std::to_string(c));
             });
    const long before = cudawait::event_pool::for_device(0).outstanding();
    {
        cudawait::scheduler sched;
        try {
            cudawait::sync_wait(sched, p.run(in.span(), out.span()));
            ADD_FAILURE() << "no exception";
        } catch (const pipeline_error& e) {
            ADD_FAILURE() << "the fallback's exception was replaced: " << e.what();
        } catch (const std::runtime_error& e) {
            EXPECT_STREQ(e.what(), "fallback refused chunk 5");
        }
    }
    EXPECT_EQ(cudawait::event_pool::for_device(0).outstanding(), before)
        << "the events of the chunks in flight were not given back";
    // run() passed the exception on after the chunks in flight had landed; 5.. never started.
    for (std::size_t i = 0; i < n; ++i) {
        ASSERT_EQ(out[i], i < 5 * chunk ? want[i] : 0xdeadbeefu) << "element " << i;
    }
    // The pipeline is still usable.
    std::fill(out.begin(), out.end(), 0xdeadbeefu);
    cudawait::scheduler sched;
    cudawait::sync_wait(sched, p.run(in.span(), out.span()));
    std::vector<u32> got(out.begin(), out.end());
    EXPECT_EQ(first_mismatch(got, want), n);
}

// The same with staged (pageable) ranges and in graph mode, where the failing launch is the
// capture of a slot's graph: chunks 0 and 1 are in flight when chunk 2's fallback throws. Every
// chunk's output is whole or untouched (staged outputs of drained chunks stay in the slots), no
// event stays out of the pool, and the pipeline runs the next batch right.
TEST_F(pipeline_gpu, a_throwing_fallback_with_chunks_in_flight_leaks_no_event_in_any_mode) {
    const std::size_t chunk = 20'000;
    const std::size_t n = chunk * 6;
    auto data = random_words(n, 32);
    auto want = expected(data, chunk);
    struct mode {
        bool pinned;
        bool graph;
    };
    for (mode m : {mode{false, false}, mode{false, true}, mode{true, true}}) {
        SCOPED_TRACE(std::string(m.pinned ? "pinned" : "pageable") + (m.graph ? ", graph" : ""));
        pipeline_options o;
        o.memory.group_bytes = 0; // one chunk per flight: per-chunk records
        o.chunk_elements = chunk;
        o.depth = 3;
        o.graph = m.graph;
        o.recovery.max_retries = 0;
        o.recovery.on_degrade = [](const cudawait::chunk_failure&) {};
        // Stage calls: one per chunk in plain mode, one per slot's capture in graph mode; either
        // way call 2 is chunk 2's.
        auto calls = std::make_shared<int>(0);
        pipe_t p(o, {[calls](std::span<u32> a, std::span<u32> b, cudawait::stream_ref s) {
                     if ((*calls)++ == 2) {
                         cudawait::check(cudawait::testing::launch_bad_config(s.get()),
                                         "launch_bad_config");
                     }
                     cudawait::check(cudawait::testing::launch_transform(
                                         a.data(), b.data(), a.size(), salt, 2'000'000, s.get()),
                                     "launch_transform");
                 }},
                 [](std::size_t c, std::span<const u32>, std::span<u32>) {
                     throw std::runtime_error("fallback refused chunk " + std::to_string(c));
                 });
        pinned_buffer<u32> pin(n);
        pinned_buffer<u32> pout(n);
        copy_into(pin, data);
        std::vector<u32> out(n, 0xdeadbeefu);
        std::fill(pout.begin(), pout.end(), 0xdeadbeefu);
        const long before = cudawait::event_pool::for_device(0).outstanding();
        cudawait::scheduler sched;
        try {
            if (m.pinned) {
                cudawait::sync_wait(sched, p.run(pin.span(), pout.span()));
            } else {
                cudawait::sync_wait(sched, p.run(data, out));
            }
            ADD_FAILURE() << "no exception";
        } catch (const pipeline_error& e) {
            ADD_FAILURE() << "the fallback's exception was replaced: " << e.what();
        } catch (const std::runtime_error& e) {
            EXPECT_STREQ(e.what(), "fallback refused chunk 2");
        }
        EXPECT_EQ(cudawait::event_pool::for_device(0).outstanding(), before)
            << "the events of the chunks in flight were not given back";
        if (m.pinned) {
            out.assign(pout.begin(), pout.end());
        }
        for (std::size_t c = 0; c < 6; ++c) {
            bool whole = std::equal(want.begin() + c * chunk, want.begin() + (c + 1) * chunk,
                                    out.begin() + c * chunk);
            bool untouched = std::all_of(out.begin() + c * chunk, out.begin() + (c + 1) * chunk,
                                         [](u32 x) { return x == 0xdeadbeefu; });
            if (c < 2 && m.pinned) {
                EXPECT_TRUE(whole) << "chunk " << c << " landed before run() passed the error on";
            } else if (c < 2) {
                EXPECT_TRUE(whole || untouched) << "chunk " << c;
            } else {
                EXPECT_TRUE(untouched) << "chunk " << c << " was written";
            }
        }
        std::fill(out.begin(), out.end(), 0xdeadbeefu);
        cudawait::sync_wait(sched, p.run(data, out));
        EXPECT_EQ(first_mismatch(out, want), n) << "the next batch";
    }
}

TEST_F(pipeline_gpu,
       a_failed_chunk_whose_fallback_throws_in_streaming_reaches_next_and_frees_its_slot) {
    const std::size_t chunk = 10'000;
    std::vector<std::vector<u32>> chunks;
    for (std::size_t i = 0; i < 6; ++i) {
        chunks.push_back(random_words(chunk - i, 200 + i));
    }
    pipeline_options o;
    o.memory.group_bytes = 0; // one chunk per flight: per-chunk records
    o.chunk_elements = chunk;
    o.depth = 3;
    o.recovery.max_retries = 0; // no level-1 retry (it would succeed): chunk 2 goes to level 2
    o.recovery.on_degrade = [](const cudawait::chunk_failure&) {};
    auto fails = std::make_shared<std::vector<int>>(std::vector<int>{2});
    pipe_t p(o, {flaky_stage(fails, std::make_shared<int>(0))},
             [](std::size_t c, std::span<const u32>, std::span<u32>) {
                 throw std::runtime_error("fallback refused chunk " + std::to_string(c));
             });
    cudawait::scheduler sched;
    // Per chunk: 1 output right, 0 output wrong, -1 the fallback's exception reached next().
    std::vector<int> seen;
    for (const streamed& c : cudawait::sync_wait(sched, stream_chunks(p, chunks))) {
        seen.push_back(c.right ? 1 : c.error == "fallback refused chunk 2" ? -1 : 0);
    }
    EXPECT_EQ(seen, (std::vector<int>{1, 1, -1, 1, 1, 1}));
    auto st = p.stats();
    EXPECT_EQ(st.gpu_chunks, 5u);
    EXPECT_EQ(st.failed_chunks, 1u);
    EXPECT_EQ(st.fallback_chunks, 0u);
    // Every slot came back (run() refuses while any is held).
    const std::size_t n = chunk * 3 + 17;
    auto in = random_words(n, 33);
    std::vector<u32> out(n, 0xdeadbeefu);
    cudawait::sync_wait(sched, p.run(in, out));
    EXPECT_EQ(first_mismatch(out, expected(in, chunk)), n);
}

// A kernel fault loses the GPU with chunks in flight; the fallback they are handed to throws.
[[noreturn]] void sticky_fault_throwing_fallback_child() {
    const std::size_t chunk = 20'000;
    const std::size_t n = chunk * 8;
    auto in = random_words(n, 34);
    auto calls = std::make_shared<int>(0);
    pipeline_options o;
    o.memory.group_bytes = 0; // one chunk per flight: per-chunk records
    o.chunk_elements = chunk;
    o.depth = 3;
    o.recovery.on_degrade = [](const cudawait::chunk_failure&) {};
    int failures = 0;
    try {
        pipe_t p(o, {[calls](std::span<u32> a, std::span<u32> b, cudawait::stream_ref s) {
                     if ((*calls)++ == 4) {
                         cudawait::check(cudawait::testing::launch_fault(s.get()), "launch_fault");
                     }
                     cudawait::check(cudawait::testing::launch_transform(
                                         a.data(), b.data(), a.size(), salt, 0, s.get()),
                                     "launch_transform");
                 }},
                 [](std::size_t, std::span<const u32>, std::span<u32>) {
                     throw std::runtime_error("fallback refused");
                 });
        std::vector<u32> out(n, 0xdeadbeefu);
        const long before = cudawait::event_pool::for_device(0).outstanding();
        {
            cudawait::scheduler sched;
            try {
                cudawait::sync_wait(sched, p.run(in, out));
                std::fprintf(stderr, "FAILED: no exception\n");
                ++failures;
            } catch (const std::runtime_error& e) {
                if (std::string(e.what()) != "fallback refused") {
                    std::fprintf(stderr, "FAILED: %s instead of the fallback's exception\n",
                                 e.what());
                    ++failures;
                }
            }
        }
        const long after = cudawait::event_pool::for_device(0).outstanding();
        if (after != before) {
            std::fprintf(stderr, "FAILED: %ld events left out of the pool\n", after - before);
            ++failures;
        }
        if (!p.stats().gpu_abandoned) {
            std::fprintf(stderr, "FAILED: the GPU was not abandoned\n");
            ++failures;
        }
    } catch (const std::exception& e) {
        std::fprintf(stderr, "FAILED: %s\n", e.what());
        ++failures;
    }
    std::fprintf(stderr,
                 failures == 0 ? "throwing fallback handled\n" : "throwing fallback mishandled\n");
    std::_Exit(failures == 0 ? 0 : 1);
}

TEST_F(pipeline_gpu, a_sticky_fault_whose_fallback_throws_leaks_no_event) {
    GTEST_FLAG_SET(death_test_style, "threadsafe");
    EXPECT_EXIT(sticky_fault_throwing_fallback_child(), ::testing::ExitedWithCode(0),
                "throwing fallback handled");
}

} // namespace

// ---- latency percentiles and the post-mortem report -----------------------------------------

namespace {

using cudawait::detail::latency_window;
using cudawait::detail::nearest_rank;

/// A strict JSON checker for the reports (RFC 8259 grammar; strings, numbers, literals,
/// nesting): true when all of `s` is one JSON value.
class json_check {
public:
    explicit json_check(std::string_view s) : m_s(s) {}
    bool valid() {
        bool ok = value();
        space();
        return ok && m_i == m_s.size();
    }

private:
    void space() {
        while (m_i < m_s.size() && std::isspace(static_cast<unsigned char>(m_s[m_i])) != 0) {
            ++m_i;
        }
    }
    bool eat(char c) {
        space();
        if (m_i < m_s.size() && m_s[m_i] == c) {
            ++m_i;
            return true;
        }
        return false;
    }
    bool literal(std::string_view w) {
        if (m_s.substr(m_i, w.size()) != w) {
            return false;
        }
        m_i += w.size();
        return true;
    }
    bool string() {
        if (!eat('"')) {
            return false;
        }
        while (m_i < m_s.size()) {
            char c = m_s[m_i++];
            if (c == '"') {
                return true;
            }
            if (static_cast<unsigned char>(c) < 0x20) {
                return false;
            }
            if (c == '\\') {
                if (m_i >= m_s.size() ||
                    std::string_view("\"\\/bfnrtu").find(m_s[m_i]) == std::string_view::npos) {
                    return false;
                }
                m_i += m_s[m_i] == 'u' ? 5 : 1;
            }
        }
        return false;
    }
    bool number() {
        std::size_t start = m_i;
        if (m_i < m_s.size() && m_s[m_i] == '-') {
            ++m_i;
        }
        std::size_t digits = m_i;
        while (m_i < m_s.size() &&
               (std::isdigit(static_cast<unsigned char>(m_s[m_i])) != 0 ||
                std::string_view(".eE+-").find(m_s[m_i]) != std::string_view::npos)) {
            ++m_i;
        }
        if (m_i == digits || std::isdigit(static_cast<unsigned char>(m_s[digits])) == 0) {
            return false;
        }
        // The whole token must be a number strtod takes completely.
        std::string tok(m_s.substr(start, m_i - start));
        char* end = nullptr;
        (void)std::strtod(tok.c_str(), &end);
        return end == tok.c_str() + tok.size();
    }
    bool value() {
        space();
        if (m_i >= m_s.size()) {
            return false;
        }
        switch (m_s[m_i]) {
        case '{':
            ++m_i;
            if (eat('}')) {
                return true;
            }
            do {
                if (!string() || !eat(':') || !value()) {
                    return false;
                }
            } while (eat(','));
            return eat('}');
        case '[':
            ++m_i;
            if (eat(']')) {
                return true;
            }
            do {
                if (!value()) {
                    return false;
                }
            } while (eat(','));
            return eat(']');
        case '"':
            return string();
        case 't':
            return literal("true");
        case 'f':
            return literal("false");
        case 'n':
            return literal("null");
        default:
            return number();
        }
    }
    std::string_view m_s;
    std::size_t m_i = 0;
};

bool contains(const std::string& s, std::string_view what) {
    return s.find(what) != std::string::npos;
}

std::string read_file(const std::string& path) {
    std::ifstream f(path);
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
}

/// A path in the test's temporary directory that does not exist yet.
std::string fresh_path(const std::string& name) {
    std::string p = ::testing::TempDir() + "cudawait_" + name + "_" +
                    std::to_string(static_cast<unsigned long>(::getpid())) + ".json";
    std::filesystem::remove(p);
    return p;
}

TEST(json_check, accepts_json_and_rejects_broken_text) {
    EXPECT_TRUE(json_check(R"({"a":[1,-2.5e3,true,null,"x\"\u0001"],"b":{}})").valid());
    EXPECT_FALSE(json_check(R"({"a":1,})").valid());
    EXPECT_FALSE(json_check(R"({"a":[1,2})").valid());
    EXPECT_FALSE(json_check(R"({"a":0x12})").valid());
    EXPECT_FALSE(json_check(R"({"a":1}})").valid());
}

TEST(pipeline_latency, nearest_rank_picks_the_sample_at_the_rounded_up_rank) {
    // The textbook example: ranks ceil(p / 100 * 5).
    std::vector<double> v{35, 20, 50, 15, 40};
    EXPECT_EQ(nearest_rank(v, 5), 15);
    EXPECT_EQ(nearest_rank(v, 30), 20);
    EXPECT_EQ(nearest_rank(v, 40), 20);
    EXPECT_EQ(nearest_rank(v, 50), 35);
    EXPECT_EQ(nearest_rank(v, 100), 50);
    // 1..100 shuffled: percentile p is p itself (29 * 100 / 100 would round wrongly in doubles).
    std::vector<double> h(100);
    for (std::size_t i = 0; i < h.size(); ++i) {
        h[i] = static_cast<double>(i + 1);
    }
    std::shuffle(h.begin(), h.end(), std::mt19937_64(7));
    for (unsigned p : {1u, 29u, 50u, 57u, 90u, 99u, 100u}) {
        EXPECT_EQ(nearest_rank(h, p), static_cast<double>(p)) << "p" << p;
    }
    // 1..10: p99 is the maximum, p90 the ninth.
    std::vector<double> ten{7, 3, 10, 1, 9, 2, 8, 4, 6, 5};
    EXPECT_EQ(nearest_rank(ten, 50), 5);
    EXPECT_EQ(nearest_rank(ten, 90), 9);
    EXPECT_EQ(nearest_rank(ten, 99), 10);
    std::vector<double> one{0.25};
    EXPECT_EQ(nearest_rank(one, 1), 0.25);
    EXPECT_EQ(nearest_rank(one, 99), 0.25);
    std::vector<double> none;
    EXPECT_THROW((void)nearest_rank(none, 50), std::invalid_argument);
    EXPECT_THROW((void)nearest_rank(ten, 0), std::invalid_argument);
    EXPECT_THROW((void)nearest_rank(ten, 101), std::invalid_argument);
}

TEST(pipeline_latency, the_window_keeps_the_last_samples_and_the_maximum_of_all) {
    latency_window w(4);
    w.clear();
    EXPECT_EQ(w.summary().samples, 0u);
    EXPECT_EQ(w.summary().max_seconds, 0);
    for (double s : {9.0, 1.0, 2.0, 3.0, 4.0, 5.0}) {
        w.add(s);
    }
    // The window holds 2, 3, 4, 5 (9 and 1 were replaced); the maximum is of all six.
    auto s = w.summary();
    EXPECT_EQ(s.samples, 4u);
    EXPECT_EQ(s.p50_seconds, 3);
    EXPECT_EQ(s.p90_seconds, 5);
    EXPECT_EQ(s.p99_seconds, 5);
    EXPECT_EQ(s.max_seconds, 9);
    w.clear();
    EXPECT_EQ(w.size(), 0u);
    w.add(0.5);
    s = w.summary();
    EXPECT_EQ(s.samples, 1u);
    EXPECT_EQ(s.p50_seconds, 0.5);
    EXPECT_EQ(s.max_seconds, 0.5);
}

TEST(pipeline_latency, the_monitor_reports_percentiles_and_keeps_the_last_failures) {
    pipeline_options o; // no timing: the monitor makes no CUDA call
    o.chunk_elements = 16;
    cudawait::detail::pipeline_monitor m(o, 2);
    m.reset();
    std::vector<double> lat;
    for (u32 x : random_words(1000, 3)) {
        lat.push_back(static_cast<double>(x % 100'000) * 1e-6 + 1e-6);
    }
    for (double s : lat) {
        m.chunk_latency(s);
    }
    auto st = m.stats(2, false);
    std::vector<double> sorted = lat;
    std::sort(sorted.begin(), sorted.end());
    EXPECT_EQ(st.latency.samples, 1000u);
    EXPECT_EQ(st.latency.p50_seconds, sorted[499]);
    EXPECT_EQ(st.latency.p90_seconds, sorted[899]);
    EXPECT_EQ(st.latency.p99_seconds, sorted[989]);
    EXPECT_EQ(st.latency.max_seconds, sorted.back());
    for (std::size_t i = 0; i < 300; ++i) {
        cudawait::chunk_failure f;
        f.chunk = i;
        f.level = i % 3 == 0 ? cudawait::degrade_level::give_up : cudawait::degrade_level::retry;
        m.record_failure(f);
    }
    auto kept = m.failures();
    ASSERT_EQ(kept.size(), cudawait::detail::pipeline_monitor::max_failures);
    EXPECT_EQ(kept.front().chunk, 300 - kept.size()) << "the oldest are dropped";
    EXPECT_EQ(kept.back().chunk, 299u);
    EXPECT_EQ(m.give_ups(), 100u) << "counted also when no longer kept";
    m.reset();
    EXPECT_TRUE(m.failures().empty());
    EXPECT_EQ(m.give_ups(), 0u);
    EXPECT_EQ(m.stats(2, false).latency.samples, 0u);
}

TEST(pipeline_report, an_empty_report_is_json_with_every_section) {
    std::ostringstream os;
    cudawait::write_report(os, pipeline_options{}, cudawait::pipeline_stats{}, {});
    const std::string s = os.str();
    EXPECT_TRUE(json_check(s).valid()) << s;
    for (std::string_view key :
         {"\"options\":{", "\"stats\":{", "\"failures\":[]", "\"device\":{\"id\":0",
          // The options, nested as pipeline_options is.
          "\"options\":{\"depth\":2,\"chunk_elements\":0,\"output_elements\":0,\"graph\":false,"
          "\"streams\":{\"device\":0,\"compute_streams\":1,\"compute_priority\":null,"
          "\"transfer_priority\":null,\"stage_streams\":false},"
          "\"memory\":{\"scratch_bytes\":0,\"group_bytes\":null,\"queue_capacity\":0,\"pool\":null}"
          ","
          "\"monitoring\":{\"timing\":false,\"alert_fraction\":0.59999999999999998,"
          "\"utilisation_fraction\":0.80000000000000004,\"alert_window\":8,\"on_alert\":false,"
          "\"timeline\":false},"
          "\"recovery\":{\"chunk_timeout_ns\":0,\"max_retries\":2,\"recover_after\":16,"
          "\"on_degrade\":false,\"report_path\":\"\"}}",
          "\"recoveries\":0", "\"gpu_chunks\":0", "\"wall_seconds\":0", "\"overlap_efficiency\":0",
          "\"gpu_abandoned\":false", "\"alerts\":0",
          "\"latency\":{\"p50_seconds\":0,\"p90_seconds\":0,\"p99_seconds\":0,"
          "\"max_seconds\":0,\"samples\":0}",
          "\"name\":"}) {
        EXPECT_TRUE(contains(s, key)) << key << " in " << s;
    }
}

TEST(pipeline_report, a_failure_is_written_with_every_field) {
    pipeline_options o;
    o.memory.group_bytes = 0; // one chunk per flight: per-chunk records
    o.depth = 3;
    o.chunk_elements = 1000;
    o.streams.compute_priority = -2;
    o.recovery.chunk_timeout = 250ms;
    o.recovery.report_path = "/tmp/a \"quoted\" path";
    cudawait::pipeline_stats st;
    st.chunks = 8;
    st.latency = {0.001, 0.002, 0.003, 0.004, 8};
    cudawait::chunk_failure f;
    f.chunk = 3;
    f.offset = 3000;
    f.elements = 1000;
    f.output_elements = 500;
    f.input_bytes = 4000;
    f.output_bytes = 2000;
    f.depth = 2;
    f.compute_streams = 1;
    f.graph = true;
    f.h2d_stream = reinterpret_cast<cudaStream_t>(std::uintptr_t{0x1234});
    f.host_in = reinterpret_cast<const void*>(std::uintptr_t{0xabcdef0});
    f.level = cudawait::degrade_level::give_up;
    f.action = cudawait::degrade_action::fallback;
    f.error.status = cudaErrorInvalidValue;
    f.error.what = "bad \"launch\"\n";
    std::vector<cudawait::chunk_failure> fs{f, f};
    fs[1].error = {};
    fs[1].error.timed_out = true;
    fs[1].error.exception = std::make_exception_ptr(std::runtime_error("late"));
    std::ostringstream os;
    cudawait::write_report(os, o, st, fs);
    const std::string s = os.str();
    EXPECT_TRUE(json_check(s).valid()) << s;
    for (std::string_view key :
         {"\"depth\":3", "\"chunk_elements\":1000", "\"compute_priority\":-2",
          "\"chunk_timeout_ns\":250000000", R"("report_path":"/tmp/a \"quoted\" path")",
          "\"chunks\":8", "\"p99_seconds\":0.0030000000000000001", "\"samples\":8",
          "{\"chunk\":3,\"offset\":3000,\"elements\":1000,\"output_elements\":500,"
          "\"input_bytes\":4000,\"output_bytes\":2000,\"depth\":2,\"compute_streams\":1,"
          "\"device\":0,\"graph\":true,\"h2d_stream\":\"0x1234\",\"compute_stream\":\"0x0\","
          "\"d2h_stream\":\"0x0\",\"host_in\":\"0xabcdef0\",\"host_out\":\"0x0\","
          "\"device_in\":\"0x0\",\"device_out\":\"0x0\",\"level\":\"give_up\","
          "\"action\":\"fallback\",\"error\":{\"status\":\"cudaErrorInvalidValue\","
          "\"status_code\":1,\"sticky\":false,\"timed_out\":false,\"exception\":false,"
          R"("what":"bad \"launch\"\n"}})",
          "\"error\":{\"status\":\"cudaSuccess\",\"status_code\":0,\"sticky\":false,"
          "\"timed_out\":true,\"exception\":true,\"what\":\"\"}"}) {
        EXPECT_TRUE(contains(s, key)) << key << " in " << s;
    }
}

TEST(pipeline_report, a_file_gets_the_same_report_and_a_bad_path_throws) {
    pipeline_options o;
    o.memory.group_bytes = 0; // one chunk per flight: per-chunk records
    o.chunk_elements = 7;
    std::vector<cudawait::chunk_failure> fs(1);
    std::ostringstream os;
    cudawait::write_report(os, o, {}, fs);
    const std::string path = fresh_path("report_file");
    cudawait::write_report(path, o, {}, fs);
    EXPECT_EQ(read_file(path), os.str());
    std::filesystem::remove(path);
    EXPECT_THROW(cudawait::write_report(::testing::TempDir() + "no/such/dir/r.json", o, {}, fs),
                 std::runtime_error);
}

/// p50 <= p90 <= p99 <= max, all above zero, from `samples` chunks.
void expect_ordered_latency(const cudawait::latency_summary& l, std::size_t samples) {
    EXPECT_EQ(l.samples, samples);
    EXPECT_GT(l.p50_seconds, 0);
    EXPECT_LE(l.p50_seconds, l.p90_seconds);
    EXPECT_LE(l.p90_seconds, l.p99_seconds);
    EXPECT_LE(l.p99_seconds, l.max_seconds);
    EXPECT_LT(l.max_seconds, 60) << "seconds, not another unit";
}

TEST_F(pipeline_gpu, a_batch_that_gives_a_chunk_to_the_fallback_writes_the_report) {
    cudaError_t bad_launch = cudaSuccess;
    {
        cudawait::stream probe;
        bad_launch = cudawait::testing::launch_bad_config(probe.get());
    }
    ASSERT_NE(bad_launch, cudaSuccess);
    const std::size_t chunk = 20'000;
    const std::size_t n = chunk * 8;
    auto in = random_words(n, 31);
    pipeline_options o;
    o.memory.group_bytes = 0; // one chunk per flight: per-chunk records
    o.chunk_elements = chunk;
    o.depth = 3;
    o.recovery.max_retries = 0; // the first failure goes to the fallback (level 2)
    o.recovery.report_path = fresh_path("batch_failure");
    o.recovery.on_degrade = [](const cudawait::chunk_failure&) {};
    pipe_t p(o,
             {flaky_stage(std::make_shared<std::vector<int>>(std::vector<int>{3}),
                          std::make_shared<int>(0))},
             host_fallback);
    std::vector<u32> out(n, 0xdeadbeefu);
    cudawait::scheduler sched;
    cudawait::sync_wait(sched, p.run(in, out));
    EXPECT_EQ(first_mismatch(out, expected(in, chunk)), n);
    auto st = p.stats();
    EXPECT_EQ(st.gpu_chunks, 7u);
    EXPECT_EQ(st.fallback_chunks, 1u);
    expect_ordered_latency(st.latency, 8); // the fallback's chunk counts too
    EXPECT_LE(st.latency.max_seconds, st.wall_seconds);
    ASSERT_EQ(p.failures().size(), 1u);
    const cudawait::chunk_failure& f = p.failures()[0];
    EXPECT_EQ(f.chunk, 3u);
    EXPECT_EQ(f.level, cudawait::degrade_level::give_up);
    EXPECT_EQ(f.action, cudawait::degrade_action::fallback);
    EXPECT_EQ(f.error.status, bad_launch) << f.error.what;

    ASSERT_TRUE(std::filesystem::exists(o.recovery.report_path)) << o.recovery.report_path;
    const std::string r = read_file(o.recovery.report_path);
    EXPECT_TRUE(json_check(r).valid()) << r;
    for (std::string key : {std::string("\"status\":\"") + cudaGetErrorName(bad_launch) + "\"",
                            "\"status_code\":" + std::to_string(static_cast<int>(bad_launch)),
                            std::string("\"options\":{\"depth\":3,\"chunk_elements\":20000"),
                            std::string("{\"chunk\":3,\"offset\":60000,\"elements\":20000"),
                            std::string("\"level\":\"give_up\",\"action\":\"fallback\""),
                            std::string("\"chunks\":8,\"gpu_chunks\":7,\"fallback_chunks\":1"),
                            std::string("\"samples\":8")}) {
        EXPECT_TRUE(contains(r, key)) << key << " in " << r;
    }
    EXPECT_FALSE(contains(r, "\"name\":null")) << "the device's name: " << r;
    std::ostringstream direct;
    p.write_report(direct);
    EXPECT_EQ(direct.str(), r) << "the file holds what write_report(out) writes";
    std::filesystem::remove(o.recovery.report_path);

    // A clean run after it: no records, and no report.
    std::vector<u32> out2(n, 0xdeadbeefu);
    cudawait::sync_wait(sched, p.run(in, out2));
    EXPECT_EQ(first_mismatch(out2, expected(in, chunk)), n);
    EXPECT_TRUE(p.failures().empty());
    EXPECT_FALSE(std::filesystem::exists(o.recovery.report_path)) << "written without a failure";
}

TEST_F(pipeline_gpu, a_batch_without_a_fallback_writes_the_report_before_throwing) {
    const std::size_t chunk = 20'000;
    const std::size_t n = chunk * 5;
    auto in = random_words(n, 32);
    pipeline_options o;
    o.memory.group_bytes = 0; // one chunk per flight: per-chunk records
    o.chunk_elements = chunk;
    o.recovery.max_retries = 1;
    o.recovery.report_path = fresh_path("batch_error");
    o.recovery.on_degrade = [](const cudawait::chunk_failure&) {};
    // Chunk 1 fails twice: a level-1 retry, then level 2 (reported failed).
    pipe_t p(o, {flaky_stage(std::make_shared<std::vector<int>>(std::vector<int>{1, 2}),
                             std::make_shared<int>(0))});
    std::vector<u32> out(n, 0);
    cudawait::scheduler sched;
    EXPECT_THROW(cudawait::sync_wait(sched, p.run(in, out)), pipeline_error);
    ASSERT_EQ(p.failures().size(), 2u);
    EXPECT_EQ(p.failures()[0].action, cudawait::degrade_action::retried_with_less_depth);
    EXPECT_EQ(p.failures()[1].action, cudawait::degrade_action::failed);
    ASSERT_TRUE(std::filesystem::exists(o.recovery.report_path));
    const std::string r = read_file(o.recovery.report_path);
    EXPECT_TRUE(json_check(r).valid()) << r;
    EXPECT_TRUE(contains(r, "\"action\":\"retried_with_less_depth\"")) << r;
    EXPECT_TRUE(contains(r, "\"level\":\"give_up\",\"action\":\"failed\"")) << r;
    EXPECT_TRUE(contains(r, "\"failed_chunks\":1")) << r;
    std::filesystem::remove(o.recovery.report_path);
}

TEST_F(pipeline_gpu, latency_percentiles_after_a_clean_batch_and_a_stream) {
    const std::size_t chunk = 20'000;
    const std::size_t n = chunk * 16 + 123;
    auto in = random_words(n, 33);
    pipeline_options o;
    o.memory.group_bytes = 0; // one chunk per flight: per-chunk records
    o.chunk_elements = chunk;
    o.depth = 3;
    o.recovery.report_path = fresh_path("clean");
    pipe_t p(o, {transform_stage(100'000)}, host_fallback);
    std::vector<u32> out(n, 0xdeadbeefu);
    cudawait::scheduler sched;
    cudawait::sync_wait(sched, p.run(in, out));
    EXPECT_EQ(first_mismatch(out, expected(in, chunk)), n);
    auto st = p.stats();
    EXPECT_EQ(st.gpu_chunks, 17u);
    expect_ordered_latency(st.latency, 17);
    EXPECT_GE(st.latency.max_seconds, 100e-6) << "each chunk's kernel spins 100 us";
    EXPECT_LE(st.latency.max_seconds, st.wall_seconds);
    EXPECT_TRUE(p.failures().empty());

    // A streaming session starts the samples anew: its own 10 chunks.
    std::vector<std::vector<u32>> chunks;
    for (std::size_t i = 0; i < 10; ++i) {
        chunks.push_back(random_words(chunk - i, 400 + i));
    }
    auto seen = cudawait::sync_wait(sched, stream_chunks(p, chunks));
    ASSERT_EQ(seen.size(), 10u);
    for (std::size_t i = 0; i < seen.size(); ++i) {
        EXPECT_TRUE(seen[i].right) << "chunk " << i;
    }
    st = p.stats();
    EXPECT_EQ(st.gpu_chunks, 10u);
    expect_ordered_latency(st.latency, 10);
    EXPECT_GE(st.latency.max_seconds, 100e-6);
    EXPECT_FALSE(std::filesystem::exists(o.recovery.report_path)) << "written without a failure";
}

TEST_F(pipeline_gpu, a_streamed_chunk_given_up_writes_the_report) {
    const std::size_t chunk = 10'000;
    std::vector<std::vector<u32>> chunks;
    for (std::size_t i = 0; i < 6; ++i) {
        chunks.push_back(random_words(chunk, 500 + i));
    }
    for (bool with_fallback : {true, false}) {
        pipeline_options o;
        o.memory.group_bytes = 0; // one chunk per flight: per-chunk records
        o.chunk_elements = chunk;
        o.depth = 3;
        o.recovery.report_path = fresh_path(with_fallback ? "stream_fallback" : "stream_failed");
        o.recovery.max_retries = 0; // the failed launch goes straight to level 2, not to a retry
        o.recovery.on_degrade = [](const cudawait::chunk_failure&) {};
        pipe_t p(o,
                 {flaky_stage(std::make_shared<std::vector<int>>(std::vector<int>{2}),
                              std::make_shared<int>(0))},
                 with_fallback ? pipe_t::fallback(host_fallback) : pipe_t::fallback{});
        cudawait::scheduler sched;
        auto seen = cudawait::sync_wait(sched, stream_chunks(p, chunks));
        ASSERT_EQ(seen.size(), 6u);
        EXPECT_EQ(seen[2].by_fallback, with_fallback);
        ASSERT_EQ(p.failures().size(), 1u) << "kept after the session ended";
        EXPECT_EQ(p.failures()[0].chunk, 2u);
        // Produced chunks count: 5 by the GPU, and the fallback's.
        expect_ordered_latency(p.stats().latency, with_fallback ? 6 : 5);
        ASSERT_TRUE(std::filesystem::exists(o.recovery.report_path)) << o.recovery.report_path;
        const std::string r = read_file(o.recovery.report_path);
        EXPECT_TRUE(json_check(r).valid()) << r;
        EXPECT_TRUE(contains(r, "{\"chunk\":2,")) << r;
        EXPECT_TRUE(
            contains(r, with_fallback ? "\"action\":\"fallback\"" : "\"action\":\"failed\""))
            << r;
        std::filesystem::remove(o.recovery.report_path);
    }
}

// pipeline_options::memory_options::device_resource: every device buffer of the slots comes from
// it, once, when the pipeline is built; none per chunk; all go back to it when the pipeline goes.
TEST_F(pipeline_gpu, the_slots_device_buffers_come_from_the_device_resource_once) {
#if !CUDAWAIT_HAS_CUDA_MR
    GTEST_SKIP() << "cuda::mr is not available";
#else
    struct resource_case {
        std::size_t stages;
        std::size_t scratch_bytes;
        bool graph;
        long buffers_per_slot; // dev_in, dev_out, dev_mid for chained stages, the scratch
    };
    const std::size_t chunk = 40'000;
    const std::size_t n = chunk * 20 + 13;
    auto in = random_words(n, 47);
    cudawait::scheduler sched;
    for (const resource_case& c : {resource_case{1, 0, false, 2}, resource_case{1, 0, true, 2},
                                   resource_case{2, 1000, false, 4}}) {
        SCOPED_TRACE(std::to_string(c.stages) + " stages, scratch " +
                     std::to_string(c.scratch_bytes) + (c.graph ? ", graph" : ""));
        cudawait::testing::device_resource_counts counts;
        cudawait::testing::counting_device_resource counting(counts);
        pipeline_options o;
        o.memory.group_bytes = 0; // one chunk per flight: per-chunk records
        o.chunk_elements = chunk;
        o.depth = 3;
        o.memory.scratch_bytes = c.scratch_bytes;
        o.graph = c.graph;
        o.memory.device_resource = counting;
        {
            pipe_t p(o, c.stages == 1 ? std::vector<pipe_t::stage>{transform_stage()}
                                      : chain(c.stages));
            const long built = static_cast<long>(o.depth) * c.buffers_per_slot;
            EXPECT_EQ(counts.allocations.load(), built) << "one allocation per slot buffer";
            EXPECT_EQ(counts.deallocations.load(), 0);
            const std::size_t bytes = counts.bytes_allocated.load();
            EXPECT_GE(bytes, o.depth * (c.stages > 1 ? 3 : 2) * chunk * 4 + c.scratch_bytes);
            std::vector<u32> out(n, 0xdeadbeefu);
            cudawait::sync_wait(sched, p.run(in, out));
            const auto want = c.stages == 1 ? expected(in, chunk) : chain_on_host(in, c.stages);
            EXPECT_EQ(first_mismatch(out, want), n);
            std::fill(out.begin(), out.end(), 0xdeadbeefu);
            cudawait::sync_wait(sched, p.run(in, out));
            EXPECT_EQ(first_mismatch(out, want), n);
            EXPECT_EQ(counts.allocations.load(), built) << "no allocation per chunk";
            EXPECT_EQ(counts.bytes_allocated.load(), bytes);
            EXPECT_EQ(counts.deallocations.load(), 0);
        }
        EXPECT_EQ(counts.deallocations.load(), counts.allocations.load()) << "all freed";
        EXPECT_EQ(counts.bytes_freed.load(), counts.bytes_allocated.load());
    }
#endif
}

} // namespace
