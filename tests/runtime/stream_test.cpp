// SPDX-License-Identifier: Apache-2.0
#include <cudawait/runtime/event.hpp>
#include <cudawait/runtime/stream.hpp>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <cuda/stream_ref>
#include <cuda_runtime.h>

#include "gpu_fixture.hpp"
#include "random_words.hpp"
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

// s.wait(x) takes every event and every stream type, on owners and views alike (CCCL's
// stream_ref::wait, PyTorch's wait_event / wait_stream).
template <class S, class X>
concept waits_for = requires(const S& s, const X& x) {
    s.wait(x);
};
template <class S>
concept waits_for_literal_zero = requires(const S& s) {
    s.wait(0);
};
template <class S>
concept waits_for_nullptr = requires(const S& s) {
    s.wait(nullptr);
};
template <class S>
struct waits_for_every_event_and_stream {
    static_assert(waits_for<S, cudawait::event>);
    static_assert(waits_for<S, cudawait::pooled_event>);
    static_assert(waits_for<S, cudawait::event_ref>);
    static_assert(waits_for<S, cudaEvent_t>);
    static_assert(waits_for<S, stream>);
    static_assert(waits_for<S, stream_ref>);
    static_assert(waits_for<S, cudaStream_t>);
    static_assert(waits_for<S, cuda::stream_ref>);
    static_assert(!waits_for_literal_zero<S>, "is 0 an event or a stream?");
    static_assert(!waits_for_nullptr<S>);
    static_assert(!waits_for<S, int>);
};
template struct waits_for_every_event_and_stream<stream>;
template struct waits_for_every_event_and_stream<stream_ref>;

// An owner takes a device as a plain id; a view still refuses an int (0 is not a stream).
template <class T>
concept from_literal_zero = requires {
    T(0);
};
static_assert(from_literal_zero<stream>, "stream(0): a stream on device 0");
static_assert(from_literal_zero<cudawait::event>, "event(0): an event on device 0");
static_assert(!from_literal_zero<stream_ref>);
static_assert(!from_literal_zero<cudawait::event_ref>);
static_assert(std::is_constructible_v<stream, int>);
static_assert(std::is_constructible_v<stream, int, int>);
static_assert(std::is_constructible_v<cudawait::event, int>);
static_assert(std::is_constructible_v<cudawait::event, int, unsigned>);
static_assert(!std::is_convertible_v<int, stream>, "the owners' constructors stay explicit");
static_assert(!std::is_convertible_v<int, cudawait::event>);
static_assert(!std::is_convertible_v<int, stream_ref>);

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
    EXPECT_THROW(s.sync(), usage_error);
    EXPECT_THROW(s.wait(reinterpret_cast<cudaEvent_t>(std::uintptr_t{0xE7})), usage_error);
    EXPECT_THROW(s.wait(reinterpret_cast<cudaStream_t>(std::uintptr_t{0x57})), usage_error);
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

TEST_F(stream_gpu, is_done_sync_and_cross_stream_wait) {
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
    EXPECT_TRUE(producer.is_done()) << "the consumer waited for the producer's event";
    EXPECT_TRUE(stream_ref(producer).is_done());
    EXPECT_EQ(*copied, 0x5EEDu);
    check(cudaEventDestroy(done), "cudaEventDestroy");
    check(cudaFree(value), "cudaFree");
    check(cudaFreeHost(copied), "cudaFreeHost");
}

TEST_F(stream_gpu, an_owner_made_from_a_plain_device_id_is_on_that_device) {
    stream s(0);
    EXPECT_EQ(s.device(), 0);
    stream high(0, cudawait::priority_high(0));
    EXPECT_EQ(high.device(), 0);
    EXPECT_EQ(high.priority(), cudawait::priority_high(0));
    cudawait::event e(0);
    e.record(s); // an event is recorded only on a stream of its own device
    e.sync();
    if (cudawait::device_count() > 1) {
        stream other(1);
        EXPECT_EQ(other.device(), 1);
        cudawait::event e1(1);
        e1.record(other);
        e1.sync();
    }
}

// The producer spins 20 ms and then writes `out`; the consumer, told to wait by `order`, copies
// `out` to the host. Without the wait the copy would read the poison.
void expect_consumer_reads_what_the_producer_wrote(
    const std::function<void(const stream& producer, const stream& consumer)>& order,
    std::uint64_t seed) {
    constexpr std::size_t n = 1 << 16;
    constexpr std::uint32_t salt = 0x9E3779B9u;
    const std::vector<std::uint32_t> in = cudawait::testing::random_words(n, seed);
    std::vector<std::uint32_t> expected(n);
    cudawait::testing::transform_on_host(in.data(), expected.data(), n, salt);
    stream producer;
    stream consumer;
    std::uint32_t* d_in = nullptr;
    std::uint32_t* d_out = nullptr;
    std::uint32_t* h_out = nullptr;
    check(cudaMalloc(&d_in, n * sizeof(std::uint32_t)), "cudaMalloc");
    check(cudaMalloc(&d_out, n * sizeof(std::uint32_t)), "cudaMalloc");
    check(cudaHostAlloc(&h_out, n * sizeof(std::uint32_t), cudaHostAllocDefault), "cudaHostAlloc");
    check(cudaMemcpy(d_in, in.data(), n * sizeof(std::uint32_t), cudaMemcpyHostToDevice),
          "cudaMemcpy");
    check(cudaMemset(d_out, 0xA5, n * sizeof(std::uint32_t)), "cudaMemset"); // poison
    for (std::size_t i = 0; i < n; ++i) {
        h_out[i] = 0x5A5A5A5Au;
    }
    check(cudawait::testing::launch_transform(d_in, d_out, n, salt, 20'000'000, producer.get()),
          "launch_transform");
    order(producer, consumer);
    check(cudaMemcpyAsync(h_out, d_out, n * sizeof(std::uint32_t), cudaMemcpyDeviceToHost,
                          consumer.get()),
          "cudaMemcpyAsync");
    consumer.sync();
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < n; ++i) {
        wrong += h_out[i] != expected[i] ? 1 : 0;
    }
    EXPECT_EQ(wrong, 0u) << "of " << n << " words; first: " << h_out[0] << " against "
                         << expected[0];
    producer.sync();
    check(cudaFree(d_in), "cudaFree");
    check(cudaFree(d_out), "cudaFree");
    check(cudaFreeHost(h_out), "cudaFreeHost");
}

TEST_F(stream_gpu, a_stream_waits_for_an_owning_event) {
    expect_consumer_reads_what_the_producer_wrote(
        [](const stream& producer, const stream& consumer) {
            cudawait::event ev;
            ev.record(producer);
            consumer.wait(ev);
        },
        1);
}

TEST_F(stream_gpu, a_stream_waits_for_a_pooled_event_and_a_view_waits_for_an_event_ref) {
    expect_consumer_reads_what_the_producer_wrote(
        [](const stream& producer, const stream& consumer) {
            cudawait::pooled_event ev = cudawait::event_pool::for_device(0).acquire();
            ev.record(producer);
            consumer.wait(ev);
        },
        2);
    expect_consumer_reads_what_the_producer_wrote(
        [](const stream& producer, const stream& consumer) {
            cudawait::event ev;
            ev.record(producer);
            stream_ref(consumer).wait(cudawait::event_ref(ev));
        },
        3);
}

TEST_F(stream_gpu, a_stream_waits_for_a_raw_event) {
    cudaEvent_t ev = nullptr;
    check(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    expect_consumer_reads_what_the_producer_wrote(
        [ev](const stream& producer, const stream& consumer) {
            check(cudaEventRecord(ev, producer.get()), "cudaEventRecord");
            consumer.wait(ev);
        },
        4);
    check(cudaEventDestroy(ev), "cudaEventDestroy");
}

TEST_F(stream_gpu, a_stream_waits_for_another_stream_of_every_kind) {
    expect_consumer_reads_what_the_producer_wrote(
        [](const stream& producer, const stream& consumer) { consumer.wait(producer); }, 5);
    expect_consumer_reads_what_the_producer_wrote(
        [](const stream& producer, const stream& consumer) {
            stream_ref(consumer).wait(stream_ref(producer));
        },
        6);
    expect_consumer_reads_what_the_producer_wrote(
        [](const stream& producer, const stream& consumer) {
            const cudaStream_t raw = producer.get();
            consumer.wait(raw);
        },
        7);
    expect_consumer_reads_what_the_producer_wrote(
        [](const stream& producer, const stream& consumer) {
            consumer.wait(cuda::stream_ref(producer.get()));
        },
        8);
}

TEST_F(stream_gpu, waiting_for_a_stream_borrows_no_pooled_event_for_longer_than_the_call) {
    stream a;
    stream b;
    const long before = cudawait::event_pool::for_device(0).outstanding();
    for (int i = 0; i < 100; ++i) {
        b.wait(a);
        EXPECT_EQ(cudawait::event_pool::for_device(0).outstanding(), before);
    }
    b.sync();
}

} // namespace
