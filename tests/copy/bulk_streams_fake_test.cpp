// SPDX-License-Identifier: Apache-2.0
// detail/bulk_streams.hpp on the fake CUDA runtime: a pipeline's D2H work is seen once its chunk
// is enqueued. (On a GPU: tests/copy/copy_lane_test.cpp.) The registry and the small-copy kernel's
// loading are process-wide, and the test needs the pipeline's streams to be the only ones
// registered for device 0: this program has one test.
#include <cudawait/copy/detail/bulk_streams.hpp>
#include <cudawait/core/scheduler.hpp>
#include <cudawait/core/sync_wait.hpp>
#include <cudawait/core/task.hpp>
#include <cudawait/core/when_all.hpp>
#include <cudawait/memory/pinned_buffer.hpp>
#include <cudawait/pipeline/pipeline.hpp>
#include <cudawait/runtime/stream.hpp>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <random>
#include <span>
#include <vector>

#include <cuda_runtime_api.h>

#include "fake_cuda.hpp"
#include <gtest/gtest.h>

namespace {

namespace fake = cudawait::fake_cuda;
using cudawait::detail::bulk_streams;
using u32 = std::uint32_t;

u32 transform(u32 x, std::size_t i) { return x * 2654435761u + static_cast<u32>(i) + 0x3d15; }

// A pipeline notes a chunk's work once the chunk is enqueued. Its stage asks whether device 0's
// bulk D2H streams are busy while the chunk is being enqueued, before its D2H is: they are idle,
// and that answer is kept for the work count seen. The stage then hangs the chunk's stream, so
// the D2H enqueued after it waits there, pending. Asked once the enqueue is over, pending() must
// see that D2H. When the pipeline bumped its work count at the start of the enqueue, the idle
// answer kept from inside the enqueue stood, and pending() said false: the chunk's D2H went
// unseen until the next chunk's enqueue.
TEST(bulk_streams_fake, a_chunk_s_d2h_is_seen_once_the_chunk_is_enqueued) {
    fake::reset();
    bulk_streams& registry = bulk_streams::instance();
    ASSERT_EQ(registry.count(0), 0u);
    const std::size_t chunk = 1 << 12;
    cudawait::pipeline_options o;
    o.depth = 2;
    o.chunk_elements = chunk;
    bool asked_in_stage = false;
    bool pending_in_stage = true;
    cudaStream_t held = nullptr;
    // The fake's device memory is host memory and its copies are made when enqueued: the chunk's
    // input is in `in` when the stage is called, and what it writes to `out` goes out with the
    // D2H enqueued after it.
    cudawait::pipeline<u32> pipe(
        o, {[&](std::span<u32> in, std::span<u32> out, cudawait::stream_ref st) {
            pending_in_stage = registry.pending(0);
            asked_in_stage = true;
            for (std::size_t i = 0; i < in.size(); ++i) {
                out[i] = transform(in[i], i);
            }
            held = st.get();
            fake::hang(held); // the chunk's stream stays busy, and the D2H after it waits
        }});
    ASSERT_EQ(registry.count(0), 1u) << "the pipeline's D2H stream is not registered";

    std::mt19937_64 rng(20261205);
    cudawait::pinned_buffer<u32> in(chunk);
    cudawait::pinned_buffer<u32> out(chunk);
    std::vector<u32> want(chunk);
    for (std::size_t i = 0; i < chunk; ++i) {
        in.data()[i] = static_cast<u32>(rng());
        want[i] = transform(in.data()[i], i);
    }
    std::fill(out.data(), out.data() + chunk, 0xdeadbeefu);
    cudawait::scheduler sched;
    bool pending_after = false;
    auto ask = [&]() -> cudawait::task<void> {
        // The stage runs inside the chunk's enqueue, on this thread: once it has run and this
        // coroutine runs again, the enqueue is over.
        const auto limit = std::chrono::steady_clock::now() + std::chrono::seconds(10);
        while (!asked_in_stage && std::chrono::steady_clock::now() < limit) {
            co_await sched.schedule();
        }
        struct release_at_exit {
            const cudaStream_t& s;
            ~release_at_exit() {
                if (s != nullptr) {
                    fake::release(s); // lets the chunk complete, however this ends
                }
            }
        } release{held};
        pending_after = registry.pending(0);
    };
    EXPECT_NO_THROW(cudawait::sync_wait(
        sched, cudawait::when_all(pipe.run(std::span<const u32>(in.data(), chunk),
                                           std::span<u32>(out.data(), chunk)),
                                  ask())));
    ASSERT_TRUE(asked_in_stage) << "the stage was not called";
    EXPECT_FALSE(pending_in_stage) << "no bulk D2H work was pending yet";
    EXPECT_TRUE(pending_after) << "the chunk's D2H, enqueued and held, was not seen";
    EXPECT_TRUE(std::equal(want.begin(), want.end(), out.data())) << "the chunk's output";
    EXPECT_FALSE(registry.pending(0)) << "all done";
}

} // namespace
