// SPDX-License-Identifier: Apache-2.0
// Chunk groups the pipeline chooses (memory.group_bytes unset), against the fake CUDA runtime
// (tests/support/fake_cuda.hpp): which groups and graph mode small and large chunks get, that an
// explicit setting wins, that a batch and a stream in such groups still call a per-chunk stage
// once per chunk with its own context and give every chunk its own result, and that a group
// whose enqueue keeps failing is retried chunk by chunk, so that only the chunk that fails alone
// goes to the fallback, reported as itself. Runs under AddressSanitizer and ThreadSanitizer in CI.
#include <cudawait/core/poll_policy.hpp>
#include <cudawait/core/scheduler.hpp>
#include <cudawait/core/sync_wait.hpp>
#include <cudawait/core/task.hpp>
#include <cudawait/core/when_all.hpp>
#include <cudawait/memory/pinned_buffer.hpp>
#include <cudawait/pipeline/pipeline.hpp>
#include <cudawait/runtime/error.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include <cuda_runtime_api.h>

#include "fake_cuda.hpp"
#include "random_words.hpp"
#include <gtest/gtest.h>

namespace {

using cudawait::pinned_buffer;
using cudawait::pipeline_options;
using cudawait::poll_policy;
using cudawait::scheduler;
using cudawait::sync_wait;
using cudawait::task;
using cudawait::testing::random_words;
using u32 = std::uint32_t;
using pipe_t = cudawait::pipeline<u32>;
namespace fake = cudawait::fake_cuda;

constexpr u32 poison = 0xdeadbeefu;
constexpr std::size_t kChunk = 1000; ///< 4000 bytes: groups of max_group_chunks by default
constexpr std::size_t kNone = static_cast<std::size_t>(-1);

class groups : public ::testing::Test {
protected:
    void SetUp() override { fake::reset(); }
    void TearDown() override {
        fake::release_all();
        fake::reset();
    }
};

/// A host function whose address the stage launches as its kernel.
void stage_kernel() {}

/// Element i of chunk c: depends on the chunk, so a stage called with another chunk's context
/// computes a wrong result.
u32 transform(u32 x, std::size_t chunk, std::size_t i) {
    return x * 2654435761u + static_cast<u32>(i) + static_cast<u32>(chunk) * 40503u + 0x5eed;
}

/// What the stage (or the fallback) makes of `in`, in chunks of kChunk.
std::vector<u32> expected(std::span<const u32> in) {
    std::vector<u32> out(in.size());
    for (std::size_t i = 0; i < in.size(); ++i) {
        out[i] = transform(in[i], i / kChunk, i % kChunk);
    }
    return out;
}

/// A per-chunk stage: launches its kernel on the chunk's stream and computes the chunk (the
/// fake's device memory is host memory, its copies made when enqueued). `calls` lists the
/// chunks it was called for; every launch for chunk `bad` fails (a launch error, not sticky).
struct chunk_stage {
    std::shared_ptr<std::vector<std::size_t>> calls = std::make_shared<std::vector<std::size_t>>();
    std::size_t bad = kNone;

    void operator()(std::span<u32> in, std::span<u32> out,
                    const cudawait::stage_context& ctx) const {
        calls->push_back(ctx.chunk);
        if (ctx.chunk == bad) {
            fake::fail_next("cudaLaunchKernel", cudaErrorLaunchOutOfResources);
        }
        cudawait::check(cudaLaunchKernel(reinterpret_cast<const void*>(&stage_kernel), dim3(1),
                                         dim3(1), nullptr, 0, ctx.stream.get()),
                        "cudaLaunchKernel");
        for (std::size_t i = 0; i < in.size(); ++i) {
            out[i] = transform(in[i], ctx.chunk, i);
        }
    }
};

pipeline_options options(std::size_t chunk_elements = kChunk) {
    pipeline_options o;
    o.chunk_elements = chunk_elements;
    return o;
}

TEST_F(groups, small_chunks_are_grouped_by_default_and_an_explicit_setting_wins) {
    constexpr std::size_t group = pipeline_options::default_group_bytes;
    {
        pipe_t p(options(), {chunk_stage{}});
        EXPECT_EQ(p.options().memory.group_bytes, group);
        EXPECT_FALSE(p.options().graph) << "graph replay for a stage not marked replayable";
    }
    {
        pipe_t p(options(), {cudawait::replayable(chunk_stage{})});
        EXPECT_EQ(p.options().memory.group_bytes, group);
        EXPECT_TRUE(p.options().graph) << "no graph replay for a replayable stage";
    }
    {
        pipe_t p(options(), {cudawait::replayable(chunk_stage{}), chunk_stage{}});
        EXPECT_FALSE(p.options().graph) << "graph replay with a stage not marked replayable";
    }
    {
        pipeline_options o = options();
        o.memory.group_bytes = 0;
        pipe_t p(o, {cudawait::replayable(chunk_stage{})});
        EXPECT_EQ(p.options().memory.group_bytes, 0u);
        EXPECT_FALSE(p.options().graph);
    }
    {
        pipeline_options o = options();
        o.memory.group_bytes = 64 * kChunk * sizeof(u32);
        pipe_t p(o, {chunk_stage{}});
        EXPECT_EQ(p.options().memory.group_bytes, 64 * kChunk * sizeof(u32));
    }
    // A chunk of half a group is grouped in twos; a larger one is not grouped.
    {
        pipe_t p(options(group / 2 / sizeof(u32)), {cudawait::replayable(chunk_stage{})});
        EXPECT_EQ(p.options().memory.group_bytes, group);
        EXPECT_TRUE(p.options().graph);
    }
    {
        pipe_t p(options(group / 2 / sizeof(u32) + 1), {cudawait::replayable(chunk_stage{})});
        EXPECT_EQ(p.options().memory.group_bytes, 0u);
        EXPECT_FALSE(p.options().graph) << "graph replay chosen for a chunk that is not grouped";
    }
    // An empty stage is still refused.
    EXPECT_THROW(
        pipe_t(options(),
               {cudawait::replayable(
                   std::function<void(std::span<u32>, std::span<u32>, cudawait::stream_ref)>{})}),
        cudawait::usage_error);
}

TEST_F(groups, a_batch_in_default_groups_calls_the_stage_once_per_chunk_with_its_context) {
    chunk_stage st;
    pipe_t p(options(), {st});
    const std::size_t chunks = 2 * pipeline_options::max_group_chunks + 88;
    const std::size_t n = chunks * kChunk - 17;
    const auto in = random_words(n, 3);
    pinned_buffer<u32> pin(n);
    pinned_buffer<u32> pout(n);
    std::copy(in.begin(), in.end(), pin.begin());
    std::fill(pout.begin(), pout.end(), poison);
    const std::size_t copies0 = fake::calls("cudaMemcpyAsync");
    scheduler sched(poll_policy::yielding());
    sync_wait(sched, p.run(pin.span(), pout.span()));
    const auto want = expected(in);
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < n; ++i) {
        wrong += pout[i] != want[i];
    }
    EXPECT_EQ(wrong, 0u) << "elements wrong";
    std::vector<std::size_t> order(chunks);
    for (std::size_t c = 0; c < chunks; ++c) {
        order[c] = c;
    }
    EXPECT_EQ(*st.calls, order) << "the stage is called once per chunk, in order";
    EXPECT_EQ(p.stats().chunks, chunks);
    EXPECT_EQ(p.stats().gpu_chunks, chunks);
    EXPECT_EQ(fake::calls("cudaMemcpyAsync") - copies0, 2u * 3u)
        << "one copy each way per group of max_group_chunks chunks";
}

TEST_F(groups, a_group_whose_enqueue_keeps_failing_hands_only_the_failing_chunk_to_the_fallback) {
    chunk_stage st;
    st.bad = pipeline_options::max_group_chunks + 44; // in the second group
    std::vector<cudawait::chunk_failure> records;
    pipeline_options o = options();
    o.recovery.on_degrade = [&](const cudawait::chunk_failure& f) { records.push_back(f); };
    std::vector<std::size_t> by_fallback;
    pipe_t p(o, {st}, [&](std::size_t c, std::span<const u32> in, std::span<u32> out) {
        by_fallback.push_back(c);
        for (std::size_t i = 0; i < in.size(); ++i) {
            out[i] = transform(in[i], c, i);
        }
    });
    const std::size_t chunks = 3 * pipeline_options::max_group_chunks;
    const std::size_t n = chunks * kChunk;
    const auto in = random_words(n, 5);
    pinned_buffer<u32> pin(n);
    pinned_buffer<u32> pout(n);
    std::copy(in.begin(), in.end(), pin.begin());
    std::fill(pout.begin(), pout.end(), poison);
    scheduler sched(poll_policy::yielding());
    EXPECT_NO_THROW(sync_wait(sched, p.run(pin.span(), pout.span())));
    const auto want = expected(in);
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < n; ++i) {
        wrong += pout[i] != want[i];
    }
    EXPECT_EQ(wrong, 0u) << "elements wrong";
    EXPECT_EQ(by_fallback, std::vector<std::size_t>{st.bad});
    EXPECT_EQ(p.stats().fallback_chunks, 1u);
    EXPECT_EQ(p.stats().gpu_chunks, chunks - 1);
    ASSERT_FALSE(records.empty());
    std::size_t give_ups = 0;
    for (const cudawait::chunk_failure& f : records) {
        if (f.level == cudawait::degrade_level::give_up) {
            ++give_ups;
            EXPECT_EQ(f.chunk, st.bad);
            EXPECT_EQ(f.chunks, 1u);
            EXPECT_EQ(f.action, cudawait::degrade_action::fallback);
        }
    }
    EXPECT_EQ(give_ups, 1u);
    EXPECT_EQ(records.front().chunk, pipeline_options::max_group_chunks)
        << "the first retries are the group's";
    EXPECT_EQ(records.front().chunks, pipeline_options::max_group_chunks);
}

// Streaming with default options: items submitted one after another go to the GPU in runs, and
// still come back one result per item, in order, each computed with its own chunk's context.
TEST_F(groups, streaming_in_default_groups_returns_each_item_in_order) {
    chunk_stage st;
    pipe_t p(options(), {st});
    EXPECT_EQ(p.options().memory.group_bytes, pipeline_options::default_group_bytes);
    constexpr std::size_t kItems = 600;
    std::vector<std::vector<u32>> items;
    for (std::size_t i = 0; i < kItems; ++i) {
        items.push_back(random_words(kChunk - (i % 7 == 6 ? 5 : 0), 100 + i));
    }
    scheduler sched(poll_policy::yielding());
    std::size_t taken = 0;
    std::size_t right = 0;
    auto produce = [](pipe_t& pipe, const std::vector<std::vector<u32>>& it) -> task<void> {
        for (const auto& item : it) {
            auto slot = co_await pipe.acquire();
            std::fill(slot.data().begin(), slot.data().end(), poison);
            std::copy(item.begin(), item.end(), slot.data().begin());
            pipe.submit(std::move(slot), item.size());
        }
        pipe.close();
    };
    auto consume = [](pipe_t& pipe, const std::vector<std::vector<u32>>& it, std::size_t& ok,
                      std::size_t& count) -> task<void> {
        while (auto r = co_await pipe.next()) {
            if (count < it.size() && r->data().size() == it[count].size()) {
                bool same = true;
                for (std::size_t i = 0; i < it[count].size(); ++i) {
                    same = same && r->data()[i] == transform(it[count][i], count, i);
                }
                ok += same;
            }
            ++count;
        }
    };
    sync_wait(sched, cudawait::when_all(produce(p, items), consume(p, items, right, taken)));
    EXPECT_EQ(taken, kItems);
    EXPECT_EQ(right, kItems);
    EXPECT_EQ(*st.calls, [] {
        std::vector<std::size_t> v(kItems);
        for (std::size_t i = 0; i < kItems; ++i) {
            v[i] = i;
        }
        return v;
    }());
}

} // namespace
