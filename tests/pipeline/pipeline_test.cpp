// SPDX-License-Identifier: Apache-2.0
// The recorder first: it defines NVTX's static-injection hook, which a file that included the
// NVTX headers before it would define weakly.
#include "nvtx_recorder.hpp"
// The rest.
#include <cudawait/core/detail/wait_list.hpp>
#include <cudawait/core/scheduler.hpp>
#include <cudawait/core/sync_wait.hpp>
#include <cudawait/core/when_all.hpp>
#include <cudawait/memory/host_registration.hpp>
#include <cudawait/memory/mapped_buffer.hpp>
#include <cudawait/pipeline/pipeline.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <new>
#include <optional>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <cuda_runtime.h>

#include "counting_device_resource.hpp"
#include "gpu_fixture.hpp"
#include "no_device.hpp"
#include "random_words.hpp"
#include "test_kernels.hpp"
#include <gtest/gtest.h>

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

using namespace std::chrono_literals;
using namespace cudawait::literals;
using cudawait::pinned_buffer;
using cudawait::pipeline;
using cudawait::pipeline_error;
using cudawait::pipeline_options;
using cudawait::usage_error;
using u32 = std::uint32_t;
using pipe_t = pipeline<u32>;

constexpr u32 salt = 0x5eed;

using cudawait::testing::random_words;

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

/// The host result of the transform stage, chunk by chunk (the index restarts in each chunk).
std::vector<u32> expected(const std::vector<u32>& in, std::size_t chunk) {
    std::vector<u32> out(in.size());
    for (std::size_t off = 0; off < in.size(); off += chunk) {
        std::size_t n = std::min(chunk, in.size() - off);
        cudawait::testing::transform_on_host(in.data() + off, out.data() + off, n, salt);
    }
    return out;
}

/// A stage that launches the transform, optionally slowly.
pipe_t::stage transform_stage(std::uint64_t spin_ns = 0) {
    return [spin_ns](std::span<u32> in, std::span<u32> out, cudawait::stream_ref s) {
        cudawait::check(cudawait::testing::launch_transform(in.data(), out.data(), in.size(), salt,
                                                            spin_ns, s.get()),
                        "launch_transform");
    };
}

/// The fallback: the same transform on the host.
void host_fallback(std::size_t, std::span<const u32> in, std::span<u32> out) {
    cudawait::testing::transform_on_host(in.data(), out.data(), in.size(), salt);
}

std::size_t first_mismatch(const std::vector<u32>& got, const std::vector<u32>& want) {
    for (std::size_t i = 0; i < want.size(); ++i) {
        if (got[i] != want[i]) {
            return i;
        }
    }
    return want.size();
}

template <class R>
void copy_into(R& dst, const std::vector<u32>& src) {
    std::copy(src.begin(), src.end(), dst.begin());
}

// ---- without a GPU: argument checks come before any CUDA call ---------------------------------

TEST(pipeline, bad_options_are_usage_errors) {
    pipeline_options o;
    EXPECT_THROW(pipe_t(o, {transform_stage()}), usage_error) << "no chunk size";
    o.chunk_elements = 1024;
    o.depth = 0;
    EXPECT_THROW(pipe_t(o, {transform_stage()}), usage_error);
    o.depth = 2;
    EXPECT_THROW(pipe_t(o, {}), usage_error) << "no stages";
    EXPECT_THROW(pipe_t(o, {pipe_t::stage{}}), usage_error) << "an empty stage";
}

TEST(pipeline, several_stages_need_one_element_type) {
    // Chained stages read each other's outputs: with In != Out only one stage is allowed.
    using mixed = pipeline<u32, float>;
    pipeline_options o;
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

class pipeline_gpu : public cudawait::testing::pool_gpu_test {};

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
    o.depth = c.depth;
    o.chunk_elements = chunk;
    o.compute_streams = c.compute_streams;
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
    o.chunk_elements = chunk;
    o.depth = 3;
    o.pool = &pool;
    pipe_t p(o, {transform_stage(500'000)});
    cudawait::scheduler sched;
    cudawait::sync_wait(sched, p.run(in, out));
    EXPECT_EQ(first_mismatch(out, expected(in, chunk)), n);
    EXPECT_LE(pool.stats().peak_in_use_bytes, (3 + 2) * (chunk * 4 + chunk * 4));
    EXPECT_GT(pool.stats().peak_in_use_bytes, 0u);
}

// ---- streaming --------------------------------------------------------------------------------

struct stream_log {
    std::size_t produced = 0;
    std::size_t consumed = 0;
    std::size_t max_outstanding = 0; ///< acquired or submitted, not yet consumed
    std::size_t bad = 0;
    std::size_t out_of_order = 0;
};

cudawait::task<void> producer(pipe_t& p, const std::vector<std::vector<u32>>& chunks,
                              stream_log& log) {
    for (const auto& c : chunks) {
        auto slot = co_await p.acquire();
        ++log.produced;
        log.max_outstanding = std::max(log.max_outstanding, log.produced - log.consumed);
        std::copy(c.begin(), c.end(), slot.data().begin());
        p.submit(std::move(slot), c.size());
    }
    p.close();
}

cudawait::task<void> consumer(pipe_t& p, const std::vector<std::vector<u32>>& chunks,
                              stream_log& log) {
    while (auto r = co_await p.next()) {
        if (r->chunk() != log.consumed) {
            ++log.out_of_order;
        }
        const auto& in = chunks[r->chunk()];
        std::vector<u32> want(in.size());
        cudawait::testing::transform_on_host(in.data(), want.data(), in.size(), salt);
        if (!std::equal(want.begin(), want.end(), r->data().begin(), r->data().end())) {
            ++log.bad;
        }
        ++log.consumed;
        co_await cudawait::sleep_for(200us); // a slow consumer: the producer must wait
    }
}

TEST_F(pipeline_gpu, streaming_delivers_in_order_with_back_pressure) {
    const std::size_t chunk = 40'000;
    std::vector<std::vector<u32>> chunks;
    std::mt19937 sizes(1);
    for (std::size_t i = 0; i < 40; ++i) {
        chunks.push_back(random_words(1 + sizes() % chunk, i));
    }
    for (bool graph : {false, true}) {
        pipeline_options o;
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

// ---- degradation ------------------------------------------------------------------------------

/// A stage that fails to launch (a non-sticky error) on the calls listed in `fail_calls`.
pipe_t::stage flaky_stage(std::shared_ptr<std::vector<int>> fail_calls,
                          std::shared_ptr<int> calls) {
    return [fail_calls, calls](std::span<u32> in, std::span<u32> out, cudawait::stream_ref s) {
        int call = (*calls)++;
        if (std::find(fail_calls->begin(), fail_calls->end(), call) != fail_calls->end()) {
            cudawait::check(cudawait::testing::launch_bad_config(s.get()), "launch_bad_config");
        }
        cudawait::check(
            cudawait::testing::launch_transform(in.data(), out.data(), in.size(), salt, 0, s.get()),
            "launch_transform");
    };
}

/// What streaming made of one chunk.
struct streamed {
    bool right = false;       ///< the output matched the host reference
    bool by_fallback = false; ///< the fallback made it
    std::string error;        ///< what next() threw for it, if it threw
};

/// Streams `chunks` through `p`, three submitted ahead and consumed as they come, then closes it
/// and checks that next() ends. A pipeline_error must name the chunk next() had reached.
cudawait::task<std::vector<streamed>> stream_chunks(pipe_t& p,
                                                    const std::vector<std::vector<u32>>& chunks) {
    std::vector<streamed> seen;
    std::size_t submitted = 0;
    while (seen.size() < chunks.size()) {
        while (submitted < chunks.size() && submitted - seen.size() < 3) {
            auto slot = co_await p.acquire();
            const auto& c = chunks[submitted++];
            std::copy(c.begin(), c.end(), slot.data().begin());
            p.submit(std::move(slot), c.size());
        }
        try {
            auto r = co_await p.next();
            const auto& in = chunks[r->chunk()];
            std::vector<u32> want(in.size());
            cudawait::testing::transform_on_host(in.data(), want.data(), in.size(), salt);
            seen.push_back(
                {std::equal(want.begin(), want.end(), r->data().begin(), r->data().end()),
                 r->by_fallback(),
                 {}});
        } catch (const pipeline_error& e) {
            if (e.failed() != std::vector<std::size_t>{seen.size()}) {
                throw;
            }
            seen.push_back({false, false, e.what()});
        } catch (const std::runtime_error& e) {
            seen.push_back({false, false, e.what()});
        }
    }
    p.close();
    if (co_await p.next()) {
        throw std::logic_error("next() did not end after close()");
    }
    co_return seen;
}

TEST_F(pipeline_gpu, streaming_hands_a_failed_chunk_to_the_fallback_in_order) {
    const std::size_t chunk = 10'000;
    std::vector<std::vector<u32>> chunks;
    for (std::size_t i = 0; i < 6; ++i) {
        chunks.push_back(random_words(chunk - i, 100 + i));
    }
    for (bool with_fallback : {true, false}) {
        pipeline_options o;
        o.chunk_elements = chunk;
        o.depth = 3;
        o.max_retries = 0; // no level-1 retry (it would succeed): chunk 2 goes to level 2
        o.on_degrade = [](const cudawait::chunk_failure&) {};
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
    o.chunk_elements = chunk;
    o.depth = 3;
    o.on_degrade = [&](const cudawait::chunk_failure& f) { log.push_back(f); };
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
    o.chunk_elements = chunk;
    o.depth = 3;
    o.max_retries = 2;
    o.on_degrade = [](const cudawait::chunk_failure&) {};
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
    o.chunk_elements = chunk;
    o.max_retries = 2;
    o.on_degrade = [](const cudawait::chunk_failure&) {};
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
    o.chunk_elements = chunk;
    o.depth = 3;
    o.chunk_timeout = 60ms;
    o.max_retries = 10;
    o.on_degrade = [&](const cudawait::chunk_failure& f) { log.push_back(f); };
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
    o.chunk_elements = chunk;
    o.depth = 2;
    o.chunk_timeout = 30ms;
    o.max_retries = 1;
    std::vector<cudawait::chunk_failure> log;
    o.on_degrade = [&](const cudawait::chunk_failure& f) { log.push_back(f); };
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

/// What the fallback of the wait tests writes: not what the GPU computes.
constexpr u32 fallback_mark = 0xfa11u;

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
    o.chunk_elements = chunk;
    o.depth = 2;
    o.chunk_timeout = 10s;
    o.on_degrade = [&](const cudawait::chunk_failure& f) { log.push_back(f); };
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
    o.chunk_elements = chunk;
    o.depth = 3;
    o.on_degrade = [](const cudawait::chunk_failure&) {};
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
        o.chunk_elements = chunk;
        o.depth = 3;
        o.timing = true;
        o.alert_window = 4;
        o.alert_fraction = fraction;
        o.utilisation_fraction = 0; // the bandwidth alert alone (link_test: utilisation)
        o.on_alert = [&](const cudawait::pipeline_alert& a) {
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

// ---- the error of a failed batch --------------------------------------------------------------

TEST_F(pipeline_gpu, a_failed_chunk_count_in_the_batch_error_matches_its_lists) {
    const std::size_t chunk = 20'000;
    const std::size_t n = chunk * 11;
    auto in = random_words(n, 30);
    pipeline_options o;
    o.chunk_elements = chunk;
    o.max_retries = 0; // each failed launch is final: chunks 1, 4, 5 and 9 fail
    o.on_degrade = [](const cudawait::chunk_failure&) {};
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
    o.chunk_elements = chunk;
    o.depth = 3;
    o.max_retries = 0;
    o.on_degrade = [](const cudawait::chunk_failure&) {};
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
        o.chunk_elements = chunk;
        o.depth = 3;
        o.graph = m.graph;
        o.max_retries = 0;
        o.on_degrade = [](const cudawait::chunk_failure&) {};
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
    o.chunk_elements = chunk;
    o.depth = 3;
    o.max_retries = 0; // no level-1 retry (it would succeed): chunk 2 goes to level 2
    o.on_degrade = [](const cudawait::chunk_failure&) {};
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
    o.chunk_elements = chunk;
    o.depth = 3;
    o.on_degrade = [](const cudawait::chunk_failure&) {};
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

// ---- one mode at a time -----------------------------------------------------------------------

cudawait::task<void> submit_all(pipe_t& p, const std::vector<std::vector<u32>>& chunks) {
    for (const auto& c : chunks) {
        auto slot = co_await p.acquire();
        std::copy(c.begin(), c.end(), slot.data().begin());
        p.submit(std::move(slot), c.size());
    }
    p.close();
}

cudawait::task<void> take_all(pipe_t& p, std::vector<std::vector<u32>>& got) {
    while (auto r = co_await p.next()) {
        if (r->chunk() != got.size()) {
            throw std::runtime_error("chunk " + std::to_string(r->chunk()) + " came as number " +
                                     std::to_string(got.size()));
        }
        got.emplace_back(r->data().begin(), r->data().end());
    }
}

/// Streams `chunks` through `p` (producer and consumer on one scheduler): the outputs in the
/// order next() gave them.
std::vector<std::vector<u32>> stream_all(cudawait::scheduler& sched, pipe_t& p,
                                         const std::vector<std::vector<u32>>& chunks) {
    std::vector<std::vector<u32>> got;
    cudawait::sync_wait(sched, cudawait::when_all(submit_all(p, chunks), take_all(p, got)));
    return got;
}

std::vector<u32> transformed(const std::vector<u32>& in) {
    std::vector<u32> out(in.size());
    cudawait::testing::transform_on_host(in.data(), out.data(), in.size(), salt);
    return out;
}

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

pipe_t::stage affine_stage(u32 a, u32 b) {
    return [a, b](std::span<u32> in, std::span<u32> out, cudawait::stream_ref s) {
        cudawait::check(cudawait::testing::launch_affine(
                            in.data(), out.data(), std::min(in.size(), out.size()), a, b, s.get()),
                        "launch_affine");
    };
}

pipe_t::stage square_sub_stage(u32 c) {
    return [c](std::span<u32> in, std::span<u32> out, cudawait::stream_ref s) {
        cudawait::check(cudawait::testing::launch_square_sub(
                            in.data(), out.data(), std::min(in.size(), out.size()), c, s.get()),
                        "launch_square_sub");
    };
}

/// y = 2x + 1, then z = y * y - 3 from y, then (a third stage) w = 5z + 7 from z.
std::vector<pipe_t::stage> chain(std::size_t stages) {
    std::vector<pipe_t::stage> v{affine_stage(2, 1), square_sub_stage(3)};
    if (stages == 3) {
        v.push_back(affine_stage(5, 7));
    }
    return v;
}

std::vector<u32> chain_on_host(const std::vector<u32>& x, std::size_t stages) {
    std::vector<u32> y(x.size());
    std::vector<u32> z(x.size());
    cudawait::testing::affine_on_host(x.data(), y.data(), x.size(), 2, 1);
    cudawait::testing::square_sub_on_host(y.data(), z.data(), y.size(), 3);
    if (stages == 3) {
        cudawait::testing::affine_on_host(z.data(), z.data(), z.size(), 5, 7);
    }
    return z;
}

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
            o.chunk_elements = chunk;
            o.depth = 3;
            o.compute_streams = 2;
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
        o.chunk_elements = chunk;
        o.compute_streams = 2;
        int compute = greatest; // default: compute highest, copies lowest
        int transfer = least;
        if (configured) {
            o.compute_priority = least;
            o.transfer_priority = greatest;
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
    o.chunk_elements = chunk;
    o.depth = 3;
    o.queue_capacity = 1; // one chunk submitted and not yet taken, though three slots exist
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
        o.chunk_elements = chunk;
        o.depth = 3;
        o.timing = true;
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
    o.chunk_elements = 1024;
    EXPECT_THROW(pipe_t(o, {pipe_t::stage(old_stage_fn{nullptr})}), usage_error);
}

TEST(pipeline_stage, stage_streams_need_one_compute_stream) {
    pipeline_options o;
    o.chunk_elements = 1024;
    o.stage_streams = true;
    o.compute_streams = 2;
    try {
        pipe_t p(o, {transform_stage(), transform_stage()});
        ADD_FAILURE() << "no exception";
    } catch (const usage_error& e) {
        EXPECT_NE(std::string(e.what()).find("compute_streams"), std::string::npos) << e.what();
    }
    o.compute_streams = 1;
    o.scratch_bytes = std::size_t(-1) - 10;
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
            o.chunk_elements = chunk;
            o.depth = depth;
            o.graph = graph;
            o.stage_streams = own_streams;
            o.scratch_bytes = bytes;
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
            EXPECT_EQ(r.device, o.device);
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
                for (unsigned i = 0; i < o.compute_streams; ++i) {
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
        o.chunk_elements = chunk;
        o.depth = 3;
        o.compute_streams = own_streams ? 1 : 2;
        o.stage_streams = own_streams;
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
    o.chunk_elements = chunk;
    o.depth = 3;
    o.graph = true;
    o.stage_streams = true;
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
        o.chunk_elements = chunk;
        o.depth = 3;
        o.stage_streams = own_streams;
        o.timing = true;
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
    o.chunk_elements = chunk;
    o.depth = 3;
    std::vector<cudawait::chunk_failure> log;
    o.on_degrade = [&](const cudawait::chunk_failure& f) { log.push_back(f); };
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
    o.chunk_elements = chunk;
    o.depth = 2;
    o.queue_capacity = 2;
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
    o.chunk_elements = chunk;
    o.depth = 2;
    o.queue_capacity = 1;
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
    o.chunk_elements = chunk;
    o.depth = 2;
    o.queue_capacity = 2;
    o.chunk_timeout = 30ms;
    o.max_retries = 0;
    o.on_degrade = [](const cudawait::chunk_failure&) {};
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
    o.chunk_elements = chunk;
    o.depth = 2;
    o.group_bytes = 2 * chunk * sizeof(u32); // two chunks per slot group
    o.chunk_timeout = 30ms;
    o.max_retries = 0;
    o.on_degrade = [](const cudawait::chunk_failure&) {};
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
    o.chunk_elements = chunk;
    o.depth = 3;
    o.recover_after = 0; // the depth stays lowered
    std::vector<cudawait::chunk_failure> log;
    o.on_degrade = [&](const cudawait::chunk_failure& f) { log.push_back(f); };
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
    o.chunk_elements = chunk;
    o.depth = 3;
    o.chunk_timeout = 60ms;
    o.max_retries = 10;
    o.recover_after = 0;
    std::vector<cudawait::chunk_failure> log;
    o.on_degrade = [&](const cudawait::chunk_failure& f) { log.push_back(f); };
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
    o.chunk_elements = chunk;
    o.depth = 2;
    o.chunk_timeout = 40ms;
    o.max_retries = 50;
    o.on_degrade = [&](const cudawait::chunk_failure& f) {
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
    o.chunk_elements = chunk;
    o.depth = 3;
    o.chunk_timeout = 30ms;
    o.max_retries = 1;
    std::vector<cudawait::chunk_failure> log;
    o.on_degrade = [&](const cudawait::chunk_failure& f) { log.push_back(f); };
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
    o.chunk_elements = chunk;
    o.depth = 3;
    o.chunk_timeout = 10s;
    o.on_degrade = [&](const cudawait::chunk_failure& f) { log.push_back(f); };
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
        o.chunk_elements = chunk;
        o.depth = 3;
        o.recover_after = 4;
        std::vector<cudawait::chunk_failure> log;
        o.on_degrade = [&](const cudawait::chunk_failure& f) { log.push_back(f); };
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

// ---- latency percentiles and the post-mortem report -----------------------------------------

#include <cudawait/pipeline/detail/latency.hpp>
#include <cudawait/pipeline/detail/monitor.hpp>
#include <cudawait/pipeline/report.hpp>

#include <cctype>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <unistd.h>

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
         {"\"options\":{",
          "\"stats\":{",
          "\"failures\":[]",
          "\"device\":{\"id\":0",
          "\"depth\":2",
          "\"chunk_elements\":0",
          "\"output_elements\":0",
          "\"compute_streams\":1",
          "\"compute_priority\":null",
          "\"transfer_priority\":null",
          "\"graph\":false",
          "\"timing\":false",
          "\"stage_streams\":false",
          "\"scratch_bytes\":0",
          "\"chunk_timeout_ns\":0",
          "\"max_retries\":2",
          "\"recover_after\":16",
          "\"utilisation_fraction\":0.80000000000000004",
          "\"timeline\":false",
          "\"recoveries\":0",
          "\"queue_capacity\":0",
          "\"pool\":null",
          "\"report_path\":\"\"",
          "\"gpu_chunks\":0",
          "\"wall_seconds\":0",
          "\"overlap_efficiency\":0",
          "\"gpu_abandoned\":false",
          "\"alerts\":0",
          "\"latency\":{\"p50_seconds\":0,\"p90_seconds\":0,\"p99_seconds\":0,"
          "\"max_seconds\":0,\"samples\":0}",
          "\"name\":"}) {
        EXPECT_TRUE(contains(s, key)) << key << " in " << s;
    }
}

TEST(pipeline_report, a_failure_is_written_with_every_field) {
    pipeline_options o;
    o.depth = 3;
    o.chunk_elements = 1000;
    o.compute_priority = -2;
    o.chunk_timeout = 250ms;
    o.report_path = "/tmp/a \"quoted\" path";
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
    o.chunk_elements = chunk;
    o.depth = 3;
    o.max_retries = 0; // the first failure goes to the fallback (level 2)
    o.report_path = fresh_path("batch_failure");
    o.on_degrade = [](const cudawait::chunk_failure&) {};
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

    ASSERT_TRUE(std::filesystem::exists(o.report_path)) << o.report_path;
    const std::string r = read_file(o.report_path);
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
    std::filesystem::remove(o.report_path);

    // A clean run after it: no records, and no report.
    std::vector<u32> out2(n, 0xdeadbeefu);
    cudawait::sync_wait(sched, p.run(in, out2));
    EXPECT_EQ(first_mismatch(out2, expected(in, chunk)), n);
    EXPECT_TRUE(p.failures().empty());
    EXPECT_FALSE(std::filesystem::exists(o.report_path)) << "written without a failure";
}

TEST_F(pipeline_gpu, a_batch_without_a_fallback_writes_the_report_before_throwing) {
    const std::size_t chunk = 20'000;
    const std::size_t n = chunk * 5;
    auto in = random_words(n, 32);
    pipeline_options o;
    o.chunk_elements = chunk;
    o.max_retries = 1;
    o.report_path = fresh_path("batch_error");
    o.on_degrade = [](const cudawait::chunk_failure&) {};
    // Chunk 1 fails twice: a level-1 retry, then level 2 (reported failed).
    pipe_t p(o, {flaky_stage(std::make_shared<std::vector<int>>(std::vector<int>{1, 2}),
                             std::make_shared<int>(0))});
    std::vector<u32> out(n, 0);
    cudawait::scheduler sched;
    EXPECT_THROW(cudawait::sync_wait(sched, p.run(in, out)), pipeline_error);
    ASSERT_EQ(p.failures().size(), 2u);
    EXPECT_EQ(p.failures()[0].action, cudawait::degrade_action::retried_with_less_depth);
    EXPECT_EQ(p.failures()[1].action, cudawait::degrade_action::failed);
    ASSERT_TRUE(std::filesystem::exists(o.report_path));
    const std::string r = read_file(o.report_path);
    EXPECT_TRUE(json_check(r).valid()) << r;
    EXPECT_TRUE(contains(r, "\"action\":\"retried_with_less_depth\"")) << r;
    EXPECT_TRUE(contains(r, "\"level\":\"give_up\",\"action\":\"failed\"")) << r;
    EXPECT_TRUE(contains(r, "\"failed_chunks\":1")) << r;
    std::filesystem::remove(o.report_path);
}

TEST_F(pipeline_gpu, latency_percentiles_after_a_clean_batch_and_a_stream) {
    const std::size_t chunk = 20'000;
    const std::size_t n = chunk * 16 + 123;
    auto in = random_words(n, 33);
    pipeline_options o;
    o.chunk_elements = chunk;
    o.depth = 3;
    o.report_path = fresh_path("clean");
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
    EXPECT_FALSE(std::filesystem::exists(o.report_path)) << "written without a failure";
}

TEST_F(pipeline_gpu, a_streamed_chunk_given_up_writes_the_report) {
    const std::size_t chunk = 10'000;
    std::vector<std::vector<u32>> chunks;
    for (std::size_t i = 0; i < 6; ++i) {
        chunks.push_back(random_words(chunk, 500 + i));
    }
    for (bool with_fallback : {true, false}) {
        pipeline_options o;
        o.chunk_elements = chunk;
        o.depth = 3;
        o.report_path = fresh_path(with_fallback ? "stream_fallback" : "stream_failed");
        o.max_retries = 0; // the failed launch goes straight to level 2, not to a retry
        o.on_degrade = [](const cudawait::chunk_failure&) {};
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
        ASSERT_TRUE(std::filesystem::exists(o.report_path)) << o.report_path;
        const std::string r = read_file(o.report_path);
        EXPECT_TRUE(json_check(r).valid()) << r;
        EXPECT_TRUE(contains(r, "{\"chunk\":2,")) << r;
        EXPECT_TRUE(
            contains(r, with_fallback ? "\"action\":\"fallback\"" : "\"action\":\"failed\""))
            << r;
        std::filesystem::remove(o.report_path);
    }
}

// pipeline_options::device_resource: every device buffer of the slots comes from it, once, when
// the pipeline is built; none per chunk; all go back to it when the pipeline goes.
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
        o.chunk_elements = chunk;
        o.depth = 3;
        o.scratch_bytes = c.scratch_bytes;
        o.graph = c.graph;
        o.device_resource = counting;
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

// ---- chunk groups (pipeline_options::group_bytes) ----------------------------------------------

namespace {

using cudawait::detail::chunk_group;
using cudawait::detail::group_chunks_for;
using cudawait::detail::plan_group;

// The group size: off, a chunk at or above group_bytes, a floor of the quotient, the cap.
TEST(pipeline_groups, the_group_size_is_the_chunks_that_fit_in_group_bytes) {
    EXPECT_EQ(group_chunks_for(0, 64_KiB, 256), 1u) << "0: no grouping";
    EXPECT_EQ(group_chunks_for(4_MiB, 64_MiB, 256), 1u) << "large chunks are not grouped";
    EXPECT_EQ(group_chunks_for(4_MiB, 4_MiB, 256), 1u);
    EXPECT_EQ(group_chunks_for(4_MiB, 64_KiB, 256), 64u);
    EXPECT_EQ(group_chunks_for(4_MiB, 1_MiB, 256), 4u);
    EXPECT_EQ(group_chunks_for(4_MiB, 3_MiB, 256), 1u) << "a quotient below 2 is no group";
    EXPECT_EQ(group_chunks_for(1_MiB, 300'000, 256), 3u) << "chunks that do not divide it";
    EXPECT_EQ(group_chunks_for(1_GiB, 4, 256), 256u) << "capped";
    EXPECT_EQ(group_chunks_for(1_GiB, 4, 0), 1u);
}

// Every group covers the chunks after the one before, and the elements of exactly those chunks,
// in the input and in the output, with a short last chunk and outputs of another size.
TEST(pipeline_groups, groups_cover_each_chunk_and_element_once_in_order) {
    struct plan_case {
        std::size_t inputs, chunk, outputs, group;
    };
    for (const plan_case& c : {plan_case{1000, 100, 100, 4}, plan_case{1001, 100, 100, 4},
                               plan_case{999, 100, 30, 3}, plan_case{5, 100, 100, 8},
                               plan_case{1000, 100, 250, 1}, plan_case{100 * 64 + 1, 100, 7, 64}}) {
        SCOPED_TRACE(std::to_string(c.inputs) + " inputs, chunk " + std::to_string(c.chunk) +
                     ", outputs " + std::to_string(c.outputs) + ", group " +
                     std::to_string(c.group));
        const std::size_t total = (c.inputs + c.chunk - 1) / c.chunk;
        std::size_t next = 0;
        std::size_t in_at = 0;
        std::size_t out_at = 0;
        std::size_t groups = 0;
        while (next < total) {
            const chunk_group g = plan_group(next, c.group, c.inputs, c.chunk, c.outputs);
            ++groups;
            EXPECT_EQ(g.first, next);
            ASSERT_GE(g.chunks, 1u);
            EXPECT_LE(g.chunks, c.group);
            EXPECT_EQ(g.in_offset, in_at);
            EXPECT_EQ(g.out_offset, out_at);
            // Sum of the chunks' own sizes, as the pipeline cuts a batch into chunks.
            std::size_t in_sum = 0;
            std::size_t out_sum = 0;
            for (std::size_t ch = g.first; ch < g.first + g.chunks; ++ch) {
                const std::size_t k = std::min(c.chunk, c.inputs - ch * c.chunk);
                in_sum += k;
                out_sum += (k * c.outputs + c.chunk - 1) / c.chunk;
                if (ch + 1 < g.first + g.chunks) {
                    EXPECT_EQ(k, c.chunk) << "only a group's last chunk may be short";
                }
            }
            EXPECT_EQ(g.in_count, in_sum);
            EXPECT_EQ(g.out_count, out_sum);
            EXPECT_EQ(g.last_in, g.in_count - (g.chunks - 1) * c.chunk);
            EXPECT_EQ(g.full(c.group, c.chunk), g.chunks == c.group && g.last_in == c.chunk);
            next += g.chunks;
            in_at += g.in_count;
            out_at += g.out_count;
        }
        EXPECT_EQ(next, total);
        EXPECT_EQ(in_at, c.inputs);
        EXPECT_EQ(groups, (total + c.group - 1) / c.group);
    }
}

// The group context cuts chunk j's spans out of the group's, and makes its stage_context.
TEST(pipeline_groups, the_group_context_cuts_out_each_chunk) {
    std::vector<u32> in(250);
    std::vector<u32> out(75);
    cudawait::group_context g{
        cudawait::stream_ref(cudaStreamPerThread), 1, 2, 0, 40, 3, 100, 30, {}};
    for (std::size_t j = 0; j < 3; ++j) {
        const std::span<u32> i = g.input_chunk(std::span<u32>(in), j);
        const std::span<u32> o = g.output_chunk(std::span<u32>(out), j);
        EXPECT_EQ(i.data(), in.data() + j * 100);
        EXPECT_EQ(i.size(), j < 2 ? 100u : 50u);
        EXPECT_EQ(o.data(), out.data() + j * 30);
        EXPECT_EQ(o.size(), j < 2 ? 30u : 15u);
        const cudawait::stage_context c = g.chunk_context(j);
        EXPECT_EQ(c.chunk, 40 + j);
        EXPECT_EQ(c.slot, 1u);
        EXPECT_EQ(c.stage, 2u);
    }
}

/// A group stage: one affine launch over the whole group (index-independent, so one launch is
/// the same as one per chunk).
constexpr u32 affine_a = 2654435761u;
constexpr u32 affine_b = 0x9e3779b9u;
struct affine_group_stage {
    void operator()(std::span<u32> in, std::span<u32> out, const cudawait::group_context& g) const {
        cudawait::check(cudawait::testing::launch_affine(in.data(), out.data(), in.size(), affine_a,
                                                         affine_b, g.stream.get()),
                        "launch_affine");
    }
};
/// A group stage that launches the transform once per chunk (the index restarts per chunk),
/// cutting the chunks out with the group context.
struct transform_group_stage {
    void operator()(std::span<u32> in, std::span<u32> out, const cudawait::group_context& g) const {
        for (std::size_t j = 0; j < g.chunks; ++j) {
            const std::span<u32> i = g.input_chunk(in, j);
            cudawait::check(cudawait::testing::launch_transform(i.data(),
                                                                g.output_chunk(out, j).data(),
                                                                i.size(), salt, 0, g.stream.get()),
                            "launch_transform");
        }
    }
};

std::vector<u32> affine_expected(const std::vector<u32>& in) {
    std::vector<u32> out(in.size());
    cudawait::testing::affine_on_host(in.data(), out.data(), in.size(), affine_a, affine_b);
    return out;
}

enum class group_stage_kind { per_chunk, group_transform, group_affine };

struct group_case {
    unsigned depth;
    std::size_t chunk;       // elements
    std::size_t group_bytes; // G = group_bytes / (chunk x 4)
    std::size_t n;           // input elements
    group_stage_kind kind;
    bool graph;
    bool pinned;
};

void PrintTo(const group_case& c, std::ostream* os) {
    *os << "depth " << c.depth << ", chunk " << c.chunk << ", group_bytes " << c.group_bytes
        << ", n " << c.n << ", kind " << static_cast<int>(c.kind) << (c.graph ? ", graph" : "")
        << (c.pinned ? ", pinned" : ", pageable");
}

std::string kind_name(group_stage_kind k) {
    switch (k) {
    case group_stage_kind::per_chunk:
        return "per_chunk";
    case group_stage_kind::group_transform:
        return "group_transform";
    case group_stage_kind::group_affine:
        return "group_affine";
    }
    return "unknown";
}

class pipeline_grouped : public pipeline_gpu, public ::testing::WithParamInterface<group_case> {};

// Grouped batches: every element right, with per-chunk and group stages, groups that do and do
// not divide the chunk count, a ragged last chunk, depths 2..4, plain and graph, pinned and
// pageable; stats count chunks; a second run reuses the slots (and replays the graphs).
TEST_P(pipeline_grouped, every_element_is_right_and_stats_count_chunks) {
    const group_case c = GetParam();
    auto in = random_words(c.n, c.n + c.depth);
    const auto want =
        c.kind == group_stage_kind::group_affine ? affine_expected(in) : expected(in, c.chunk);
    pipeline_options o;
    o.depth = c.depth;
    o.chunk_elements = c.chunk;
    o.group_bytes = c.group_bytes;
    o.graph = c.graph;
    std::vector<pipe_t::stage> stages;
    switch (c.kind) {
    case group_stage_kind::per_chunk:
        stages.push_back(transform_stage());
        break;
    case group_stage_kind::group_transform:
        stages.emplace_back(transform_group_stage{});
        break;
    case group_stage_kind::group_affine:
        stages.emplace_back(affine_group_stage{});
        break;
    }
    pipe_t pipe(o, std::move(stages));
    const std::size_t chunks = (c.n + c.chunk - 1) / c.chunk;
    cudawait::scheduler sched;
    for (int round = 0; round < 2; ++round) {
        SCOPED_TRACE("round " + std::to_string(round));
        if (c.pinned) {
            pinned_buffer<u32> pin(c.n);
            pinned_buffer<u32> pout(c.n);
            copy_into(pin, in);
            std::fill(pout.begin(), pout.end(), 0xdeadbeefu);
            cudawait::sync_wait(sched, pipe.run(pin.span(), pout.span()));
            ASSERT_EQ(first_mismatch(std::vector<u32>(pout.begin(), pout.end()), want), c.n);
        } else {
            std::vector<u32> out(c.n, 0xdeadbeefu);
            cudawait::sync_wait(sched, pipe.run(in, out));
            ASSERT_EQ(first_mismatch(out, want), c.n);
        }
        const auto st = pipe.stats();
        EXPECT_EQ(st.chunks, chunks);
        EXPECT_EQ(st.gpu_chunks, chunks);
        EXPECT_EQ(st.fallback_chunks + st.failed_chunks + st.retries, 0u);
        EXPECT_EQ(st.input_bytes, c.n * sizeof(u32));
        EXPECT_EQ(st.output_bytes, c.n * sizeof(u32));
        EXPECT_EQ(st.latency.samples, chunks) << "a latency sample per chunk";
    }
}

INSTANTIATE_TEST_SUITE_P(
    configurations, pipeline_grouped,
    ::testing::Values(
        // 4 chunks per group, 24 chunks: groups divide the chunks.
        group_case{2, 4096, 64_KiB, 4096 * 24, group_stage_kind::per_chunk, false, true},
        group_case{3, 4096, 64_KiB, 4096 * 24, group_stage_kind::group_affine, false, true},
        // 3 chunks per group (group_bytes not a multiple of the chunk), ragged last chunk.
        group_case{4, 5000, 64_KiB, 5000 * 20 + 777, group_stage_kind::group_transform, false,
                   true},
        group_case{2, 5000, 64_KiB, 5000 * 20 + 777, group_stage_kind::per_chunk, false, false},
        group_case{3, 5000, 64_KiB, 5000 * 20 + 777, group_stage_kind::group_affine, true, true},
        group_case{4, 4096, 64_KiB, 4096 * 25 + 1, group_stage_kind::per_chunk, true, true},
        group_case{2, 4096, 64_KiB, 4096 * 22 + 100, group_stage_kind::group_transform, true,
                   false},
        // Fewer chunks than one group; and 64 chunks of 1 KiB per group.
        group_case{3, 1000, 1_MiB, 2500, group_stage_kind::per_chunk, false, true},
        group_case{4, 256, 64_KiB, 256 * 300 + 5, group_stage_kind::group_affine, false, true},
        group_case{2, 256, 64_KiB, 256 * 300 + 5, group_stage_kind::per_chunk, true, true}),
    [](const ::testing::TestParamInfo<group_case>& info) {
        const group_case& c = info.param;
        return "depth" + std::to_string(c.depth) + "_chunk" + std::to_string(c.chunk) + "_n" +
               std::to_string(c.n) + "_" + kind_name(c.kind) + (c.graph ? "_graph" : "") +
               (c.pinned ? "_pinned" : "_pageable");
    });

/// What a group stage was told, per call.
struct group_call {
    std::size_t first_chunk, chunks, in_stride, out_stride, in_size, out_size, scratch_size;
    unsigned slot, stage;
    int device;
    cudaStream_t stream;
};

struct recording_group_stage {
    std::shared_ptr<std::vector<group_call>> calls;
    void operator()(std::span<u32> in, std::span<u32> out, const cudawait::group_context& g) const {
        calls->push_back({g.first_chunk, g.chunks, g.in_stride, g.out_stride, in.size(), out.size(),
                          g.scratch.size(), g.slot, g.stage, g.device, g.stream.get()});
        affine_group_stage{}(in, out, g);
    }
};

// The group context: consecutive groups from chunk 0, G chunks each but the last, the strides,
// spans as long as the group's chunks, the slot below the depth, a compute stream, the scratch;
// and a per-chunk stage is called once per chunk, in order, with each chunk's index.
TEST_F(pipeline_gpu, a_group_stage_is_told_the_chunks_of_its_group) {
    const std::size_t chunk = 3000;          // 12000 bytes: 5 chunks per 64 KiB group
    const std::size_t n = chunk * 23 + 1234; // 24 chunks: groups of 5, 5, 5, 5, 4
    auto in = random_words(n, 77);
    auto calls = std::make_shared<std::vector<group_call>>();
    auto per_chunk = std::make_shared<std::vector<std::size_t>>();
    pipeline_options o;
    o.depth = 3;
    o.chunk_elements = chunk;
    o.group_bytes = 64_KiB;
    o.scratch_bytes = 512;
    pipe_t::stage counting = [per_chunk](std::span<u32> a, std::span<u32> b,
                                         const cudawait::stage_context& ctx) {
        per_chunk->push_back(ctx.chunk);
        EXPECT_EQ(a.size(), b.size());
        EXPECT_EQ(ctx.scratch.size(), 512u);
        cudawait::check(
            cudawait::testing::launch_affine(a.data(), b.data(), a.size(), 1, 0, ctx.stream.get()),
            "launch_affine");
    };
    pipe_t pipe(o, {recording_group_stage{calls}, counting});
    // Pinned ranges: a batch that stages pageable ones moves one chunk per flight.
    pinned_buffer<u32> pin(n);
    pinned_buffer<u32> pout(n);
    copy_into(pin, in);
    std::fill(pout.begin(), pout.end(), 0xdeadbeefu);
    cudawait::scheduler sched;
    cudawait::sync_wait(sched, pipe.run(pin.span(), pout.span()));
    EXPECT_EQ(first_mismatch(std::vector<u32>(pout.begin(), pout.end()), affine_expected(in)), n);
    ASSERT_EQ(calls->size(), 5u);
    std::size_t next = 0;
    for (std::size_t i = 0; i < calls->size(); ++i) {
        const group_call& c = (*calls)[i];
        SCOPED_TRACE("group " + std::to_string(i));
        EXPECT_EQ(c.first_chunk, next);
        EXPECT_EQ(c.chunks, i < 4 ? 5u : 4u);
        EXPECT_EQ(c.in_stride, chunk);
        EXPECT_EQ(c.out_stride, chunk);
        const std::size_t elements = i < 4 ? 5 * chunk : 3 * chunk + 1234;
        EXPECT_EQ(c.in_size, elements);
        EXPECT_EQ(c.out_size, elements);
        EXPECT_EQ(c.scratch_size, 512u);
        EXPECT_LT(c.slot, 3u);
        EXPECT_EQ(c.stage, 0u);
        EXPECT_EQ(c.device, 0);
        EXPECT_EQ(c.stream, pipe.compute_stream(0).get());
        next += c.chunks;
    }
    EXPECT_EQ(next, 24u);
    std::vector<std::size_t> all(24);
    for (std::size_t i = 0; i < all.size(); ++i) {
        all[i] = i;
    }
    EXPECT_EQ(*per_chunk, all) << "the per-chunk stage: once per chunk, in order";
}

/// A group stage that fails to launch (non-sticky) whenever its group holds chunk `bad`.
struct failing_group_stage {
    std::size_t bad;
    std::shared_ptr<int> failures;
    void operator()(std::span<u32> in, std::span<u32> out, const cudawait::group_context& g) const {
        if (g.first_chunk <= bad && bad < g.first_chunk + g.chunks) {
            ++*failures;
            cudawait::check(cudawait::testing::launch_bad_config(g.stream.get()),
                            "launch_bad_config");
        }
        transform_group_stage{}(in, out, g);
    }
};

// A group that keeps failing goes to the fallback: each of its chunks once, the others come
// from the GPU; the records name the group; pipeline_error without a fallback lists chunks.
TEST_F(pipeline_gpu, a_failing_group_hands_each_of_its_chunks_to_the_fallback_once) {
    const std::size_t chunk = 4096; // 4 chunks per 64 KiB group
    const std::size_t n = chunk * 18 + 99;
    auto in = random_words(n, 91);
    const auto want = expected(in, chunk);
    for (bool with_fallback : {true, false}) {
        SCOPED_TRACE(with_fallback ? "fallback" : "no fallback");
        auto failures = std::make_shared<int>(0);
        std::vector<std::size_t> fallback_calls;
        std::vector<cudawait::chunk_failure> records;
        pipeline_options o;
        o.chunk_elements = chunk;
        o.group_bytes = 64_KiB;
        o.depth = 3;
        o.max_retries = 2;
        o.on_degrade = [&](const cudawait::chunk_failure& f) { records.push_back(f); };
        pipe_t::fallback fb;
        if (with_fallback) {
            fb = [&](std::size_t c, std::span<const u32> a, std::span<u32> b) {
                fallback_calls.push_back(c);
                host_fallback(c, a, b);
            };
        }
        pipe_t p(o, {failing_group_stage{9, failures}}, fb); // group 2: chunks 8..11
        // Pinned ranges, so that the batch moves groups (a staged one moves single chunks).
        pinned_buffer<u32> pin(n);
        pinned_buffer<u32> pout(n);
        copy_into(pin, in);
        std::fill(pout.begin(), pout.end(), 0xdeadbeefu);
        cudawait::scheduler sched;
        auto outputs = [&] { return std::vector<u32>(pout.begin(), pout.end()); };
        if (with_fallback) {
            cudawait::sync_wait(sched, p.run(pin.span(), pout.span()));
            EXPECT_EQ(first_mismatch(outputs(), want), n);
            EXPECT_EQ(fallback_calls, (std::vector<std::size_t>{8, 9, 10, 11}));
        } else {
            try {
                cudawait::sync_wait(sched, p.run(pin.span(), pout.span()));
                ADD_FAILURE() << "no pipeline_error";
            } catch (const pipeline_error& e) {
                EXPECT_EQ(e.failed(), (std::vector<std::size_t>{8, 9, 10, 11}));
                EXPECT_EQ(e.completed().size(), 15u);
            }
            const std::vector<u32> out = outputs();
            for (std::size_t i = 0; i < n; ++i) {
                const bool failed_chunk = i / chunk >= 8 && i / chunk < 12;
                if (!failed_chunk) {
                    ASSERT_EQ(out[i], want[i]) << "element " << i;
                }
            }
        }
        EXPECT_EQ(*failures, 3) << "first try and max_retries retries";
        const auto st = p.stats();
        EXPECT_EQ(st.gpu_chunks, 15u);
        EXPECT_EQ(with_fallback ? st.fallback_chunks : st.failed_chunks, 4u);
        EXPECT_EQ(st.retries, 2u);
        ASSERT_EQ(records.size(), 3u);
        for (const auto& r : records) {
            EXPECT_EQ(r.chunk, 8u);
            EXPECT_EQ(r.chunks, 4u);
            EXPECT_EQ(r.elements, 4 * chunk);
            EXPECT_EQ(r.offset, 8 * chunk);
        }
        EXPECT_EQ(records.back().level, cudawait::degrade_level::give_up);
    }
}

// Streaming through a grouped pipeline: small items of random sizes, each delivered in order
// with every element checked.
TEST_F(pipeline_gpu, streaming_small_items_through_a_grouped_pipeline_stays_in_order) {
    const std::size_t chunk = 2048;
    std::vector<std::vector<u32>> chunks;
    std::mt19937 sizes(5);
    for (std::size_t i = 0; i < 100; ++i) {
        chunks.push_back(random_words(1 + sizes() % chunk, 500 + i));
    }
    for (bool graph : {false, true}) {
        pipeline_options o;
        o.chunk_elements = chunk;
        o.group_bytes = 64_KiB;
        o.depth = 3;
        o.graph = graph;
        pipe_t p(o, {transform_stage()});
        cudawait::scheduler sched;
        const auto seen = cudawait::sync_wait(sched, stream_chunks(p, chunks));
        ASSERT_EQ(seen.size(), chunks.size());
        for (std::size_t i = 0; i < seen.size(); ++i) {
            EXPECT_TRUE(seen[i].right) << "item " << i << (graph ? ", graph" : "");
            EXPECT_FALSE(seen[i].by_fallback);
        }
        EXPECT_EQ(p.stats().gpu_chunks, chunks.size());
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
    o.chunk_elements = chunk;
    o.depth = 2;
    o.pool = &pool;
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
    o.chunk_elements = chunk;
    o.depth = 3;
    o.pool = &pool;
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

// ---- chunk groups and staged batches in one pipeline ------------------------------------------

namespace {

// A grouped pipeline moves a pinned batch in groups and a pageable (staged) batch one chunk per
// flight, and runs of either kind may follow each other on one pipeline: the group stage is told
// groups of G chunks (the last shorter) for pinned ranges and groups of one chunk, in order, for
// pageable ones; graph replays built by a pinned run serve the next pinned run after a pageable
// one; every element checked after every run, stats per chunk.
TEST_F(pipeline_gpu, grouped_pinned_and_per_chunk_staged_batches_alternate_on_one_pipeline) {
    const std::size_t chunk = 4096;         // 16 KiB: 4 chunks per 64 KiB group
    const std::size_t n = chunk * 13 + 517; // 14 chunks: groups of 4, 4, 4, 2
    auto in = random_words(n, 4242);
    const auto want = affine_expected(in);
    pinned_buffer<u32> pin(n);
    pinned_buffer<u32> pout(n);
    copy_into(pin, in);
    for (bool graph : {false, true}) {
        SCOPED_TRACE(graph ? "graph" : "plain");
        auto calls = std::make_shared<std::vector<group_call>>();
        pipeline_options o;
        o.chunk_elements = chunk;
        o.group_bytes = 64_KiB;
        o.depth = 3;
        o.graph = graph;
        pipe_t pipe(o, {recording_group_stage{calls}});
        cudawait::scheduler sched;
        for (int round = 0; round < 3; ++round) {
            for (bool pinned : {true, false}) {
                SCOPED_TRACE(testing::Message()
                             << "round " << round << (pinned ? ", pinned" : ", pageable"));
                calls->clear();
                std::vector<u32> out(n, 0xdeadbeefu);
                if (pinned) {
                    std::fill(pout.begin(), pout.end(), 0xdeadbeefu);
                    cudawait::sync_wait(sched, pipe.run(pin.span(), pout.span()));
                    out.assign(pout.begin(), pout.end());
                } else {
                    cudawait::sync_wait(sched, pipe.run(in, out));
                }
                ASSERT_EQ(first_mismatch(out, want), n);
                const auto st = pipe.stats();
                EXPECT_EQ(st.chunks, 14u);
                EXPECT_EQ(st.gpu_chunks, 14u);
                EXPECT_EQ(st.latency.samples, 14u);
                EXPECT_EQ(st.input_bytes, n * sizeof(u32));
                // In graph mode the stage is called only when a slot's graph is captured.
                if (graph && pinned) {
                    EXPECT_LE(calls->size(), (round == 0 ? 3u : 0u) + 1u)
                        << "graphs captured once per slot; the short last group runs plainly";
                    for (const group_call& c : *calls) {
                        EXPECT_TRUE(c.chunks == 4 || (c.first_chunk == 12 && c.chunks == 2));
                    }
                    continue;
                }
                const std::size_t groups = pinned ? 4 : 14;
                ASSERT_EQ(calls->size(), groups);
                std::size_t next = 0;
                for (const group_call& c : *calls) {
                    EXPECT_EQ(c.first_chunk, next);
                    const std::size_t want_chunks =
                        pinned ? std::min<std::size_t>(4, 14 - next) : 1;
                    EXPECT_EQ(c.chunks, want_chunks);
                    const std::size_t elements = std::min(want_chunks * chunk, n - next * chunk);
                    EXPECT_EQ(c.in_size, elements);
                    EXPECT_EQ(c.out_size, elements);
                    EXPECT_LT(c.slot, 3u);
                    next += c.chunks;
                }
                EXPECT_EQ(next, 14u);
            }
        }
    }
}

// In a grouped pipeline a staged batch retries, records and hands to the fallback single
// chunks: a launch failing for chunk 9 sends chunk 9 alone to the fallback, and the records
// name one chunk; a pinned batch through the same pipeline then gives up the whole group.
TEST_F(pipeline_gpu, a_staged_batch_in_a_grouped_pipeline_fails_single_chunks) {
    const std::size_t chunk = 4096; // 4 chunks per 64 KiB group
    const std::size_t n = chunk * 18 + 99;
    auto in = random_words(n, 93);
    const auto want = expected(in, chunk);
    auto failures = std::make_shared<int>(0);
    std::vector<std::size_t> fallback_calls;
    std::vector<cudawait::chunk_failure> records;
    pipeline_options o;
    o.chunk_elements = chunk;
    o.group_bytes = 64_KiB;
    o.depth = 3;
    o.max_retries = 1;
    o.on_degrade = [&](const cudawait::chunk_failure& f) { records.push_back(f); };
    pipe_t p(o, {failing_group_stage{9, failures}},
             [&](std::size_t c, std::span<const u32> a, std::span<u32> b) {
                 fallback_calls.push_back(c);
                 host_fallback(c, a, b);
             });
    cudawait::scheduler sched;
    std::vector<u32> out(n, 0xdeadbeefu);
    cudawait::sync_wait(sched, p.run(in, out));
    EXPECT_EQ(first_mismatch(out, want), n);
    EXPECT_EQ(fallback_calls, std::vector<std::size_t>{9});
    EXPECT_EQ(*failures, 2);
    ASSERT_EQ(records.size(), 2u);
    for (const auto& r : records) {
        EXPECT_EQ(r.chunk, 9u);
        EXPECT_EQ(r.chunks, 1u);
        EXPECT_EQ(r.elements, chunk);
        EXPECT_EQ(r.offset, 9 * chunk);
    }
    auto st = p.stats();
    EXPECT_EQ(st.gpu_chunks, 18u);
    EXPECT_EQ(st.fallback_chunks, 1u);
    EXPECT_EQ(st.latency.samples, 19u);

    records.clear();
    fallback_calls.clear();
    pinned_buffer<u32> pin(n);
    pinned_buffer<u32> pout(n);
    copy_into(pin, in);
    std::fill(pout.begin(), pout.end(), 0xdeadbeefu);
    cudawait::sync_wait(sched, p.run(pin.span(), pout.span()));
    EXPECT_EQ(first_mismatch(std::vector<u32>(pout.begin(), pout.end()), want), n);
    EXPECT_EQ(fallback_calls, (std::vector<std::size_t>{8, 9, 10, 11}));
    ASSERT_FALSE(records.empty());
    EXPECT_EQ(records.back().chunks, 4u);
    st = p.stats();
    EXPECT_EQ(st.gpu_chunks, 15u);
    EXPECT_EQ(st.fallback_chunks, 4u);
}

} // namespace

// ---- streaming in chunk groups ----------------------------------------------------------------

namespace {

/// A pipeline of 4096-element chunks in groups of 4 (64 KiB), whose group stage records its
/// calls and runs the per-chunk transform over each chunk of the run.
struct grouped_stream_setup {
    std::shared_ptr<std::vector<group_call>> calls = std::make_shared<std::vector<group_call>>();
    pipeline_options options(unsigned depth, bool graph) const {
        pipeline_options o;
        o.chunk_elements = 4096;
        o.group_bytes = 64_KiB;
        o.depth = depth;
        o.graph = graph;
        o.chunk_timeout = 20s; // a wait that hangs fails the test instead of hanging it
        return o;
    }
};

/// Records the run, then the transform per chunk (group_context cuts the chunks out).
struct recording_transform_group_stage {
    std::shared_ptr<std::vector<group_call>> calls;
    void operator()(std::span<u32> in, std::span<u32> out, const cudawait::group_context& g) const {
        calls->push_back({g.first_chunk, g.chunks, g.in_stride, g.out_stride, in.size(), out.size(),
                          g.scratch.size(), g.slot, g.stage, g.device, g.stream.get()});
        transform_group_stage{}(in, out, g);
    }
};

bool transformed_right(std::span<const u32> got, const std::vector<u32>& in) {
    std::vector<u32> want(in.size());
    cudawait::testing::transform_on_host(in.data(), want.data(), in.size(), salt);
    return std::equal(want.begin(), want.end(), got.begin(), got.end());
}

/// Acquires and submits items[first..last) (each item's data), nothing else.
cudawait::task<void> submit_items(pipe_t& p, const std::vector<std::vector<u32>>& items,
                                  std::size_t first, std::size_t last) {
    for (std::size_t i = first; i < last; ++i) {
        auto slot = co_await p.acquire();
        std::copy(items[i].begin(), items[i].end(), slot.data().begin());
        p.submit(std::move(slot), items[i].size());
    }
}

/// Takes `count` results with next(timeout): each must be item `first + k`, right and from the
/// GPU. Returns how many were.
cudawait::task<std::size_t> take_items(pipe_t& p, const std::vector<std::vector<u32>>& items,
                                       std::size_t first, std::size_t count) {
    std::size_t good = 0;
    for (std::size_t k = 0; k < count; ++k) {
        auto r = co_await p.next(10s);
        if (r && r->chunk() == first + k && !r->by_fallback() &&
            transformed_right(r->data(), items[first + k])) {
            ++good;
        }
    }
    co_return good;
}

// Full groups: items submitted in order fill the slot groups and go as one flight each (the
// group stage is told runs of 4 chunks from chunk 0 on), every element right, in order; a
// short last item ends its run; stats count items. Graph mode replays the full groups.
TEST_F(pipeline_gpu, streaming_in_groups_sends_full_groups_as_one_flight) {
    for (bool graph : {false, true}) {
        SCOPED_TRACE(graph ? "graph" : "plain");
        grouped_stream_setup setup;
        pipe_t p(setup.options(3, graph), {recording_transform_group_stage{setup.calls}});
        std::vector<std::vector<u32>> items;
        for (std::size_t i = 0; i < 22; ++i) {
            items.push_back(random_words(i == 21 ? 1000 : 4096, 700 + i));
        }
        cudawait::scheduler sched;
        cudawait::sync_wait(sched, [&]() -> cudawait::task<void> {
            // 12 items fill the three slot groups; the producer then must wait for results.
            co_await submit_items(p, items, 0, 12);
            EXPECT_EQ(co_await take_items(p, items, 0, 12), 12u);
            co_await submit_items(p, items, 12, 22);
            p.close();
            EXPECT_EQ(co_await take_items(p, items, 12, 10), 10u);
            EXPECT_FALSE(co_await p.next(10s)) << "the session ends";
        }());
        const auto st = p.stats();
        EXPECT_EQ(st.chunks, 22u);
        EXPECT_EQ(st.gpu_chunks, 22u);
        EXPECT_EQ(st.latency.samples, 22u);
        EXPECT_EQ(st.input_bytes, (21 * 4096 + 1000) * sizeof(u32));
        if (!graph) {
            // Runs 0-3, 4-7, 8-11, 12-15, 16-19 and 20-21 (ended by the short item 21).
            ASSERT_EQ(setup.calls->size(), 6u);
            for (std::size_t g = 0; g < 6; ++g) {
                EXPECT_EQ((*setup.calls)[g].first_chunk, 4 * g);
                EXPECT_EQ((*setup.calls)[g].chunks, g < 5 ? 4u : 2u);
                EXPECT_EQ((*setup.calls)[g].in_size, g < 5 ? 4 * 4096u : 4096u + 1000u);
            }
        }
        // The pipeline is idle again: a batch runs.
        auto in = random_words(4096 * 9, 9);
        pinned_buffer<u32> pin(in.size());
        pinned_buffer<u32> pout(in.size());
        copy_into(pin, in);
        cudawait::sync_wait(sched, p.run(pin.span(), pout.span()));
        EXPECT_EQ(first_mismatch(std::vector<u32>(pout.begin(), pout.end()), expected(in, 4096)),
                  in.size());
    }
}

// A partial run is sent when next() needs its first chunk (no flush otherwise: the group is not
// full, no acquire() waits, no close()), and when close() is called; the rest of a slot group
// serves the next items (a later run from the middle of the group).
TEST_F(pipeline_gpu, streaming_in_groups_sends_a_partial_run_for_next_and_close) {
    for (bool graph : {false, true}) {
        SCOPED_TRACE(graph ? "graph" : "plain");
        grouped_stream_setup setup;
        pipe_t p(setup.options(2, graph), {recording_transform_group_stage{setup.calls}});
        std::vector<std::vector<u32>> items;
        for (std::size_t i = 0; i < 7; ++i) {
            items.push_back(random_words(4096, 800 + i));
        }
        cudawait::scheduler sched;
        cudawait::sync_wait(sched, [&]() -> cudawait::task<void> {
            co_await submit_items(p, items, 0, 2); // chunks 0, 1 of group A: held back
            EXPECT_EQ(co_await take_items(p, items, 0, 2), 2u) << "next() sent them";
            co_await submit_items(p, items, 2, 3); // chunk 2 of group A
            EXPECT_EQ(co_await take_items(p, items, 2, 1), 1u);
            co_await submit_items(p, items, 3, 6); // chunk 3 of A, chunks 0, 1 of B
            p.close();
            EXPECT_EQ(co_await take_items(p, items, 3, 3), 3u) << "close() sent them";
            EXPECT_FALSE(co_await p.next(10s));
        }());
        if (!graph) {
            ASSERT_EQ(setup.calls->size(), 4u);
            const std::size_t first[] = {0, 2, 3, 4};
            const std::size_t chunks[] = {2, 1, 1, 2};
            for (std::size_t g = 0; g < 4; ++g) {
                EXPECT_EQ((*setup.calls)[g].first_chunk, first[g]);
                EXPECT_EQ((*setup.calls)[g].chunks, chunks[g]);
            }
        }
        EXPECT_EQ(p.stats().gpu_chunks, 6u);
    }
}

// acquire() that would wait sends what is held back first: with one slot group, three items
// submitted and the fourth acquired but not submitted, acquire(0) finds no chunk free and times
// out, and the three are on the GPU then (next() returns them); the fourth, submitted later, goes
// alone, and the group serves the producer again once its results were destroyed.
TEST_F(pipeline_gpu, streaming_in_groups_sends_the_held_run_before_acquire_waits) {
    grouped_stream_setup setup;
    pipe_t p(setup.options(1, false), {recording_transform_group_stage{setup.calls}});
    std::vector<std::vector<u32>> items;
    for (std::size_t i = 0; i < 8; ++i) {
        items.push_back(random_words(4096 - 3 * (i == 7), 900 + i));
    }
    cudawait::scheduler sched;
    cudawait::sync_wait(sched, [&]() -> cudawait::task<void> {
        co_await submit_items(p, items, 0, 3);
        auto held = co_await p.acquire(); // chunk 3 of the only group
        EXPECT_THROW((void)co_await p.acquire(0ms), cudawait::timeout_error);
        EXPECT_EQ(setup.calls->size(), 1u) << "the waiting acquire() sent chunks 0-2";
        {
            std::vector<std::optional<pipe_t::result>> results;
            for (std::size_t k = 0; k < 3; ++k) {
                results.push_back(co_await p.next(10s));
                EXPECT_TRUE(results.back() && results.back()->chunk() == k &&
                            transformed_right(results.back()->data(), items[k]));
            }
            std::copy(items[3].begin(), items[3].end(), held.data().begin());
            p.submit(std::move(held), items[3].size()); // the group's last chunk: sent
            EXPECT_EQ(setup.calls->size(), 2u);
            EXPECT_THROW((void)co_await p.acquire(0ms), cudawait::timeout_error)
                << "the group is held by results";
        }
        EXPECT_EQ(co_await take_items(p, items, 3, 1), 1u);
        co_await submit_items(p, items, 4, 8); // the group again, from its first chunk
        p.close();
        EXPECT_EQ(co_await take_items(p, items, 4, 4), 4u);
        EXPECT_FALSE(co_await p.next(10s));
    }());
    ASSERT_EQ(setup.calls->size(), 3u);
    EXPECT_EQ((*setup.calls)[2].first_chunk, 4u);
    EXPECT_EQ((*setup.calls)[2].chunks, 4u);
    EXPECT_EQ((*setup.calls)[2].in_size, 4 * 4096u - 3);
}

// Runs hold only chunks submitted in the order they were acquired, all full but the last: a
// short item ends its run, an item submitted out of order or after a dropped one starts a new
// run; the results come in submission order, each with its own data.
TEST_F(pipeline_gpu, streaming_in_groups_keeps_ragged_and_out_of_order_items_apart) {
    for (bool graph : {false, true}) {
        SCOPED_TRACE(graph ? "graph" : "plain");
        grouped_stream_setup setup;
        pipe_t p(setup.options(3, graph), {recording_transform_group_stage{setup.calls}});
        std::vector<std::vector<u32>> data;
        for (std::size_t i = 0; i < 6; ++i) {
            data.push_back(random_words(i == 1 ? 77 : 4096, 1000 + i));
        }
        cudawait::scheduler sched;
        cudawait::sync_wait(sched, [&]() -> cudawait::task<void> {
            std::vector<pipe_t::input_slot> s;
            for (std::size_t i = 0; i < 6; ++i) {
                s.push_back(co_await p.acquire()); // group A: 0-3, group B: 4, 5
                std::copy(data[i].begin(), data[i].end(), s.back().data().begin());
            }
            // Submission order: 0, 1 (short: ends the run), 3, 2 (out of order), 5 (4 dropped).
            const std::size_t order[] = {0, 1, 3, 2, 5};
            for (std::size_t i : order) {
                p.submit(std::move(s[i]), data[i].size());
            }
            s.clear(); // drops chunk 4 unused
            p.close();
            for (std::size_t k = 0; k < 5; ++k) {
                auto r = co_await p.next(10s);
                EXPECT_TRUE(r && r->chunk() == k && transformed_right(r->data(), data[order[k]]))
                    << "result " << k;
            }
            EXPECT_FALSE(co_await p.next(10s));
        }());
        if (!graph) {
            // Runs: {0, 1}, {3}, {2}, {5}.
            ASSERT_EQ(setup.calls->size(), 4u);
            EXPECT_EQ((*setup.calls)[0].chunks, 2u);
            EXPECT_EQ((*setup.calls)[0].in_size, 4096u + 77u);
            for (std::size_t g = 1; g < 4; ++g) {
                EXPECT_EQ((*setup.calls)[g].chunks, 1u);
                EXPECT_EQ((*setup.calls)[g].first_chunk, g + 1);
            }
        }
        EXPECT_EQ(p.stats().gpu_chunks, 5u);
    }
}

// Ragged items of random sizes through a per-chunk stage (its index restarts per chunk, so a
// wrong chunk boundary shows), the three-ahead producer of stream_chunks, graph off and on.
TEST_F(pipeline_gpu, streaming_in_groups_with_ragged_items_is_exact) {
    std::vector<std::vector<u32>> chunks;
    std::mt19937 sizes(17);
    for (std::size_t i = 0; i < 150; ++i) {
        const bool full = sizes() % 3 != 0;
        chunks.push_back(random_words(full ? 4096 : 1 + sizes() % 4096, 1100 + i));
    }
    for (bool graph : {false, true}) {
        grouped_stream_setup setup;
        pipe_t p(setup.options(3, graph), {transform_stage()});
        cudawait::scheduler sched;
        const auto seen = cudawait::sync_wait(sched, stream_chunks(p, chunks));
        ASSERT_EQ(seen.size(), chunks.size());
        for (std::size_t i = 0; i < seen.size(); ++i) {
            EXPECT_TRUE(seen[i].right) << "item " << i << (graph ? ", graph" : "");
        }
        EXPECT_EQ(p.stats().gpu_chunks, chunks.size());
        EXPECT_EQ(p.stats().latency.samples, chunks.size());
    }
}

// A run whose enqueue keeps failing: each of its chunks goes to the fallback once, in order,
// when next() reaches it, with one record for the run (chunks = the run's); without a fallback
// next() throws pipeline_error for each of them and the chunks after them still come.
TEST_F(pipeline_gpu, streaming_in_groups_hands_each_chunk_of_a_failed_run_to_the_fallback) {
    std::vector<std::vector<u32>> items;
    for (std::size_t i = 0; i < 12; ++i) {
        items.push_back(random_words(4096, 1200 + i));
    }
    for (bool with_fallback : {true, false}) {
        SCOPED_TRACE(with_fallback ? "fallback" : "no fallback");
        auto failures = std::make_shared<int>(0);
        std::vector<std::size_t> fallback_calls;
        std::vector<cudawait::chunk_failure> records;
        grouped_stream_setup setup;
        pipeline_options o = setup.options(3, false);
        o.max_retries = 1;
        o.on_degrade = [&](const cudawait::chunk_failure& f) { records.push_back(f); };
        pipe_t::fallback fb;
        if (with_fallback) {
            fb = [&](std::size_t c, std::span<const u32> a, std::span<u32> b) {
                fallback_calls.push_back(c);
                host_fallback(c, a, b);
            };
        }
        pipe_t p(o, {failing_group_stage{5, failures}}, fb); // the run of chunks 4..7
        cudawait::scheduler sched;
        std::vector<int> outcome; // 1 GPU, 2 fallback, 3 pipeline_error, 0 wrong
        cudawait::sync_wait(sched, [&]() -> cudawait::task<void> {
            co_await submit_items(p, items, 0, 12);
            p.close();
            for (std::size_t k = 0; k < 12; ++k) {
                try {
                    auto r = co_await p.next(10s);
                    const bool right =
                        r && r->chunk() == k && transformed_right(r->data(), items[k]);
                    outcome.push_back(!right ? 0 : r->by_fallback() ? 2 : 1);
                } catch (const pipeline_error& e) {
                    outcome.push_back(e.failed() == std::vector<std::size_t>{k} ? 3 : 0);
                }
            }
            EXPECT_FALSE(co_await p.next(10s));
        }());
        const int bad = with_fallback ? 2 : 3;
        EXPECT_EQ(outcome, (std::vector<int>{1, 1, 1, 1, bad, bad, bad, bad, 1, 1, 1, 1}));
        if (with_fallback) {
            EXPECT_EQ(fallback_calls, (std::vector<std::size_t>{4, 5, 6, 7}));
        }
        EXPECT_EQ(*failures, 2) << "first try and one retry";
        ASSERT_EQ(records.size(), 2u) << "a retry and one give-up for the run";
        for (const auto& r : records) {
            EXPECT_EQ(r.chunk, 4u);
            EXPECT_EQ(r.chunks, 4u);
            EXPECT_EQ(r.elements, 4 * 4096u);
        }
        const auto st = p.stats();
        EXPECT_EQ(st.chunks, 12u);
        EXPECT_EQ(st.gpu_chunks, 8u);
        EXPECT_EQ(with_fallback ? st.fallback_chunks : st.failed_chunks, 4u);
        EXPECT_EQ(st.retries, 1u);
    }
}

// next(timeout) on a held-back run sends it and, when the time runs out first, keeps the chunk
// first in line; a chunk_timeout that passes gives the run up: its chunks and those behind it
// fail, and the slot groups serve the producer again (fresh pinned buffers).
TEST_F(pipeline_gpu, streaming_in_groups_keeps_timeouts_per_chunk_and_gives_up_runs) {
    std::vector<std::vector<u32>> items;
    for (std::size_t i = 0; i < 8; ++i) {
        items.push_back(random_words(4096, 1300 + i));
    }
    grouped_stream_setup setup;
    pipeline_options o = setup.options(2, false);
    o.chunk_timeout = 100ms;
    o.max_retries = 0;
    o.on_degrade = [](const cudawait::chunk_failure&) {};
    pipe_t p(o, {transform_stage(300'000'000)}); // 0.3 s per chunk: past chunk_timeout
    cudawait::scheduler sched;
    cudawait::sync_wait(sched, [&]() -> cudawait::task<void> {
        co_await submit_items(p, items, 0, 6); // runs {0-3} (sent), {4, 5} (held back)
        EXPECT_THROW((void)co_await p.next(0ms), cudawait::timeout_error) << "a poll";
        std::vector<std::size_t> failed;
        for (std::size_t k = 0; k < 6; ++k) {
            try {
                (void)co_await p.next();
            } catch (const pipeline_error& e) {
                failed.insert(failed.end(), e.failed().begin(), e.failed().end());
            }
        }
        EXPECT_EQ(failed, (std::vector<std::size_t>{0, 1, 2, 3, 4, 5}));
        // Both slot groups serve the producer again at once.
        auto a = co_await p.acquire(0ms);
        p.close();
        EXPECT_FALSE(co_await p.next(10s));
    }());
    const auto st = p.stats();
    EXPECT_TRUE(st.gpu_abandoned);
    EXPECT_EQ(st.failed_chunks, 6u);
}

} // namespace

namespace {

// close() sends the run held back; an exception from on_degrade meanwhile (a retry of the
// failed enqueue) does not leave close() but reaches the next call of next(), and the run's
// chunks then come from the fallback, once each, in order.
TEST_F(pipeline_gpu, streaming_in_groups_defers_what_on_degrade_throws_in_close_to_next) {
    std::vector<std::vector<u32>> items;
    for (std::size_t i = 0; i < 2; ++i) {
        items.push_back(random_words(4096, 1400 + i));
    }
    grouped_stream_setup setup;
    pipeline_options o = setup.options(2, false);
    int degrade_calls = 0;
    o.on_degrade = [&](const cudawait::chunk_failure&) {
        if (degrade_calls++ == 0) {
            throw std::runtime_error("on_degrade refused");
        }
    };
    auto failures = std::make_shared<int>(0);
    std::vector<std::size_t> fallback_calls;
    pipe_t p(o, {failing_group_stage{1, failures}},
             [&](std::size_t c, std::span<const u32> a, std::span<u32> b) {
                 fallback_calls.push_back(c);
                 host_fallback(c, a, b);
             });
    cudawait::scheduler sched;
    cudawait::sync_wait(sched, [&]() -> cudawait::task<void> {
        co_await submit_items(p, items, 0, 2); // held back: the group is not full
        EXPECT_NO_THROW(p.close());
        EXPECT_THROW((void)co_await p.next(10s), std::runtime_error);
        for (std::size_t k = 0; k < 2; ++k) {
            auto r = co_await p.next(10s);
            EXPECT_TRUE(r && r->chunk() == k && r->by_fallback() &&
                        transformed_right(r->data(), items[k]))
                << "item " << k;
        }
        EXPECT_FALSE(co_await p.next(10s));
    }());
    EXPECT_EQ(*failures, 1);
    EXPECT_EQ(fallback_calls, (std::vector<std::size_t>{0, 1}));
    EXPECT_EQ(degrade_calls, 2) << "the retry's record and one give-up for the run";
}

} // namespace

// ---- streaming from and into the caller's own memory (submit with views) ---------------------

namespace {

using cudawait::detail::append_piece;
using cudawait::detail::copy_batch;
using cudawait::detail::copy_piece;

// Pieces join only when both are the slot's own and continue each other on both ends; the
// caller's spans stay apart even when adjacent.
TEST(pipeline_views, only_adjacent_pieces_of_the_slot_merge) {
    alignas(16) static char host[1024];
    alignas(16) static char dev[1024];
    std::vector<copy_piece> v;
    append_piece(v, dev, host, 100, true);
    append_piece(v, dev + 100, host + 100, 50, true); // continues it: merged
    ASSERT_EQ(v.size(), 1u);
    EXPECT_EQ(v[0].bytes, 150u);
    append_piece(v, dev + 150, host + 150, 10, false); // a caller's span: its own piece
    append_piece(v, dev + 160, host + 160, 10, false); // adjacent, still its own
    append_piece(v, dev + 170, host + 170, 30, true);  // after a caller's span: its own
    append_piece(v, dev + 200, host + 300, 8, true);   // not adjacent on the host
    append_piece(v, dev + 300, host + 308, 8, true);   // not adjacent on the device
    append_piece(v, dev + 308, host + 316, 4, true);   // continues the last: merged
    ASSERT_EQ(v.size(), 6u);
    const std::size_t bytes[] = {150, 10, 10, 30, 8, 12};
    const std::ptrdiff_t at[] = {0, 150, 160, 170, 300, 308};
    for (std::size_t i = 0; i < v.size(); ++i) {
        EXPECT_EQ(v[i].bytes, bytes[i]) << "piece " << i;
        EXPECT_EQ(static_cast<const char*>(v[i].src) - host, at[i]) << "piece " << i;
    }
    EXPECT_EQ(static_cast<char*>(v[5].dst) - dev, 300);
}

// The batch's arrays: each piece cut at piece_bytes (0: whole), in order, empty ones left out,
// and the arrays are laid out anew each time.
TEST(pipeline_views, the_batch_cuts_pieces_at_piece_bytes_in_order) {
    alignas(16) static char host[4096];
    alignas(16) static char dev[4096];
    const std::vector<copy_piece> pieces = {{dev, host, 1000, true},
                                            {dev + 1000, host + 2000, 0, false},
                                            {dev + 1000, host + 3000, 300, false},
                                            {dev + 1300, host + 100, 256, false}};
    copy_batch b;
    b.lay_out(pieces, 0);
    ASSERT_EQ(b.sizes().size(), 3u);
    EXPECT_EQ(b.sizes()[0], 1000u);
    EXPECT_EQ(b.srcs()[1], host + 3000);
    EXPECT_EQ(b.dsts()[2], dev + 1300);
    b.lay_out(pieces, 256);
    const std::vector<std::size_t> sizes = {256, 256, 256, 232, 256, 44, 256};
    const std::vector<std::ptrdiff_t> src = {0, 256, 512, 768, 3000, 3256, 100};
    const std::vector<std::ptrdiff_t> dst = {0, 256, 512, 768, 1000, 1256, 1300};
    ASSERT_EQ(b.sizes().size(), sizes.size());
    for (std::size_t i = 0; i < sizes.size(); ++i) {
        EXPECT_EQ(b.sizes()[i], sizes[i]) << "copy " << i;
        EXPECT_EQ(static_cast<char*>(b.srcs()[i]) - host, src[i]) << "copy " << i;
        EXPECT_EQ(static_cast<char*>(b.dsts()[i]) - dev, dst[i]) << "copy " << i;
    }
    b.lay_out(std::span<const copy_piece>(pieces).first(1), 4096);
    ASSERT_EQ(b.sizes().size(), 1u);
    EXPECT_EQ(b.sizes()[0], 1000u);
}

enum class host_kind { pinned, registered, pageable };
constexpr host_kind all_host_kinds[] = {host_kind::pinned, host_kind::registered,
                                        host_kind::pageable};

std::string kind_name(host_kind k) {
    switch (k) {
    case host_kind::pinned:
        return "pinned";
    case host_kind::registered:
        return "registered";
    case host_kind::pageable:
        return "pageable";
    }
    return "?";
}

/// `n` words of host memory of one kind: a pinned_buffer, a registered std::vector or a plain
/// one.
template <class T = u32>
struct host_words {
    host_words(std::size_t n, host_kind k) : vec(k == host_kind::pinned ? 0 : n) {
        if (k == host_kind::pinned) {
            pin = pinned_buffer<T>(n);
        } else if (k == host_kind::registered) {
            reg = cudawait::host_registration<T>(std::span<T>(vec));
        }
    }
    std::span<T> span() { return vec.empty() ? pin.span() : std::span<T>(vec); }
    std::vector<T> copy() { return std::vector<T>(span().begin(), span().end()); }
    std::vector<T> vec;
    pinned_buffer<T> pin;
    cudawait::host_registration<T> reg; // goes before the vector
};

/// Streams `in` as items of `item` elements (the last shorter) into `out` as views (each item's
/// output at out_item x its index), every item through acquire() and submit(slot, in, out);
/// then close().
template <class P, class In, class Out>
cudawait::task<void> produce_views(P& p, std::span<const In> in, std::span<Out> out,
                                   std::size_t item, std::size_t out_item) {
    for (std::size_t off = 0, i = 0; off < in.size(); off += item, ++i) {
        const std::size_t k = std::min(item, in.size() - off);
        auto slot = co_await p.acquire();
        p.submit(std::move(slot), in.subspan(off, k), out.subspan(i * out_item, p.output_size(k)));
    }
    p.close();
}

/// Takes every result: counts those in order, from the GPU, whose data() is their place in
/// `out` (item index x out_item).
template <class P, class Out>
cudawait::task<std::size_t> take_views(P& p, std::span<Out> out, std::size_t out_item) {
    std::size_t placed = 0;
    std::size_t expect = 0;
    while (auto r = co_await p.next(20s)) {
        if (r->chunk() == expect++ && !r->by_fallback() &&
            r->data().data() == out.data() + r->chunk() * out_item) {
            ++placed;
        }
    }
    co_return placed;
}

// Every kind of host memory on either side, with and without chunk groups: pinned and
// registered spans are copied directly, pageable ones staged; every element right, a short last
// item, the result's data() the caller's output, the input untouched, stats per item.
TEST_F(pipeline_gpu, streamed_views_of_pinned_registered_and_pageable_memory_are_exact) {
    const std::size_t item = 4096;
    const std::size_t n = item * 13 + 123; // 14 items
    const auto words = random_words(n, 1500);
    const auto want = expected(words, item);
    cudawait::scheduler sched;
    for (bool grouped : {false, true}) {
        for (host_kind ki : all_host_kinds) {
            for (host_kind ko : all_host_kinds) {
                SCOPED_TRACE(std::string(grouped ? "grouped, " : "") + kind_name(ki) + " -> " +
                             kind_name(ko));
                host_words<> in(n, ki);
                host_words<> out(n, ko);
                std::copy(words.begin(), words.end(), in.span().begin());
                std::fill(out.span().begin(), out.span().end(), 0xdeadbeefu);
                pipeline_options o;
                o.chunk_elements = item;
                o.depth = 3;
                o.group_bytes = grouped ? 64_KiB : 0; // 4 items per slot group
                o.chunk_timeout = 20s;
                pipe_t p(o, {transform_stage()});
                const auto [produced, placed] = cudawait::sync_wait(
                    sched, cudawait::when_all(produce_views<pipe_t, u32, u32>(
                                                  p, in.span(), out.span(), item, item),
                                              take_views<pipe_t, u32>(p, out.span(), item)));
                (void)produced;
                EXPECT_EQ(placed, 14u);
                EXPECT_EQ(first_mismatch(out.copy(), want), n);
                EXPECT_EQ(first_mismatch(in.copy(), words), n) << "the input was written";
                const auto st = p.stats();
                EXPECT_EQ(st.gpu_chunks, 14u);
                EXPECT_EQ(st.chunks, 14u);
                EXPECT_EQ(st.latency.samples, 14u);
                EXPECT_EQ(st.input_bytes, n * sizeof(u32));
            }
        }
    }
}

/// How a_grouped_run_mixes_slot_chunks_and_views submits item i: 0 slot chunk, 1 adjacent
/// views, 2 views of buffers of their own, 3 a pinned input and a pageable output.
int kind_of_item(std::size_t i) { return i / 4 == 2 ? 0 : static_cast<int>(i % 4); }

// One grouped run may mix slot chunks and views: items alternate between the slot's own input
// and views (adjacent spans of one pinned buffer, and scattered pinned buffers of their own; a
// pageable output staged among them), a group stage is told full runs of 4 chunks, and every
// element of every item is right. One run (items 8-11) is all slot chunks: in graph mode it
// replays its slot's graph, and the runs with views on that slot before and after it take the
// plain path (the stage is called for each of them: once per run in both modes).
TEST_F(pipeline_gpu, a_grouped_run_mixes_slot_chunks_and_views) {
    const std::size_t item = 4096;
    const std::size_t items = 24;
    std::vector<std::vector<u32>> data;
    for (std::size_t i = 0; i < items; ++i) {
        data.push_back(random_words(i + 1 == items ? 999 : item, 1600 + i));
    }
    for (bool graph : {false, true}) {
        SCOPED_TRACE(graph ? "graph" : "plain");
        grouped_stream_setup setup;
        pipe_t p(setup.options(3, graph), {recording_transform_group_stage{setup.calls}});
        pinned_buffer<u32> adjacent_in(items * item);  // views of items 4k+1: back to back
        pinned_buffer<u32> adjacent_out(items * item); // (and of items 4k+2 for the output)
        std::vector<pinned_buffer<u32>> own_in;        // items 4k+2: each its own buffer
        std::vector<pinned_buffer<u32>> own_out;
        std::vector<std::vector<u32>> pageable_out(items); // items 4k+3: pinned in, pageable out
        std::fill(adjacent_out.begin(), adjacent_out.end(), 0xdeadbeefu);
        cudawait::scheduler sched;
        cudawait::sync_wait(sched, [&]() -> cudawait::task<void> {
            for (std::size_t i = 0; i < items; ++i) {
                auto slot = co_await p.acquire();
                const std::vector<u32>& d = data[i];
                const std::size_t out_n = p.output_size(d.size());
                switch (kind_of_item(i)) {
                case 0: // the slot's own buffers
                    std::copy(d.begin(), d.end(), slot.data().begin());
                    p.submit(std::move(slot), d.size());
                    break;
                case 1: { // adjacent views of one buffer
                    std::span<u32> in = adjacent_in.span().subspan(i * item, d.size());
                    std::copy(d.begin(), d.end(), in.begin());
                    p.submit(std::move(slot), in, adjacent_out.span().subspan(i * item, out_n));
                    break;
                }
                case 2: { // scattered views: buffers of their own
                    own_in.emplace_back(d.size());
                    own_out.emplace_back(out_n);
                    std::copy(d.begin(), d.end(), own_in.back().begin());
                    std::fill(own_out.back().begin(), own_out.back().end(), 0xdeadbeefu);
                    p.submit(std::move(slot), own_in.back().span(), own_out.back().span());
                    break;
                }
                default: { // a pinned input, a pageable output
                    std::span<u32> in = adjacent_in.span().subspan(i * item, d.size());
                    std::copy(d.begin(), d.end(), in.begin());
                    pageable_out[i].assign(out_n, 0xdeadbeefu);
                    p.submit(std::move(slot), in, std::span<u32>(pageable_out[i]));
                    break;
                }
                }
                // Results are kept (their slot groups with them) so the producer runs ahead,
                // up to the three slot groups; then the oldest are taken.
                if (i % 12 == 11) {
                    for (std::size_t k = i - 11; k <= i; ++k) {
                        auto r = co_await p.next(20s);
                        EXPECT_TRUE(r && r->chunk() == k && !r->by_fallback()) << "item " << k;
                        if (r) {
                            EXPECT_TRUE(transformed_right(r->data(), data[k])) << "item " << k;
                            if (kind_of_item(k) == 3) {
                                EXPECT_EQ(r->data().data(), pageable_out[k].data());
                            }
                        }
                    }
                }
            }
            p.close();
            EXPECT_FALSE(co_await p.next(20s));
        }());
        for (std::size_t i = 0, own = 0; i < items; ++i) {
            std::span<const u32> out;
            if (kind_of_item(i) == 1) {
                out = adjacent_out.span().subspan(i * item, data[i].size());
            } else if (kind_of_item(i) == 2) {
                out = own_out[own++].span();
            } else if (kind_of_item(i) == 3) {
                out = pageable_out[i];
            } else {
                continue; // checked through its result
            }
            EXPECT_TRUE(transformed_right(out, data[i])) << "item " << i << " in its view";
        }
        ASSERT_EQ(setup.calls->size(), items / 4) << "one run per full slot group";
        for (std::size_t g = 0; g < items / 4; ++g) {
            EXPECT_EQ((*setup.calls)[g].first_chunk, 4 * g);
            EXPECT_EQ((*setup.calls)[g].chunks, 4u);
        }
        EXPECT_EQ(p.stats().gpu_chunks, items);
    }
}

/// Out != In: one word per item, the sum of the item (launch_sum), in a wrapper type.
struct word_sum {
    u32 value;
};
using sum_pipe = pipeline<u32, word_sum>;

// In != Out with output_elements: each item's output is one element in the caller's output
// (adjacent one-word views), with and without chunk groups, graph mode off and on.
TEST_F(pipeline_gpu, views_carry_outputs_of_another_type_and_size) {
    const std::size_t item = 4096;
    const std::size_t n = item * 10 + 17; // 11 items
    const auto words = random_words(n, 1700);
    for (bool grouped : {false, true}) {
        for (bool graph : {false, true}) {
            SCOPED_TRACE(std::string(grouped ? "grouped" : "single") + (graph ? ", graph" : ""));
            pipeline_options o;
            o.chunk_elements = item;
            o.output_elements = 1;
            o.depth = 2;
            o.graph = graph;
            o.group_bytes = grouped ? 64_KiB : 0;
            o.chunk_timeout = 20s;
            sum_pipe p(o, {[](std::span<u32> in, std::span<word_sum> out, cudawait::stream_ref s) {
                           cudawait::check(cudawait::testing::launch_sum(
                                               in.data(), in.size(),
                                               reinterpret_cast<u32*>(out.data()), s.get()),
                                           "launch_sum");
                       }});
            pinned_buffer<u32> in(n);
            std::copy(words.begin(), words.end(), in.begin());
            pinned_buffer<word_sum> out(11);
            std::fill(out.begin(), out.end(), word_sum{0xdeadbeefu});
            cudawait::scheduler sched;
            const auto [produced, placed] = cudawait::sync_wait(
                sched, cudawait::when_all(produce_views<sum_pipe, u32, word_sum>(
                                              p, in.span(), out.span(), item, 1),
                                          take_views<sum_pipe, word_sum>(p, out.span(), 1)));
            (void)produced;
            EXPECT_EQ(placed, 11u);
            for (std::size_t c = 0; c < 11; ++c) {
                u32 sum = 0;
                for (std::size_t i = c * item; i < std::min(n, (c + 1) * item); ++i) {
                    sum += words[i];
                }
                EXPECT_EQ(out[c].value, sum) << "item " << c;
            }
        }
    }
}

// A view chunk that fails goes to the fallback with the caller's spans: its output lands in
// `out` (pinned or pageable), the result says so and points there; the chunks around it come
// from the GPU. Without groups (a stage failing on one call) and in a grouped run (the group
// fails: each of its chunks once).
TEST_F(pipeline_gpu, the_fallback_takes_a_failed_view_chunk_into_its_output) {
    const std::size_t item = 4096;
    const std::size_t n = item * 8;
    const auto words = random_words(n, 1800);
    const auto want = expected(words, item);
    for (bool grouped : {false, true}) {
        for (host_kind ko : {host_kind::pinned, host_kind::pageable}) {
            SCOPED_TRACE(std::string(grouped ? "grouped, " : "") + kind_name(ko));
            std::vector<std::size_t> fallback_calls;
            std::vector<const u32*> fallback_in;
            std::vector<u32*> fallback_out;
            pipeline_options o;
            o.chunk_elements = item;
            o.depth = 2;
            o.max_retries = 0;
            o.chunk_timeout = 20s;
            o.on_degrade = [](const cudawait::chunk_failure&) {};
            o.group_bytes = grouped ? 64_KiB : 0;
            auto failures = std::make_shared<int>(0);
            pipe_t::stage stage =
                grouped ? pipe_t::stage(failing_group_stage{5, failures})
                        : flaky_stage(std::make_shared<std::vector<int>>(std::vector<int>{5}),
                                      failures);
            pipe_t p(o, {stage}, [&](std::size_t c, std::span<const u32> a, std::span<u32> b) {
                fallback_calls.push_back(c);
                fallback_in.push_back(a.data());
                fallback_out.push_back(b.data());
                host_fallback(c, a, b);
            });
            pinned_buffer<u32> in(n);
            std::copy(words.begin(), words.end(), in.begin());
            host_words<> out(n, ko);
            std::fill(out.span().begin(), out.span().end(), 0xdeadbeefu);
            cudawait::scheduler sched;
            std::vector<int> outcome; // 1 GPU, 2 fallback, 0 wrong
            cudawait::sync_wait(sched, [&]() -> cudawait::task<void> {
                for (std::size_t i = 0; i < 8; ++i) {
                    auto slot = co_await p.acquire();
                    p.submit(std::move(slot), in.span().subspan(i * item, item),
                             out.span().subspan(i * item, item));
                    if (i % 2 == 1) { // two at a time: the slots come back
                        for (std::size_t k = i - 1; k <= i; ++k) {
                            auto r = co_await p.next(20s);
                            const bool right = r && r->chunk() == k &&
                                               r->data().data() == out.span().data() + k * item;
                            outcome.push_back(!right ? 0 : r->by_fallback() ? 2 : 1);
                        }
                    }
                }
                p.close();
                EXPECT_FALSE(co_await p.next(20s));
            }());
            // Items go two at a time, so the runs are {0, 1}, {2, 3}, ...: the group stage fails
            // the run {4, 5}, the per-chunk stage chunk 5.
            const std::vector<int> g = {1, 1, 1, 1, 2, 2, 1, 1};
            const std::vector<int> s = {1, 1, 1, 1, 1, 2, 1, 1};
            EXPECT_EQ(outcome, grouped ? g : s);
            const std::vector<std::size_t> calls =
                grouped ? std::vector<std::size_t>{4, 5} : std::vector<std::size_t>{5};
            EXPECT_EQ(fallback_calls, calls);
            for (std::size_t j = 0; j < fallback_calls.size(); ++j) {
                EXPECT_EQ(fallback_in[j], in.data() + fallback_calls[j] * item);
                EXPECT_EQ(fallback_out[j], out.span().data() + fallback_calls[j] * item);
            }
            EXPECT_EQ(first_mismatch(out.copy(), want), n);
            EXPECT_EQ(p.stats().fallback_chunks, calls.size());
            EXPECT_EQ(p.stats().gpu_chunks, 8 - calls.size());
        }
    }
}

// Bad views are usage errors and leave the slot the caller's: a mis-sized, null or device
// output, an empty, null, too long or device input, an empty slot, and after close(); the slot
// then still submits a right chunk.
TEST_F(pipeline_gpu, bad_views_are_usage_errors_and_the_slot_stays_usable) {
    const std::size_t item = 4096;
    pipeline_options o;
    o.chunk_elements = item;
    o.depth = 2;
    o.chunk_timeout = 20s;
    pipe_t p(o, {transform_stage()});
    const auto words = random_words(item + 1, 1900);
    pinned_buffer<u32> in(item + 1);
    std::copy(words.begin(), words.end(), in.begin());
    pinned_buffer<u32> out(item + 1);
    std::fill(out.begin(), out.end(), 0xdeadbeefu);
    cudawait::stream alloc(cudawait::device_ref(0));
    cudawait::device_buffer<u32> dev(item, alloc);
    alloc.sync();
    const std::span<const u32> good_in = in.span().first(item);
    const std::span<u32> good_out = out.span().first(item);
    cudawait::scheduler sched;
    cudawait::sync_wait(sched, [&]() -> cudawait::task<void> {
        auto slot = co_await p.acquire();
        EXPECT_THROW(p.submit(std::move(slot), good_in, out.span().first(item - 1)), usage_error);
        EXPECT_THROW(p.submit(std::move(slot), good_in, out.span()), usage_error) << "mis-sized";
        EXPECT_THROW(p.submit(std::move(slot), good_in, std::span<u32>()), usage_error);
        EXPECT_THROW(p.submit(std::move(slot), in.span().first(0), out.span().first(0)),
                     usage_error)
            << "empty";
        EXPECT_THROW(p.submit(std::move(slot), std::span<const u32>(), good_out), usage_error);
        EXPECT_THROW(p.submit(std::move(slot), in.span(), out.span()), usage_error)
            << "longer than a chunk";
        EXPECT_THROW(p.submit(std::move(slot), good_in, dev.span()), usage_error) << "device";
        EXPECT_THROW(p.submit(std::move(slot), std::span<const u32>(dev.span()), good_out),
                     usage_error);
        pipe_t::input_slot empty;
        EXPECT_THROW(p.submit(std::move(empty), good_in, good_out), usage_error);
        // Still the caller's: a right chunk goes through.
        p.submit(std::move(slot), good_in, good_out);
        auto r = co_await p.next(20s);
        const std::vector<u32> first(words.begin(), words.begin() + item);
        EXPECT_TRUE(r && r->data().data() == out.data() && transformed_right(r->data(), first));
        auto late = co_await p.acquire();
        p.close();
        EXPECT_THROW(p.submit(std::move(late), good_in, good_out), usage_error) << "closed";
        EXPECT_NO_THROW((void)late.data()) << "the slot is still the caller's after close()";
        r.reset();
        late = pipe_t::input_slot();
        EXPECT_FALSE(co_await p.next(20s));
    }());
    EXPECT_EQ(out[item], 0xdeadbeefu) << "nothing written past the view";
    EXPECT_EQ(p.stats().gpu_chunks, 1u);
}

} // namespace
