// SPDX-License-Identifier: Apache-2.0
#include <cudawait/mapped_buffer.hpp>
#include <cudawait/scheduler.hpp>
#include <cudawait/sync_wait.hpp>
#include <cudawait/task.hpp>

#include "gpu_fixture.hpp"
#include "test_kernels.hpp"

#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>
#include <type_traits>

#include <cuda_runtime.h>
#include <gtest/gtest.h>

namespace {

using namespace std::chrono_literals;
using cudawait::mapped_buffer;
using cudawait::usage_error;

static_assert(!std::is_copy_constructible_v<mapped_buffer<int>>);

TEST(mapped_buffer, zero_elements_is_a_usage_error) {
    EXPECT_THROW(mapped_buffer<int>(0), usage_error);
    mapped_buffer<int> empty;
    EXPECT_THROW((void)empty.device_data(), usage_error);
}

class mapped_buffer_gpu : public cudawait::testing::gpu_test {};

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
    EXPECT_FALSE(cudawait::stream_ref(s).ready());
    std::atomic_ref<std::uint32_t>(flags[0]).store(1, std::memory_order_release);
    s.sync();
    EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);
}

} // namespace
