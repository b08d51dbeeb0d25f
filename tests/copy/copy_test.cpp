// SPDX-License-Identifier: Apache-2.0
#include <cudawait/copy/copy.hpp>
#include <cudawait/copy/detail/staging.hpp>
#include <cudawait/core/scheduler.hpp>
#include <cudawait/core/sync_wait.hpp>
#include <cudawait/core/when_all.hpp>
#include <cudawait/memory/device_buffer.hpp>
#include <cudawait/memory/pinned_buffer.hpp>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ostream>
#include <random>
#include <span>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "gpu_fixture.hpp"
#include "host_pool.hpp"
#include "no_device.hpp"
#include "test_kernels.hpp"
#include <gtest/gtest.h>

namespace {

using namespace cudawait::literals;
using cudawait::copy;
using cudawait::copy_async;
using cudawait::copy_options;
using cudawait::device_buffer;
using cudawait::memory_kind;
using cudawait::pinned_buffer;
using cudawait::usage_error;

std::vector<std::uint8_t> random_bytes(std::size_t n, std::uint64_t seed) {
    std::vector<std::uint8_t> v(n);
    std::mt19937_64 rng(seed);
    for (auto& b : v) {
        b = static_cast<std::uint8_t>(rng());
    }
    return v;
}

// ---- argument checks: no CUDA call is made before they pass -----------------------------------

TEST(copy, mismatched_sizes_zero_sizes_null_and_overlap_are_usage_errors) {
    std::vector<int> a(10);
    std::vector<int> b(11);
    const auto s = cudawait::stream_ref(cudaStreamPerThread);
    try {
        copy_async(a, b, s);
        ADD_FAILURE() << "no exception";
    } catch (const usage_error& e) {
        EXPECT_NE(std::string(e.what()).find("10"), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find("11"), std::string::npos) << e.what();
    }
    EXPECT_THROW((void)copy(a, b, s), usage_error) << "thrown at the call, before any await";
    std::vector<int> empty;
    EXPECT_THROW(copy_async(empty, std::vector<int>{}, s), usage_error);
    EXPECT_THROW(copy_async(std::span<int>(static_cast<int*>(nullptr), 4),
                            std::span<const int>(a.data(), 4), s),
                 usage_error);
    EXPECT_THROW(copy_async(std::span<int>(a.data() + 2, 5), std::span<const int>(a.data(), 5), s),
                 usage_error);
    pinned_buffer<int> moved_from;
    EXPECT_THROW(copy_async(moved_from, a, s), usage_error);
}

// ---- range types of the user's: copy asks the type, as it does for the library's buffers -------

// A view that states where its memory lives, as the library's buffers do.
template <class T, memory_kind Kind>
class stated_view {
public:
    static constexpr memory_kind memory = Kind;
    stated_view(T* data, std::size_t n) : m_data(data), m_size(n) {}
    [[nodiscard]] T* begin() const { return m_data; }
    [[nodiscard]] T* end() const { return m_data + m_size; }
    [[nodiscard]] T* data() const { return m_data; }
    [[nodiscard]] std::size_t size() const { return m_size; }

private:
    T* m_data;
    std::size_t m_size;
};

// Page-locked memory that also names the pool it came from, as pinned_buffer does.
template <class T>
class pooled_view : public stated_view<T, memory_kind::pinned> {
public:
    pooled_view(T* data, std::size_t n, cudawait::pinned_pool& pool)
        : stated_view<T, memory_kind::pinned>(data, n), m_pool(&pool) {}
    [[nodiscard]] cudawait::pinned_pool& pool() const { return *m_pool; }

private:
    cudawait::pinned_pool* m_pool;
};

TEST(copy, a_user_range_that_states_its_memory_is_believed_and_its_pool_is_used) {
    using cudawait::detail::make_plan;
    static_assert(cudawait::detail::copyable_pair<stated_view<int, memory_kind::device>,
                                                  stated_view<const int, memory_kind::pinned>>);
    cudawait::testing::host_pool h;
    cudawait::pinned_pool staging(h.options());
    cudawait::testing::host_pool h2;
    cudawait::pinned_pool own(h2.options());
    const copy_options opt{&staging};
    std::vector<int> a(10);
    std::vector<int> b(10);
    // Every kind comes from the types: asking the driver would fail here without a device, and
    // would call this vector memory pageable.
    auto plan = make_plan(stated_view<int, memory_kind::device>(a.data(), 10),
                          stated_view<const int, memory_kind::pageable>(b.data(), 10), opt);
    EXPECT_EQ(plan.dst_kind, memory_kind::device);
    EXPECT_EQ(plan.src_kind, memory_kind::pageable);
    EXPECT_TRUE(plan.staged());
    EXPECT_TRUE(plan.to_device());
    plan = make_plan(stated_view<int, memory_kind::managed>(a.data(), 10),
                     stated_view<const int, memory_kind::pinned>(b.data(), 10), opt);
    EXPECT_EQ(plan.dst_kind, memory_kind::managed);
    EXPECT_EQ(plan.src_kind, memory_kind::pinned);
    EXPECT_FALSE(plan.staged());
    EXPECT_EQ(plan.src_pool, nullptr) << "pinned, but not the staging pool's";

    // Page-locked memory is marked in its own pool where the type names one (pool()), else in
    // the staging pool if that owns it.
    int* block = static_cast<int*>(own.allocate(10 * sizeof(int)));
    plan = make_plan(stated_view<int, memory_kind::device>(a.data(), 10),
                     pooled_view<int>(block, 10, own), opt);
    EXPECT_EQ(plan.src_pool, &own);
    EXPECT_EQ(plan.dst_pool, nullptr);
    plan = make_plan(pooled_view<int>(block, 10, own),
                     stated_view<const int, memory_kind::device>(b.data(), 10), opt);
    EXPECT_EQ(plan.dst_pool, &own);
    plan = make_plan(stated_view<int, memory_kind::pinned>(block, 10),
                     stated_view<const int, memory_kind::device>(b.data(), 10), opt);
    EXPECT_EQ(plan.dst_pool, nullptr) << "the staging pool does not own the block";
    plan = make_plan(stated_view<int, memory_kind::pinned>(block, 10),
                     stated_view<const int, memory_kind::device>(b.data(), 10), copy_options{&own});
    EXPECT_EQ(plan.dst_pool, &own) << "the staging pool owns the block";
    own.deallocate(block);
}

// The host half of staging (detail/staging.hpp), shared by staged copies and the pipeline: every
// byte arrives, for sizes below one worker's part, at it, and split over several workers.
TEST(copy, staging_in_and_out_copies_every_byte) {
    for (std::size_t n : {std::size_t{1}, std::size_t{4099}, 1_MiB, 5 * 1_MiB + 3}) {
        SCOPED_TRACE(n);
        auto src = random_bytes(n, n);
        std::vector<std::uint8_t> staged(n, 0xa5);
        std::vector<std::uint8_t> back(n, 0x5a);
        cudawait::detail::stage_in(staged.data(), src.data(), n, 0);
        EXPECT_EQ(staged, src);
        cudawait::detail::stage_out(back.data(), staged.data(), n, 1);
        EXPECT_EQ(back, src);
    }
}

TEST(copy, without_a_device_is_a_cuda_error) {
    auto child = [] {
        std::vector<int> a(10, 1);
        std::vector<int> b(10, 2);
        try {
            copy_async(a, b, cudawait::stream_ref(cudaStreamPerThread));
            std::fprintf(stderr, "no exception\n");
            std::exit(1);
        } catch (const cudawait::cuda_error& e) {
            std::fprintf(stderr, "copy failed cleanly: %s\n", e.what());
            std::exit(b == std::vector<int>(10, 2) ? 0 : 1);
        }
    };
    CUDAWAIT_EXPECT_IN_CHILD_WITHOUT_DEVICE(child(), "copy failed cleanly");
}

// ---- with a GPU -------------------------------------------------------------------------------

class copy_gpu : public cudawait::testing::pool_gpu_test {};

TEST_F(copy_gpu, classify_tells_the_four_kinds_apart) {
    cudawait::stream s;
    std::vector<int> pageable(16);
    pinned_buffer<int> pinned(16);
    device_buffer<int> dev(16, s);
    int* managed = nullptr;
    ASSERT_EQ(cudaMallocManaged(&managed, 64), cudaSuccess);
    EXPECT_EQ(cudawait::classify(pageable.data()), memory_kind::pageable);
    EXPECT_EQ(cudawait::classify(pinned.data()), memory_kind::pinned);
    EXPECT_EQ(cudawait::classify(dev.data()), memory_kind::device);
    EXPECT_EQ(cudawait::classify(managed), memory_kind::managed);
    ASSERT_EQ(cudaFree(managed), cudaSuccess);
    s.sync();
}

TEST_F(copy_gpu, pinned_and_device_round_trip_with_copy_async) {
    cudawait::stream s;
    const std::size_t n = 3_MiB + 17;
    auto want = random_bytes(n, 1);
    pinned_buffer<std::uint8_t> in(n);
    pinned_buffer<std::uint8_t> out(n);
    std::memcpy(in.data(), want.data(), n);
    std::memset(out.data(), 0xcd, n);
    device_buffer<std::uint8_t> dev(n, s);
    device_buffer<std::uint8_t> dev2(n, s);
    copy_async(dev, in, s);
    copy_async(dev2, dev, s); // device to device
    copy_async(out, dev2, s);
    s.sync();
    ASSERT_EQ(std::memcmp(out.data(), want.data(), n), 0);
}

TEST_F(copy_gpu, user_ranges_that_state_their_memory_copy_both_ways) {
    cudawait::stream s;
    cudawait::pinned_pool pool;
    const std::size_t n = (3_MiB + 20) / 4;
    const std::size_t bytes = n * sizeof(std::uint32_t);
    std::vector<std::uint32_t> host(n);
    std::mt19937 rng(31);
    for (auto& x : host) {
        x = static_cast<std::uint32_t>(rng());
    }
    device_buffer<std::uint32_t> dev(n, s);
    ASSERT_EQ(cudaMemsetAsync(dev.data(), 0x77, bytes, s.get()), cudaSuccess);
    const stated_view<const std::uint32_t, memory_kind::device> dev_in(dev.data(), n);
    copy_options opt;
    opt.chunk_bytes = 1_MiB;

    // Pageable (as stated) to device (as stated): staged through the pool's chunks.
    copy_async(stated_view<std::uint32_t, memory_kind::device>(dev.data(), n),
               stated_view<const std::uint32_t, memory_kind::pageable>(host.data(), n), s, opt);
    // Device to page-locked memory with its own pool(): one direct copy.
    pinned_buffer<std::uint32_t> out(n, pool);
    std::memset(out.data(), 0xcd, bytes);
    copy_async(pooled_view<std::uint32_t>(out.data(), n, pool), dev_in, s);
    s.sync();
    ASSERT_EQ(std::memcmp(out.data(), host.data(), bytes), 0);

    // Awaited, device to pageable (as stated): staged.
    std::vector<std::uint32_t> back(n, 0xdeadbeef);
    cudawait::scheduler sched;
    cudawait::sync_wait(
        sched,
        copy(stated_view<std::uint32_t, memory_kind::pageable>(back.data(), n), dev_in, s, opt));
    EXPECT_EQ(back, host);

    // The stated pool is the one marked in use: freed while the copy still waits behind a slow
    // kernel, the block is held back.
    // The pool hands out whole blocks (rounded up), and holds back the whole block.
    const std::size_t in_use_before = pool.stats().in_use_bytes;
    void* raw = pool.allocate(bytes);
    const std::size_t block = pool.stats().in_use_bytes - in_use_before;
    ASSERT_GE(block, bytes);
    ASSERT_LT(block, bytes + 4096);
    ASSERT_EQ(cudawait::testing::launch_spin(100'000'000, nullptr, 0, s.get()), cudaSuccess);
    copy_async(pooled_view<std::uint32_t>(static_cast<std::uint32_t*>(raw), n, pool), dev_in, s);
    pool.deallocate(raw);
    EXPECT_EQ(pool.stats().pending_bytes, block) << "freed while the copy engine will write it";
    s.sync();
    EXPECT_EQ(pool.collect(), block);
}

TEST_F(copy_gpu, pool_memory_is_marked_in_use_by_the_stream) {
    cudawait::stream s;
    cudawait::pinned_pool pool;
    const std::size_t n = 1_MiB;
    device_buffer<std::uint8_t> dev(n, s);
    pinned_buffer<std::uint8_t> src(n, pool);
    auto want = random_bytes(n, 2);
    std::memcpy(src.data(), want.data(), n);
    // The stream is busy for 100 ms, so the copy has not started when the buffer is freed.
    ASSERT_EQ(cudawait::testing::launch_spin(100'000'000, nullptr, 0, s.get()), cudaSuccess);
    copy_async(dev, src, s, copy_options{&pool});
    src.reset();
    EXPECT_EQ(pool.stats().pending_bytes, n) << "freed while the copy engine will still read it";
    // A raw span into the pool gets the same treatment.
    void* raw = pool.allocate(n);
    std::memset(raw, 0x5a, n);
    copy_async(dev, std::span<const std::uint8_t>(static_cast<std::uint8_t*>(raw), n), s,
               copy_options{&pool});
    pool.deallocate(raw);
    EXPECT_EQ(pool.stats().pending_bytes, 2 * n);
    s.sync();
    EXPECT_EQ(pool.collect(), 2 * n);
    std::vector<std::uint8_t> back(n);
    copy_async(back, dev, s, copy_options{&pool});
    EXPECT_EQ(back, std::vector<std::uint8_t>(n, 0x5a));
}

struct staged_case {
    std::size_t bytes;
    std::size_t offset; ///< into the host vector: unaligned host pointers
    std::size_t chunk;
    unsigned depth;
};

void PrintTo(const staged_case& c, std::ostream* os) {
    *os << c.bytes << " bytes at offset " << c.offset << ", chunks of " << c.chunk << " x"
        << c.depth;
}

class copy_staged : public copy_gpu, public ::testing::WithParamInterface<staged_case> {};

// Pageable <-> device at odd sizes and offsets, through several chunks, both entry points.
TEST_P(copy_staged, pageable_round_trip_is_exact) {
    staged_case c = GetParam();
    cudawait::stream s;
    copy_options opt;
    opt.chunk_bytes = c.chunk;
    opt.depth = c.depth;
    auto host = random_bytes(c.bytes + c.offset, c.bytes * 31 + c.offset);
    std::span<const std::uint8_t> src(host.data() + c.offset, c.bytes);
    std::vector<std::uint8_t> back_storage(c.bytes + 2 * c.offset + 8, 0xee);
    std::span<std::uint8_t> back(back_storage.data() + c.offset + 1, c.bytes);
    device_buffer<std::uint8_t> dev(c.bytes, s);
    ASSERT_EQ(cudaMemsetAsync(dev.data(), 0x77, c.bytes, s.get()), cudaSuccess);

    copy_async(dev, src, s, opt); // blocking staging
    copy_async(back, dev, s, opt);
    ASSERT_TRUE(std::equal(back.begin(), back.end(), src.begin())) << "copy_async";
    EXPECT_EQ(back_storage[c.offset], 0xee) << "wrote before the destination";
    EXPECT_EQ(back_storage[c.offset + 1 + c.bytes], 0xee) << "wrote past the destination";

    std::fill(back.begin(), back.end(), std::uint8_t{0xee});
    ASSERT_EQ(cudaMemsetAsync(dev.data(), 0x11, c.bytes, s.get()), cudaSuccess);
    cudawait::scheduler sched;
    cudawait::sync_wait(sched, copy(dev, src, s, opt)); // awaited staging
    cudawait::sync_wait(sched, copy(back, dev, s, opt));
    ASSERT_TRUE(std::equal(back.begin(), back.end(), src.begin())) << "co_await copy";
    EXPECT_EQ(back_storage[c.offset + 1 + c.bytes], 0xee);
}

INSTANTIATE_TEST_SUITE_P(
    sizes, copy_staged,
    ::testing::Values(staged_case{1, 0, 64_KiB, 2}, staged_case{255, 3, 64_KiB, 2},
                      staged_case{4097, 1, 4096, 2}, staged_case{1_MiB + 3, 7, 64_KiB, 3},
                      staged_case{5_MiB + 7, 5, 1_MiB, 2}, staged_case{5_MiB + 7, 0, 1_MiB, 4},
                      staged_case{40_MiB + 13, 1, 8_MiB, 3}),
    [](const ::testing::TestParamInfo<staged_case>& info) {
        const staged_case& c = info.param;
        return "bytes" + std::to_string(c.bytes) + "_offset" + std::to_string(c.offset) + "_chunk" +
               std::to_string(c.chunk) + "_depth" + std::to_string(c.depth);
    });

TEST_F(copy_gpu, staged_copies_follow_the_streams_earlier_work) {
    cudawait::stream s;
    const std::size_t n = (6_MiB + 40) / 4;
    std::vector<std::uint32_t> host(n);
    std::mt19937 rng(9);
    for (auto& x : host) {
        x = static_cast<std::uint32_t>(rng());
    }
    device_buffer<std::uint32_t> dev(n, s);
    std::vector<std::uint32_t> back(n, 0xdeadbeef);
    copy_options opt;
    opt.chunk_bytes = 1_MiB;
    cudawait::scheduler sched;
    auto work = [&]() -> cudawait::task<void> {
        co_await copy(dev, host, s, opt);
        // A slow kernel, then the copy back: the copy must wait for it.
        if (cudawait::testing::launch_spin(30'000'000, nullptr, 0, s.get()) != cudaSuccess ||
            cudawait::testing::launch_mix(dev.data(), n, 77, s.get()) != cudaSuccess) {
            throw std::runtime_error("launch failed");
        }
        co_await copy(back, dev, s, opt);
    };
    cudawait::sync_wait(sched, work());
    cudawait::testing::mix_on_host(host.data(), n, 77);
    EXPECT_EQ(back, host);
}

TEST_F(copy_gpu, concurrent_awaited_copies_on_several_streams) {
    cudawait::stream s1;
    cudawait::stream s2;
    const std::size_t n = 9_MiB + 5;
    auto a = random_bytes(n, 10);
    auto b = random_bytes(n, 11);
    device_buffer<std::uint8_t> da(n, s1);
    device_buffer<std::uint8_t> db(n, s2);
    std::vector<std::uint8_t> ra(n, 0);
    std::vector<std::uint8_t> rb(n, 0);
    copy_options opt;
    opt.chunk_bytes = 2_MiB;
    cudawait::scheduler sched;
    auto trip = [&](std::vector<std::uint8_t>& src, device_buffer<std::uint8_t>& d,
                    std::vector<std::uint8_t>& dst,
                    cudawait::stream_ref s) -> cudawait::task<void> {
        co_await copy(d, src, s, opt);
        co_await copy(dst, d, s, opt);
    };
    cudawait::sync_wait(sched, cudawait::when_all(trip(a, da, ra, s1), trip(b, db, rb, s2)));
    EXPECT_EQ(ra, a);
    EXPECT_EQ(rb, b);
}

// ---- device memory of two devices: peer copies ---------------------------------------------

TEST(copy_peer, enable_peer_access_rejects_ids_that_name_no_device) {
    // Without a driver or a device the id check fails the same way: a cuda_error.
    EXPECT_THROW((void)cudawait::enable_peer_access(-1, 0), cudawait::cuda_error);
    EXPECT_THROW((void)cudawait::enable_peer_access(0, 1 << 20), cudawait::cuda_error);
}

std::vector<std::uint32_t> random_words(std::size_t n, std::uint64_t seed) {
    std::vector<std::uint32_t> v(n);
    std::mt19937_64 rng(seed);
    for (auto& x : v) {
        x = static_cast<std::uint32_t>(rng());
    }
    return v;
}

// The device's memory, read back through a staged copy into a vector that is poisoned first.
std::vector<std::uint32_t> read_back(const device_buffer<std::uint32_t>& d,
                                     cudawait::stream_ref s) {
    std::vector<std::uint32_t> out(d.size(), 0xdeadbeef);
    copy_async(out, d, s);
    return out;
}

TEST_F(copy_gpu, peer_access_of_a_device_to_itself_is_on_and_leaves_no_error) {
    EXPECT_TRUE(cudawait::enable_peer_access(0, 0));
    EXPECT_TRUE(cudawait::enable_peer_access(0, 0)) << "asked twice";
    EXPECT_EQ(cudaGetLastError(), cudaSuccess) << "no error left behind";
}

TEST_F(copy_gpu, device_to_device_on_one_device_through_the_peer_call_is_exact) {
    cudawait::stream s;
    const std::size_t n = (5_MiB + 12) / 4;
    const std::size_t bytes = n * sizeof(std::uint32_t);
    auto want = random_words(n, 41);
    device_buffer<std::uint32_t> src(n, s);
    device_buffer<std::uint32_t> dst(n, s);
    copy_async(src, want, s);

    // The plan knows both sides' device; one device is no peer copy.
    auto plan = cudawait::detail::make_plan(dst, src, copy_options{});
    EXPECT_EQ(plan.dst_device, 0);
    EXPECT_EQ(plan.src_device, 0);
    EXPECT_FALSE(plan.peer());
    EXPECT_FALSE(plan.staged());

    // The peer call with both ids 0: cudaMemcpyPeerAsync within one device.
    ASSERT_EQ(cudaMemsetAsync(dst.data(), 0xcd, bytes, s.get()), cudaSuccess);
    cudawait::detail::enqueue_peer(dst.data(), 0, src.data(), 0, bytes, s);
    EXPECT_EQ(read_back(dst, s), want) << "cudaMemcpyPeerAsync 0 -> 0";

    // The public entry points, enqueued and awaited.
    ASSERT_EQ(cudaMemsetAsync(dst.data(), 0xcd, bytes, s.get()), cudaSuccess);
    copy_async(dst, src, s);
    EXPECT_EQ(read_back(dst, s), want) << "copy_async";
    ASSERT_EQ(cudaMemsetAsync(dst.data(), 0xcd, bytes, s.get()), cudaSuccess);
    cudawait::scheduler sched;
    cudawait::sync_wait(sched, copy(dst, src, s));
    EXPECT_EQ(read_back(dst, s), want) << "co_await copy";
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

TEST_F(copy_gpu, device_buffers_of_different_sizes_are_a_usage_error) {
    cudawait::stream s;
    device_buffer<std::uint32_t> a(100, s);
    device_buffer<std::uint32_t> b(101, s);
    EXPECT_THROW(copy_async(a, b, s), usage_error);
    EXPECT_THROW((void)copy(a, b, s), usage_error);
    s.sync();
}

// Between the first and the last device (0 and 1 on two GPUs; on one GPU both are device 0,
// and the plan is then a copy within the device): every direction and stream choice is exact.
TEST_F(copy_gpu, device_to_device_between_the_first_and_last_device_is_exact_either_way) {
    const int a = 0;
    const int b = cudawait::device_count() - 1;
    cudawait::stream sa{cudawait::device_ref(a)};
    cudawait::stream sb{cudawait::device_ref(b)};
    const std::size_t n = (7_MiB + 4) / 4;
    const std::size_t bytes = n * sizeof(std::uint32_t);
    auto want = random_words(n, 42);
    auto other = random_words(n, 43);
    device_buffer<std::uint32_t> on_a(n, sa);
    device_buffer<std::uint32_t> on_b(n, sb);
    device_buffer<std::uint32_t> back_a(n, sa);
    copy_async(on_a, want, sa);

    if (a != b) {
        int can_ab = 0;
        int can_ba = 0;
        ASSERT_EQ(cudaDeviceCanAccessPeer(&can_ab, a, b), cudaSuccess);
        ASSERT_EQ(cudaDeviceCanAccessPeer(&can_ba, b, a), cudaSuccess);
        EXPECT_EQ(cudawait::enable_peer_access(a, b), can_ab != 0);
        EXPECT_EQ(cudawait::enable_peer_access(b, a), can_ba != 0);
        EXPECT_EQ(cudawait::enable_peer_access(a, b), can_ab != 0) << "settled once, same answer";
    } else {
        EXPECT_TRUE(cudawait::enable_peer_access(a, b)) << "a device reaches its own memory";
    }
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);

    auto plan = cudawait::detail::make_plan(on_b, on_a, copy_options{});
    EXPECT_EQ(plan.dst_device, b);
    EXPECT_EQ(plan.src_device, a);
    EXPECT_EQ(plan.peer(), a != b);

    // a -> b on the source device's stream, enqueued only.
    ASSERT_EQ(cudaMemsetAsync(on_b.data(), 0xcd, bytes, sb.get()), cudaSuccess);
    sb.sync();
    copy_async(on_b, on_a, sa);
    sa.sync();
    EXPECT_EQ(read_back(on_b, sb), want) << "a -> b on a's stream";

    // b -> a on the source device's stream, awaited; then a -> b on the destination's stream,
    // with other data.
    ASSERT_EQ(cudaMemsetAsync(back_a.data(), 0xcd, bytes, sa.get()), cudaSuccess);
    sa.sync();
    cudawait::scheduler sched;
    cudawait::sync_wait(sched, copy(back_a, on_b, sb));
    EXPECT_EQ(read_back(back_a, sa), want) << "b -> a on b's stream";
    copy_async(on_a, other, sa);
    sa.sync();
    cudawait::sync_wait(sched, copy(on_b, on_a, sb));
    EXPECT_EQ(read_back(on_b, sb), other) << "a -> b on b's stream";
    sa.sync();
    sb.sync();
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

// ---- copies on the device's copy lanes (copy_lane.hpp) -----------------------------------------

TEST(copy_lane, bad_arguments_are_usage_errors_at_the_call) {
    std::vector<int> a(10);
    std::vector<int> b(11);
    using cudawait::lane;
    EXPECT_THROW((void)copy(a, b), usage_error);
    EXPECT_THROW((void)copy(a, b, lane::small), usage_error);
    EXPECT_THROW((void)copy(a, b, lane::bulk, copy_options{}), usage_error);
    std::vector<int> empty;
    EXPECT_THROW((void)copy(empty, std::vector<int>{}), usage_error);
    EXPECT_THROW(
        (void)copy(std::span<int>(a.data() + 2, 5), std::span<const int>(a.data(), 5), lane::small),
        usage_error)
        << "overlap";
    EXPECT_THROW((void)copy(std::span<int>(static_cast<int*>(nullptr), 4),
                            std::span<const int>(a.data(), 4)),
                 usage_error);
}

// Each of the three memory kinds on the host side of a lane copy, to the device and back, at
// sizes on the small lane (one element, odd, 4 KiB, the threshold) and above it (the bulk lane),
// through the lane the size picks and through each named one; every element checked against
// random data, into poisoned memory.
TEST_F(copy_gpu, lane_copies_of_every_memory_kind_are_exact) {
    using cudawait::lane;
    cudawait::stream s;
    cudawait::scheduler sched;
    const copy_options opt; // small_bytes 64 KiB
    std::uint64_t seed = 100;
    for (std::size_t bytes :
         {std::size_t{4}, std::size_t{4100}, 4_KiB, 64_KiB, 64_KiB + 4, 1_MiB + 12}) {
        const std::size_t n = bytes / sizeof(std::uint32_t);
        for (int how = 0; how < 3; ++how) { // 0: by size, 1: lane::small, 2: lane::bulk
            SCOPED_TRACE(::testing::Message() << bytes << " bytes, way " << how);
            auto trip = [&](auto& dst, const auto& src) -> cudawait::task<void> {
                if (how == 0) {
                    co_await copy(dst, src, opt);
                } else {
                    co_await copy(dst, src, how == 1 ? lane::small : lane::bulk, opt);
                }
            };
            device_buffer<std::uint32_t> dev(n, s);
            device_buffer<std::uint32_t> dev2(n, s);
            ASSERT_EQ(cudaMemsetAsync(dev.data(), 0xcd, bytes, s.get()), cudaSuccess);
            ASSERT_EQ(cudaMemsetAsync(dev2.data(), 0xcd, bytes, s.get()), cudaSuccess);
            s.sync(); // a lane copy is not ordered with `s`

            // Pageable (staged through one pinned block) to the device and back.
            auto want = random_words(n, seed++);
            std::vector<std::uint32_t> back(n, 0xdeadbeef);
            cudawait::sync_wait(sched, trip(dev, want));
            cudawait::sync_wait(sched, trip(back, dev));
            ASSERT_EQ(back, want) << "pageable";

            // Device to device (the destination device's h2d stream), then pinned back.
            cudawait::sync_wait(sched, trip(dev2, dev));
            pinned_buffer<std::uint32_t> pin(n);
            std::memset(pin.data(), 0xab, bytes);
            cudawait::sync_wait(sched, trip(pin, dev2));
            ASSERT_EQ(std::memcmp(pin.data(), want.data(), bytes), 0) << "device, then pinned";

            // Pinned to the device, read back through the caller's stream.
            want = random_words(n, seed++);
            std::memcpy(pin.data(), want.data(), bytes);
            cudawait::sync_wait(sched, trip(dev, pin));
            ASSERT_EQ(read_back(dev, s), want) << "pinned";
            s.sync();
        }
    }
}

// The lane a copy takes: the device's small or bulk lane as its size or the caller says, and
// the stream of its direction.
TEST_F(copy_gpu, lane_copies_go_on_the_lane_of_their_size_and_direction) {
    using cudawait::copy_direction;
    using cudawait::lane;
    using cudawait::detail::lane_stream;
    using cudawait::detail::make_plan;
    cudawait::stream s;
    auto& lanes = cudawait::copy_lanes::for_device(cudawait::device_ref(0));
    device_buffer<std::uint32_t> small_dev(16, s);
    device_buffer<std::uint32_t> big_dev(1_MiB, s);
    std::vector<std::uint32_t> small_host(16);
    pinned_buffer<std::uint32_t> big_host(1_MiB);
    const copy_options opt;
    auto plan = make_plan(small_dev, small_host, opt);
    EXPECT_EQ(lane_stream(plan, lane::small), lanes.get(lane::small, copy_direction::h2d));
    EXPECT_EQ(lane_stream(plan, lane::bulk), lanes.get(lane::bulk, copy_direction::h2d));
    plan = make_plan(small_host, small_dev, opt);
    EXPECT_EQ(lane_stream(plan, lane::small), lanes.get(lane::small, copy_direction::d2h));
    plan = make_plan(big_host, big_dev, opt);
    EXPECT_EQ(lane_stream(plan, lane::bulk), lanes.get(lane::bulk, copy_direction::d2h));
    device_buffer<std::uint32_t> other_dev(1_MiB, s);
    plan = make_plan(other_dev, big_dev, opt);
    EXPECT_EQ(lane_stream(plan, lane::small), lanes.get(lane::small, copy_direction::h2d))
        << "device to device: the destination's h2d stream";
    s.sync();
}

} // namespace
