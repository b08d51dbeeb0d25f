// SPDX-License-Identifier: Apache-2.0
// The recorder first: it defines NVTX's static-injection hook, which a file that included the
// NVTX headers before it would define weakly.
#include "nvtx_recorder.hpp"
// The rest.
#include <functional>
#include <limits>

#include "pipeline_checks.hpp"

namespace {

using namespace cudawait::testing::pipeline_checks;

// ---- without a GPU: argument checks come before any CUDA call ---------------------------------

TEST(pipeline, bad_options_are_usage_errors) {
    pipeline_options o;
    o.memory.group_bytes = 0; // one chunk per flight
    EXPECT_THROW(pipe_t(o, {transform_stage()}), usage_error) << "no chunk size";
    o.chunk_elements = 1024;
    o.depth = 0;
    EXPECT_THROW(pipe_t(o, {transform_stage()}), usage_error);
    o.depth = 2;
    EXPECT_THROW(pipe_t(o, {}), usage_error) << "no stages";
    EXPECT_THROW(pipe_t(o, {pipe_t::stage{}}), usage_error) << "an empty stage";
}

/// The message of the usage_error that `f` throws, or "" when it throws none.
template <class F>
std::string usage_error_of(F&& f) {
    try {
        f();
    } catch (const usage_error& e) {
        return e.what();
    }
    return "";
}

// validate() states each rule between the fields and names the field that breaks it; the
// pipeline calls it before any CUDA call. (A negative chunk_timeout, a negative or NaN alert
// fraction and an alert window of 0 were accepted before.)
TEST(pipeline_options, validate_names_the_field_of_each_rule) {
    pipeline_options good;
    good.memory.group_bytes = 0; // one chunk per flight
    good.chunk_elements = 1024;
    EXPECT_NO_THROW(good.validate());
    // A designated initialiser may leave out any field and group (with -Wextra too).
    const pipeline_options designated{.chunk_elements = 1024, .recovery = {.max_retries = 1}};
    EXPECT_NO_THROW(designated.validate());
    struct rule {
        std::function<void(pipeline_options&)> breaks;
        std::string message;
    };
    const std::vector<rule> rules = {
        {[](pipeline_options& o) { o.chunk_elements = 0; },
         "pipeline_options.chunk_elements must be non-zero"},
        {[](pipeline_options& o) { o.depth = 0; }, "pipeline_options.depth must be at least 1"},
        {[](pipeline_options& o) { o.streams.compute_streams = 0; },
         "pipeline_options.streams.compute_streams must be at least 1"},
        {[](pipeline_options& o) {
             o.streams.stage_streams = true;
             o.streams.compute_streams = 2;
         },
         "pipeline_options.streams.compute_streams must be 1 with streams.stage_streams"},
        {[](pipeline_options& o) { o.memory.scratch_bytes = std::size_t(-1) - 10; },
         "pipeline_options.memory.scratch_bytes is too large"},
        {[](pipeline_options& o) { o.monitoring.alert_fraction = -0.5; },
         "pipeline_options.monitoring.alert_fraction must be >= 0"},
        {[](pipeline_options& o) {
             o.monitoring.alert_fraction = std::numeric_limits<double>::quiet_NaN();
         },
         "pipeline_options.monitoring.alert_fraction must be >= 0"},
        {[](pipeline_options& o) { o.monitoring.utilisation_fraction = -1; },
         "pipeline_options.monitoring.utilisation_fraction must be >= 0"},
        {[](pipeline_options& o) { o.monitoring.alert_window = 0; },
         "pipeline_options.monitoring.alert_window must be at least 1"},
        {[](pipeline_options& o) { o.recovery.chunk_timeout = -1ns; },
         "pipeline_options.recovery.chunk_timeout must be >= 0"},
    };
    for (const rule& r : rules) {
        SCOPED_TRACE(r.message);
        pipeline_options o = good;
        r.breaks(o);
        const std::string direct = usage_error_of([&] { o.validate(); });
        EXPECT_EQ(direct.rfind(r.message, 0), 0u) << direct;
        const std::string built = usage_error_of([&] { pipe_t p(o, {transform_stage()}); });
        EXPECT_EQ(built, direct) << "the pipeline checks its options with validate()";
        EXPECT_EQ(usage_error_of([&] { o.validate("multi_pipeline_options.per_shard"); })
                      .rfind("multi_pipeline_options.per_shard." +
                                 r.message.substr(std::string("pipeline_options.").size()),
                             0),
                  0u);
    }
    // What the rules allow: the edges, and the values the fields document.
    pipeline_options o = good;
    o.monitoring.alert_fraction = 1.5; // above 1: an alert on every window (the tests use it)
    o.monitoring.utilisation_fraction = 0;
    o.monitoring.alert_window = 1;
    o.recovery.chunk_timeout = 0ns;
    o.streams.stage_streams = true;
    o.memory.scratch_bytes = std::size_t(-1) / 2;
    EXPECT_NO_THROW(o.validate());
}

TEST(pipeline, several_stages_need_one_element_type) {
    // Chained stages read each other's outputs: with In != Out only one stage is allowed.
    using mixed = pipeline<u32, float>;
    pipeline_options o;
    o.memory.group_bytes = 0; // one chunk per flight
    o.chunk_elements = 1024;
    mixed::stage stage = [](std::span<u32>, std::span<float>, cudawait::stream_ref) {};
    try {
        mixed p(o, {stage, stage});
        ADD_FAILURE() << "no exception";
    } catch (const usage_error& e) {
        EXPECT_NE(std::string(e.what()).find("In == Out"), std::string::npos) << e.what();
    }
    try {
        mixed p(o, {stage});
    } catch (const usage_error& e) {
        ADD_FAILURE() << "one stage of In != Out is allowed: " << e.what();
    } catch (const cudawait::cuda_error&) {
        // without a device the streams cannot be made
    }
}

TEST(pipeline, a_failed_batch_error_counts_the_chunks_it_lists) {
    pipeline_error e = cudawait::detail::batch_failed({0, 1, 3, 4, 6, 7, 8, 9, 10, 11}, {2, 5});
    EXPECT_STREQ(e.what(), "pipeline: 2 of 12 chunks failed");
    EXPECT_EQ(e.failed(), (std::vector<std::size_t>{2, 5}));
    EXPECT_EQ(e.completed().size(), 10u);
}

TEST(pipeline, every_degradation_level_and_action_has_its_name) {
    using cudawait::degrade_action;
    using cudawait::degrade_level;
    using cudawait::to_string;
    EXPECT_EQ(to_string(degrade_level::retry), "retry");
    EXPECT_EQ(to_string(degrade_level::give_up), "give_up");
    EXPECT_EQ(static_cast<int>(degrade_level::retry), 1);
    EXPECT_EQ(static_cast<int>(degrade_level::give_up), 2);
    const std::pair<degrade_action, std::string_view> actions[] = {
        {degrade_action::retried_with_less_depth, "retried_with_less_depth"},
        {degrade_action::waited_again, "waited_again"},
        {degrade_action::fallback, "fallback"},
        {degrade_action::failed, "failed"},
        {degrade_action::gpu_lost, "gpu_lost"},
        {degrade_action::fallback_after_gpu_lost, "fallback_after_gpu_lost"},
        {degrade_action::failed_after_gpu_lost, "failed_after_gpu_lost"},
        {degrade_action::failed_timed_out, "failed_timed_out"},
    };
    for (auto [action, name] : actions) {
        EXPECT_EQ(to_string(action), name);
    }
    static_assert(to_string(degrade_action::waited_again) == "waited_again");
}

TEST(pipeline, a_default_chunk_error_is_no_failure) {
    cudawait::chunk_error e;
    EXPECT_FALSE(e.failed());
    e.status = cudaErrorInvalidValue;
    EXPECT_TRUE(e.failed());
    cudawait::chunk_error t;
    t.timed_out = true;
    EXPECT_TRUE(t.failed());
    cudawait::chunk_error m;
    m.what = "the GPU was abandoned after an earlier error";
    EXPECT_TRUE(m.failed());
}

TEST(pipeline, without_a_device_construction_is_a_cuda_error) {
    auto child = [] {
        pipeline_options o;
        o.memory.group_bytes = 0; // one chunk per flight
        o.chunk_elements = 1024;
        try {
            pipe_t p(o, {transform_stage()});
            std::fprintf(stderr, "no exception\n");
            std::exit(1);
        } catch (const cudawait::cuda_error& e) {
            std::fprintf(stderr, "pipeline failed cleanly: %s\n", e.what());
            std::exit(0);
        }
    };
    CUDAWAIT_EXPECT_IN_CHILD_WITHOUT_DEVICE(child(), "pipeline failed cleanly");
}

// ---- with a GPU -------------------------------------------------------------------------------

struct batch_case {
    unsigned depth;
    unsigned compute_streams;
    bool pinned;
    bool graph;
    std::uint64_t spin_ns;
};

void PrintTo(const batch_case& c, std::ostream* os) {
    *os << "depth " << c.depth << ", " << c.compute_streams << " compute stream(s), "
        << (c.pinned ? "pinned" : "pageable") << (c.graph ? ", graph" : "") << ", spin "
        << c.spin_ns;
}

class pipeline_batch : public pipeline_gpu, public ::testing::WithParamInterface<batch_case> {};

// Random data through every configuration, a short last chunk included; every element checked.
TEST_P(pipeline_batch, every_element_is_right) {
    const batch_case c = GetParam();
    const std::size_t chunk = 64_KiB + 3;
    const std::size_t n = chunk * 9 + 1234;
    auto in = random_words(n, c.depth * 100 + c.compute_streams);
    auto want = expected(in, chunk);
    pipeline_options o;
    o.memory.group_bytes = 0; // one chunk per flight
    o.depth = c.depth;
    o.chunk_elements = chunk;
    o.streams.compute_streams = c.compute_streams;
    o.graph = c.graph;
    pipe_t pipe(o, {transform_stage(c.spin_ns)});
    cudawait::scheduler sched;
    if (c.pinned) {
        pinned_buffer<u32> pin(n);
        pinned_buffer<u32> pout(n);
        copy_into(pin, in);
        std::fill(pout.begin(), pout.end(), 0xdeadbeefu);
        cudawait::sync_wait(sched, pipe.run(pin.span(), pout.span()));
        std::vector<u32> got(pout.begin(), pout.end());
        ASSERT_EQ(first_mismatch(got, want), n);
        // A second run through the same pipeline (slots reused, graphs replayed).
        std::fill(pout.begin(), pout.end(), 0xdeadbeefu);
        cudawait::sync_wait(sched, pipe.run(pin.span(), pout.span()));
        got.assign(pout.begin(), pout.end());
        ASSERT_EQ(first_mismatch(got, want), n);
    } else {
        std::vector<u32> out(n, 0xdeadbeefu);
        cudawait::sync_wait(sched, pipe.run(in, out));
        ASSERT_EQ(first_mismatch(out, want), n);
    }
    auto st = pipe.stats();
    EXPECT_EQ(st.chunks, 10u);
    EXPECT_EQ(st.gpu_chunks, 10u);
    EXPECT_EQ(st.fallback_chunks + st.failed_chunks + st.retries, 0u);
}

INSTANTIATE_TEST_SUITE_P(
    configurations, pipeline_batch,
    ::testing::Values(batch_case{1, 1, true, false, 0}, batch_case{2, 1, true, false, 0},
                      batch_case{3, 2, true, false, 0}, batch_case{2, 1, false, false, 0},
                      batch_case{3, 2, false, false, 2'000'000}, batch_case{2, 1, true, true, 0},
                      batch_case{3, 1, false, true, 0}, batch_case{4, 3, true, false, 1'000'000}),
    [](const ::testing::TestParamInfo<batch_case>& info) {
        const batch_case& c = info.param;
        return "depth" + std::to_string(c.depth) + "_compute" + std::to_string(c.compute_streams) +
               (c.pinned ? "_pinned" : "_pageable") + (c.graph ? "_graph" : "") +
               (c.spin_ns != 0 ? "_slow" : "");
    });

TEST_F(pipeline_gpu, graph_mode_gives_the_same_bytes_as_plain_mode) {
    const std::size_t chunk = 100'000;
    const std::size_t n = chunk * 6 + 77;
    auto in = random_words(n, 42);
    std::vector<u32> plain(n, 1);
    std::vector<u32> graphed(n, 2);
    pipeline_options o;
    o.memory.group_bytes = 0; // one chunk per flight
    o.chunk_elements = chunk;
    o.depth = 3;
    cudawait::scheduler sched;
    {
        pipe_t p(o, {transform_stage()});
        cudawait::sync_wait(sched, p.run(in, plain));
    }
    o.graph = true;
    {
        pipe_t p(o, {transform_stage()});
        cudawait::sync_wait(sched, p.run(in, graphed));
    }
    EXPECT_EQ(plain, graphed);
    EXPECT_EQ(first_mismatch(graphed, expected(in, chunk)), n);
}

TEST_F(pipeline_gpu, output_size_can_differ_from_input_size) {
    const std::size_t chunk = 30'000;
    const std::size_t n = chunk * 5 + 100; // six chunks, one output each
    auto in = random_words(n, 3);
    pipeline_options o;
    o.memory.group_bytes = 0; // one chunk per flight
    o.chunk_elements = chunk;
    o.output_elements = 1;
    pipe_t p(o, {[](std::span<u32> in_, std::span<u32> out, cudawait::stream_ref s) {
                 cudawait::check(
                     cudawait::testing::launch_sum(in_.data(), in_.size(), out.data(), s.get()),
                     "launch_sum");
             }});
    EXPECT_EQ(p.output_size(n), 6u);
    std::vector<u32> out(6, 0);
    cudawait::scheduler sched;
    cudawait::sync_wait(sched, p.run(in, out));
    for (std::size_t c = 0; c < 6; ++c) {
        u32 sum = 0;
        for (std::size_t i = c * chunk; i < std::min(n, (c + 1) * chunk); ++i) {
            sum += in[i];
        }
        EXPECT_EQ(out[c], sum) << "chunk " << c;
    }
    std::vector<u32> wrong(5);
    EXPECT_THROW((void)p.run(in, wrong), usage_error);
}

// The staging rings hold depth + 2 input and output chunks (one of each filling or draining
// while the others wait for the GPU).
TEST_F(pipeline_gpu, staging_holds_at_most_depth_plus_two_times_input_plus_output_chunk_bytes) {
    cudawait::pinned_pool pool;
    const std::size_t chunk = 1_MiB / 4;
    const std::size_t n = chunk * 12 + 5;
    auto in = random_words(n, 11);
    std::vector<u32> out(n);
    pipeline_options o;
    o.memory.group_bytes = 0; // one chunk per flight
    o.chunk_elements = chunk;
    o.depth = 3;
    o.memory.pool = &pool;
    pipe_t p(o, {transform_stage(500'000)});
    cudawait::scheduler sched;
    cudawait::sync_wait(sched, p.run(in, out));
    EXPECT_EQ(first_mismatch(out, expected(in, chunk)), n);
    EXPECT_LE(pool.stats().peak_in_use_bytes, (3 + 2) * (chunk * 4 + chunk * 4));
    EXPECT_GT(pool.stats().peak_in_use_bytes, 0u);
}

// ---- monitoring -------------------------------------------------------------------------------

TEST_F(pipeline_gpu, timing_reports_stage_times_bandwidth_and_alerts) {
    const std::size_t chunk = 4_MiB / 4;
    const std::size_t n = chunk * 16;
    pinned_buffer<u32> in(n);
    pinned_buffer<u32> out(n);
    copy_into(in, random_words(n, 13));
    for (double fraction : {0.01, 1.5}) {
        std::size_t alerts = 0;
        pipeline_options o;
        o.memory.group_bytes = 0; // one chunk per flight
        o.chunk_elements = chunk;
        o.depth = 3;
        o.monitoring.timing = true;
        o.monitoring.alert_window = 4;
        o.monitoring.alert_fraction = fraction;
        o.monitoring.utilisation_fraction = 0; // the bandwidth alert alone (link_test: utilisation)
        o.monitoring.on_alert = [&](const cudawait::pipeline_alert& a) {
            ++alerts;
            EXPECT_GT(a.peak_gbps, 0);
            EXPECT_EQ(a.window, 4u);
        };
        pipe_t p(o, {transform_stage()});
        cudawait::scheduler sched;
        cudawait::sync_wait(sched, p.run(in.span(), out.span()));
        auto st = p.stats();
        EXPECT_GT(st.link_peak_gbps, 1.0);
        EXPECT_GT(st.h2d_gbps, 1.0);
        EXPECT_GT(st.d2h_gbps, 1.0);
        EXPECT_LT(st.h2d_gbps, st.link_peak_gbps * 1.2);
        EXPECT_GT(st.compute_seconds, 0);
        EXPECT_GT(st.compute_to_transfer, 0);
        EXPECT_GT(st.overlap_efficiency, 0);
        EXPECT_LE(st.overlap_efficiency, 1.05);
        EXPECT_GT(st.throughput_gbps, 0);
        EXPECT_GT(p.suggest_chunk_size(), 0u);
        if (fraction < 0.5) {
            EXPECT_EQ(alerts, 0u);
        } else {
            EXPECT_GE(alerts, 4u) << "4 windows of 4 chunks, both directions below 150% of peak";
        }
        EXPECT_EQ(st.alerts, alerts);
    }
}

// ---- one mode at a time -----------------------------------------------------------------------

/// Whether run() refuses now with usage_error.
cudawait::task<bool> run_refused(pipe_t& p, std::span<const u32> in, std::span<u32> out) {
    try {
        co_await p.run(in, out);
    } catch (const usage_error&) {
        co_return true;
    }
    co_return false;
}

/// One streamed chunk, with run() tried at each point of the session, acquire() after close(),
/// then the end, then run() again while a result is still held: whether each was refused (the
/// end: whether it came).
cudawait::task<std::vector<bool>> refusals_through_a_session(pipe_t& p, const std::vector<u32>& in,
                                                             std::vector<u32>& result) {
    std::vector<u32> scratch(in.size(), 0);
    std::vector<bool> refused;
    auto slot = co_await p.acquire();
    refused.push_back(co_await run_refused(p, in, scratch)); // a slot acquired
    std::copy(in.begin(), in.end(), slot.data().begin());
    p.submit(std::move(slot), in.size());
    refused.push_back(co_await run_refused(p, in, scratch)); // a chunk not yet taken
    std::optional<pipe_t::result> r = co_await p.next();
    result.assign(r->data().begin(), r->data().end());
    refused.push_back(co_await run_refused(p, in, scratch)); // a result held
    p.close();
    refused.push_back(co_await run_refused(p, in, scratch)); // closed, the end not yet taken
    bool acquire_refused = false;
    try {
        (void)co_await p.acquire();
    } catch (const usage_error&) {
        acquire_refused = true;
    }
    refused.push_back(acquire_refused);
    refused.push_back(!(co_await p.next()).has_value());     // the end
    refused.push_back(co_await run_refused(p, in, scratch)); // the end taken, a result held
    r.reset();
    co_return refused;
}

TEST_F(pipeline_gpu, after_a_drained_stream_batches_and_new_streams_may_follow) {
    const std::size_t chunk = 30'000;
    const std::size_t n = chunk * 4 + 99;
    auto in = random_words(n, 35);
    auto want = expected(in, chunk);
    auto one = random_words(chunk - 5, 36);
    std::vector<std::vector<u32>> chunks;
    for (std::size_t i = 0; i < 7; ++i) {
        chunks.push_back(random_words(chunk - 11 * i, 400 + i));
    }
    for (bool graph : {false, true}) {
        SCOPED_TRACE(graph ? "graph" : "plain");
        pipeline_options o;
        o.memory.group_bytes = 0; // one chunk per flight
        o.chunk_elements = chunk;
        o.depth = 3;
        o.graph = graph;
        pipe_t p(o, {transform_stage()});
        cudawait::scheduler sched;
        std::vector<u32> result;
        auto refused = cudawait::sync_wait(sched, refusals_through_a_session(p, one, result));
        EXPECT_EQ(refused, std::vector<bool>(7, true))
            << "run() refused while the session was open or a result held, acquire() after "
               "close(), then the end";
        EXPECT_EQ(result, transformed(one));
        // Idle: a batch.
        std::vector<u32> out(n, 0xdeadbeefu);
        cudawait::sync_wait(sched, p.run(in, out));
        EXPECT_EQ(first_mismatch(out, want), n);
        // A new session, numbered from 0, then another batch.
        auto got = stream_all(sched, p, chunks);
        ASSERT_EQ(got.size(), chunks.size());
        for (std::size_t i = 0; i < chunks.size(); ++i) {
            EXPECT_EQ(got[i], transformed(chunks[i])) << "chunk " << i;
        }
        EXPECT_EQ(p.stats().chunks, chunks.size()) << "the session's own statistics";
        std::fill(out.begin(), out.end(), 0xdeadbeefu);
        cudawait::sync_wait(sched, p.run(in, out));
        EXPECT_EQ(first_mismatch(out, want), n);
    }
}

// ---- chained stages ---------------------------------------------------------------------------

TEST_F(pipeline_gpu, chained_stages_each_read_the_previous_stage_output) {
    const std::size_t chunk = 50'000;
    const std::size_t n = chunk * 5 + 321;
    auto data = random_words(n, 37);
    pinned_buffer<u32> pin(n);
    pinned_buffer<u32> pout(n);
    copy_into(pin, data);
    std::vector<std::vector<u32>> chunks;
    std::mt19937 sizes(38);
    for (std::size_t i = 0; i < 12; ++i) {
        chunks.push_back(random_words(i % 3 == 0 ? chunk : 1 + sizes() % chunk, 600 + i));
    }
    for (std::size_t stages : {2, 3}) {
        auto want = chain_on_host(data, stages);
        for (bool graph : {false, true}) {
            SCOPED_TRACE(std::to_string(stages) + " stages" + (graph ? ", graph" : ""));
            pipeline_options o;
            o.memory.group_bytes = 0; // one chunk per flight
            o.chunk_elements = chunk;
            o.depth = 3;
            o.streams.compute_streams = 2;
            o.graph = graph;
            pipe_t p(o, chain(stages));
            cudawait::scheduler sched;
            // Pageable (staged, one chunk per slot) and pinned (run-ahead) batches.
            std::vector<u32> out(n, 0xdeadbeefu);
            cudawait::sync_wait(sched, p.run(data, out));
            EXPECT_EQ(first_mismatch(out, want), n);
            std::fill(pout.begin(), pout.end(), 0xdeadbeefu);
            cudawait::sync_wait(sched, p.run(pin.span(), pout.span()));
            std::vector<u32> got(pout.begin(), pout.end());
            EXPECT_EQ(first_mismatch(got, want), n);
            // Streaming, full and short chunks.
            auto outs = stream_all(sched, p, chunks);
            ASSERT_EQ(outs.size(), chunks.size());
            for (std::size_t i = 0; i < chunks.size(); ++i) {
                EXPECT_EQ(outs[i], chain_on_host(chunks[i], stages)) << "chunk " << i;
            }
            auto st = p.stats();
            EXPECT_EQ(st.gpu_chunks, chunks.size());
            EXPECT_EQ(st.fallback_chunks + st.failed_chunks, 0u);
        }
    }
}

TEST_F(pipeline_gpu, chained_stages_read_outputs_shorter_than_the_input) {
    // Stage 0 sums the chunk into one element; stage 1 reads that one element: 2 * sum + 1.
    const std::size_t chunk = 30'000;
    const std::size_t n = chunk * 4 + 5;
    auto in = random_words(n, 39);
    for (bool graph : {false, true}) {
        SCOPED_TRACE(graph ? "graph" : "plain");
        pipeline_options o;
        o.memory.group_bytes = 0; // one chunk per flight
        o.chunk_elements = chunk;
        o.output_elements = 1;
        o.graph = graph;
        std::size_t second_input = 0;
        pipe_t p(o, {[](std::span<u32> a, std::span<u32> b, cudawait::stream_ref s) {
                         cudawait::check(
                             cudawait::testing::launch_sum(a.data(), a.size(), b.data(), s.get()),
                             "launch_sum");
                     },
                     [&second_input](std::span<u32> a, std::span<u32> b, cudawait::stream_ref s) {
                         second_input = std::max(second_input, a.size());
                         cudawait::check(cudawait::testing::launch_affine(a.data(), b.data(),
                                                                          b.size(), 2, 1, s.get()),
                                         "launch_affine");
                     }});
        std::vector<u32> out(5, 0xdeadbeefu);
        cudawait::scheduler sched;
        cudawait::sync_wait(sched, p.run(in, out));
        EXPECT_EQ(second_input, 1u) << "the second stage reads the first one's output";
        for (std::size_t c = 0; c < 5; ++c) {
            u32 sum = 0;
            for (std::size_t i = c * chunk; i < std::min(n, (c + 1) * chunk); ++i) {
                sum += in[i];
            }
            EXPECT_EQ(out[c], sum * 2 + 1) << "chunk " << c;
        }
    }
}

// ---- NVTX ranges ------------------------------------------------------------------------------

cudawait::task<void> run_counted(pipe_t& p, std::span<const u32> in, std::span<u32> out,
                                 int& finished) {
    co_await p.run(in, out);
    ++finished;
}

cudawait::task<void> stream_counted(pipe_t& p, const std::vector<std::vector<u32>>& chunks,
                                    std::vector<std::vector<u32>>& got, int& finished) {
    co_await cudawait::when_all(submit_all(p, chunks), take_all(p, got));
    ++finished;
}

/// Wakes every 50 us until `finished` reaches `of`: at each wake-up, between other coroutines'
/// turns, no push/pop range may be open on the thread.
cudawait::task<void> nvtx_probe(const int& finished, int of, std::size_t& wakeups,
                                std::size_t& violations) {
    auto& rec = cudawait::testing::nvtx_recorder::instance();
    while (finished < of) {
        co_await cudawait::sleep_for(50us);
        ++wakeups;
        if (!rec.open_pushes().empty()) {
            ++violations;
        }
    }
}

// A batch on one pipeline and a stream on another, interleaved on one scheduler thread, with an
// NVTX tool in the process that records every range: a push/pop range never stays open across
// a suspension (so no pop closes another coroutine's range), and every wait is a start/end range
// ended by its own id.
TEST_F(pipeline_gpu, nvtx_ranges_stay_nested_with_two_pipelines_on_one_scheduler) {
    auto& rec = cudawait::testing::nvtx_recorder::instance();
    { cudawait::trace_range first("first", 0); } // NVTX initialises its tool on the first call
    if (!rec.installed()) {
        GTEST_SKIP() << "another NVTX tool (a profiler's injection) took precedence";
    }
    const std::size_t chunk = 20'000;
    const std::size_t n = chunk * 6 + 10; // seven chunks
    auto data = random_words(n, 40);
    pinned_buffer<u32> in(n);
    pinned_buffer<u32> out(n);
    copy_into(in, data);
    std::vector<std::vector<u32>> chunks;
    for (std::size_t i = 0; i < 8; ++i) {
        chunks.push_back(random_words(chunk - 3 * i, 700 + i));
    }
    for (bool graph : {false, true}) {
        SCOPED_TRACE(graph ? "graph" : "plain");
        rec.clear();
        // A stage runs inside the pipeline's synchronous enqueue: the thread's stack holds the
        // range around it and nothing a suspended coroutine left open.
        std::size_t stage_calls = 0;
        std::size_t stage_violations = 0;
        pipe_t::stage stage = [&](std::span<u32> a, std::span<u32> b, cudawait::stream_ref s) {
            ++stage_calls;
            auto open = rec.open_pushes();
            if (open.size() != 1 || (open[0].message != "compute" && open[0].message != "graph")) {
                ++stage_violations;
            }
            cudawait::check(cudawait::testing::launch_transform(a.data(), b.data(), a.size(), salt,
                                                                1'000'000, s.get()),
                            "launch_transform");
        };
        pipeline_options o;
        o.memory.group_bytes = 0; // one chunk per flight
        o.chunk_elements = chunk;
        o.graph = graph;
        o.depth = 2;
        pipe_t batch_pipe(o, {stage});
        o.depth = 3;
        pipe_t stream_pipe(o, {stage});
        std::fill(out.begin(), out.end(), 0xdeadbeefu);
        std::vector<std::vector<u32>> got;
        int finished = 0;
        std::size_t wakeups = 0;
        std::size_t probe_violations = 0;
        {
            cudawait::scheduler sched;
            cudawait::sync_wait(
                sched, cudawait::when_all(run_counted(batch_pipe, in.span(), out.span(), finished),
                                          stream_counted(stream_pipe, chunks, got, finished),
                                          nvtx_probe(finished, 2, wakeups, probe_violations)));
        }
        std::vector<u32> outv(out.begin(), out.end());
        EXPECT_EQ(first_mismatch(outv, expected(data, chunk)), n);
        ASSERT_EQ(got.size(), chunks.size());
        for (std::size_t i = 0; i < chunks.size(); ++i) {
            EXPECT_EQ(got[i], transformed(chunks[i])) << "chunk " << i;
        }
        EXPECT_GT(stage_calls, 0u);
        EXPECT_EQ(stage_violations, 0u) << "a stage ran under a range another coroutine opened";
        EXPECT_GT(wakeups, 0u);
        EXPECT_EQ(probe_violations, 0u) << "a push/pop range stayed open across a suspension";
        EXPECT_EQ(rec.errors(), std::vector<std::string>{});
        EXPECT_EQ(rec.open_push_count(), 0u);
        EXPECT_TRUE(rec.open_starts().empty());
        std::size_t waits = 0;
        std::size_t pushed = 0;
        for (const auto& r : rec.closed()) {
            EXPECT_EQ(r.domain, "cudawait") << r.message;
            if (r.message == "wait") {
                EXPECT_FALSE(r.push_pop) << "a wait spans a co_await: a start/end range";
                ++waits;
            } else if (r.push_pop) {
                EXPECT_EQ(r.opened_on, r.closed_on) << r.message;
                ++pushed;
            }
        }
        EXPECT_EQ(waits, 7u + chunks.size()) << "one wait per chunk: 7 batch chunks, 8 streamed";
        EXPECT_GT(pushed, 0u);
    }
}

// ---- what the options promise -----------------------------------------------------------------

TEST_F(pipeline_gpu, streams_carry_the_default_and_the_configured_priorities) {
    int least = 0;
    int greatest = 0;
    ASSERT_EQ(cudaDeviceGetStreamPriorityRange(&least, &greatest), cudaSuccess);
    const std::size_t chunk = 10'000;
    const std::size_t n = chunk * 4;
    auto in = random_words(n, 41);
    for (bool configured : {false, true}) {
        SCOPED_TRACE(configured ? "configured: compute lowest, copies highest" : "defaults");
        pipeline_options o;
        o.memory.group_bytes = 0; // one chunk per flight
        o.chunk_elements = chunk;
        o.streams.compute_streams = 2;
        int compute = greatest; // default: compute highest, copies lowest
        int transfer = least;
        if (configured) {
            o.streams.compute_priority = least;
            o.streams.transfer_priority = greatest;
            std::swap(compute, transfer);
        }
        std::vector<std::pair<cudaStream_t, int>> calls;
        pipe_t p(o, {[&calls](std::span<u32> a, std::span<u32> b, cudawait::stream_ref s) {
                     int priority = 0;
                     cudawait::check(cudaStreamGetPriority(s.get(), &priority),
                                     "cudaStreamGetPriority");
                     calls.emplace_back(s.get(), priority);
                     cudawait::check(cudawait::testing::launch_transform(
                                         a.data(), b.data(), a.size(), salt, 0, s.get()),
                                     "launch_transform");
                 }});
        EXPECT_EQ(p.h2d_stream().priority(), transfer);
        EXPECT_EQ(p.d2h_stream().priority(), transfer);
        EXPECT_EQ(p.compute_stream(0).priority(), compute);
        EXPECT_EQ(p.compute_stream(1).priority(), compute);
        EXPECT_THROW((void)p.compute_stream(2), usage_error);
        std::vector<u32> out(n, 0xdeadbeefu);
        cudawait::scheduler sched;
        cudawait::sync_wait(sched, p.run(in, out));
        EXPECT_EQ(first_mismatch(out, expected(in, chunk)), n);
        ASSERT_EQ(calls.size(), 4u);
        std::set<cudaStream_t> used;
        for (auto [s, priority] : calls) {
            EXPECT_EQ(priority, compute);
            used.insert(s);
        }
        EXPECT_EQ(used,
                  (std::set<cudaStream_t>{p.compute_stream(0).get(), p.compute_stream(1).get()}))
            << "the stages ran on the compute streams, in turn";
    }
}

/// "a3" for what = 'a', k = 3.
std::string step(char what, std::size_t k) {
    std::string s(1, what);
    s += std::to_string(k);
    return s;
}

TEST_F(pipeline_gpu, a_queue_capacity_below_the_depth_bounds_submissions) {
    const std::size_t chunk = 10'000;
    std::vector<std::vector<u32>> chunks;
    for (std::size_t i = 0; i < 5; ++i) {
        chunks.push_back(random_words(chunk - i, 800 + i));
    }
    pipeline_options o;
    o.memory.group_bytes = 0; // one chunk per flight
    o.chunk_elements = chunk;
    o.depth = 3;
    o.memory.queue_capacity = 1; // one chunk submitted and not yet taken, though three slots exist
    pipe_t p(o, {transform_stage()});
    std::vector<std::string> log;
    std::size_t bad = 0;
    auto produce = [&]() -> cudawait::task<> {
        for (std::size_t k = 0; k < chunks.size(); ++k) {
            auto slot = co_await p.acquire();
            log.push_back(step('a', k));
            std::copy(chunks[k].begin(), chunks[k].end(), slot.data().begin());
            p.submit(std::move(slot), chunks[k].size());
        }
        p.close();
    };
    auto consume = [&]() -> cudawait::task<> {
        co_await cudawait::sleep_for(5ms); // the producer runs ahead meanwhile, if it can
        for (std::size_t k = 0;; ++k) {
            log.push_back(step('c', k));
            auto r = co_await p.next();
            if (!r) {
                break;
            }
            auto want = transformed(chunks[r->chunk()]);
            if (r->chunk() != k ||
                !std::equal(want.begin(), want.end(), r->data().begin(), r->data().end())) {
                ++bad;
            }
        }
    };
    cudawait::scheduler sched;
    cudawait::sync_wait(sched, cudawait::when_all(produce(), consume()));
    EXPECT_EQ(bad, 0u);
    ASSERT_GE(log.size(), 2u);
    EXPECT_EQ(log[0], "a0");
    EXPECT_EQ(log[1], "c0")
        << "the second acquire waited, with two slots free, until next() took the first chunk";
    auto at = [&](const std::string& what) {
        return std::find(log.begin(), log.end(), what) - log.begin();
    };
    for (std::size_t k = 1; k < chunks.size(); ++k) {
        EXPECT_GT(at(step('a', k)), at(step('c', k - 1)))
            << "acquire " << k << " returned before next() took chunk " << k - 1;
    }
}

TEST_F(pipeline_gpu, suggested_chunk_size_grows_for_a_light_kernel_and_shrinks_for_a_heavy_one) {
    // The rule (suggest_chunk_size): compute:transfer above 3 halves the chunk; below 1.5, with
    // copies under 1 ms each, doubles it.
    cudawait::scheduler sched;
    for (bool heavy : {false, true}) {
        SCOPED_TRACE(heavy ? "heavy kernel" : "light kernel");
        // Light: 1 MiB chunks (tens of microseconds per copy), a kernel of a few microseconds.
        // Heavy: 8 MiB chunks (a few hundred microseconds per copy), 3 ms kernels.
        const std::size_t chunk = (heavy ? 8_MiB : 1_MiB) / 4;
        const std::size_t n = chunk * (heavy ? 6 : 16);
        pinned_buffer<u32> in(n);
        pinned_buffer<u32> out(n);
        auto data = random_words(n, heavy ? 43 : 42);
        copy_into(in, data);
        std::fill(out.begin(), out.end(), 0xdeadbeefu);
        pipeline_options o;
        o.memory.group_bytes = 0; // one chunk per flight
        o.chunk_elements = chunk;
        o.depth = 3;
        o.monitoring.timing = true;
        pipe_t p(o, {transform_stage(heavy ? 3'000'000 : 0)});
        // The light kernel's few microseconds are timed between events, so kernels of other
        // processes holding the SMs (ctest runs test programs side by side) can stretch them:
        // up to three runs, and the stats of the one with the least compute time.
        cudawait::pipeline_stats st;
        for (int attempt = 0; attempt < 3; ++attempt) {
            std::fill(out.begin(), out.end(), 0xdeadbeefu);
            cudawait::sync_wait(sched, p.run(in.span(), out.span()));
            std::vector<u32> got(out.begin(), out.end());
            EXPECT_EQ(first_mismatch(got, expected(data, chunk)), n);
            st = p.stats();
            if (heavy || st.compute_to_transfer < 1.5) {
                break;
            }
        }
        std::size_t suggested = p.suggest_chunk_size();
        if (heavy) {
            ASSERT_GT(st.compute_to_transfer, 3.0) << "the kernel dominates";
            EXPECT_LT(suggested, chunk);
            EXPECT_GE(suggested, chunk / 2);
        } else {
            ASSERT_LT(st.compute_to_transfer, 1.5) << "the copies dominate";
            EXPECT_EQ(suggested, 2 * chunk);
        }
    }
}

// ---- stage context, scratch and stage streams ------------------------------------------------

using cudawait::stage_context;
using old_stage_fn = void (*)(std::span<u32>, std::span<u32>, cudawait::stream_ref);
using context_stage_fn = void (*)(std::span<u32>, std::span<u32>, const stage_context&);

// Either form makes a stage; other signatures do not.
static_assert(std::is_same_v<pipe_t::stage, cudawait::pipeline_stage<u32, u32>>);
static_assert(std::is_constructible_v<pipe_t::stage, old_stage_fn>);
static_assert(std::is_constructible_v<pipe_t::stage, context_stage_fn>);
static_assert(std::is_constructible_v<
              pipe_t::stage, std::function<void(std::span<u32>, std::span<u32>, cudaStream_t)>>);
static_assert(!std::is_constructible_v<pipe_t::stage, void (*)(std::span<u32>, std::span<u32>)>);
static_assert(!std::is_constructible_v<pipe_t::stage,
                                       void (*)(std::span<float>, std::span<u32>, cudaStream_t)>);
static_assert(!std::is_constructible_v<pipe_t::stage, int>);
static_assert(std::is_copy_constructible_v<pipe_t::stage>);
static_assert(std::is_nothrow_default_constructible_v<pipe_t::stage>);

/// A context with a made-up stream handle (never given to CUDA).
stage_context fake_context(unsigned stage, std::span<std::byte> scratch = {}) {
    auto s = reinterpret_cast<cudaStream_t>(std::uintptr_t{0x5000});
    return stage_context{
        .stream = s, .slot = 2, .stage = stage, .device = 0, .chunk = 9, .scratch = scratch};
}

TEST(pipeline_stage, takes_either_form_and_calls_it_with_the_context) {
    std::vector<u32> a(4);
    std::vector<u32> b(3);
    std::vector<std::byte> scratch(64);
    const stage_context ctx = fake_context(1, scratch);

    cudaStream_t old_seen = nullptr;
    std::size_t old_sizes = 0;
    pipe_t::stage old_form = [&](std::span<u32> in, std::span<u32> out, cudawait::stream_ref s) {
        old_seen = s.get();
        old_sizes = in.size() * 10 + out.size();
    };
    const stage_context* ctx_seen = nullptr;
    pipe_t::stage new_form = [&](std::span<u32> in, std::span<u32> out, const stage_context& c) {
        ctx_seen = &c;
        EXPECT_EQ(in.data(), a.data());
        EXPECT_EQ(out.data(), b.data());
    };
    ASSERT_TRUE(old_form);
    ASSERT_TRUE(new_form);
    old_form(a, b, ctx);
    new_form(a, b, ctx);
    EXPECT_EQ(old_seen, ctx.stream.get()) << "the older form gets the context's stream";
    EXPECT_EQ(old_sizes, 43u);
    EXPECT_EQ(ctx_seen, &ctx) << "the context form gets the context itself, not a copy";

    // A mutable lambda (std::function called its target as an lvalue; so does the stage), a
    // generic one written for the stream, and a copy that calls the same target.
    int calls = 0;
    pipe_t::stage counting = [&calls, n = 0](std::span<u32>, std::span<u32>,
                                             cudawait::stream_ref) mutable { calls = ++n; };
    counting(a, b, ctx);
    pipe_t::stage copy = counting;
    copy(a, b, ctx);
    EXPECT_EQ(calls, 2);
    cudaStream_t generic_seen = nullptr;
    pipe_t::stage generic = [&](auto, auto, auto s) { generic_seen = cudaStream_t(s); };
    generic(a, b, ctx);
    EXPECT_EQ(generic_seen, ctx.stream.get());
    // Mixed in one list, as the constructor takes them.
    std::vector<pipe_t::stage> both{old_form, new_form};
    EXPECT_EQ(both.size(), 2u);
}

TEST(pipeline_stage, an_empty_callable_makes_an_empty_stage) {
    EXPECT_FALSE(pipe_t::stage{});
    EXPECT_FALSE(pipe_t::stage(old_stage_fn{nullptr}));
    EXPECT_FALSE(pipe_t::stage(context_stage_fn{nullptr}));
    EXPECT_FALSE(
        pipe_t::stage(std::function<void(std::span<u32>, std::span<u32>, cudawait::stream_ref)>{}));
    EXPECT_FALSE(
        pipe_t::stage(std::function<void(std::span<u32>, std::span<u32>, const stage_context&)>{}));
    // The pipeline refuses them before any CUDA call.
    pipeline_options o;
    o.memory.group_bytes = 0; // one chunk per flight
    o.chunk_elements = 1024;
    EXPECT_THROW(pipe_t(o, {pipe_t::stage(old_stage_fn{nullptr})}), usage_error);
}

TEST(pipeline_stage, stage_streams_need_one_compute_stream) {
    pipeline_options o;
    o.memory.group_bytes = 0; // one chunk per flight
    o.chunk_elements = 1024;
    o.streams.stage_streams = true;
    o.streams.compute_streams = 2;
    try {
        pipe_t p(o, {transform_stage(), transform_stage()});
        ADD_FAILURE() << "no exception";
    } catch (const usage_error& e) {
        EXPECT_NE(std::string(e.what()).find("compute_streams"), std::string::npos) << e.what();
    }
    o.streams.compute_streams = 1;
    o.memory.scratch_bytes = std::size_t(-1) - 10;
    EXPECT_THROW(pipe_t(o, {transform_stage()}), usage_error) << "scratch size overflows";
}

/// `in` through the transform with each of `salts` in turn, chunk by chunk (the index restarts
/// in each chunk).
std::vector<u32> transforms_on_host(const std::vector<u32>& in, std::size_t chunk,
                                    const std::vector<u32>& salts) {
    std::vector<u32> cur = in;
    std::vector<u32> next(in.size());
    for (u32 st : salts) {
        for (std::size_t off = 0; off < in.size(); off += chunk) {
            std::size_t n = std::min(chunk, in.size() - off);
            cudawait::testing::transform_on_host(cur.data() + off, next.data() + off, n, st);
        }
        cur.swap(next);
    }
    return cur;
}

/// A stage of the context form that launches the transform with its own salt, slowly if asked.
pipe_t::stage salted_stage(u32 stage_salt, std::uint64_t spin_ns = 0) {
    return [stage_salt, spin_ns](std::span<u32> in, std::span<u32> out, const stage_context& c) {
        cudawait::check(cudawait::testing::launch_transform(in.data(), out.data(), in.size(),
                                                            stage_salt, spin_ns, c.stream.get()),
                        "launch_transform");
    };
}

/// What stages saw of the scratch.
struct scratch_log {
    explicit scratch_log(unsigned depth) : per_slot(depth) {}
    std::vector<std::set<std::uintptr_t>> per_slot; ///< scratch addresses each slot handed out
    std::size_t calls = 0;
    std::size_t wrong_size = 0;
    std::size_t misaligned = 0;
    std::size_t bad_slot = 0;
};

/// A stage that goes through the slot's scratch: copies its input there (after `spin_ns`), then
/// writes out = transform(scratch) with its own salt. The output is right only if the scratch
/// held this chunk's input, from this stage, when the transform read it.
pipe_t::stage scratch_stage(u32 stage_salt, std::uint64_t spin_ns, std::size_t bytes,
                            scratch_log& log) {
    return [stage_salt, spin_ns, bytes, &log](std::span<u32> in, std::span<u32> out,
                                              const stage_context& c) {
        ++log.calls;
        const auto at = reinterpret_cast<std::uintptr_t>(c.scratch.data());
        if (c.slot < log.per_slot.size()) {
            log.per_slot[c.slot].insert(at);
        } else {
            ++log.bad_slot;
        }
        log.wrong_size += c.scratch.size() != bytes ? 1 : 0;
        log.misaligned += at % 256 != 0 ? 1 : 0;
        auto* tmp = reinterpret_cast<u32*>(c.scratch.data());
        cudawait::check(cudawait::testing::launch_delayed_copy(spin_ns, tmp, in.data(), in.size(),
                                                               c.stream.get()),
                        "launch_delayed_copy");
        cudawait::check(cudawait::testing::launch_transform(tmp, out.data(), in.size(), stage_salt,
                                                            0, c.stream.get()),
                        "launch_transform");
    };
}

TEST_F(pipeline_gpu, stages_share_the_slot_scratch_which_is_stable_aligned_and_disjoint) {
    const std::size_t chunk = 20'000;
    const std::size_t n = chunk * 10 + 777; // eleven chunks, the last short
    const unsigned depth = 3;
    const std::size_t bytes = chunk * sizeof(u32) + 100; // not a multiple of the alignment
    const std::vector<u32> salts{0x1234, 0xabcd};
    auto data = random_words(n, 61);
    auto want = transforms_on_host(data, chunk, salts);
    pinned_buffer<u32> pin(n);
    pinned_buffer<u32> pout(n);
    copy_into(pin, data);
    for (bool graph : {false, true}) {
        for (bool own_streams : {false, true}) {
            SCOPED_TRACE(std::string(graph ? "graph" : "plain") +
                         (own_streams ? ", stage streams" : ""));
            pipeline_options o;
            o.memory.group_bytes = 0; // one chunk per flight
            o.chunk_elements = chunk;
            o.depth = depth;
            o.graph = graph;
            o.streams.stage_streams = own_streams;
            o.memory.scratch_bytes = bytes;
            scratch_log log(depth);
            // Both stages use the whole scratch, one after the other.
            pipe_t p(o, {scratch_stage(salts[0], 100'000, bytes, log),
                         scratch_stage(salts[1], 0, bytes, log)});
            cudawait::scheduler sched;
            // Pinned (run-ahead: chunks of one slot queued behind each other) and pageable.
            std::fill(pout.begin(), pout.end(), 0xdeadbeefu);
            cudawait::sync_wait(sched, p.run(pin.span(), pout.span()));
            std::vector<u32> got(pout.begin(), pout.end());
            EXPECT_EQ(first_mismatch(got, want), n);
            std::vector<u32> out(n, 0xdeadbeefu);
            cudawait::sync_wait(sched, p.run(data, out));
            EXPECT_EQ(first_mismatch(out, want), n);

            // Plain: every chunk calls both stages, twice over. Graph: each slot's capture once,
            // and the short chunk (outside the graph) in each run.
            EXPECT_EQ(log.calls, graph ? 2u * (depth + 2) : 2u * 11 * 2);
            EXPECT_EQ(log.wrong_size, 0u);
            EXPECT_EQ(log.misaligned, 0u);
            EXPECT_EQ(log.bad_slot, 0u);
            std::vector<std::uintptr_t> starts;
            for (unsigned sl = 0; sl < depth; ++sl) {
                ASSERT_EQ(log.per_slot[sl].size(), 1u) << "slot " << sl << ": one scratch";
                starts.push_back(*log.per_slot[sl].begin());
            }
            std::sort(starts.begin(), starts.end());
            for (std::size_t i = 1; i < starts.size(); ++i) {
                EXPECT_GE(starts[i] - starts[i - 1], bytes) << "slots' scratch overlaps";
            }
        }
    }
}

/// What stages were told, one record per call.
struct context_record {
    unsigned stage;
    unsigned slot;
    int device;
    std::size_t chunk;
    cudaStream_t stream;
};

/// A salted transform stage that records its context.
pipe_t::stage recording_stage(u32 stage_salt, std::vector<context_record>& log) {
    return [stage_salt, &log](std::span<u32> in, std::span<u32> out, const stage_context& c) {
        log.push_back({c.stage, c.slot, c.device, c.chunk, c.stream.get()});
        EXPECT_TRUE(c.scratch.empty()) << "scratch_bytes 0: an empty span";
        cudawait::check(cudawait::testing::launch_transform(in.data(), out.data(), in.size(),
                                                            stage_salt, 0, c.stream.get()),
                        "launch_transform");
    };
}

/// Checks the records of `chunks` chunks through 3 stages on `depth` slots: each stage's index,
/// a slot below the depth and the same for all stages of a chunk, the device, every chunk seen
/// once by each stage; with own streams stage k on compute_stream(k), else all of a chunk's
/// stages on one of the compute streams.
void check_contexts(const std::vector<context_record>& log, const pipe_t& p, std::size_t chunks,
                    bool own_streams) {
    const pipeline_options& o = p.options();
    ASSERT_EQ(log.size(), 3 * chunks);
    std::vector<unsigned> slot_of(chunks, ~0u);
    std::vector<cudaStream_t> stream_of(chunks, nullptr);
    for (unsigned k = 0; k < 3; ++k) {
        std::multiset<std::size_t> seen;
        for (const context_record& r : log) {
            if (r.stage != k) {
                continue;
            }
            seen.insert(r.chunk);
            ASSERT_LT(r.chunk, chunks);
            EXPECT_LT(r.slot, o.depth);
            EXPECT_EQ(r.device, o.streams.device);
            if (slot_of[r.chunk] == ~0u) {
                slot_of[r.chunk] = r.slot;
            }
            EXPECT_EQ(r.slot, slot_of[r.chunk]) << "chunk " << r.chunk << " changed slots";
            if (own_streams) {
                EXPECT_EQ(r.stream, p.compute_stream(k).get()) << "stage " << k;
            } else {
                if (stream_of[r.chunk] == nullptr) {
                    stream_of[r.chunk] = r.stream;
                }
                EXPECT_EQ(r.stream, stream_of[r.chunk]) << "chunk " << r.chunk;
                bool compute = false;
                for (unsigned i = 0; i < o.streams.compute_streams; ++i) {
                    compute = compute || r.stream == p.compute_stream(i).get();
                }
                EXPECT_TRUE(compute) << "chunk " << r.chunk << " outside the compute streams";
            }
        }
        EXPECT_EQ(seen.size(), chunks) << "stage " << k;
        for (std::size_t c = 0; c < chunks; ++c) {
            EXPECT_EQ(seen.count(c), 1u) << "stage " << k << ", chunk " << c;
        }
    }
}

TEST_F(pipeline_gpu, stage_context_tells_stage_slot_device_and_chunk) {
    const std::size_t chunk = 10'000;
    const std::size_t n = chunk * 7 + 5; // eight chunks
    const std::vector<u32> salts{0x11, 0x22, 0x33};
    auto data = random_words(n, 62);
    auto want = transforms_on_host(data, chunk, salts);
    std::vector<std::vector<u32>> pieces;
    for (std::size_t i = 0; i < 6; ++i) {
        pieces.push_back(random_words(i == 5 ? 333 : chunk, 700 + i));
    }
    for (bool own_streams : {false, true}) {
        SCOPED_TRACE(own_streams ? "stage streams" : "compute streams");
        pipeline_options o;
        o.memory.group_bytes = 0; // one chunk per flight
        o.chunk_elements = chunk;
        o.depth = 3;
        o.streams.compute_streams = own_streams ? 1 : 2;
        o.streams.stage_streams = own_streams;
        std::vector<context_record> log;
        pipe_t p(o, {recording_stage(salts[0], log), recording_stage(salts[1], log),
                     recording_stage(salts[2], log)});
        cudawait::scheduler sched;
        std::vector<u32> out(n, 0xdeadbeefu);
        cudawait::sync_wait(sched, p.run(data, out));
        EXPECT_EQ(first_mismatch(out, want), n);
        check_contexts(log, p, 8, own_streams);
        // Streaming: the chunk is the submission index, from 0 in each session.
        log.clear();
        auto outs = stream_all(sched, p, pieces);
        ASSERT_EQ(outs.size(), pieces.size());
        for (std::size_t i = 0; i < pieces.size(); ++i) {
            EXPECT_EQ(outs[i], transforms_on_host(pieces[i], chunk, salts)) << "chunk " << i;
        }
        check_contexts(log, p, pieces.size(), own_streams);
    }
}

TEST_F(pipeline_gpu, in_graph_mode_the_stages_are_called_once_per_slot_on_the_capture_stream) {
    const std::size_t chunk = 10'000;
    const std::size_t n = chunk * 7 + 5; // seven full chunks, one short
    const std::vector<u32> salts{0x11, 0x22, 0x33};
    auto data = random_words(n, 63);
    pinned_buffer<u32> pin(n);
    pinned_buffer<u32> pout(n);
    copy_into(pin, data);
    std::fill(pout.begin(), pout.end(), 0xdeadbeefu);
    pipeline_options o;
    o.memory.group_bytes = 0; // one chunk per flight
    o.chunk_elements = chunk;
    o.depth = 3;
    o.graph = true;
    o.streams.stage_streams = true;
    std::vector<context_record> log;
    pipe_t p(o, {recording_stage(salts[0], log), recording_stage(salts[1], log),
                 recording_stage(salts[2], log)});
    cudawait::scheduler sched;
    cudawait::sync_wait(sched, p.run(pin.span(), pout.span()));
    std::vector<u32> got(pout.begin(), pout.end());
    EXPECT_EQ(first_mismatch(got, transforms_on_host(data, chunk, salts)), n);
    for (unsigned k = 0; k < 3; ++k) {
        std::set<unsigned> captured_slots;
        std::size_t plain = 0;
        for (const context_record& r : log) {
            if (r.stage != k) {
                continue;
            }
            if (r.stream == p.compute_stream(k).get()) {
                ++plain;
                EXPECT_EQ(r.chunk, 7u) << "only the short chunk runs outside the graph";
            } else {
                EXPECT_TRUE(captured_slots.insert(r.slot).second) << "slot captured twice";
                EXPECT_LT(r.chunk, 7u);
            }
        }
        EXPECT_EQ(captured_slots.size(), 3u) << "stage " << k;
        EXPECT_EQ(plain, 1u) << "stage " << k;
    }
}

// Timing: excluded from the sanitizer passes (their name has "overlap").
TEST_F(pipeline_gpu, stage_streams_overlap_the_stages_of_successive_chunks) {
    const std::size_t chunk = 4096; // 16 blocks per kernel: all resident at once
    const std::size_t chunks = 12;
    const std::size_t n = chunk * chunks;
    const std::uint64_t ms = 1'000'000;
    const std::vector<std::uint64_t> spin{2 * ms, 4 * ms, 2 * ms};
    const std::vector<u32> salts{0x1111, 0x2222, 0x3333};
    const double stage_sum = static_cast<double>(chunks * (2 + 4 + 2)) * 1e-3; // seconds
    auto data = random_words(n, 64);
    auto want = transforms_on_host(data, chunk, salts);
    pinned_buffer<u32> pin(n);
    pinned_buffer<u32> pout(n);
    copy_into(pin, data);
    cudawait::scheduler sched;
    for (bool own_streams : {true, false}) {
        SCOPED_TRACE(own_streams ? "stage streams" : "one compute stream");
        pipeline_options o;
        o.memory.group_bytes = 0; // one chunk per flight
        o.chunk_elements = chunk;
        o.depth = 3;
        o.streams.stage_streams = own_streams;
        o.monitoring.timing = true;
        pipe_t p(o, {salted_stage(salts[0], spin[0]), salted_stage(salts[1], spin[1]),
                     salted_stage(salts[2], spin[2])});
        double wall = 0;
        for (int run = 0; run < 2; ++run) { // the first warms up (module loading)
            std::fill(pout.begin(), pout.end(), 0xdeadbeefu);
            const auto t0 = std::chrono::steady_clock::now();
            cudawait::sync_wait(sched, p.run(pin.span(), pout.span()));
            wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
            std::vector<u32> got(pout.begin(), pout.end());
            ASSERT_EQ(first_mismatch(got, want), n) << "run " << run;
        }
        auto st = p.stats();
        EXPECT_EQ(st.gpu_chunks, chunks);
        // A chunk's compute time runs from its first stage's start to its last one's end.
        EXPECT_GE(st.compute_seconds, 0.95 * stage_sum);
        if (own_streams) {
            // Stage 1 (4 ms) bounds the rate: about 2 + 12 x 4 + 2 ms against 96 ms in sum.
            EXPECT_LT(wall, 0.75 * stage_sum) << "wall " << wall << " s, stages " << stage_sum;
        } else {
            // One compute stream runs every kernel in turn.
            EXPECT_GE(wall, 0.95 * stage_sum) << "wall " << wall << " s, stages " << stage_sum;
        }
    }
}

} // namespace

// ---- pageable staging on worker threads, registered host memory ------------------------------

// Pageable ranges through the batch's staging rings: chunk sizes below one worker's part, at it
// and split over several workers, a ragged last chunk, depths 2 to 4, pageable on either side or
// both; the output poisoned before every run and every element checked. A second run through the
// same pipeline reuses the rings.
TEST_F(pipeline_gpu, pageable_batches_of_any_chunk_size_and_depth_are_exact) {
    struct sides {
        bool pinned_in;
        bool pinned_out;
    };
    for (std::size_t chunk : {std::size_t{4099}, 1_MiB / 4 + 3, 3_MiB / 4 + 5}) {
        for (unsigned depth : {2u, 3u, 4u}) {
            for (sides sd : {sides{false, false}, sides{true, false}, sides{false, true}}) {
                SCOPED_TRACE(testing::Message() << "chunk " << chunk << ", depth " << depth
                                                << (sd.pinned_in ? ", pinned in" : "")
                                                << (sd.pinned_out ? ", pinned out" : ""));
                const std::size_t n = chunk * 7 + chunk / 3 + 1; // ragged last chunk
                auto in = random_words(n, chunk + depth);
                const auto want = expected(in, chunk);
                pipeline_options o;
                o.memory.group_bytes = 0; // one chunk per flight
                o.chunk_elements = chunk;
                o.depth = depth;
                pipe_t p(o, {transform_stage()});
                cudawait::scheduler sched;
                pinned_buffer<u32> pin(n);
                pinned_buffer<u32> pout(n);
                copy_into(pin, in);
                std::vector<u32> out(n);
                for (int round = 0; round < 2; ++round) {
                    std::fill(out.begin(), out.end(), 0xdeadbeefu);
                    std::fill(pout.begin(), pout.end(), 0xdeadbeefu);
                    std::span<const u32> src =
                        sd.pinned_in ? std::span<const u32>(pin.span()) : std::span<const u32>(in);
                    std::span<u32> dst = sd.pinned_out ? pout.span() : std::span<u32>(out);
                    cudawait::sync_wait(sched, p.run(src, dst));
                    if (sd.pinned_out) {
                        out.assign(pout.begin(), pout.end());
                    }
                    ASSERT_EQ(first_mismatch(out, want), n) << "round " << round;
                    auto st = p.stats();
                    EXPECT_EQ(st.chunks, 8u);
                    EXPECT_EQ(st.gpu_chunks, 8u);
                    EXPECT_EQ(st.fallback_chunks + st.failed_chunks + st.retries, 0u);
                    EXPECT_EQ(st.latency.samples, 8u) << "one latency sample per chunk";
                }
            }
        }
    }
}

// Stage-ins and stage-outs of different chunks run at once on their workers while the GPU
// works: with many chunks, a slow and a fast kernel, and two pipelines on one scheduler (their
// copies share the workers), every chunk lands where it belongs.
TEST_F(pipeline_gpu, concurrent_stage_in_and_stage_out_keep_every_chunk_in_place) {
    const std::size_t chunk = 2_MiB / 4 + 17;
    const std::size_t n = chunk * 24 + 99;
    for (unsigned depth : {2u, 3u, 4u}) {
        for (std::uint64_t spin : {std::uint64_t{0}, std::uint64_t{300'000}}) {
            SCOPED_TRACE(testing::Message() << "depth " << depth << ", spin " << spin);
            auto in_a = random_words(n, depth * 7 + spin);
            auto in_b = random_words(n, depth * 11 + spin + 1);
            const auto want_a = expected(in_a, chunk);
            const auto want_b = expected(in_b, chunk);
            std::vector<u32> out_a(n, 0xdeadbeefu);
            std::vector<u32> out_b(n, 0xdeadbeefu);
            pipeline_options o;
            o.memory.group_bytes = 0; // one chunk per flight
            o.chunk_elements = chunk;
            o.depth = depth;
            pipe_t a(o, {transform_stage(spin)});
            pipe_t b(o, {transform_stage(spin)});
            cudawait::scheduler sched;
            cudawait::sync_wait(sched, cudawait::when_all(a.run(in_a, out_a), b.run(in_b, out_b)));
            ASSERT_EQ(first_mismatch(out_a, want_a), n);
            ASSERT_EQ(first_mismatch(out_b, want_b), n);
            EXPECT_EQ(a.stats().gpu_chunks, 25u);
            EXPECT_EQ(b.stats().gpu_chunks, 25u);
        }
    }
}

// The staging rings: (depth + 2) input and output chunks, made once and kept between runs.
TEST_F(pipeline_gpu, the_staging_rings_are_made_once_and_bounded_by_depth_plus_two) {
    cudawait::pinned_pool pool;
    const std::size_t chunk = 1_MiB / 4;
    const std::size_t n = chunk * 20 + 5;
    auto in = random_words(n, 21);
    std::vector<u32> out(n);
    pipeline_options o;
    o.memory.group_bytes = 0; // one chunk per flight
    o.chunk_elements = chunk;
    o.depth = 2;
    o.memory.pool = &pool;
    pipe_t p(o, {transform_stage()});
    cudawait::scheduler sched;
    cudawait::sync_wait(sched, p.run(in, out));
    EXPECT_EQ(first_mismatch(out, expected(in, chunk)), n);
    const auto first = pool.stats();
    EXPECT_LE(first.peak_in_use_bytes, (2 + 2) * (chunk * 4 + chunk * 4));
    EXPECT_GT(first.in_use_bytes, 0u) << "the rings are kept";
    std::fill(out.begin(), out.end(), 0u);
    cudawait::sync_wait(sched, p.run(in, out));
    EXPECT_EQ(first_mismatch(out, expected(in, chunk)), n);
    EXPECT_EQ(pool.stats().hits + pool.stats().misses, first.hits + first.misses)
        << "the second run took no new buffers";
}

// Registered vectors take the pinned path: no staging buffer is taken, as plain spans (the
// driver calls them pinned) and as registered spans; every element checked, runs repeated.
TEST_F(pipeline_gpu, registered_vectors_run_without_staging) {
    cudawait::pinned_pool pool;
    const std::size_t chunk = 1_MiB / 4 + 1;
    const std::size_t n = chunk * 9 + 777;
    auto in = random_words(n, 31);
    const auto want = expected(in, chunk);
    std::vector<u32> out(n);
    cudawait::host_registration reg_in(in);
    cudawait::host_registration reg_out(out);
    pipeline_options o;
    o.memory.group_bytes = 0; // one chunk per flight
    o.chunk_elements = chunk;
    o.depth = 3;
    o.memory.pool = &pool;
    pipe_t p(o, {transform_stage()});
    cudawait::scheduler sched;
    for (int round = 0; round < 2; ++round) {
        std::fill(out.begin(), out.end(), 0xdeadbeefu);
        cudawait::sync_wait(sched, p.run(reg_in.span(), reg_out.span()));
        ASSERT_EQ(first_mismatch(out, want), n) << "registered spans, round " << round;
        std::fill(out.begin(), out.end(), 0xdeadbeefu);
        cudawait::sync_wait(sched, p.run(in, out));
        ASSERT_EQ(first_mismatch(out, want), n) << "plain vectors, round " << round;
    }
    EXPECT_EQ(pool.stats().peak_in_use_bytes, 0u) << "registered memory was staged";
    EXPECT_EQ(p.stats().gpu_chunks, 10u);
}
