// SPDX-License-Identifier: Apache-2.0
// How far a pipeline feeds the GPU ahead of the host, against the fake CUDA runtime
// (tests/support/fake_cuda.hpp): with the D2H stream held back no chunk completes, so whatever was
// enqueued by then was enqueued without the host seeing a completion. A batch over pinned ranges
// runs ahead by runahead_factor x depth chunks, a staged (pageable) batch by one chunk per slot,
// streaming enqueues each chunk at submit(). Where running ahead meets the recovery rules: a
// failed enqueue drains what is ahead and retries with one slot fewer; a chunk that times out past
// its retries fails with every chunk enqueued ahead of the host (their copies may still land),
// and the rest go to the fallback. Runs under AddressSanitizer and ThreadSanitizer in CI.
#include <cudawait/core/poll_policy.hpp>
#include <cudawait/core/scheduler.hpp>
#include <cudawait/core/sync_wait.hpp>
#include <cudawait/core/task.hpp>
#include <cudawait/memory/pinned_buffer.hpp>
#include <cudawait/pipeline/pipeline.hpp>
#include <cudawait/runtime/error.hpp>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <thread>
#include <vector>

#include <cuda_runtime_api.h>

#include "fake_cuda.hpp"
#include "random_words.hpp"
#include <gtest/gtest.h>

namespace {

using namespace std::chrono_literals;
using cudawait::pinned_buffer;
using cudawait::poll_policy;
using cudawait::scheduler;
using cudawait::sync_wait;
using cudawait::task;
using cudawait::testing::random_words;
using u32 = std::uint32_t;
namespace fake = cudawait::fake_cuda;

constexpr u32 poison = 0xdeadbeefu;
constexpr std::size_t kChunk = 1000;

/// What the batch driver keeps in flight with pinned host ranges, per slot (detail/slots.hpp).
constexpr std::size_t kRunahead = 4;

class runahead : public ::testing::Test {
protected:
    void SetUp() override { fake::reset(); }
    void TearDown() override {
        fake::release_all();
        fake::reset();
    }
};

/// A host function whose address the stage launches as its kernel.
void stage_kernel() {}

u32 transform(u32 x, std::size_t i) { return x * 2654435761u + static_cast<u32>(i) + 0x5eed; }

/// The stage's result for `in`, in chunks of kChunk (the index restarts in each chunk).
std::vector<u32> expected(std::span<const u32> in) {
    std::vector<u32> out(in.size());
    for (std::size_t i = 0; i < in.size(); ++i) {
        out[i] = transform(in[i], i % kChunk);
    }
    return out;
}

/// The stage: launches its kernel on the chunk's stream and computes the chunk. The fake's
/// device memory is host memory and its copies are made when enqueued, so the input is in `in`
/// now and what goes to `out` leaves with the D2H copy enqueued after the stage. `calls` counts
/// the chunks enqueued; `fail_chunk`'s first launch fails (a launch error, not sticky).
struct counting_stage {
    std::shared_ptr<std::vector<std::size_t>> calls = std::make_shared<std::vector<std::size_t>>();
    std::size_t fail_chunk = static_cast<std::size_t>(-1);

    void operator()(std::span<u32> in, std::span<u32> out,
                    const cudawait::stage_context& ctx) const {
        const bool fail =
            ctx.chunk == fail_chunk && std::count(calls->begin(), calls->end(), ctx.chunk) == 0;
        calls->push_back(ctx.chunk);
        if (fail) {
            fake::fail_next("cudaLaunchKernel", cudaErrorLaunchOutOfResources);
        }
        cudawait::check(cudaLaunchKernel(reinterpret_cast<const void*>(&stage_kernel), dim3(1),
                                         dim3(1), nullptr, 0, ctx.stream.get()),
                        "cudaLaunchKernel");
        for (std::size_t i = 0; i < in.size(); ++i) {
            out[i] = transform(in[i], i);
        }
    }
};

/// Options of one chunk per flight (no chunk groups, which small chunks get by default): how
/// far ahead is counted in chunks.
cudawait::pipeline_options options(unsigned depth) {
    cudawait::pipeline_options o;
    o.chunk_elements = kChunk;
    o.depth = depth;
    o.memory.group_bytes = 0;
    o.recovery.on_degrade = [](const cudawait::chunk_failure&) {};
    return o;
}

/// Polls `sched` until nothing happens for 20 ms (staging workers may still be filling rings).
void poll_until_quiet(scheduler& sched) {
    auto quiet_since = std::chrono::steady_clock::now();
    while (std::chrono::steady_clock::now() - quiet_since < 20ms) {
        if (sched.poll()) {
            quiet_since = std::chrono::steady_clock::now();
        } else {
            std::this_thread::sleep_for(100us);
        }
    }
}

/// Runs `in` through `pipe` into `out`, then sets `finished`.
task<void> run_batch(cudawait::pipeline<u32>& pipe, std::span<const u32> in, std::span<u32> out,
                     bool& finished) {
    co_await pipe.run(in, out);
    finished = true;
}

// ---- how far ahead ------------------------------------------------------------------------------

// A batch over pinned ranges: with no chunk completing, the host enqueued runahead x depth chunks
// (stage, copies and events) from its first turn, without seeing one completion; released, the
// batch finishes every chunk right.
TEST_F(runahead, a_pinned_batch_enqueues_runahead_times_depth_chunks_before_one_completes) {
    for (unsigned depth : {1u, 2u, 3u}) {
        SCOPED_TRACE(::testing::Message() << "depth " << depth);
        counting_stage st;
        cudawait::pipeline<u32> p(options(depth), {st});
        const std::size_t chunks = kRunahead * depth * 2 + 3;
        const std::size_t n = chunks * kChunk - 17;
        const auto in = random_words(n, depth);
        pinned_buffer<u32> pin(n);
        pinned_buffer<u32> pout(n);
        std::copy(in.begin(), in.end(), pin.begin());
        std::fill(pout.begin(), pout.end(), poison);
        fake::hang(p.d2h_stream().get());
        scheduler sched(poll_policy::yielding());
        bool done = false;
        sched.spawn(run_batch(p, pin.span(), pout.span(), done));
        poll_until_quiet(sched);
        EXPECT_FALSE(done);
        EXPECT_EQ(st.calls->size(), kRunahead * depth) << "chunks enqueued before a completion";
        fake::release(p.d2h_stream().get());
        sched.run();
        EXPECT_TRUE(done);
        const auto want = expected(in);
        EXPECT_TRUE(std::equal(want.begin(), want.end(), pout.begin(), pout.end()));
        EXPECT_EQ(p.stats().gpu_chunks, chunks);
        EXPECT_EQ(st.calls->size(), chunks);
    }
}

// A batch over pageable ranges is staged through pinned rings: one chunk per slot is in flight,
// and the rest wait for a completion.
TEST_F(runahead, a_pageable_batch_keeps_one_chunk_per_slot_in_flight) {
    const unsigned depth = 2;
    counting_stage st;
    cudawait::pipeline<u32> p(options(depth), {st});
    const std::size_t chunks = 9;
    const std::size_t n = chunks * kChunk;
    const auto in = random_words(n, 7);
    std::vector<u32> out(n, poison);
    fake::hang(p.d2h_stream().get());
    scheduler sched(poll_policy::yielding());
    bool done = false;
    sched.spawn(run_batch(p, in, out, done));
    poll_until_quiet(sched);
    EXPECT_FALSE(done);
    EXPECT_EQ(st.calls->size(), depth) << "chunks enqueued before a completion";
    fake::release(p.d2h_stream().get());
    sched.run();
    EXPECT_TRUE(done);
    EXPECT_TRUE(out == expected(in));
    EXPECT_EQ(p.stats().gpu_chunks, chunks);
}

// Streaming: each chunk is enqueued when it is submitted, whether next() was called or not; with
// no chunk completing, the producer gets `depth` slots (a slot serves it again once its result
// was taken), and the results come in order once the GPU completes them.
TEST_F(runahead, streaming_enqueues_each_chunk_at_submit) {
    const unsigned depth = 3;
    counting_stage st;
    cudawait::pipeline<u32> p(options(depth), {st});
    fake::hang(p.d2h_stream().get());
    scheduler sched(poll_policy::yielding());
    std::vector<std::vector<u32>> items;
    for (std::size_t i = 0; i < depth; ++i) {
        items.push_back(random_words(kChunk - 3 * i, 40 + i));
    }
    bool refused = false;
    sync_wait(sched,
              [](cudawait::pipeline<u32>& pipe, const std::vector<std::vector<u32>>& it,
                 const counting_stage& stage, bool& busy) -> task<void> {
                  for (std::size_t i = 0; i < it.size(); ++i) {
                      auto slot = co_await pipe.acquire();
                      std::fill(slot.data().begin(), slot.data().end(), poison);
                      std::copy(it[i].begin(), it[i].end(), slot.data().begin());
                      pipe.submit(std::move(slot), it[i].size());
                      EXPECT_EQ(stage.calls->size(), i + 1)
                          << "chunk " << i << " not enqueued at submit";
                  }
                  try {
                      auto more = co_await pipe.acquire(0ms);
                  } catch (const cudawait::timeout_error&) {
                      busy = true;
                  }
                  pipe.close();
              }(p, items, st, refused));
    EXPECT_TRUE(refused) << "a slot beyond depth while no chunk completed";
    fake::release(p.d2h_stream().get());
    std::size_t right = 0;
    std::size_t taken = 0;
    sync_wait(sched,
              [](cudawait::pipeline<u32>& pipe, const std::vector<std::vector<u32>>& it,
                 std::size_t& ok, std::size_t& count) -> task<void> {
                  while (auto r = co_await pipe.next()) {
                      if (count < it.size()) {
                          const auto want = expected(it[count]);
                          ok += std::equal(want.begin(), want.end(), r->data().begin(),
                                           r->data().end());
                      }
                      ++count;
                  }
              }(p, items, right, taken));
    EXPECT_EQ(taken, items.size());
    EXPECT_EQ(right, items.size());
}

// ---- running ahead and the recovery rules ----------------------------------------------------

// A launch that fails while chunks are enqueued ahead: what is ahead is drained, the chunk is
// retried with one slot fewer, and every chunk is produced by the GPU, right, in place.
TEST_F(runahead, a_failed_enqueue_drains_what_is_ahead_and_retries_with_one_slot_fewer) {
    const unsigned depth = 3;
    counting_stage st;
    st.fail_chunk = 5;
    std::vector<cudawait::chunk_failure> records;
    cudawait::pipeline_options o = options(depth);
    o.recovery.on_degrade = [&](const cudawait::chunk_failure& f) { records.push_back(f); };
    cudawait::pipeline<u32> p(o, {st});
    const std::size_t chunks = 20;
    const std::size_t n = chunks * kChunk;
    const auto in = random_words(n, 11);
    pinned_buffer<u32> pin(n);
    pinned_buffer<u32> pout(n);
    std::copy(in.begin(), in.end(), pin.begin());
    std::fill(pout.begin(), pout.end(), poison);
    scheduler sched(poll_policy::yielding());
    EXPECT_NO_THROW(sync_wait(sched, p.run(pin.span(), pout.span())));
    const auto want = expected(in);
    EXPECT_TRUE(std::equal(want.begin(), want.end(), pout.begin(), pout.end()));
    EXPECT_EQ(p.stats().gpu_chunks, chunks);
    EXPECT_EQ(p.stats().fallback_chunks + p.stats().failed_chunks, 0u);
    ASSERT_EQ(records.size(), 1u);
    EXPECT_EQ(records[0].chunk, 5u);
    EXPECT_EQ(records[0].level, cudawait::degrade_level::retry);
    EXPECT_EQ(records[0].action, cudawait::degrade_action::retried_with_less_depth);
    EXPECT_EQ(records[0].depth, depth - 1);
    EXPECT_EQ(st.calls->size(), chunks + 1) << "chunk 5 called twice, the others once";
}

// A chunk that never completes times out, is waited for again, and past its retries fails with
// every chunk enqueued ahead of the host: their copies may still land, so the fallback writes
// none of them. The chunks not yet enqueued go to the fallback, and run() reports the failed ones.
TEST_F(runahead, a_chunk_timed_out_past_its_retries_fails_with_the_chunks_enqueued_ahead) {
    const unsigned depth = 2;
    counting_stage st;
    std::vector<cudawait::chunk_failure> records;
    cudawait::pipeline_options o = options(depth);
    o.recovery.chunk_timeout = 20ms;
    o.recovery.max_retries = 1;
    o.recovery.on_degrade = [&](const cudawait::chunk_failure& f) { records.push_back(f); };
    const std::size_t chunks = 15;
    const std::size_t n = chunks * kChunk;
    const auto in = random_words(n, 13);
    const auto want = expected(in);
    std::vector<std::size_t> fallback_chunks;
    cudawait::pipeline<u32> p(o, {st},
                              [&](std::size_t c, std::span<const u32> ci, std::span<u32> co) {
                                  fallback_chunks.push_back(c);
                                  for (std::size_t i = 0; i < ci.size(); ++i) {
                                      co[i] = transform(ci[i], i);
                                  }
                              });
    pinned_buffer<u32> pin(n);
    pinned_buffer<u32> pout(n);
    std::copy(in.begin(), in.end(), pin.begin());
    std::fill(pout.begin(), pout.end(), poison);
    fake::hang(p.d2h_stream().get());
    scheduler sched(poll_policy::yielding());
    std::vector<std::size_t> failed;
    try {
        sync_wait(sched, p.run(pin.span(), pout.span()));
        ADD_FAILURE() << "run() returned with chunks that never completed";
    } catch (const cudawait::pipeline_error& e) {
        failed = e.failed();
    }
    fake::release(p.d2h_stream().get());
    const std::size_t ahead = kRunahead * depth;
    std::vector<std::size_t> first(ahead);
    for (std::size_t c = 0; c < ahead; ++c) {
        first[c] = c;
    }
    EXPECT_EQ(failed, first);
    EXPECT_EQ(p.stats().failed_chunks, ahead);
    EXPECT_EQ(p.stats().fallback_chunks, chunks - ahead);
    EXPECT_EQ(p.stats().gpu_chunks, 0u);
    ASSERT_EQ(fallback_chunks.size(), chunks - ahead);
    for (std::size_t i = 0; i < fallback_chunks.size(); ++i) {
        EXPECT_EQ(fallback_chunks[i], ahead + i);
    }
    // The fallback's chunks are right; the failed ones are the GPU's to write.
    EXPECT_TRUE(std::equal(want.begin() + ahead * kChunk, want.end(), pout.begin() + ahead * kChunk,
                           pout.end()));
    EXPECT_EQ(st.calls->size(), ahead) << "a chunk enqueued after the GPU was given up";
    // One wait again (retry), then a give-up per chunk in flight.
    ASSERT_EQ(records.size(), 1 + ahead);
    EXPECT_EQ(records[0].chunk, 0u);
    EXPECT_EQ(records[0].action, cudawait::degrade_action::waited_again);
    for (std::size_t i = 1; i < records.size(); ++i) {
        EXPECT_EQ(records[i].level, cudawait::degrade_level::give_up);
        EXPECT_EQ(records[i].action, cudawait::degrade_action::failed_timed_out);
        EXPECT_EQ(records[i].chunk, i - 1);
    }
}

} // namespace
