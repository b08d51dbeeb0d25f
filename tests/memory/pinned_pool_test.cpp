// SPDX-License-Identifier: Apache-2.0
// Nothing here defines LIBCUDACXX_ENABLE_EXPERIMENTAL_MEMORY_RESOURCE: the pool must be a
// cuda::mr resource for a user who does nothing special.
#include <cudawait/copy/copy.hpp>
#include <cudawait/core/scheduler.hpp>
#include <cudawait/core/task.hpp>
#include <cudawait/memory/device_buffer.hpp>
#include <cudawait/memory/pinned_buffer.hpp>
#include <cudawait/memory/pinned_pool.hpp>
#include <cudawait/runtime/stream.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory_resource>
#include <mutex>
#include <random>
#include <set>
#include <stdexcept>
#include <stop_token>
#include <string>
#include <thread>
#include <vector>

#include <cuda_runtime.h>

#include "cuda_mr_ref.hpp"
#include "gpu_fixture.hpp"
#include "host_pool.hpp"
#include "mapped_words.hpp"
#include "no_device.hpp"
#include "pinned_pool_helpers.hpp"
#include "test_kernels.hpp"
#include <gtest/gtest.h>
#include <stdlib.h>

namespace {

using namespace cudawait::literals;
using cudawait::pinned_pool;
using cudawait::pinned_pool_options;
using cudawait::pool_exhausted;
using cudawait::usage_error;
using cudawait::use_token;

#if __has_include(<cuda/memory_resource>)
static_assert(CUDAWAIT_HAS_CUDA_MR == 1, "libcu++ is here, so the pool is a cuda::mr resource");
#endif
#if CUDAWAIT_HAS_CUDA_MR
using cudawait::testing::pool_ref;
using cudawait::testing::ref_allocate;
using cudawait::testing::ref_deallocate;
#endif
static_assert(std::is_base_of_v<std::pmr::memory_resource, pinned_pool>);
static_assert(std::is_base_of_v<std::bad_alloc, pool_exhausted>);

using cudawait::testing::fake_stream;
using cudawait::testing::host_pool;
using cudawait::testing::timed_tracker;

using cudawait::testing::all_equal;
using cudawait::testing::fill;
using cudawait::testing::heap_round;

// ---- pool bookkeeping, without a GPU ---------------------------------------------------------

TEST(pinned_pool, blocks_are_disjoint_and_large_ones_2mib_aligned) {
    host_pool h;
    pinned_pool pool(h.options());
    std::vector<std::pair<void*, std::size_t>> blocks;
    std::mt19937_64 rng(11);
    for (int i = 0; i < 200; ++i) {
        std::size_t n = 1 + rng() % (i % 10 == 0 ? 6_MiB : 300_KiB);
        void* p = pool.allocate(n);
        EXPECT_EQ(reinterpret_cast<std::uintptr_t>(p) % 256, 0u);
        if (n >= 2_MiB) {
            EXPECT_EQ(reinterpret_cast<std::uintptr_t>(p) % 2_MiB, 0u) << n;
        }
        fill(p, n, static_cast<std::uint8_t>(i));
        blocks.emplace_back(p, n);
    }
    for (std::size_t i = 0; i < blocks.size(); ++i) {
        EXPECT_TRUE(all_equal(blocks[i].first, blocks[i].second, static_cast<std::uint8_t>(i)))
            << "block " << i << " was overwritten by another";
        pool.deallocate(blocks[i].first);
    }
    EXPECT_EQ(pool.stats().in_use_bytes, 0u);
}

TEST(pinned_pool, large_requests_are_not_rounded_to_powers_of_two) {
    host_pool h;
    pinned_pool pool(h.options(1_GiB, 2_MiB));
    void* p = pool.allocate(33_MiB + 1);
    EXPECT_EQ(pool.stats().in_use_bytes, 33_MiB + 256);
    EXPECT_EQ(pool.stats().reserved_bytes, 34_MiB);
    pool.deallocate(p);
    // A size whose segregated-fit class lies above its slab still fits in that slab. (The
    // empty 34 MiB slab, too small for it, goes back before the pool grows past its peak.)
    void* q = pool.allocate(200_MiB + 1);
    EXPECT_EQ(pool.stats().reserved_bytes, 202_MiB);
    EXPECT_EQ(pool.stats().growth_count, 2u);
    pool.deallocate(q);
}

// Rounds of a batch of mixed sizes (1 KiB to 64 MiB, log-uniform, 2 GiB in all), each freed
// before the next: the pool must not waste more than 15% over the peak it was asked for.
TEST(pinned_pool, waste_stays_bounded_on_a_mixed_workload) {
    host_pool h;
    pinned_pool pool(h.options(8_GiB));
    std::mt19937_64 rng(5);
    std::uniform_real_distribution<double> log_size(std::log(1024.0), std::log(64.0 * (1 << 20)));
    std::size_t peak = 0;
    for (int round = 0; round < 30; ++round) {
        std::vector<void*> live;
        std::size_t live_bytes = 0;
        while (live_bytes < 2_GiB) {
            auto n = static_cast<std::size_t>(std::exp(log_size(rng)));
            live.push_back(pool.allocate(n));
            live_bytes += n;
        }
        peak = std::max(peak, live_bytes);
        std::shuffle(live.begin(), live.end(), rng);
        for (void* p : live) {
            pool.deallocate(p);
        }
    }
    auto s = pool.stats();
    EXPECT_EQ(s.peak_requested_bytes, peak);
    double waste = static_cast<double>(s.peak_reserved_bytes) / static_cast<double>(peak);
    RecordProperty("waste_ratio", std::to_string(waste));
    EXPECT_LE(waste, 1.15) << "reserved " << s.peak_reserved_bytes << " for a peak of " << peak;
    EXPECT_GT(s.hits, s.misses * 10);
}

TEST(pinned_pool, freed_block_is_not_reused_until_its_use_completed) {
    host_pool h;
    pinned_pool pool(h.options());
    void* a = pool.allocate(1_MiB);
    pool.record_use(a, fake_stream(1));
    pool.deallocate(a);
    EXPECT_EQ(pool.stats().pending_bytes, 1_MiB);
    // The same request while the GPU may still use `a`: a different block.
    void* b = pool.allocate(1_MiB);
    EXPECT_NE(b, a);
    EXPECT_GE(std::abs(static_cast<std::byte*>(b) - static_cast<std::byte*>(a)),
              static_cast<std::ptrdiff_t>(1_MiB));
    EXPECT_EQ(pool.collect(), 0u) << "nothing completed yet";
    h.tracker->complete(0);
    EXPECT_EQ(pool.collect(), 1_MiB);
    EXPECT_EQ(pool.stats().pending_bytes, 0u);
    void* c = pool.allocate(1_MiB);
    EXPECT_EQ(c, a) << "the completed block is back in circulation";
    pool.deallocate(b);
    pool.deallocate(c);
    EXPECT_EQ(h.tracker->outstanding, 0);
}

TEST(pinned_pool, every_stream_that_used_a_block_must_finish) {
    host_pool h;
    pinned_pool pool(h.options());
    auto* a = static_cast<std::byte*>(pool.allocate(4_MiB));
    pool.record_use(a, fake_stream(1));         // mark 0
    pool.record_use(a + 12345, fake_stream(2)); // mark 1: an interior pointer counts
    pool.record_use(a, fake_stream(1));         // mark 2 replaces mark 0 (same stream)
    EXPECT_EQ(h.tracker->outstanding, 2);
    pool.deallocate(a);
    h.tracker->complete(2);
    EXPECT_EQ(pool.collect(), 0u) << "stream 2 has not finished";
    h.tracker->complete(1);
    EXPECT_EQ(pool.collect(), 4_MiB);
    EXPECT_EQ(h.tracker->outstanding, 0);
}

TEST(pinned_pool, growth_collects_completed_blocks_before_asking_the_upstream) {
    host_pool h;
    pinned_pool pool(h.options(1_GiB, 64_MiB));
    void* a = pool.allocate(64_MiB);
    pool.record_use(a, fake_stream(1));
    pool.deallocate(a);
    h.tracker->complete(0);
    void* b = pool.allocate(64_MiB); // a miss in the free lists; collection finds `a`
    EXPECT_EQ(b, a);
    EXPECT_EQ(h.slabs->allocations, 1);
    pool.deallocate(b);
}

TEST(pinned_pool, at_the_cap_free_slabs_are_released_and_the_request_retried) {
    host_pool h;
    pinned_pool pool(h.options(192_MiB, 64_MiB));
    void* a = pool.allocate(64_MiB);
    void* b = pool.allocate(64_MiB);
    void* c = pool.allocate(64_MiB);
    EXPECT_EQ(pool.stats().reserved_bytes, 192_MiB);
    pool.deallocate(a);
    pool.deallocate(c);
    // 128 MiB fits in no slab; growing would pass the cap, so the two free slabs go back first.
    void* d = pool.allocate(128_MiB);
    EXPECT_EQ(h.slabs->deallocations, 2);
    EXPECT_EQ(pool.stats().reserved_bytes, 192_MiB);
    fill(d, 128_MiB, 0x5a);
    fill(b, 64_MiB, 0xa5);
    EXPECT_TRUE(all_equal(d, 128_MiB, 0x5a));
    pool.deallocate(b);
    pool.deallocate(d);
}

TEST(pinned_pool, past_the_cap_throws_pool_exhausted_with_the_figures) {
    host_pool h;
    pinned_pool pool(h.options(128_MiB, 64_MiB));
    void* a = pool.allocate(100_MiB);
    try {
        (void)pool.allocate(60_MiB);
        ADD_FAILURE() << "no exception";
    } catch (const pool_exhausted& e) {
        EXPECT_EQ(e.requested(), 60_MiB);
        EXPECT_EQ(e.in_use(), 100_MiB);
        EXPECT_EQ(e.pending(), 0u);
        EXPECT_EQ(e.cap(), 128_MiB);
        std::string what = e.what();
        EXPECT_NE(what.find("requested " + std::to_string(60_MiB)), std::string::npos) << what;
        EXPECT_NE(what.find(std::to_string(100_MiB) + " bytes in use"), std::string::npos) << what;
        EXPECT_NE(what.find("0 bytes pending"), std::string::npos) << what;
        EXPECT_NE(what.find("cap of " + std::to_string(128_MiB)), std::string::npos) << what;
    }
    EXPECT_THROW((void)pool.allocate(60_MiB), std::bad_alloc);
    // What was handed out is untouched and still usable.
    fill(a, 100_MiB, 0x11);
    EXPECT_TRUE(all_equal(a, 100_MiB, 0x11));
    EXPECT_THROW(pool.reserve(1_GiB), pool_exhausted);
    pool.deallocate(a);
    EXPECT_NO_THROW(pool.deallocate(pool.allocate(60_MiB)));
}

// Seven 1 MiB blocks in use and one pending (a kernel still reads it) fill an 8 MiB cap.
struct full_pool {
    host_pool h;
    pinned_pool pool;
    std::vector<void*> held;
    void* pending = nullptr;

    explicit full_pool(std::chrono::nanoseconds cap_wait) : pool(options(h, cap_wait)) {
        for (int i = 0; i < 7; ++i) {
            held.push_back(pool.allocate(1_MiB));
        }
        pending = pool.allocate(1_MiB);
        pool.record_use(pending, fake_stream(1)); // mark 0
        pool.deallocate(pending);
    }
    ~full_pool() {
        for (void* p : held) {
            if (p != nullptr) {
                pool.deallocate(p);
            }
        }
    }
    static pinned_pool_options options(host_pool& h, std::chrono::nanoseconds cap_wait) {
        pinned_pool_options o = h.options(8_MiB, 64_MiB);
        o.cap_wait = cap_wait;
        return o;
    }
};

TEST(pinned_pool, at_the_cap_a_request_waits_for_a_pending_block_to_come_back) {
    full_pool f(std::chrono::seconds(60));
    ASSERT_EQ(f.pool.stats().reserved_bytes, 8_MiB);
    std::atomic<bool> completed{false};
    std::thread gpu([&] {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        completed = true;
        f.h.tracker->complete(0);
    });
    void* p = nullptr;
    EXPECT_NO_THROW(p = f.pool.allocate(1_MiB)) << "the pending block was not waited for";
    EXPECT_TRUE(completed.load()) << "handed out before its use completed";
    EXPECT_EQ(p, f.pending) << "the block that came back";
    EXPECT_EQ(f.h.slabs->allocations, 1);
    gpu.join();
    if (p != nullptr) {
        f.pool.deallocate(p);
    }
}

TEST(pinned_pool, at_the_cap_a_free_from_another_thread_ends_the_wait) {
    full_pool f(std::chrono::seconds(60)); // the pending block never completes
    void* given_back = f.held[3];
    std::thread other([&] {
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
        f.pool.deallocate(given_back);
    });
    void* p = nullptr;
    EXPECT_NO_THROW(p = f.pool.allocate(1_MiB));
    EXPECT_EQ(p, given_back);
    other.join();
    f.held[3] = p;
    f.h.tracker->complete(0);
}

TEST(pinned_pool, at_the_cap_blocks_nobody_frees_throw_at_once_with_the_figures) {
    // Everything in use, nothing pending: waiting cannot help.
    host_pool h;
    pinned_pool_options o = h.options(8_MiB, 64_MiB);
    o.cap_wait = std::chrono::seconds(60);
    pinned_pool pool(o);
    std::vector<void*> held;
    for (int i = 0; i < 8; ++i) {
        held.push_back(pool.allocate(1_MiB));
    }
    auto start = std::chrono::steady_clock::now();
    try {
        (void)pool.allocate(1_MiB);
        ADD_FAILURE() << "no exception";
    } catch (const pool_exhausted& e) {
        EXPECT_EQ(e.requested(), 1_MiB);
        EXPECT_EQ(e.in_use(), 8_MiB);
        EXPECT_EQ(e.pending(), 0u);
        EXPECT_EQ(e.cap(), 8_MiB);
    }
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30))
        << "waited although nothing was pending";
    for (void* p : held) {
        pool.deallocate(p);
    }
}

TEST(pinned_pool, at_the_cap_a_request_larger_than_the_room_left_throws_at_once) {
    full_pool f(std::chrono::seconds(60));
    auto start = std::chrono::steady_clock::now();
    // 7 MiB in use: even once the pending block is back, 2 MiB cannot fit under 8 MiB.
    EXPECT_THROW((void)f.pool.allocate(2_MiB), pool_exhausted);
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));
    f.h.tracker->complete(0);
}

TEST(pinned_pool, at_the_cap_the_wait_is_bounded_and_the_error_states_the_pending_bytes) {
    full_pool f(std::chrono::milliseconds(50)); // the pending block never completes
    auto start = std::chrono::steady_clock::now();
    try {
        (void)f.pool.allocate(1_MiB);
        ADD_FAILURE() << "no exception";
    } catch (const pool_exhausted& e) {
        EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(50));
        EXPECT_EQ(e.requested(), 1_MiB);
        EXPECT_EQ(e.in_use(), 7_MiB);
        EXPECT_EQ(e.pending(), 1_MiB);
        EXPECT_EQ(e.cap(), 8_MiB);
        std::string what = e.what();
        EXPECT_NE(what.find("requested " + std::to_string(1_MiB)), std::string::npos) << what;
        EXPECT_NE(what.find(std::to_string(7_MiB) + " bytes in use"), std::string::npos) << what;
        EXPECT_NE(what.find(std::to_string(1_MiB) + " bytes pending"), std::string::npos) << what;
        EXPECT_NE(what.find("cap of " + std::to_string(8_MiB)), std::string::npos) << what;
    }
    EXPECT_GT(f.h.tracker->queries, 2) << "the pending block was checked while waiting";
    f.h.tracker->complete(0);
    void* p = f.pool.allocate(1_MiB); // and once it completed, it is handed out
    EXPECT_EQ(p, f.pending);
    f.pool.deallocate(p);
}

TEST(pinned_pool, default_cap_is_a_quarter_of_the_memory_the_process_may_use) {
    host_pool h;
    pinned_pool_options o = h.options(0);
    pinned_pool pool(o);
    EXPECT_EQ(pool.max_pinned_bytes(), cudawait::detail::usable_memory_bytes() / 4);
    EXPECT_LE(pool.max_pinned_bytes(), cudawait::detail::physical_memory_bytes() / 4);
    EXPECT_GT(pool.max_pinned_bytes(), 0u);
}

// A fake /proc and /sys/fs/cgroup below a fresh temporary directory.
class fake_root {
public:
    fake_root() {
        std::string tmpl = ::testing::TempDir() + "cudawait_cgroup_XXXXXX";
        if (::mkdtemp(tmpl.data()) == nullptr) {
            throw std::runtime_error("mkdtemp failed");
        }
        m_dir = tmpl;
    }
    fake_root(const fake_root&) = delete;
    fake_root& operator=(const fake_root&) = delete;
    ~fake_root() {
        std::error_code ec;
        std::filesystem::remove_all(m_dir, ec);
    }
    void write(const std::string& relative, const std::string& text) const {
        std::filesystem::path p = m_dir / relative;
        std::filesystem::create_directories(p.parent_path());
        std::ofstream(p) << text;
    }
    [[nodiscard]] std::string path() const { return m_dir.string(); }

private:
    std::filesystem::path m_dir;
};

using cudawait::detail::cgroup_memory_limit;
using cudawait::detail::physical_memory_bytes;
using cudawait::detail::usable_memory_bytes;

TEST(memory_limit, cgroup_v2_limit_of_the_process_cgroup) {
    fake_root r;
    r.write("proc/self/cgroup", "0::/user.slice/app.scope\n");
    r.write("sys/fs/cgroup/user.slice/memory.max", "max\n");
    r.write("sys/fs/cgroup/user.slice/app.scope/memory.max", "17179869184\n");
    EXPECT_EQ(cgroup_memory_limit(r.path()), 16_GiB);
    EXPECT_EQ(usable_memory_bytes(r.path()), std::min(16_GiB, physical_memory_bytes()));
}

TEST(memory_limit, cgroup_v2_lower_limit_of_a_parent_binds) {
    fake_root r;
    r.write("proc/self/cgroup", "0::/user.slice/app.scope\n");
    r.write("sys/fs/cgroup/user.slice/memory.max", "1073741824\n");
    r.write("sys/fs/cgroup/user.slice/app.scope/memory.max", "max\n");
    EXPECT_EQ(cgroup_memory_limit(r.path()), 1_GiB);
    EXPECT_EQ(usable_memory_bytes(r.path()), 1_GiB) << "lower than physical memory";
}

TEST(memory_limit, cgroup_v2_inside_a_container_namespace) {
    fake_root r;
    r.write("proc/self/cgroup", "0::/\n");
    r.write("sys/fs/cgroup/memory.max", "1073741824\n");
    EXPECT_EQ(cgroup_memory_limit(r.path()), 1_GiB);
    EXPECT_EQ(usable_memory_bytes(r.path()), 1_GiB);
}

TEST(memory_limit, cgroup_v2_max_is_no_limit) {
    fake_root r;
    r.write("proc/self/cgroup", "0::/user.slice/app.scope\n");
    r.write("sys/fs/cgroup/user.slice/memory.max", "max\n");
    r.write("sys/fs/cgroup/user.slice/app.scope/memory.max", "max\n");
    EXPECT_EQ(cgroup_memory_limit(r.path()), 0u);
    EXPECT_EQ(usable_memory_bytes(r.path()), physical_memory_bytes());
}

TEST(memory_limit, cgroup_v1_limit_at_the_mount_root_when_the_path_is_the_hosts) {
    // A container without a cgroup namespace: /proc/self/cgroup names the host's path, and the
    // memory controller's mount is the container's own cgroup.
    fake_root r;
    r.write("proc/self/cgroup", "12:cpu,cpuacct:/docker/abc\n6:memory:/docker/abc\n"
                                "1:name=systemd:/docker/abc\n0::/docker/abc\n");
    r.write("sys/fs/cgroup/memory/memory.limit_in_bytes", "1073741824\n");
    EXPECT_EQ(cgroup_memory_limit(r.path()), 1_GiB);
    EXPECT_EQ(usable_memory_bytes(r.path()), 1_GiB);
}

TEST(memory_limit, cgroup_v1_limit_of_the_process_cgroup) {
    fake_root r;
    r.write("proc/self/cgroup", "4:cpu,memory:/batch/job7\n");
    r.write("sys/fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n");
    r.write("sys/fs/cgroup/memory/batch/job7/memory.limit_in_bytes", "3221225472\n");
    EXPECT_EQ(cgroup_memory_limit(r.path()), 3_GiB);
}

TEST(memory_limit, cgroup_v1_unlimited_leaves_physical_memory) {
    fake_root r;
    r.write("proc/self/cgroup", "6:memory:/\n");
    r.write("sys/fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n");
    EXPECT_EQ(cgroup_memory_limit(r.path()), std::size_t{9223372036854771712ull});
    EXPECT_EQ(usable_memory_bytes(r.path()), physical_memory_bytes());
}

TEST(memory_limit, missing_or_unreadable_files_mean_no_limit) {
    fake_root r;
    EXPECT_EQ(cgroup_memory_limit(r.path()), 0u) << "no /proc/self/cgroup";
    r.write("proc/self/cgroup", "0::/user.slice\n");
    EXPECT_EQ(cgroup_memory_limit(r.path()), 0u) << "no memory.max anywhere";
    r.write("sys/fs/cgroup/user.slice/memory.max", "lots\n");
    EXPECT_EQ(cgroup_memory_limit(r.path()), 0u) << "not a number";
    r.write("proc/self/cgroup", "garbage without colons\n");
    EXPECT_EQ(cgroup_memory_limit(r.path()), 0u);
    EXPECT_EQ(usable_memory_bytes(r.path()), physical_memory_bytes());
    EXPECT_EQ(cgroup_memory_limit(r.path() + "/does/not/exist"), 0u);
}

TEST(pinned_pool, a_failing_upstream_leaves_the_pool_consistent) {
    host_pool h;
    pinned_pool pool(h.options());
    void* a = pool.allocate(1_MiB);
    fill(a, 1_MiB, 0x33);
    h.slabs->fail_next = true;
    EXPECT_THROW((void)pool.allocate(100_MiB), std::bad_alloc);
    EXPECT_TRUE(all_equal(a, 1_MiB, 0x33));
    void* b = pool.allocate(100_MiB);
    EXPECT_NE(b, nullptr);
    pool.deallocate(a);
    pool.deallocate(b);
}

TEST(pinned_pool, stats_count_hits_misses_growth_and_peaks) {
    host_pool h;
    pinned_pool pool(h.options(1_GiB, 64_MiB));
    pool.reserve(128_MiB);
    auto s0 = pool.stats();
    EXPECT_EQ(s0.reserved_bytes, 128_MiB);
    EXPECT_EQ(s0.growth_count, 1u);
    EXPECT_GT(s0.growth_time.count(), 0);
    void* a = pool.allocate(10_MiB);
    void* b = pool.allocate(3000);
    auto s1 = pool.stats();
    EXPECT_EQ(s1.hits, 2u);
    EXPECT_EQ(s1.misses, 0u);
    EXPECT_EQ(s1.in_use_bytes, 10_MiB + 3072);
    EXPECT_EQ(s1.requested_bytes, 10_MiB + 3000);
    EXPECT_EQ(s1.blocks_in_use, 2u);
    void* c = pool.allocate(200_MiB);
    auto s2 = pool.stats();
    EXPECT_EQ(s2.misses, 1u);
    EXPECT_EQ(s2.growth_count, 2u);
    EXPECT_EQ(s2.peak_in_use_bytes, 210_MiB + 3072);
    pool.deallocate(c);
    pool.deallocate(a);
    pool.deallocate(b);
    auto s3 = pool.stats();
    EXPECT_EQ(s3.in_use_bytes, 0u);
    EXPECT_EQ(s3.peak_in_use_bytes, 210_MiB + 3072);
    EXPECT_EQ(s3.peak_reserved_bytes, 328_MiB);
    EXPECT_EQ(pool.release_unused(), 328_MiB);
    EXPECT_EQ(pool.stats().reserved_bytes, 0u);
    EXPECT_EQ(h.slabs->live_bytes(), 0u);
}

TEST(pinned_pool, stats_track_the_peaks_of_pending_and_of_in_use_plus_pending) {
    host_pool h;
    pinned_pool pool(h.options());
    void* a = pool.allocate(1_MiB);
    void* b = pool.allocate(2_MiB);
    pool.record_use(a, fake_stream(1));
    pool.deallocate(a); // 2 MiB in use, 1 MiB pending
    void* c = pool.allocate(3_MiB);
    auto s1 = pool.stats();
    EXPECT_EQ(s1.pending_bytes, 1_MiB);
    EXPECT_EQ(s1.peak_pending_bytes, 1_MiB);
    EXPECT_EQ(s1.peak_in_use_and_pending_bytes, 6_MiB);
    h.tracker->complete(0);
    EXPECT_EQ(pool.collect(), 1_MiB);
    pool.deallocate(b);
    pool.deallocate(c);
    void* d = pool.allocate(4_MiB); // below the peak: the peaks stay
    auto s2 = pool.stats();
    EXPECT_EQ(s2.pending_bytes, 0u);
    EXPECT_EQ(s2.peak_pending_bytes, 1_MiB);
    EXPECT_EQ(s2.peak_in_use_and_pending_bytes, 6_MiB);
    EXPECT_EQ(s2.peak_in_use_bytes, 5_MiB);
    pool.deallocate(d);
}

// A pipeline of depth D holds D pinned input chunks and D pinned output chunks while it stages.
// Reserving size_for(D, in, out) on an empty pool must hold them without growing, whatever the
// order the slots take them in; the rule of thumb may not.
TEST(pinned_pool, size_for_with_chunk_sizes_holds_a_pipelines_staging_buffers) {
    EXPECT_EQ(pinned_pool::size_for(3, 64_MiB, 64_MiB), 384_MiB);
    EXPECT_EQ(pinned_pool::size_for(2, 3_MiB, 3_MiB), 16_MiB) << "3 MiB blocks 2 MiB-aligned";
    EXPECT_EQ(pinned_pool::size_for(2, 1000, 3000), 2u * (1024 + 3072));
    EXPECT_EQ(pinned_pool::size_for(3, 1_MiB, 2_MiB), 3 * (1_MiB + 4_MiB - 256));

    struct shape {
        std::size_t depth;
        std::size_t in;
        std::size_t out;
    };
    std::vector<shape> shapes = {{2, 3_MiB, 3_MiB},
                                 {3, 1_MiB + 5, 5_MiB + 3},
                                 {4, 2_MiB, 1_MiB + 256},
                                 {3, 1_MiB + 256_KiB, 2_MiB},
                                 {2, 64_MiB, 64_MiB},
                                 {3, 100_KiB, 7_MiB},
                                 {1, 1, 1},
                                 {5, 2_MiB - 255, 2_MiB + 1}};
    std::mt19937_64 rng(29);
    std::uniform_real_distribution<double> log_size(0.0, std::log(12.0 * (1 << 20)));
    for (int i = 0; i < 150; ++i) {
        auto size = [&] {
            auto n = static_cast<std::size_t>(std::exp(log_size(rng)));
            return rng() % 4 == 0 ? heap_round(n, 2_MiB) : std::max<std::size_t>(n, 1);
        };
        shapes.push_back({1 + rng() % 6, size(), size()});
    }
    for (const shape& sh : shapes) {
        for (int order = 0; order < 3; ++order) {
            host_pool h;
            pinned_pool pool(h.options(4_GiB, 2_MiB));
            pool.reserve(pinned_pool::size_for(sh.depth, sh.in, sh.out));
            std::vector<cudawait::pinned_buffer<std::byte>> held;
            auto take = [&](std::size_t n) { held.emplace_back(n, pool); };
            for (std::size_t slot = 0; slot < sh.depth; ++slot) {
                if (order == 0) { // as the pipeline does: input, then output, slot by slot
                    take(sh.in);
                    take(sh.out);
                } else {
                    take(order == 1 ? sh.in : sh.out);
                }
            }
            for (std::size_t slot = 0; order != 0 && slot < sh.depth; ++slot) {
                take(order == 1 ? sh.out : sh.in);
            }
            ASSERT_EQ(pool.stats().growth_count, 1u)
                << "depth " << sh.depth << ", chunks of " << sh.in << " in and " << sh.out
                << " out, order " << order << ": reserved "
                << pinned_pool::size_for(sh.depth, sh.in, sh.out);
        }
    }

    // The rule of thumb (depth x chunk x 2) falls short where the pool's placement costs room.
    host_pool h;
    pinned_pool pool(h.options(4_GiB, 2_MiB));
    pool.reserve(2 * 3_MiB * 2);
    std::vector<cudawait::pinned_buffer<std::byte>> held;
    for (int i = 0; i < 4; ++i) {
        held.emplace_back(3_MiB, pool);
    }
    EXPECT_EQ(pool.stats().growth_count, 2u);
}

TEST(pinned_pool, bad_requests_get_typed_errors) {
    host_pool h;
    pinned_pool pool(h.options());
    EXPECT_THROW((void)pool.allocate(0), usage_error);
    EXPECT_THROW((void)pool.allocate(64, 3), usage_error);
    EXPECT_THROW((void)pool.allocate(64, 4_MiB), usage_error);
    int on_stack = 0;
    EXPECT_THROW(pool.deallocate(&on_stack), usage_error);
    EXPECT_THROW(pool.record_use(&on_stack, fake_stream(1)), usage_error);
    EXPECT_EQ(h.tracker->outstanding, 0) << "a rejected record_use gives its mark back";
    void* p = pool.allocate(100);
    pool.deallocate(p);
    EXPECT_THROW(pool.deallocate(p), usage_error) << "double free";
    EXPECT_THROW(pool.record_use(p, fake_stream(1)), usage_error) << "use after free";
    EXPECT_EQ(h.tracker->outstanding, 0);
    EXPECT_EQ(pool.stats().in_use_bytes, 0u);
}

TEST(pinned_pool, destructor_waits_for_pending_blocks_and_reports_leaks) {
    host_pool h;
    ::testing::internal::CaptureStderr();
    {
        pinned_pool pool(h.options());
        void* pending = pool.allocate(1_MiB);
        pool.record_use(pending, fake_stream(1));
        pool.deallocate(pending);
        void* leaked = pool.allocate(12345);
        fill(leaked, 12345, 0x77);
        (void)pool.allocate(2_MiB); // a second leak, in the same slab
    }
    std::string err = ::testing::internal::GetCapturedStderr();
    EXPECT_EQ(h.tracker->waits, 1) << "the pending block's use was waited for";
    EXPECT_EQ(h.tracker->outstanding, 0);
    EXPECT_NE(err.find("2 block(s) still handed out"), std::string::npos) << err;
    EXPECT_NE(err.find("12345"), std::string::npos) << err;
    EXPECT_NE(err.find(std::to_string(2_MiB)), std::string::npos) << err;
    EXPECT_EQ(h.slabs->deallocations, 0) << "the slab with leaked blocks stays mapped";
    EXPECT_EQ(h.slabs->live_bytes(), 64_MiB);
}

TEST(pinned_pool, concurrent_threads_never_share_a_block) {
    host_pool h;
    pinned_pool pool(h.options(2_GiB, 64_MiB));
    std::atomic<int> corrupt{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t) {
        threads.emplace_back([&, t] {
            std::mt19937_64 rng(static_cast<std::uint64_t>(t) + 100);
            std::vector<std::pair<void*, std::size_t>> mine;
            for (int i = 0; i < 3000; ++i) {
                if (mine.size() < 20 && rng() % 2 == 0) {
                    std::size_t n = 1 + rng() % 256_KiB;
                    void* p = pool.allocate(n);
                    fill(p, n, static_cast<std::uint8_t>(t + 1));
                    mine.emplace_back(p, n);
                } else if (!mine.empty()) {
                    auto [p, n] = mine.back();
                    mine.pop_back();
                    if (!all_equal(p, n, static_cast<std::uint8_t>(t + 1))) {
                        ++corrupt;
                    }
                    if (rng() % 4 == 0) {
                        pool.record_use(p, fake_stream(static_cast<std::uintptr_t>(t) + 1));
                    }
                    pool.deallocate(p);
                }
                if (i % 500 == 0) {
                    pool.collect();
                }
            }
            for (auto [p, n] : mine) {
                pool.deallocate(p);
            }
        });
    }
    std::thread completer([&] {
        for (int i = 0; i < 200; ++i) {
            std::size_t n = h.tracker->marks();
            for (std::size_t k = 0; k < n; ++k) {
                h.tracker->complete(k);
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
    });
    for (auto& t : threads) {
        t.join();
    }
    completer.join();
    EXPECT_EQ(corrupt.load(), 0);
    EXPECT_EQ(pool.stats().in_use_bytes, 0u);
}

TEST(pinned_pool, works_as_a_pmr_memory_resource) {
    host_pool h;
    pinned_pool pool(h.options());
    std::pmr::vector<std::uint64_t> v(&pool);
    for (std::uint64_t i = 0; i < 100000; ++i) {
        v.push_back(i * 2654435761u);
    }
    for (std::uint64_t i = 0; i < 100000; ++i) {
        ASSERT_EQ(v[i], i * 2654435761u);
    }
    EXPECT_GE(pool.stats().in_use_bytes, 100000 * sizeof(std::uint64_t));
    EXPECT_TRUE(pool.is_equal(pool));
    std::pmr::monotonic_buffer_resource other;
    EXPECT_FALSE(pool.is_equal(other));
    v = {};
    v.shrink_to_fit();
    EXPECT_EQ(pool.stats().in_use_bytes, 0u);
}

TEST(pinned_pool, allocates_through_cuda_mr_resource_refs_made_by_gcc_and_by_nvcc) {
#if !CUDAWAIT_HAS_CUDA_MR
    GTEST_SKIP() << "this libcu++ has no memory resources";
#else
    ASSERT_TRUE(cudawait::testing::cuda_mr_in_nvcc_unit());
    host_pool h;
    pinned_pool pool(h.options());
    pool_ref ref{pool};
    EXPECT_TRUE(ref == pool_ref{pool});
    auto* a = static_cast<std::uint8_t*>(ref_allocate(ref, 3000));
    auto* b = static_cast<std::uint8_t*>(cudawait::testing::allocate_through_cuda_mr(pool, 5000));
    ASSERT_NE(b, nullptr);
    EXPECT_TRUE(pool.owns(a));
    EXPECT_TRUE(pool.owns(b));
    EXPECT_EQ(pool.stats().requested_bytes, 8000u);
    fill(a, 3000, 0x3c);
    fill(b, 5000, 0xc3);
    EXPECT_TRUE(all_equal(a, 3000, 0x3c));
    EXPECT_TRUE(all_equal(b, 5000, 0xc3));
    ref_deallocate(ref, a, 3000);
    cudawait::testing::deallocate_through_cuda_mr(pool, b, 5000);
    EXPECT_EQ(pool.stats().in_use_bytes, 0u);
    EXPECT_EQ(pool.stats().blocks_in_use, 0u);
#endif
}

TEST(pinned_pool, its_copyable_view_allocates_from_it_and_compares_by_pool) {
#if !CUDAWAIT_HAS_CUDA_MR
    GTEST_SKIP() << "this libcu++ has no memory resources";
#else
    static_assert(std::copyable<cudawait::pinned_pool_resource>);
    host_pool h;
    host_pool h2;
    pinned_pool pool(h.options());
    pinned_pool other(h2.options());
    cudawait::pinned_pool_resource view = pool.resource();
    const cudawait::pinned_pool_resource copy = view;
    EXPECT_TRUE(copy == view);
    EXPECT_FALSE(copy == other.resource());
    EXPECT_EQ(&copy.pool(), &pool);
    pool_ref ref{view};
    auto* a = static_cast<std::uint8_t*>(ref_allocate(ref, 4000));
    auto* b = static_cast<std::uint8_t*>(copy.allocate_sync(6000));
    EXPECT_TRUE(pool.owns(a));
    EXPECT_TRUE(pool.owns(b));
    EXPECT_FALSE(other.owns(a));
    EXPECT_EQ(pool.stats().requested_bytes, 10000u);
    fill(a, 4000, 0x5a);
    fill(b, 6000, 0xa5);
    EXPECT_TRUE(all_equal(a, 4000, 0x5a));
    EXPECT_TRUE(all_equal(b, 6000, 0xa5));
    ref_deallocate(ref, a, 4000);
    view.deallocate(b, 6000);
    EXPECT_EQ(pool.stats().in_use_bytes, 0u);
    EXPECT_EQ(other.stats().requested_bytes, 0u);
#endif
}

// ---- with a GPU: real page-locked memory ----------------------------------------------------

TEST(pinned_pool_no_device, growth_without_a_device_is_a_cuda_error) {
    auto child = [] {
        try {
            pinned_pool pool;
            (void)pool.allocate(1_MiB);
            std::fprintf(stderr, "no exception\n");
            std::exit(1);
        } catch (const cudawait::cuda_error& e) {
            std::fprintf(stderr, "pool growth failed cleanly: %s\n", e.what());
            std::exit(0);
        }
    };
    CUDAWAIT_EXPECT_IN_CHILD_WITHOUT_DEVICE(child(), "pool growth failed cleanly");
}

class pinned_pool_gpu : public cudawait::testing::gpu_test {};

// Pool blocks through the device and back: `in` H2D, mixed with `salt`, D2H into `out`, both
// marked with record_use; returns once the stream finished. @throws cuda_error
void mix_on_the_device(pinned_pool& pool, const std::uint32_t* in, std::uint32_t* out,
                       std::size_t n, std::uint32_t salt) {
    using cudawait::check;
    cudawait::stream s;
    std::uint32_t* d = nullptr;
    check(cudaMallocAsync(&d, n * 4, s.get()), "cudaMallocAsync");
    check(cudaMemcpyAsync(d, in, n * 4, cudaMemcpyHostToDevice, s.get()), "cudaMemcpyAsync");
    check(cudawait::testing::launch_mix(d, n, salt, s.get()), "launch_mix");
    check(cudaMemcpyAsync(out, d, n * 4, cudaMemcpyDeviceToHost, s.get()), "cudaMemcpyAsync");
    pool.record_use(in, s);
    pool.record_use(out, s);
    check(cudaFreeAsync(d, s.get()), "cudaFreeAsync");
    s.sync();
}

TEST_F(pinned_pool_gpu, slabs_are_page_locked_and_usable_by_the_device) {
    pinned_pool pool;
    pool.reserve(256_MiB);
    EXPECT_EQ(pool.stats().reserved_bytes, 256_MiB);
    const std::size_t n = (3_MiB + 12345) / 4;
    auto* h = static_cast<std::uint32_t*>(pool.allocate(n * 4));
    auto* back = static_cast<std::uint32_t*>(pool.allocate(n * 4));
    cudaPointerAttributes attr{};
    ASSERT_EQ(cudaPointerGetAttributes(&attr, h), cudaSuccess);
    EXPECT_EQ(attr.type, cudaMemoryTypeHost);
    std::mt19937 rng(21);
    for (std::size_t i = 0; i < n; ++i) {
        h[i] = static_cast<std::uint32_t>(rng());
        back[i] = 0xdeadbeef;
    }
    mix_on_the_device(pool, h, back, n, 99);
    cudawait::testing::mix_on_host(h, n, 99);
    for (std::size_t i = 0; i < n; ++i) {
        ASSERT_EQ(back[i], h[i]) << i;
    }
    pool.deallocate(h);
    pool.deallocate(back);
    std::size_t block = (n * 4 + 255) / 256 * 256;
    EXPECT_EQ(pool.collect(), 2 * block) << "the copies finished: both blocks come back";
    EXPECT_EQ(pool.stats().pending_bytes, 0u);
}

TEST_F(pinned_pool_gpu, a_block_the_gpu_still_reads_is_not_handed_out_again) {
    pinned_pool pool;
    const std::size_t n = 1_MiB / 4;
    auto* b = static_cast<std::uint32_t*>(pool.allocate(n * 4));
    std::mt19937 rng(5);
    std::vector<std::uint32_t> expected(n);
    for (std::size_t i = 0; i < n; ++i) {
        b[i] = expected[i] = static_cast<std::uint32_t>(rng());
    }
    cudawait::stream s;
    std::uint32_t* d = nullptr;
    ASSERT_EQ(cudaMallocAsync(&d, n * 4, s.get()), cudaSuccess);
    ASSERT_EQ(cudaMemsetAsync(d, 0xff, n * 4, s.get()), cudaSuccess);
    // The kernel reads B over the bus 200 ms from now.
    ASSERT_EQ(cudawait::testing::launch_delayed_copy(200'000'000, d, b, n, s.get()), cudaSuccess);
    pool.record_use(b, s);
    pool.deallocate(b);
    // Allocate the same size again while the kernel has not read B yet, and scribble on it.
    std::vector<std::uint32_t*> again;
    for (int i = 0; i < 4; ++i) {
        auto* p = static_cast<std::uint32_t*>(pool.allocate(n * 4));
        EXPECT_NE(p, b) << "B was handed out while the GPU still reads it";
        std::fill(p, p + n, 0xbad0bad0u);
        again.push_back(p);
    }
    EXPECT_FALSE(cudawait::stream_ref(s).is_done()) << "the kernel should still be spinning";
    std::vector<std::uint32_t> got(n);
    ASSERT_EQ(cudaMemcpyAsync(got.data(), d, n * 4, cudaMemcpyDeviceToHost, s.get()), cudaSuccess);
    ASSERT_EQ(cudaFreeAsync(d, s.get()), cudaSuccess);
    s.sync();
    for (std::size_t i = 0; i < n; ++i) {
        ASSERT_EQ(got[i], expected[i]) << "the kernel saw new data at " << i;
    }
    // Now that the kernel is done, B comes back.
    EXPECT_EQ(pool.collect(), n * 4);
    auto* reused = static_cast<std::uint32_t*>(pool.allocate(n * 4));
    EXPECT_EQ(reused, b);
    pool.deallocate(reused);
    for (auto* p : again) {
        pool.deallocate(p);
    }
}

TEST_F(pinned_pool_gpu, destructor_waits_for_the_gpu_before_giving_memory_back) {
    cudawait::stream s;
    const std::size_t n = 256_KiB / 4;
    std::uint32_t* d = nullptr;
    ASSERT_EQ(cudaMallocAsync(&d, n * 4, s.get()), cudaSuccess);
    std::vector<std::uint32_t> expected(n);
    {
        pinned_pool pool;
        auto* b = static_cast<std::uint32_t*>(pool.allocate(n * 4));
        std::mt19937 rng(8);
        for (std::size_t i = 0; i < n; ++i) {
            b[i] = expected[i] = static_cast<std::uint32_t>(rng());
        }
        ASSERT_EQ(cudawait::testing::launch_delayed_copy(100'000'000, d, b, n, s.get()),
                  cudaSuccess);
        pool.record_use(b, s);
        pool.deallocate(b);
    } // unregisters and unmaps only after the kernel read B
    std::vector<std::uint32_t> got(n);
    ASSERT_EQ(cudaMemcpyAsync(got.data(), d, n * 4, cudaMemcpyDeviceToHost, s.get()), cudaSuccess);
    ASSERT_EQ(cudaFreeAsync(d, s.get()), cudaSuccess);
    s.sync();
    EXPECT_EQ(got, expected);
}

TEST_F(pinned_pool_gpu, release_unused_unregisters_free_slabs) {
    pinned_pool pool;
    pool.reserve(128_MiB);
    void* p = pool.allocate(100_MiB);
    pool.deallocate(p);
    EXPECT_EQ(pool.release_unused(), 128_MiB);
    EXPECT_EQ(pool.stats().reserved_bytes, 0u);
    cudaPointerAttributes attr{};
    ASSERT_EQ(cudaPointerGetAttributes(&attr, p), cudaSuccess);
    EXPECT_EQ(attr.type, cudaMemoryTypeUnregistered);
}

TEST_F(pinned_pool_gpu, at_the_cap_allocate_waits_for_a_block_a_kernel_still_reads) {
    pinned_pool_options o;
    o.max_pinned_bytes = 8_MiB;
    o.cap_wait = std::chrono::seconds(30);
    pinned_pool pool(o);
    std::vector<void*> held;
    for (int i = 0; i < 7; ++i) {
        held.push_back(pool.allocate(1_MiB));
    }
    const std::size_t n = 1_MiB / 4;
    auto* a = static_cast<std::uint32_t*>(pool.allocate(1_MiB));
    std::mt19937 rng(17);
    std::vector<std::uint32_t> expected(n);
    for (std::size_t i = 0; i < n; ++i) {
        a[i] = expected[i] = static_cast<std::uint32_t>(rng());
    }
    EXPECT_EQ(pool.stats().reserved_bytes, 8_MiB);
    cudawait::stream s;
    std::uint32_t* d = nullptr;
    ASSERT_EQ(cudaMallocAsync(&d, n * 4, s.get()), cudaSuccess);
    ASSERT_EQ(cudaMemsetAsync(d, 0xff, n * 4, s.get()), cudaSuccess);
    // The kernel reads A over the bus 100 ms from now.
    ASSERT_EQ(cudawait::testing::launch_delayed_copy(100'000'000, d, a, n, s.get()), cudaSuccess);
    pool.record_use(a, s);
    pool.deallocate(a);
    std::uint32_t* b = nullptr;
    try {
        b = static_cast<std::uint32_t*>(pool.allocate(1_MiB));
    } catch (const pool_exhausted& e) {
        ADD_FAILURE() << e.what();
    }
    if (b != nullptr) {
        EXPECT_TRUE(cudawait::stream_ref(s).is_done()) << "handed out while the kernel ran";
        EXPECT_EQ(b, a) << "the block the kernel read";
        std::fill(b, b + n, 0xbad0bad0u);
    }
    std::vector<std::uint32_t> got(n);
    ASSERT_EQ(cudaMemcpyAsync(got.data(), d, n * 4, cudaMemcpyDeviceToHost, s.get()), cudaSuccess);
    ASSERT_EQ(cudaFreeAsync(d, s.get()), cudaSuccess);
    s.sync();
    for (std::size_t i = 0; i < n; ++i) {
        ASSERT_EQ(got[i], expected[i]) << "the kernel saw new data at " << i;
    }
    EXPECT_EQ(pool.stats().reserved_bytes, 8_MiB);
    if (b != nullptr) {
        pool.deallocate(b);
    }
    for (void* p : held) {
        pool.deallocate(p);
    }
}

TEST_F(pinned_pool_gpu, memory_from_cuda_mr_resource_refs_feeds_the_device) {
#if !CUDAWAIT_HAS_CUDA_MR
    GTEST_SKIP() << "this libcu++ has no memory resources";
#else
    pinned_pool pool;
    const std::size_t n = (1_MiB + 4096) / 4;
    pool_ref ref{pool};
    auto* in = static_cast<std::uint32_t*>(ref_allocate(ref, n * 4)); // a g++ unit's reference
    auto* out = static_cast<std::uint32_t*>(
        cudawait::testing::allocate_through_cuda_mr(pool, n * 4)); // an nvcc unit's
    ASSERT_NE(out, nullptr);
    for (void* p : {static_cast<void*>(in), static_cast<void*>(out)}) {
        cudaPointerAttributes attr{};
        ASSERT_EQ(cudaPointerGetAttributes(&attr, p), cudaSuccess);
        EXPECT_EQ(attr.type, cudaMemoryTypeHost);
    }
    std::mt19937 rng(23);
    std::vector<std::uint32_t> want(n);
    for (std::size_t i = 0; i < n; ++i) {
        in[i] = want[i] = static_cast<std::uint32_t>(rng());
        out[i] = 0xdeadbeef;
    }
    mix_on_the_device(pool, in, out, n, 5);
    cudawait::testing::mix_on_host(want.data(), n, 5);
    for (std::size_t i = 0; i < n; ++i) {
        ASSERT_EQ(out[i], want[i]) << i;
    }
    ref_deallocate(ref, in, n * 4);
    cudawait::testing::deallocate_through_cuda_mr(pool, out, n * 4);
    pool.collect();
    EXPECT_EQ(pool.stats().in_use_bytes, 0u);
    EXPECT_EQ(pool.stats().pending_bytes, 0u);
#endif
}

// Requests of own_slab_bytes and more grow slabs of their own size; smaller ones never use them;
// a free own slab is reused only by a request it fits within a quarter plus 2 MiB, and empty
// slabs go back before the pool grows past its peak.
TEST(pinned_pool, large_requests_get_own_slabs_that_small_ones_never_cut_up) {
    host_pool h;
    pinned_pool pool(h.options(1_GiB, 2_MiB)); // own_slab_bytes: 8 MiB by default
    auto* a = static_cast<std::byte*>(pool.allocate(20_MiB));
    EXPECT_EQ(pool.stats().reserved_bytes, 20_MiB) << "a slab of the request's size";
    pool.deallocate(a);
    // 20 MiB is more than 12 MiB + 3 MiB + 2 MiB: a new slab, and the empty one goes back first
    // (growing beside it would take the pool past its 20 MiB peak).
    auto* b = static_cast<std::byte*>(pool.allocate(12_MiB));
    EXPECT_EQ(h.slabs->deallocations, 1);
    EXPECT_EQ(pool.stats().reserved_bytes, 12_MiB);
    EXPECT_EQ(pool.stats().peak_reserved_bytes, 20_MiB);
    pool.deallocate(b);
    // 12 MiB is within 11 MiB + 2.75 MiB + 2 MiB: reused.
    auto* c = static_cast<std::byte*>(pool.allocate(11_MiB));
    EXPECT_EQ(c, b);
    EXPECT_EQ(pool.stats().growth_count, 2u);
    pool.deallocate(c);
    // A small request leaves the empty own slab alone and grows a shared one (no release: that
    // stays below the peak).
    auto* d = static_cast<std::byte*>(pool.allocate(1_MiB));
    EXPECT_TRUE(d + 1_MiB <= b || d >= b + 12_MiB) << "a small block inside an own slab";
    EXPECT_EQ(pool.stats().reserved_bytes, 14_MiB);
    EXPECT_EQ(h.slabs->deallocations, 1);
    // A large request takes room in the shared slabs when it finds some there (reserve()).
    pool.reserve(14_MiB + 64_MiB);
    auto* e = static_cast<std::byte*>(pool.allocate(40_MiB));
    EXPECT_EQ(pool.stats().reserved_bytes, 78_MiB) << "served by the reserved slab";
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(e) % 2_MiB, 0u);
    pool.deallocate(d);
    pool.deallocate(e);
    EXPECT_EQ(pool.release_unused(), 78_MiB);
    EXPECT_EQ(h.slabs->live_bytes(), 0u);
}

TEST(pinned_pool, own_slab_bytes_zero_grows_only_shared_slabs) {
    host_pool h;
    pinned_pool_options o = h.options(1_GiB, 64_MiB);
    o.own_slab_bytes = 0;
    pinned_pool pool(o);
    void* a = pool.allocate(20_MiB);
    EXPECT_EQ(pool.stats().reserved_bytes, 64_MiB);
    void* b = pool.allocate(1_MiB);
    EXPECT_EQ(pool.stats().reserved_bytes, 64_MiB) << "the small block shares the slab";
    pool.deallocate(a);
    pool.deallocate(b);
}

// The pool as a stream-ordered cuda::mr resource (an async_resource_ref with CCCL 3.0): a block
// freed on a stream is not handed out again until the GPU passed that point on the stream.
TEST_F(pinned_pool_gpu, a_block_freed_in_stream_order_waits_for_the_kernel_reading_it) {
#if !CUDAWAIT_HAS_CUDA_MR
    GTEST_SKIP() << "cuda::mr is not available";
#else
    pinned_pool pool;
    cudawait::pinned_pool_resource view = pool.resource(); // copyable: what CCCL 3.1 refs need
    cudawait::testing::async_pool_ref r = view;
    const std::size_t n = 1_MiB / 4;
    cudawait::stream s;
    auto* b = static_cast<std::uint32_t*>(cudawait::testing::ref_allocate_async(r, n * 4, s.get()));
    ASSERT_NE(b, nullptr);
    std::mt19937 rng(23);
    std::uint32_t expected_sum = 0;
    for (std::size_t i = 0; i < n; ++i) {
        b[i] = static_cast<std::uint32_t>(rng());
        expected_sum += b[i];
    }
    cudawait::testing::mapped_words flag(1);
    flag.write(0, 0);
    std::uint32_t* sum = nullptr;
    ASSERT_EQ(cudaMallocAsync(&sum, sizeof(std::uint32_t), s.get()), cudaSuccess);
    // The kernel waits for the flag (60 s at most: growing the pool under a sanitizer takes
    // seconds), then a kernel reads the block.
    ASSERT_EQ(cudawait::testing::launch_wait_flag(flag.device, 60'000'000'000ull, s.get()),
              cudaSuccess);
    ASSERT_EQ(cudawait::testing::launch_sum(b, n, sum, s.get()), cudaSuccess);
    cudawait::testing::ref_deallocate_async(r, b, n * 4, s.get());
    EXPECT_EQ(pool.stats().pending_bytes, n * 4) << "freed, but the GPU has not passed the point";
    std::vector<std::uint32_t*> again;
    for (int i = 0; i < 4; ++i) {
        auto* p =
            static_cast<std::uint32_t*>(cudawait::testing::ref_allocate_async(r, n * 4, s.get()));
        EXPECT_NE(p, b) << "the block was handed out while a kernel on the stream still reads it";
        std::fill(p, p + n, 0xbad0bad0u);
        again.push_back(p);
    }
    EXPECT_FALSE(cudawait::stream_ref(s).is_done()) << "the kernel should still be waiting";
    flag.write(0, 1);
    std::uint32_t got = 0;
    ASSERT_EQ(cudaMemcpyAsync(&got, sum, sizeof got, cudaMemcpyDeviceToHost, s.get()), cudaSuccess);
    ASSERT_EQ(cudaFreeAsync(sum, s.get()), cudaSuccess);
    s.sync();
    EXPECT_EQ(got, expected_sum) << "the kernel read data written after the free";
    // The GPU passed the free: the block may come back now.
    EXPECT_EQ(pool.collect(), n * 4);
    auto* reused =
        static_cast<std::uint32_t*>(cudawait::testing::ref_allocate_async(r, n * 4, s.get()));
    EXPECT_EQ(reused, b);
    cudawait::testing::ref_deallocate_async(r, reused, n * 4, s.get());
    for (auto* p : again) {
        cudawait::testing::ref_deallocate_async(r, p, n * 4, s.get());
    }
    s.sync();
    pool.collect();
    EXPECT_EQ(pool.stats().in_use_bytes, 0u);
    EXPECT_EQ(pool.stats().pending_bytes, 0u);
#endif
}

} // namespace
