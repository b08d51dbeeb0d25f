// SPDX-License-Identifier: Apache-2.0
// This file includes libcu++'s <cuda/memory_resource> before cudawait and without
// LIBCUDACXX_ENABLE_EXPERIMENTAL_MEMORY_RESOURCE, as a user might. CCCL 3.0 then declares no
// memory resources (and a later definition of the switch cannot bring them back): cudawait
// must still compile, say so through CUDAWAIT_HAS_CUDA_MR, and work.
// clang-format off
#if __has_include(<cuda/memory_resource>)
#include <cuda/memory_resource>
#endif
#include <cudawait/memory/pinned_buffer.hpp>
// clang-format on

#include <cstdint>
#include <memory_resource>
#include <random>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <cuda_runtime.h>

#include "gpu_fixture.hpp"
#include "host_pool.hpp"
#include <gtest/gtest.h>

namespace {

using namespace cudawait::literals;
using cudawait::pinned_buffer;
using cudawait::pinned_pool;
using cudawait::usage_error;
using cudawait::testing::fake_stream;
using cudawait::testing::host_pool;

#if defined(CCCL_VERSION) && CCCL_VERSION < 3001000
static_assert(CUDAWAIT_HAS_CUDA_MR == 0, "<cuda/memory_resource> came first, without the switch");
#elif defined(CCCL_VERSION)
static_assert(CUDAWAIT_HAS_CUDA_MR == 1);
#endif
static_assert(std::is_base_of_v<std::pmr::memory_resource, pinned_pool>);
static_assert(!std::is_copy_constructible_v<pinned_buffer<int>>);
static_assert(std::is_nothrow_move_constructible_v<pinned_buffer<int>>);
static_assert(std::ranges::contiguous_range<pinned_buffer<int>>);

TEST(pinned_buffer, holds_a_block_of_its_pool_until_destroyed) {
    host_pool h;
    pinned_pool pool(h.options());
    {
        pinned_buffer<std::uint32_t> b(1000, pool);
        EXPECT_EQ(b.size(), 1000u);
        EXPECT_EQ(b.size_bytes(), 4000u);
        EXPECT_EQ(pool.stats().requested_bytes, 4000u);
        EXPECT_EQ(&b.pool(), &pool);
        std::mt19937 rng(1);
        std::vector<std::uint32_t> want(1000);
        for (std::size_t i = 0; i < 1000; ++i) {
            b[i] = want[i] = static_cast<std::uint32_t>(rng());
        }
        EXPECT_TRUE(std::equal(b.begin(), b.end(), want.begin()));
        EXPECT_EQ(b.span().data(), b.data());
    }
    EXPECT_EQ(pool.stats().in_use_bytes, 0u);
}

TEST(pinned_buffer, moves_transfer_ownership_and_leave_an_empty_buffer) {
    host_pool h;
    pinned_pool pool(h.options());
    pinned_buffer<int> a(64, pool);
    int* p = a.data();
    pinned_buffer<int> b(std::move(a));
    EXPECT_EQ(b.data(), p);
    EXPECT_FALSE(a); // NOLINT(bugprone-use-after-move): checking the moved-from state
    EXPECT_THROW((void)a.data(), usage_error);
    EXPECT_THROW((void)a.span(), usage_error);
    EXPECT_THROW(a.record_use(fake_stream(1)), usage_error);
    pinned_buffer<int> c(16, pool);
    c = std::move(b); // c's old block goes back to the pool
    EXPECT_EQ(c.data(), p);
    EXPECT_EQ(pool.stats().blocks_in_use, 1u);
    c.reset();
    EXPECT_EQ(pool.stats().blocks_in_use, 0u);
    EXPECT_TRUE(c.empty());
}

// Everything that reaches the memory throws on an empty buffer, operator[] included (it used to
// index a null pointer), and the message names the buffer type.
void expect_no_access(const pinned_buffer<int>& b) {
    EXPECT_FALSE(b);
    EXPECT_TRUE(b.empty());
    EXPECT_EQ(b.size(), 0u);
    EXPECT_EQ(b.size_bytes(), 0u);
    EXPECT_THROW((void)b.data(), usage_error);
    EXPECT_THROW((void)b[0], usage_error);
    EXPECT_THROW((void)b.span(), usage_error);
    EXPECT_THROW((void)b.begin(), usage_error);
    EXPECT_THROW((void)b.end(), usage_error);
    EXPECT_THROW((void)b.pool(), usage_error);
    EXPECT_THROW(b.record_use(fake_stream(1)), usage_error);
    try {
        (void)b[3];
        ADD_FAILURE() << "no exception";
    } catch (const usage_error& e) {
        EXPECT_NE(std::string(e.what()).find("pinned_buffer"), std::string::npos) << e.what();
    }
}

TEST(pinned_buffer, an_empty_moved_from_or_reset_buffer_gives_no_access_to_memory) {
    host_pool h;
    pinned_pool pool(h.options());
    {
        SCOPED_TRACE("default constructed");
        expect_no_access(pinned_buffer<int>());
    }
    pinned_buffer<int> a(8, pool);
    a[7] = 42;
    pinned_buffer<int> b(std::move(a));
    EXPECT_EQ(b[7], 42);
    {
        SCOPED_TRACE("moved from");
        expect_no_access(a); // NOLINT(bugprone-use-after-move): checking the moved-from state
    }
    pinned_buffer<int> c(4, pool);
    c = std::move(b);
    {
        SCOPED_TRACE("move-assigned from");
        expect_no_access(b); // NOLINT(bugprone-use-after-move)
    }
    EXPECT_EQ(c[7], 42);
    EXPECT_EQ(&c.pool(), &pool);
    c.reset();
    {
        SCOPED_TRACE("reset");
        expect_no_access(c);
    }
    EXPECT_EQ(pool.stats().blocks_in_use, 0u);
}

TEST(pinned_buffer, record_use_defers_reuse_of_its_block) {
    host_pool h;
    pinned_pool pool(h.options());
    void* first = nullptr;
    {
        pinned_buffer<float> b(256, pool);
        first = b.data();
        b.record_use(fake_stream(3));
    }
    EXPECT_EQ(pool.stats().pending_bytes, 1024u);
    pinned_buffer<float> again(256, pool);
    EXPECT_NE(static_cast<void*>(again.data()), first);
    h.tracker->complete(0);
    pool.collect();
    pinned_buffer<float> third(256, pool);
    EXPECT_EQ(static_cast<void*>(third.data()), first);
}

TEST(pinned_buffer, bad_sizes_are_typed_errors) {
    host_pool h;
    pinned_pool pool(h.options(256_MiB));
    EXPECT_THROW(pinned_buffer<int>(0, pool), usage_error);
    EXPECT_THROW(pinned_buffer<double>(std::size_t(-1) / 4, pool), usage_error);
    EXPECT_THROW(pinned_buffer<char>(512_MiB, pool), cudawait::pool_exhausted);
    EXPECT_EQ(pool.stats().in_use_bytes, 0u);
}

class pinned_buffer_gpu : public cudawait::testing::gpu_test {};

TEST_F(pinned_buffer_gpu, default_pool_memory_is_page_locked) {
    pinned_buffer<std::uint64_t> b(12345);
    cudaPointerAttributes attr{};
    ASSERT_EQ(cudaPointerGetAttributes(&attr, b.data()), cudaSuccess);
    EXPECT_EQ(attr.type, cudaMemoryTypeHost);
    EXPECT_EQ(&b.pool(), &cudawait::default_pinned_pool());
}

} // namespace
