// SPDX-License-Identifier: Apache-2.0
#include <cudawait/core/interop.hpp>
#include <cudawait/core/scheduler.hpp>
#include <cudawait/core/sync_wait.hpp>
#include <cudawait/core/task.hpp>
#include <cudawait/memory/device_buffer.hpp>
#include <cudawait/memory/pinned_buffer.hpp>
#include <cudawait/runtime/event.hpp>
#include <cudawait/runtime/stream.hpp>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <random>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include <cuda/stream_ref>
#include <cuda_runtime.h>

#if __has_include(<cuda/event>)
#include <cuda/event>
#define CUDAWAIT_TEST_HAS_CUDA_EVENT_REF 1
#else
#define CUDAWAIT_TEST_HAS_CUDA_EVENT_REF 0
#endif

#include "gpu_fixture.hpp"
#include "test_kernels.hpp"
#include <gtest/gtest.h>

namespace {

using cudawait::event_like;
using cudawait::event_ref;
using cudawait::stream_like;
using cudawait::stream_ref;

// Stand-ins shaped like the stream and event types of other libraries, with no dependency on
// them: what matters is which members and conversions they offer.

/// Like PyTorch's c10::cuda::CUDAStream: `.stream()` and an implicit conversion.
class torch_like_stream {
public:
    explicit torch_like_stream(cudaStream_t s) : m_s(s) {}
    [[nodiscard]] cudaStream_t stream() const { return m_s; }
    operator cudaStream_t() const { return m_s; }

private:
    cudaStream_t m_s;
};

/// Like rmm::cuda_stream_view: `.value()` and an implicit conversion.
class rmm_like_stream_view {
public:
    constexpr explicit rmm_like_stream_view(cudaStream_t s) noexcept : m_s(s) {}
    [[nodiscard]] constexpr cudaStream_t value() const noexcept { return m_s; }
    constexpr operator cudaStream_t() const noexcept { return m_s; }

private:
    cudaStream_t m_s;
};

/// Like cuda::stream_ref (or a stream of another library without conversions): `.get()` only.
class get_only_stream {
public:
    explicit get_only_stream(cudaStream_t s) : m_s(s) {}
    [[nodiscard]] cudaStream_t get() const { return m_s; }

private:
    cudaStream_t m_s;
};

/// A type that converts only explicitly.
class explicit_stream {
public:
    explicit explicit_stream(cudaStream_t s) : m_s(s) {}
    explicit operator cudaStream_t() const { return m_s; }

private:
    cudaStream_t m_s;
};

/// `.stream()` and `.get()` naming different handles: `.stream()` is asked first.
class two_member_stream {
public:
    two_member_stream(cudaStream_t s, cudaStream_t other) : m_s(s), m_other(other) {}
    [[nodiscard]] cudaStream_t stream() const { return m_s; }
    [[nodiscard]] cudaStream_t get() const { return m_other; }

private:
    cudaStream_t m_s;
    cudaStream_t m_other;
};

/// Like cuda::event_ref: `.get()` only.
class get_only_event {
public:
    explicit get_only_event(cudaEvent_t e) : m_e(e) {}
    [[nodiscard]] cudaEvent_t get() const { return m_e; }

private:
    cudaEvent_t m_e;
};

/// `.event()` only.
class event_member_event {
public:
    explicit event_member_event(cudaEvent_t e) : m_e(e) {}
    [[nodiscard]] cudaEvent_t event() const { return m_e; }

private:
    cudaEvent_t m_e;
};

/// An implicit conversion.
class converting_event {
public:
    explicit converting_event(cudaEvent_t e) : m_e(e) {}
    operator cudaEvent_t() const { return m_e; }

private:
    cudaEvent_t m_e;
};

struct stream_deleter {
    void operator()(cudaStream_t) const noexcept {}
};

// The concepts.
static_assert(stream_like<torch_like_stream>);
static_assert(stream_like<rmm_like_stream_view>);
static_assert(stream_like<get_only_stream>);
static_assert(stream_like<explicit_stream>);
static_assert(stream_like<const two_member_stream&>);
static_assert(stream_like<cuda::stream_ref>);
static_assert(stream_like<cudaStream_t>);
static_assert(stream_like<stream_ref>);
static_assert(stream_like<cudawait::stream>);
static_assert(!stream_like<int>, "0 must not become a stream");
static_assert(!stream_like<std::nullptr_t>);
static_assert(!stream_like<void*>, "a static_cast from void* is not a stream");
static_assert(!stream_like<cudaEvent_t>);
static_assert(!stream_like<get_only_event>);
static_assert(event_like<get_only_event>);
static_assert(event_like<event_member_event>);
static_assert(event_like<converting_event>);
static_assert(event_like<cudaEvent_t>);
static_assert(event_like<event_ref>);
static_assert(event_like<cudawait::event>);
static_assert(event_like<cudawait::pooled_event>);
static_assert(!event_like<int>);
static_assert(!event_like<void*>);
static_assert(!event_like<torch_like_stream>);
static_assert(!event_like<cudaStream_t>);

// Implicit views where the type converts implicitly to the handle; explicit where only a member
// names it.
static_assert(std::is_convertible_v<torch_like_stream, stream_ref>);
static_assert(std::is_convertible_v<rmm_like_stream_view, stream_ref>);
static_assert(!std::is_convertible_v<get_only_stream, stream_ref>);
static_assert(std::is_constructible_v<stream_ref, get_only_stream>);
static_assert(!std::is_convertible_v<explicit_stream, stream_ref>);
static_assert(std::is_constructible_v<stream_ref, explicit_stream>);
static_assert(std::is_constructible_v<stream_ref, two_member_stream>);
static_assert(!std::is_convertible_v<std::unique_ptr<CUstream_st, stream_deleter>, stream_ref>,
              "an owner with .get() is viewed only on request");
static_assert(std::is_constructible_v<stream_ref, std::unique_ptr<CUstream_st, stream_deleter>>);
static_assert(!std::is_convertible_v<std::optional<cudaStream_t>, stream_ref>);
static_assert(std::is_convertible_v<converting_event, event_ref>);
static_assert(!std::is_convertible_v<get_only_event, event_ref>);
static_assert(std::is_constructible_v<event_ref, get_only_event>);
static_assert(std::is_constructible_v<event_ref, event_member_event>);
static_assert(!std::is_constructible_v<stream_ref, get_only_event>);
static_assert(!std::is_constructible_v<event_ref, torch_like_stream>);
// What held before still holds.
static_assert(std::is_convertible_v<cuda::stream_ref, stream_ref>);
static_assert(std::is_convertible_v<const cudawait::stream&, stream_ref>);
static_assert(std::is_convertible_v<const cudawait::event&, event_ref>);
static_assert(!std::is_constructible_v<stream_ref, int>);
static_assert(!std::is_constructible_v<event_ref, std::nullptr_t>);

// `co_await x` inside a task compiles for each, and yields nothing.
template <class A>
constexpr bool awaits_to_void = std::is_void_v<cudawait::detail::awaited_t<A>>;
static_assert(awaits_to_void<torch_like_stream&>);
static_assert(awaits_to_void<const rmm_like_stream_view&>);
static_assert(awaits_to_void<get_only_stream>);
static_assert(awaits_to_void<explicit_stream&>);
static_assert(awaits_to_void<two_member_stream&>);
static_assert(awaits_to_void<cuda::stream_ref&>);
static_assert(awaits_to_void<get_only_event&>);
static_assert(awaits_to_void<event_member_event>);
static_assert(awaits_to_void<converting_event&>);

// And a task that awaits each, instantiated: made and dropped unstarted (a task is lazy), so no
// device is needed.
template <class A>
cudawait::task<void> await_it(A a) {
    co_await a;
}

TEST(interop, a_task_awaiting_each_type_is_instantiated) {
    auto s = reinterpret_cast<cudaStream_t>(std::uintptr_t{0x1000});
    auto e = reinterpret_cast<cudaEvent_t>(std::uintptr_t{0x3000});
    cudawait::task<void> tasks[] = {
        await_it(torch_like_stream(s)),  await_it(rmm_like_stream_view(s)),
        await_it(get_only_stream(s)),    await_it(explicit_stream(s)),
        await_it(cuda::stream_ref(s)),   await_it(get_only_event(e)),
        await_it(event_member_event(e)), await_it(converting_event(e))};
    for (auto& t : tasks) {
        EXPECT_TRUE(t.valid());
        EXPECT_FALSE(t.done());
    }
}

TEST(interop, views_take_the_handle_each_type_names) {
    auto a = reinterpret_cast<cudaStream_t>(std::uintptr_t{0x1000});
    auto b = reinterpret_cast<cudaStream_t>(std::uintptr_t{0x2000});
    stream_ref t = torch_like_stream(a);
    EXPECT_EQ(t.get(), a);
    stream_ref r = rmm_like_stream_view(b);
    EXPECT_EQ(r.get(), b);
    EXPECT_EQ(stream_ref(get_only_stream(a)).get(), a);
    EXPECT_EQ(stream_ref(explicit_stream(b)).get(), b);
    EXPECT_EQ(stream_ref(two_member_stream(a, b)).get(), a) << ".stream() comes before .get()";
    EXPECT_EQ(cudawait::native_stream(two_member_stream(b, a)), b);
    EXPECT_EQ(stream_ref(cuda::stream_ref(a)).get(), a);
    std::unique_ptr<CUstream_st, stream_deleter> owner(b);
    EXPECT_EQ(stream_ref(owner).get(), b);

    auto e = reinterpret_cast<cudaEvent_t>(std::uintptr_t{0x3000});
    EXPECT_EQ(event_ref(get_only_event(e)).get(), e);
    EXPECT_EQ(event_ref(event_member_event(e)).get(), e);
    event_ref c = converting_event(e);
    EXPECT_EQ(c.get(), e);
    EXPECT_EQ(cudawait::native_event(converting_event(e)), e);
}

TEST(interop, a_moved_from_owner_still_throws_through_the_generic_view) {
    cudawait::stream s = cudawait::stream::from_native_handle(
        reinterpret_cast<cudaStream_t>(std::uintptr_t{0x4000}));
    cudaStream_t raw = s.release();
    EXPECT_EQ(raw, reinterpret_cast<cudaStream_t>(std::uintptr_t{0x4000}));
    EXPECT_THROW((void)cudawait::native_stream(s), cudawait::usage_error);
    EXPECT_THROW((void)stream_ref(s), cudawait::usage_error);
}

// ---- GPU -----------------------------------------------------------------------------------

class interop_gpu : public cudawait::testing::gpu_test {};

std::vector<std::uint32_t> random_words(std::size_t n, std::uint64_t seed) {
    std::vector<std::uint32_t> v(n);
    std::mt19937_64 rng(seed);
    for (auto& x : v) {
        x = static_cast<std::uint32_t>(rng());
    }
    return v;
}

void ok(cudaError_t st, const char* what) {
    if (st != cudaSuccess) {
        throw cudawait::cuda_error(st, what);
    }
}

/// Enqueues on `s`: random words up, a slow kernel, mix, the words back into a poisoned pinned
/// buffer. Then a task awaits what `wrap(s, e)` makes (e recorded after the copy back), and
/// checks every word: only an await that waited for the copy sees them all.
template <class Wrap>
void expect_await_waits(Wrap wrap, std::uint32_t salt) {
    const std::size_t n = 1 << 16;
    cudawait::stream s;
    cudawait::event done;
    auto want = random_words(n, salt);
    cudawait::pinned_buffer<std::uint32_t> host(n);
    cudawait::pinned_buffer<std::uint32_t> back(n);
    std::copy(want.begin(), want.end(), host.begin());
    std::fill(back.begin(), back.end(), 0xdeadbeefu);
    cudawait::device_buffer<std::uint32_t> dev(n, s);
    ok(cudaMemcpyAsync(dev.data(), host.data(), n * 4, cudaMemcpyHostToDevice, s.get()),
       "cudaMemcpyAsync");
    ok(cudawait::testing::launch_spin(20'000'000, nullptr, 0, s.get()), "launch_spin");
    ok(cudawait::testing::launch_mix(dev.data(), n, salt, s.get()), "launch_mix");
    ok(cudaMemcpyAsync(back.data(), dev.data(), n * 4, cudaMemcpyDeviceToHost, s.get()),
       "cudaMemcpyAsync");
    done.record(s);
    cudawait::testing::mix_on_host(want.data(), n, salt);
    cudawait::scheduler sched;
    auto awaitable = wrap(s.get(), done.get());
    auto work = [&]() -> cudawait::task<void> {
        co_await awaitable;
        // Checked on the scheduler's thread right after the resume, before anything else syncs.
        for (std::size_t i = 0; i < n; ++i) {
            if (back[i] != want[i]) {
                ADD_FAILURE() << "word " << i << ": " << back[i] << " != " << want[i];
                co_return;
            }
        }
    };
    cudawait::sync_wait(sched, work());
    s.sync();
}

TEST_F(interop_gpu, torch_like_stream_await_waits_for_the_kernel) {
    expect_await_waits([](cudaStream_t s, cudaEvent_t) { return torch_like_stream(s); }, 1);
}
TEST_F(interop_gpu, rmm_like_stream_view_await_waits_for_the_kernel) {
    expect_await_waits([](cudaStream_t s, cudaEvent_t) { return rmm_like_stream_view(s); }, 2);
}
TEST_F(interop_gpu, get_only_stream_await_waits_for_the_kernel) {
    expect_await_waits([](cudaStream_t s, cudaEvent_t) { return get_only_stream(s); }, 3);
}
TEST_F(interop_gpu, explicit_stream_await_waits_for_the_kernel) {
    expect_await_waits([](cudaStream_t s, cudaEvent_t) { return explicit_stream(s); }, 4);
}
TEST_F(interop_gpu, libcudacxx_stream_ref_await_waits_for_the_kernel) {
    expect_await_waits([](cudaStream_t s, cudaEvent_t) { return cuda::stream_ref(s); }, 5);
}
TEST_F(interop_gpu, get_only_event_await_waits_for_the_kernel) {
    expect_await_waits([](cudaStream_t, cudaEvent_t e) { return get_only_event(e); }, 6);
}
TEST_F(interop_gpu, event_member_event_await_waits_for_the_kernel) {
    expect_await_waits([](cudaStream_t, cudaEvent_t e) { return event_member_event(e); }, 7);
}
TEST_F(interop_gpu, converting_event_await_waits_for_the_kernel) {
    expect_await_waits([](cudaStream_t, cudaEvent_t e) { return converting_event(e); }, 8);
}
#if CUDAWAIT_TEST_HAS_CUDA_EVENT_REF
static_assert(event_like<cuda::event_ref>);
TEST_F(interop_gpu, libcudacxx_event_ref_await_waits_for_the_kernel) {
    expect_await_waits([](cudaStream_t, cudaEvent_t e) { return cuda::event_ref(e); }, 9);
}
#endif

// The legacy default stream: a kernel there spins, then writes a value; the helper orders a
// cudawait (non-blocking) stream's copy after it. Without the helper the copy may or may not
// see the value, so only the positive is asserted.
TEST_F(interop_gpu, wait_for_legacy_stream_orders_a_copy_after_legacy_work) {
    cudawait::stream s;
    cudawait::device_buffer<std::uint32_t> word(1, s);
    cudawait::pinned_buffer<std::uint32_t> out(1);
    ok(cudaMemsetAsync(word.data(), 0, 4, s.get()), "cudaMemsetAsync");
    s.sync(); // the allocation and the zero are in place before the legacy stream uses them
    out[0] = 0xdeadbeefu;
    ok(cudawait::testing::launch_spin(30'000'000, word.data(), 0x5eed1u, cudaStreamLegacy),
       "launch_spin");
    cudawait::wait_for_legacy_stream(s);
    ok(cudaMemcpyAsync(out.data(), word.data(), 4, cudaMemcpyDeviceToHost, s.get()),
       "cudaMemcpyAsync");
    s.sync();
    EXPECT_EQ(out[0], 0x5eed1u);
    ok(cudaStreamSynchronize(cudaStreamLegacy), "cudaStreamSynchronize");
}

TEST_F(interop_gpu, after_legacy_stream_resumes_once_legacy_work_finished) {
    cudawait::stream s;
    cudawait::device_buffer<std::uint32_t> word(1, s);
    cudawait::pinned_buffer<std::uint32_t> out(1);
    ok(cudaMemsetAsync(word.data(), 0, 4, s.get()), "cudaMemsetAsync");
    s.sync();
    out[0] = 0xdeadbeefu;
    cudawait::scheduler sched;
    auto work = [&]() -> cudawait::task<void> {
        ok(cudawait::testing::launch_spin(30'000'000, word.data(), 0x5eed2u, cudaStreamLegacy),
           "launch_spin");
        co_await cudawait::after_legacy_stream(s);
        ok(cudaMemcpyAsync(out.data(), word.data(), 4, cudaMemcpyDeviceToHost, s.get()),
           "cudaMemcpyAsync");
        co_await s;
    };
    cudawait::sync_wait(sched, work());
    EXPECT_EQ(out[0], 0x5eed2u);
    ok(cudaStreamSynchronize(cudaStreamLegacy), "cudaStreamSynchronize");
}

// The other direction: a kernel on a cudawait stream spins, then writes; legacy_stream_wait_for
// orders a copy on the legacy stream after it.
TEST_F(interop_gpu, legacy_stream_wait_for_orders_legacy_work_after_a_stream) {
    cudawait::stream s;
    cudawait::device_buffer<std::uint32_t> word(1, s);
    cudawait::pinned_buffer<std::uint32_t> out(1);
    ok(cudaMemsetAsync(word.data(), 0, 4, s.get()), "cudaMemsetAsync");
    out[0] = 0xdeadbeefu;
    ok(cudawait::testing::launch_spin(30'000'000, word.data(), 0x5eed3u, s.get()), "launch_spin");
    cudawait::legacy_stream_wait_for(s);
    ok(cudaMemcpyAsync(out.data(), word.data(), 4, cudaMemcpyDeviceToHost, cudaStreamLegacy),
       "cudaMemcpyAsync");
    ok(cudaStreamSynchronize(cudaStreamLegacy), "cudaStreamSynchronize");
    EXPECT_EQ(out[0], 0x5eed3u);
    s.sync();
}

// cudaStreamPerThread works the same way through wait_for_stream.
TEST_F(interop_gpu, wait_for_stream_orders_after_the_per_thread_stream) {
    cudawait::stream s;
    cudawait::device_buffer<std::uint32_t> word(1, s);
    cudawait::pinned_buffer<std::uint32_t> out(1);
    ok(cudaMemsetAsync(word.data(), 0, 4, s.get()), "cudaMemsetAsync");
    s.sync();
    out[0] = 0xdeadbeefu;
    ok(cudawait::testing::launch_spin(30'000'000, word.data(), 0x5eed4u, cudaStreamPerThread),
       "launch_spin");
    cudawait::wait_for_stream(s, cudaStreamPerThread);
    ok(cudaMemcpyAsync(out.data(), word.data(), 4, cudaMemcpyDeviceToHost, s.get()),
       "cudaMemcpyAsync");
    s.sync();
    EXPECT_EQ(out[0], 0x5eed4u);
    ok(cudaStreamSynchronize(cudaStreamPerThread), "cudaStreamSynchronize");
}

// And two streams of the library: `s` waits for `producer` without the host waiting.
TEST_F(interop_gpu, wait_for_stream_orders_one_stream_after_another) {
    cudawait::stream s;
    cudawait::stream producer;
    cudawait::device_buffer<std::uint32_t> word(1, producer);
    cudawait::pinned_buffer<std::uint32_t> out(1);
    ok(cudaMemsetAsync(word.data(), 0, 4, producer.get()), "cudaMemsetAsync");
    out[0] = 0xdeadbeefu;
    ok(cudawait::testing::launch_spin(30'000'000, word.data(), 0x5eed5u, producer.get()),
       "launch_spin");
    cudawait::wait_for_stream(s, producer);
    ok(cudaMemcpyAsync(out.data(), word.data(), 4, cudaMemcpyDeviceToHost, s.get()),
       "cudaMemcpyAsync");
    s.sync();
    EXPECT_EQ(out[0], 0x5eed5u);
    producer.sync();
}

} // namespace
