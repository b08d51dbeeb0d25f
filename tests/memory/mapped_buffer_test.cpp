// SPDX-License-Identifier: Apache-2.0
#include <cudawait/core/scheduler.hpp>
#include <cudawait/core/sync_wait.hpp>
#include <cudawait/core/task.hpp>
#include <cudawait/memory/mapped_buffer.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <random>
#include <ranges>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include <cuda_runtime.h>

#include "gpu_fixture.hpp"
#include "test_kernels.hpp"
#include <gtest/gtest.h>

namespace {

using namespace std::chrono_literals;
using cudawait::mapped_buffer;
using cudawait::usage_error;

static_assert(!std::is_copy_constructible_v<mapped_buffer<int>>);
static_assert(std::is_nothrow_move_constructible_v<mapped_buffer<int>>);
static_assert(std::ranges::contiguous_range<mapped_buffer<int>>);

// Everything that reaches the memory, on either side, throws on an empty buffer, operator[]
// included (it used to index a null pointer); the message names the buffer type.
void expect_no_access(const mapped_buffer<std::uint32_t>& b) {
    EXPECT_FALSE(b);
    EXPECT_TRUE(b.empty());
    EXPECT_EQ(b.size(), 0u);
    EXPECT_EQ(b.size_bytes(), 0u);
    EXPECT_THROW((void)b.data(), usage_error);
    EXPECT_THROW((void)b.device_data(), usage_error);
    EXPECT_THROW((void)b[0], usage_error);
    EXPECT_THROW((void)b.span(), usage_error);
    EXPECT_THROW((void)b.device_span(), usage_error);
    EXPECT_THROW((void)b.begin(), usage_error);
    EXPECT_THROW((void)b.end(), usage_error);
    try {
        (void)b[1];
        ADD_FAILURE() << "no exception";
    } catch (const usage_error& e) {
        EXPECT_NE(std::string(e.what()).find("mapped_buffer"), std::string::npos) << e.what();
    }
}

TEST(mapped_buffer, zero_elements_is_a_usage_error) {
    EXPECT_THROW(mapped_buffer<int>(0), usage_error);
    EXPECT_THROW(mapped_buffer<double>(std::size_t(-1) / 4), usage_error);
    mapped_buffer<std::uint32_t> empty;
    expect_no_access(empty);
}

class mapped_buffer_gpu : public cudawait::testing::gpu_test {};

TEST_F(mapped_buffer_gpu, moves_carry_both_addresses_and_leave_no_access) {
    mapped_buffer<std::uint32_t> a(16);
    std::uint32_t* host = a.data();
    std::uint32_t* dev = a.device_data();
    EXPECT_EQ(a.device_span().data(), dev);
    EXPECT_EQ(a.device_span().size(), 16u);
    a[15] = 0xfeedu;
    mapped_buffer<std::uint32_t> b(std::move(a));
    {
        SCOPED_TRACE("moved from");
        expect_no_access(a); // NOLINT(bugprone-use-after-move)
    }
    EXPECT_EQ(b.data(), host);
    EXPECT_EQ(b.device_data(), dev);
    EXPECT_EQ(b[15], 0xfeedu);
    mapped_buffer<std::uint32_t> c(4);
    c = std::move(b);
    {
        SCOPED_TRACE("move-assigned from");
        expect_no_access(b); // NOLINT(bugprone-use-after-move)
    }
    EXPECT_EQ(c.data(), host);
    EXPECT_EQ(c.device_data(), dev);
    EXPECT_EQ(c.size(), 16u);
    // The moved device address still reaches the host's bytes: a kernel transforms them all.
    std::mt19937 rng(23);
    std::vector<std::uint32_t> want(16);
    for (std::size_t i = 0; i < 16; ++i) {
        c[i] = want[i] = static_cast<std::uint32_t>(rng());
    }
    cudawait::stream s;
    ASSERT_EQ(cudawait::testing::launch_mix(c.device_data(), 16, 9, s.get()), cudaSuccess);
    s.sync();
    cudawait::testing::mix_on_host(want.data(), 16, 9);
    EXPECT_TRUE(std::equal(c.begin(), c.end(), want.begin()));
    c.reset();
    {
        SCOPED_TRACE("reset");
        expect_no_access(c);
    }
}

struct observation {
    std::uint32_t value = 0;
    int polls = 0;
};

// Polls the flag between short sleeps, as a coroutine on the scheduler.
cudawait::task<observation> watch_flag(const mapped_buffer<std::uint32_t>& flags) {
    observation o;
    auto deadline = std::chrono::steady_clock::now() + 10s;
    std::atomic_ref<std::uint32_t> flag(flags[0]);
    while ((o.value = flag.load(std::memory_order_acquire)) == 0 &&
           std::chrono::steady_clock::now() < deadline) {
        ++o.polls;
        co_await cudawait::sleep_for(50us);
    }
    co_return o;
}

TEST_F(mapped_buffer_gpu, a_coroutine_observes_a_flag_a_kernel_writes) {
    mapped_buffer<std::uint32_t> flags(4);
    EXPECT_EQ(flags[0], 0u) << "zero-initialised";
    cudawait::stream s;
    cudawait::scheduler sched;
    // The kernel spins 50 ms, then stores 0x1234abcd through the device pointer.
    ASSERT_EQ(cudawait::testing::launch_spin(50'000'000, flags.device_data(), 0x1234abcd, s.get()),
              cudaSuccess);
    observation o = cudawait::sync_wait(sched, watch_flag(flags));
    EXPECT_EQ(o.value, 0x1234abcdu);
    EXPECT_GT(o.polls, 0) << "the flag was set while the coroutine watched";
    s.sync();
}

TEST_F(mapped_buffer_gpu, a_kernel_observes_a_flag_the_host_writes) {
    mapped_buffer<std::uint32_t> flags(1);
    cudawait::stream s;
    // Without the flag the kernel would spin for 20 s.
    ASSERT_EQ(cudawait::testing::launch_wait_flag(flags.device_data(), 20'000'000'000ull, s.get()),
              cudaSuccess);
    auto start = std::chrono::steady_clock::now();
    std::this_thread::sleep_for(20ms);
    EXPECT_FALSE(cudawait::stream_ref(s).is_done());
    std::atomic_ref<std::uint32_t>(flags[0]).store(1, std::memory_order_release);
    s.sync();
    EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);
}

} // namespace
