// SPDX-License-Identifier: Apache-2.0
#include <cudawait/stream.hpp>

#include <cstdint>
#include <type_traits>
#include <utility>

#include <cuda/stream_ref>
#include <cuda_runtime.h>

#include "gpu_fixture.hpp"
#include "test_kernels.hpp"
#include <gtest/gtest.h>

namespace {

using cudawait::check;
using cudawait::stream;
using cudawait::stream_ref;
using cudawait::usage_error;

static_assert(std::is_trivially_copyable_v<stream_ref>);
static_assert(std::is_convertible_v<cudaStream_t, stream_ref>);
static_assert(std::is_convertible_v<stream_ref, cudaStream_t>);
static_assert(!std::is_constructible_v<stream_ref, int>, "0 must not become a stream");
static_assert(!std::is_constructible_v<stream_ref, std::nullptr_t>);
static_assert(std::is_convertible_v<cuda::stream_ref, stream_ref>);
static_assert(std::is_convertible_v<stream_ref, cuda::stream_ref>);
static_assert(!std::is_copy_constructible_v<stream>);
static_assert(std::is_nothrow_move_constructible_v<stream>);
static_assert(std::is_convertible_v<const stream&, stream_ref>);
static_assert(std::is_convertible_v<const stream&, cuda::stream_ref>);
static_assert(sizeof(stream_ref) == sizeof(cudaStream_t), "the operations add no state");

TEST(stream, views_round_trip_raw_and_libcudacxx_handles) {
    auto raw = reinterpret_cast<cudaStream_t>(std::uintptr_t{0x1234});
    stream_ref r = raw;
    EXPECT_EQ(r.get(), raw);
    cuda::stream_ref c = r;
    EXPECT_EQ(c.get(), raw);
    stream_ref back = c;
    EXPECT_EQ(back, r);
    cudaStream_t again = back;
    EXPECT_EQ(again, raw);
}

TEST(stream, adopting_a_null_handle_is_a_usage_error) {
    EXPECT_THROW((void)stream::from_native_handle(nullptr), usage_error);
}

// A handle CUDA never sees: every operation of an empty owner must throw before any CUDA call,
// so this runs without a device (and a null handle never reaches the legacy stream).
void expect_every_operation_throws(const stream& s) {
    EXPECT_FALSE(static_cast<bool>(s));
    EXPECT_THROW((void)s.get(), usage_error);
    EXPECT_THROW((void)s.ref(), usage_error);
    EXPECT_THROW((void)static_cast<stream_ref>(s), usage_error);
    EXPECT_THROW((void)static_cast<cuda::stream_ref>(s), usage_error);
    EXPECT_THROW((void)s.is_done(), usage_error);
    EXPECT_THROW((void)s.ready(), usage_error);
    EXPECT_THROW(s.sync(), usage_error);
    EXPECT_THROW(s.wait(reinterpret_cast<cudaEvent_t>(std::uintptr_t{0xE7})), usage_error);
    EXPECT_THROW((void)s.device(), usage_error);
    EXPECT_THROW((void)s.priority(), usage_error);
}

TEST(stream, every_operation_of_a_moved_from_or_released_stream_is_a_usage_error) {
    const long before = stream::live_count();
    auto fake = reinterpret_cast<cudaStream_t>(std::uintptr_t{0x5EED});
    stream owner = stream::from_native_handle(fake);
    stream moved(std::move(owner));
    {
        SCOPED_TRACE("moved from");
        expect_every_operation_throws(owner); // NOLINT(bugprone-use-after-move)
    }
    EXPECT_EQ(moved.release(), fake);
    {
        SCOPED_TRACE("released");
        expect_every_operation_throws(moved);
    }
    EXPECT_EQ(stream::live_count(), before);
}

class stream_gpu : public cudawait::testing::gpu_test {};

TEST_F(stream_gpu, created_non_blocking_on_the_requested_device_and_priority) {
    cudawait::device_ref dev(0);
    const int high = cudawait::priority_high(dev);
    const int low = cudawait::priority_low(dev);
    stream hi(dev, high);
    stream lo(dev, low);
    unsigned flags = 0;
    ASSERT_EQ(cudaStreamGetFlags(hi.get(), &flags), cudaSuccess);
    EXPECT_EQ(flags, static_cast<unsigned>(cudaStreamNonBlocking));
    EXPECT_EQ(hi.priority(), high);
    EXPECT_EQ(lo.priority(), low);
    EXPECT_EQ(hi.device(), 0);
    stream dflt;
    ASSERT_EQ(cudaStreamGetFlags(dflt.get(), &flags), cudaSuccess);
    EXPECT_EQ(flags, static_cast<unsigned>(cudaStreamNonBlocking));
}

TEST_F(stream_gpu, moved_from_stream_is_a_usage_error_and_moves_do_not_leak) {
    const long before = stream::live_count();
    stream a;
    stream b;
    EXPECT_EQ(stream::live_count(), before + 2);
    cudaStream_t ha = a.get();
    b = std::move(a); // b's old stream is destroyed, not leaked
    EXPECT_EQ(stream::live_count(), before + 1);
    EXPECT_EQ(b.get(), ha);
    EXPECT_FALSE(static_cast<bool>(a));
    EXPECT_THROW((void)a.get(), usage_error);
    EXPECT_THROW(a.sync(), usage_error);
    EXPECT_THROW((void)a.is_done(), usage_error);
    EXPECT_THROW((void)a.ready(), usage_error);
    stream c(std::move(b));
    EXPECT_EQ(c.get(), ha);
    EXPECT_EQ(stream::live_count(), before + 1);
}

TEST_F(stream_gpu, release_and_adopt_hand_ownership_across) {
    const long before = stream::live_count();
    cudaStream_t raw = nullptr;
    {
        stream s;
        raw = s.release();
        EXPECT_FALSE(static_cast<bool>(s));
    }
    EXPECT_EQ(stream::live_count(), before);
    EXPECT_EQ(cudaStreamQuery(raw), cudaSuccess) << "released stream must still be alive";
    {
        stream adopted = stream::from_native_handle(raw);
        EXPECT_EQ(adopted.get(), raw);
        EXPECT_EQ(stream::live_count(), before + 1);
    }
    EXPECT_EQ(stream::live_count(), before);
}

TEST_F(stream_gpu, destruction_waits_for_work_in_flight) {
    std::uint32_t* flag = nullptr;
    check(cudaHostAlloc(&flag, sizeof(std::uint32_t), cudaHostAllocMapped), "cudaHostAlloc");
    *flag = 0;
    {
        stream s;
        check(cudawait::testing::launch_spin(50'000'000, flag, 0xC0FFEEu, s.get()), "launch");
    }
    // The destructor synchronised: the kernel's write is visible without any other wait.
    EXPECT_EQ(*reinterpret_cast<volatile std::uint32_t*>(flag), 0xC0FFEEu);
    check(cudaFreeHost(flag), "cudaFreeHost");
}

TEST_F(stream_gpu, is_done_ready_sync_and_cross_stream_wait) {
    stream producer;
    stream consumer;
    std::uint32_t* value = nullptr;
    std::uint32_t* copied = nullptr;
    check(cudaMalloc(&value, sizeof(std::uint32_t)), "cudaMalloc");
    check(cudaHostAlloc(&copied, sizeof(std::uint32_t), cudaHostAllocDefault), "cudaHostAlloc");
    *copied = 0xDEADBEEFu;
    check(cudaMemsetAsync(value, 0, sizeof(std::uint32_t), producer.get()), "cudaMemsetAsync");
    check(cudawait::testing::launch_spin(30'000'000, value, 0x5EEDu, producer.get()), "launch");
    EXPECT_FALSE(producer.is_done()) << "the kernel spins for 30 ms";
    EXPECT_FALSE(producer.ready());
    EXPECT_FALSE(stream_ref(producer).is_done());
    cudaEvent_t done = nullptr;
    check(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    check(cudaEventRecord(done, producer.get()), "cudaEventRecord");
    consumer.wait(done); // ordered by the event, not by a host wait
    check(cudaMemcpyAsync(copied, value, sizeof(std::uint32_t), cudaMemcpyDeviceToHost,
                          consumer.get()),
          "cudaMemcpyAsync");
    consumer.sync();
    EXPECT_TRUE(consumer.is_done());
    EXPECT_TRUE(consumer.ready());
    EXPECT_TRUE(producer.is_done()) << "the consumer waited for the producer's event";
    EXPECT_TRUE(producer.ready());
    EXPECT_TRUE(stream_ref(producer).is_done());
    EXPECT_TRUE(stream_ref(producer).ready());
    EXPECT_EQ(*copied, 0x5EEDu);
    check(cudaEventDestroy(done), "cudaEventDestroy");
    check(cudaFree(value), "cudaFree");
    check(cudaFreeHost(copied), "cudaFreeHost");
}

} // namespace
