// SPDX-License-Identifier: Apache-2.0
#include <cudawait/memory/device_buffer.hpp>
#include <cudawait/memory/pinned_buffer.hpp>
#include <cudawait/runtime/device.hpp>
#include <cudawait/runtime/error.hpp>
#include <cudawait/runtime/graph.hpp>
#include <cudawait/runtime/stream.hpp>

#include <algorithm>
#include <cstdint>
#include <random>
#include <stdexcept>
#include <type_traits>
#include <utility>
#include <vector>

#include <cuda_runtime.h>

#include "gpu_fixture.hpp"
#include "random_words.hpp"
#include "test_kernels.hpp"
#include <gtest/gtest.h>

namespace {

using cudawait::check;
using cudawait::graph;
using cudawait::graph_exec;
using cudawait::usage_error;
using u32 = std::uint32_t;

static_assert(!std::is_copy_constructible_v<graph> && !std::is_copy_assignable_v<graph>);
static_assert(!std::is_copy_constructible_v<graph_exec> && !std::is_copy_assignable_v<graph_exec>);
static_assert(std::is_nothrow_move_constructible_v<graph> &&
              std::is_nothrow_move_assignable_v<graph>);
static_assert(std::is_nothrow_move_constructible_v<graph_exec> &&
              std::is_nothrow_move_assignable_v<graph_exec>);

// ---- without a GPU: empty owners, moves and adoption make no CUDA call ------------------------

TEST(graph, an_empty_graph_throws_usage_error_on_use) {
    graph g;
    EXPECT_FALSE(static_cast<bool>(g));
    EXPECT_THROW((void)g.get(), usage_error);
    EXPECT_THROW((void)g.instantiate(), usage_error);
    u32 a = 0;
    u32 b = 0;
    EXPECT_THROW((void)g.add_memcpy_1d(&a, &b, sizeof a, cudaMemcpyHostToHost), usage_error);
    EXPECT_THROW((void)g.add_child(graph{}), usage_error);
    EXPECT_EQ(g.release(), nullptr);
    EXPECT_THROW((void)graph::from_native_handle(nullptr), usage_error);
}

TEST(graph, an_empty_graph_exec_throws_usage_error_on_use) {
    graph_exec e;
    EXPECT_FALSE(static_cast<bool>(e));
    EXPECT_THROW((void)e.get(), usage_error);
    u32 a = 0;
    u32 b = 0;
    EXPECT_THROW(e.set_memcpy_1d(nullptr, &a, &b, sizeof a, cudaMemcpyHostToHost), usage_error);
    EXPECT_THROW(e.launch(cudaStreamPerThread), usage_error);
    EXPECT_EQ(e.release(), nullptr);
    EXPECT_THROW((void)graph_exec::from_native_handle(nullptr), usage_error);
}

// The handles below are never given to CUDA: each owner releases its handle before it goes, so
// no destroy call is made.
TEST(graph, a_move_hands_the_handle_over_and_leaves_the_source_empty) {
    auto* raw = reinterpret_cast<cudaGraph_t>(std::uintptr_t{0x1000});
    graph a = graph::from_native_handle(raw);
    graph b(std::move(a));
    EXPECT_FALSE(static_cast<bool>(a));
    EXPECT_THROW((void)a.get(), usage_error) << "a moved-from graph is empty";
    EXPECT_EQ(b.get(), raw);
    graph c;
    c = std::move(b); // into an empty one: nothing to destroy
    EXPECT_FALSE(static_cast<bool>(b));
    EXPECT_EQ(c.get(), raw);
    EXPECT_EQ(c.release(), raw);
    EXPECT_FALSE(static_cast<bool>(c));
}

TEST(graph, a_moved_from_graph_exec_is_empty) {
    auto* raw = reinterpret_cast<cudaGraphExec_t>(std::uintptr_t{0x2000});
    graph_exec a = graph_exec::from_native_handle(raw);
    graph_exec b;
    b = std::move(a);
    EXPECT_THROW((void)a.get(), usage_error) << "a moved-from graph_exec is empty";
    EXPECT_THROW(a.launch(cudaStreamPerThread), usage_error);
    graph_exec c(std::move(b));
    EXPECT_FALSE(static_cast<bool>(b));
    EXPECT_EQ(c.release(), raw);
}

// ---- with a GPU -------------------------------------------------------------------------------

class graph_gpu : public cudawait::testing::gpu_test {};

constexpr u32 salt = 0x6a11;

using cudawait::testing::random_words;

std::vector<u32> transformed(const u32* in, std::size_t n) {
    std::vector<u32> out(n);
    cudawait::testing::transform_on_host(in, out.data(), n, salt);
    return out;
}

// H2D node -> captured kernel -> D2H node, replayed twice with the host ends pointed elsewhere
// in between: every element of both outputs is checked, the poisoned ones included.
TEST_F(graph_gpu, a_captured_graph_replays_with_retargeted_copies) {
    const std::size_t n = 100'003;
    const std::size_t bytes = n * sizeof(u32);
    cudawait::stream s(cudawait::device_ref(0));
    cudawait::device_buffer<u32> dev_in(n, s);
    cudawait::device_buffer<u32> dev_out(n, s);
    s.sync();
    cudawait::pinned_buffer<u32> in1(n);
    cudawait::pinned_buffer<u32> in2(n);
    cudawait::pinned_buffer<u32> out1(n);
    cudawait::pinned_buffer<u32> out2(n);
    auto d1 = random_words(n, 1);
    auto d2 = random_words(n, 2);
    std::copy(d1.begin(), d1.end(), in1.begin());
    std::copy(d2.begin(), d2.end(), in2.begin());
    std::fill(out1.begin(), out1.end(), 0xdeadbeefu);
    std::fill(out2.begin(), out2.end(), 0xdeadbeefu);

    graph g = graph::create();
    cudaGraphNode_t h2d = g.add_memcpy_1d(dev_in.data(), in1.data(), bytes, cudaMemcpyHostToDevice);
    cudawait::stream capture_stream(cudawait::device_ref(0));
    graph work = cudawait::capture(capture_stream, [&](cudawait::stream_ref cs) {
        check(cudawait::testing::launch_transform(dev_in.data(), dev_out.data(), n, salt, 0,
                                                  cs.get()),
              "launch_transform");
    });
    EXPECT_TRUE(static_cast<bool>(work));
    cudaGraphNode_t kernel = g.add_child(work, {h2d});
    cudaGraphNode_t d2h =
        g.add_memcpy_1d(out1.data(), dev_out.data(), bytes, cudaMemcpyDeviceToHost, {kernel});
    graph_exec exec = g.instantiate();

    exec.launch(s);
    s.sync();
    std::vector<u32> got(out1.begin(), out1.end());
    EXPECT_EQ(got, transformed(d1.data(), n));

    exec.set_memcpy_1d(h2d, dev_in.data(), in2.data(), bytes, cudaMemcpyHostToDevice);
    exec.set_memcpy_1d(d2h, out2.data(), dev_out.data(), bytes, cudaMemcpyDeviceToHost);
    exec.launch(s);
    s.sync();
    got.assign(out2.begin(), out2.end());
    EXPECT_EQ(got, transformed(d2.data(), n));
    got.assign(out1.begin(), out1.end());
    EXPECT_EQ(got, transformed(d1.data(), n)) << "the first output was written again";

    // Moving the executable graph keeps it usable.
    graph_exec moved(std::move(exec));
    EXPECT_THROW(exec.launch(s), usage_error);
    std::fill(out2.begin(), out2.end(), 0xdeadbeefu);
    moved.launch(s);
    s.sync();
    got.assign(out2.begin(), out2.end());
    EXPECT_EQ(got, transformed(d2.data(), n));
}

// A callable that throws mid-capture: the exception comes through, the stream is out of capture
// mode and works as before.
TEST_F(graph_gpu, a_throwing_capture_ends_the_capture_and_passes_the_exception_on) {
    cudawait::stream s(cudawait::device_ref(0));
    cudawait::device_buffer<u32> out(1, s);
    EXPECT_THROW((void)cudawait::capture(s,
                                         [&](cudawait::stream_ref cs) {
                                             check(cudawait::testing::launch_spin(1000, out.data(),
                                                                                  7, cs.get()),
                                                   "launch_spin");
                                             throw std::runtime_error("stage refused");
                                         }),
                 std::runtime_error);
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusActive;
    ASSERT_EQ(cudaStreamIsCapturing(s.get(), &status), cudaSuccess);
    EXPECT_EQ(status, cudaStreamCaptureStatusNone);
    ASSERT_EQ(cudaGetLastError(), cudaSuccess);
    // The stream runs work again.
    check(cudawait::testing::launch_spin(1000, out.data(), 9, s.get()), "launch_spin");
    u32 host = 0;
    check(cudaMemcpyAsync(&host, out.data(), sizeof host, cudaMemcpyDeviceToHost, s.get()),
          "cudaMemcpyAsync");
    s.sync();
    EXPECT_EQ(host, 9u);
}

} // namespace
