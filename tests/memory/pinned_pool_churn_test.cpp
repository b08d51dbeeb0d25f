// SPDX-License-Identifier: Apache-2.0
// pinned_pool under churn: threads and coroutines allocating, using and freeing blocks of mixed
// sizes, on fake streams and on the GPU. The pool's bookkeeping is in pinned_pool_test.cpp.
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

using cudawait::testing::all_equal;
using cudawait::testing::fake_stream;
using cudawait::testing::fill;
using cudawait::testing::heap_round;
using cudawait::testing::host_pool;
using cudawait::testing::timed_tracker;

class pinned_pool_gpu : public cudawait::testing::gpu_test {};

// Freed blocks whose uses may still run, by address, with the earliest time the pool may hand
// them out again: an allocation overlapping one before that time is a block handed out while
// the GPU still uses it. Thread-safe.
class in_flight_ranges {
public:
    using clock = std::chrono::steady_clock;

    void add(const void* p, std::size_t n, clock::time_point reusable) {
        std::lock_guard lock(m_mutex);
        take(p, n, {}, false); // ranges it overlaps were handed out and freed again
        auto start = reinterpret_cast<std::uintptr_t>(p);
        m_ranges.emplace(start, std::pair{start + n, reusable});
    }
    /// Called with a block just handed out, and a time after the pool handed it out. Counts the
    /// overlaps with freed ranges, and the early ones.
    void check(const void* p, std::size_t n, clock::time_point handed_out_by) {
        std::lock_guard lock(m_mutex);
        take(p, n, handed_out_by, true);
    }

    std::atomic<long> reused{0}; ///< allocations that overlapped a freed, used range
    std::atomic<long> early{0};  ///< ... before its uses could have completed

private:
    void take(const void* p, std::size_t n, clock::time_point by, bool count) {
        auto lo = reinterpret_cast<std::uintptr_t>(p);
        auto hi = lo + n;
        auto it = m_ranges.lower_bound(lo);
        if (it != m_ranges.begin() && std::prev(it)->second.first > lo) {
            --it;
        }
        bool overlapped = false;
        while (it != m_ranges.end() && it->first < hi) {
            overlapped = true;
            early += count && it->second.second > by ? 1 : 0;
            it = m_ranges.erase(it);
        }
        reused += count && overlapped ? 1 : 0;
    }

    std::mutex m_mutex;
    std::map<std::uintptr_t, std::pair<std::uintptr_t, clock::time_point>> m_ranges;
};

// Four threads churn blocks as a copy loop does: a block used on stream 1 (and one time in four
// on stream 2 too) and freed at once, a second block of the same size for the way back, then
// both streams waited for. Eight more threads take buffers with a shorter use. The uses
// complete by the clock, as the GPU's would, and each query costs a microsecond, as a driver
// query does while the GPU is busy. The pool must reuse blocks whose uses completed, not grow:
// it may hold twice what was in use or pending at its peak, plus a slab, and twice what the
// threads held or still had in flight (which the test counts itself), plus a slab.
TEST(pinned_pool, concurrent_churn_reuses_completed_blocks_instead_of_growing) {
    using clock = std::chrono::steady_clock;
    using std::chrono::microseconds;
    const microseconds short_use(150);
    const microseconds long_use(300);
    const microseconds buffer_use(80);
    auto delay = [=](cudaStream_t s) -> std::chrono::nanoseconds {
        auto id = reinterpret_cast<std::uintptr_t>(s);
        return id == 1 ? short_use : id == 2 ? long_use : buffer_use;
    };
    auto tracker = std::make_shared<timed_tracker>(delay, microseconds(1));
    host_pool h;
    h.slabs->grow_time = std::chrono::milliseconds(2); // registration is slow on real memory
    pinned_pool_options o = h.options(4_GiB, 64_MiB);
    o.tracker = tracker;
    pinned_pool pool(o);

    // Bytes the threads hold or have in flight (freed, use not yet complete), and their peak.
    std::atomic<std::size_t> demand{0};
    std::atomic<std::size_t> peak_demand{0};
    auto hold = [&](std::size_t n) {
        std::size_t now = demand += (n + 255) / 256 * 256;
        std::size_t peak = peak_demand.load();
        while (now > peak && !peak_demand.compare_exchange_weak(peak, now)) {
        }
    };
    auto drop = [&](std::size_t n) { demand -= (n + 255) / 256 * 256; };

    const long rounds_per_thread = 300;
    std::atomic<int> churning{4}; // the buffer threads run while the churn threads do
    std::atomic<long> corrupt{0};
    std::atomic<long> rounds{0};
    in_flight_ranges freed;
    std::mutex error_mutex;
    std::string error;
    auto guarded = [&](auto body) {
        return [&, body] {
            try {
                body();
            } catch (const std::exception& e) {
                std::lock_guard lock(error_mutex);
                error = e.what();
            }
        };
    };
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t) {
        threads.emplace_back(guarded([&, t] {
            struct finished {
                std::atomic<int>& n;
                ~finished() { --n; } // also when the thread fails
            } done{churning};
            std::mt19937_64 rng(static_cast<std::uint64_t>(t) + 1);
            std::uniform_int_distribution<std::size_t> size(1_KiB, 4_MiB);
            for (long round = 0; round < rounds_per_thread; ++round) {
                std::size_t n = size(rng);
                auto va = static_cast<std::uint8_t>(rng() | 1);
                auto vb = static_cast<std::uint8_t>(va + 2);
                auto* a = static_cast<std::uint8_t*>(pool.allocate(n));
                freed.check(a, n, clock::now());
                hold(n);
                fill(a, n, va);
                // Each use completes no earlier than this after it was recorded.
                auto reusable = clock::now() + short_use;
                pool.record_use(a, fake_stream(1));
                bool both = rng() % 4 == 0;
                if (both) {
                    reusable = clock::now() + long_use;
                    pool.record_use(a, fake_stream(2));
                }
                auto synced = clock::now() + (both ? long_use : short_use);
                freed.add(a, n, reusable);
                pool.deallocate(a);
                auto* b = static_cast<std::uint8_t*>(pool.allocate(n));
                freed.check(b, n, clock::now());
                hold(n);
                fill(b, n, vb);
                pool.record_use(b, fake_stream(1));
                std::this_thread::sleep_until(synced);
                corrupt += all_equal(b, n, vb) ? 0 : 1;
                drop(n); // both uses of `a` and the one of `b` completed
                drop(n);
                pool.deallocate(b);
                ++rounds;
            }
        }));
    }
    for (int t = 0; t < 8; ++t) {
        threads.emplace_back(guarded([&, t] {
            std::mt19937_64 rng(static_cast<std::uint64_t>(t) + 100);
            std::uniform_int_distribution<std::size_t> words(256, 256_KiB);
            while (churning.load() > 0) {
                std::size_t n = words(rng);
                cudawait::pinned_buffer<std::uint32_t> buf(n, pool);
                freed.check(buf.data(), n * 4, clock::now());
                hold(n * 4);
                auto v = static_cast<std::uint8_t>(rng() | 1);
                fill(buf.data(), n * 4, v);
                buf.record_use(fake_stream(10 + static_cast<std::uintptr_t>(t)));
                std::this_thread::sleep_for(buffer_use);
                corrupt += all_equal(buf.data(), n * 4, v) ? 0 : 1;
                drop(n * 4);
            }
        }));
    }
    for (auto& t : threads) {
        t.join();
    }
    EXPECT_EQ(error, "");
    EXPECT_EQ(corrupt.load(), 0) << "a block in use was written by another thread";
    EXPECT_EQ(freed.early.load(), 0) << "a block was handed out before its uses completed";
    EXPECT_GT(freed.reused.load(), 0) << "no freed block was handed out again";
    EXPECT_EQ(rounds.load(), 4 * rounds_per_thread);

    std::this_thread::sleep_for(long_use * 2); // every use has completed
    pool.collect();
    auto s = pool.stats();
    RecordProperty("peak_reserved_bytes", std::to_string(s.peak_reserved_bytes));
    RecordProperty("peak_in_use_and_pending_bytes",
                   std::to_string(s.peak_in_use_and_pending_bytes));
    RecordProperty("peak_pending_bytes", std::to_string(s.peak_pending_bytes));
    RecordProperty("peak_demand_bytes", std::to_string(peak_demand.load()));
    RecordProperty("growth_count", std::to_string(s.growth_count));
    std::string figures =
        "peak reserved " + std::to_string(s.peak_reserved_bytes) + ", peak in use " +
        std::to_string(s.peak_in_use_bytes) + ", peak pending " +
        std::to_string(s.peak_pending_bytes) + ", peak in use + pending " +
        std::to_string(s.peak_in_use_and_pending_bytes) + ", peak held " + "or in flight " +
        std::to_string(peak_demand.load()) + ", " + std::to_string(s.growth_count) + " growths";
    EXPECT_LE(s.peak_reserved_bytes, 2 * s.peak_in_use_and_pending_bytes + 64_MiB) << figures;
    EXPECT_LE(s.peak_reserved_bytes, 2 * peak_demand.load() + 64_MiB) << figures;
    EXPECT_EQ(s.in_use_bytes, 0u);
    EXPECT_EQ(s.blocks_in_use, 0u);
    EXPECT_EQ(s.pending_bytes, 0u);
    EXPECT_EQ(tracker->outstanding(), 0) << "every recorded use was given back";
}

// ---- the churn seen on an H200, for real ------------------------------------------------------

// Byte i of a pseudo-random stream named by `seed` (splitmix64 over 8-byte words).
std::uint64_t mix64(std::uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}
void fill_random(std::uint8_t* p, std::size_t n, std::uint64_t seed) {
    for (std::size_t i = 0; i < n; i += 8) {
        std::uint64_t w = mix64(seed + i);
        std::memcpy(p + i, &w, std::min<std::size_t>(8, n - i));
    }
}
bool equals_random(const std::uint8_t* p, std::size_t n, std::uint64_t seed) {
    for (std::size_t i = 0; i < n; i += 8) {
        std::uint64_t w = mix64(seed + i);
        if (std::memcmp(p + i, &w, std::min<std::size_t>(8, n - i)) != 0) {
            return false;
        }
    }
    return true;
}

// What the churn threads and coroutines report, and the bytes they hold or still have in flight
// (freed, GPU work not yet waited for), with its peak.
struct churn_state {
    std::atomic<long> corrupt{0};
    std::atomic<long> churn_rounds{0};
    std::atomic<long> trips{0};
    std::atomic<std::size_t> demand{0};
    std::atomic<std::size_t> peak_demand{0};
    std::atomic<bool> failed{false};
    std::mutex error_mutex;
    std::string error;

    void hold(std::size_t n) {
        std::size_t now = demand += (n + 255) / 256 * 256;
        std::size_t peak = peak_demand.load();
        while (now > peak && !peak_demand.compare_exchange_weak(peak, now)) {
        }
    }
    void drop(std::size_t n) { demand -= (n + 255) / 256 * 256; }
    void fail(const char* what) {
        std::lock_guard lock(error_mutex);
        if (error.empty()) {
            error = what;
        }
        failed = true;
    }
};

// Waits until `n` < `limit`; false when `deadline` passed first.
bool wait_below(const std::atomic<int>& n, int limit,
                std::chrono::steady_clock::time_point deadline) {
    while (n.load() >= limit) {
        if (std::chrono::steady_clock::now() > deadline) {
            return false;
        }
        std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    return true;
}

// One coroutine of the churn: a pinned buffer of random words to the device, a kernel, and the
// result back into the same buffer (poisoned in between), checked word by word.
cudawait::task<void> churn_trip(pinned_pool& pool, cudawait::stream_ref s, std::size_t n,
                                std::uint64_t seed, churn_state& st, std::atomic<int>& in_flight) {
    try {
        cudawait::pinned_buffer<std::uint32_t> buf(n, pool);
        st.hold(n * 4);
        std::vector<std::uint32_t> want(n);
        for (std::size_t i = 0; i < n; ++i) {
            want[i] = buf[i] = static_cast<std::uint32_t>(mix64(seed + i));
        }
        cudawait::device_buffer<std::uint32_t> din(n, s);
        cudawait::device_buffer<std::uint32_t> dout(n, s);
        co_await cudawait::copy(din, buf, s);
        std::fill(buf.begin(), buf.end(), 0xdeadbeefu);
        auto salt = static_cast<std::uint32_t>(seed);
        cudawait::check(
            cudawait::testing::launch_transform(din.data(), dout.data(), n, salt, 0, s.get()),
            "launch_transform");
        co_await cudawait::copy(buf, dout, s);
        cudawait::testing::transform_on_host(want.data(), want.data(), n, salt);
        if (!std::equal(buf.begin(), buf.end(), want.begin())) {
            ++st.corrupt;
        }
        st.drop(n * 4);
        ++st.trips;
    } catch (const std::exception& e) {
        st.fail(e.what());
    }
    --in_flight;
}

// Four threads share a pool with eight threads that spawn coroutines onto one scheduler. Each
// churn thread loops: a block of random size (1 KiB to 4 MiB) filled with random bytes; on
// stream a a ~150 us spin kernel, then an H2D copy of the block; one time in four also on stream
// b a ~300 us spin, then a second H2D of the block; record_use on each stream used; the block
// freed at once; a second block of the same size, D2H into it, record_use; both streams
// synchronised; the data checked (the second H2D too, through the second block); the block
// freed. The coroutines copy a pinned buffer to device memory, run a kernel and copy back. Runs
// for CUDAWAIT_CHURN_SECONDS (default 20). The pool must reuse completed blocks rather than grow:
// every byte right, reserved bytes within twice the peak of in-use + pending bytes plus a slab
// (and within twice what the threads held or had in flight plus a slab), and at the end every
// block back and nothing pending.
TEST_F(pinned_pool_gpu, churn_of_copies_and_coroutines_keeps_the_pool_small) {
    using clock = std::chrono::steady_clock;
    double seconds = 20;
    if (const char* env = std::getenv("CUDAWAIT_CHURN_SECONDS")) {
        seconds = std::strtod(env, nullptr);
        ASSERT_GT(seconds, 0) << "CUDAWAIT_CHURN_SECONDS=" << env;
    }
    const auto stop = clock::now() + std::chrono::duration_cast<clock::duration>(
                                         std::chrono::duration<double>(seconds));
    pinned_pool pool;
    churn_state st;
    std::array<std::atomic<int>, 8> in_flight{}; // trips of each spawning thread
    {
        cudawait::scheduler sched;
        std::jthread runner([&](std::stop_token token) {
            try {
                sched.run(token);
            } catch (const std::exception& e) {
                st.fail(e.what());
            }
        });
        std::vector<std::thread> threads;
        for (int t = 0; t < 4; ++t) {
            threads.emplace_back([&, t] {
                try {
                    std::mt19937_64 rng(static_cast<std::uint64_t>(t) + 1);
                    std::uniform_int_distribution<std::size_t> size(1_KiB, 4_MiB);
                    cudawait::stream a;
                    cudawait::stream b;
                    cudawait::device_buffer<std::uint8_t> da(4_MiB, a);
                    cudawait::device_buffer<std::uint8_t> db(4_MiB, b);
                    a.sync();
                    b.sync();
                    while (clock::now() < stop && !st.failed) {
                        std::size_t n = size(rng);
                        std::uint64_t seed = rng();
                        auto* x = static_cast<std::uint8_t*>(pool.allocate(n));
                        st.hold(n);
                        fill_random(x, n, seed);
                        using cudawait::check;
                        using cudawait::testing::launch_spin;
                        check(launch_spin(150'000, nullptr, 0, a.get()), "launch_spin");
                        check(cudaMemcpyAsync(da.data(), x, n, cudaMemcpyHostToDevice, a.get()),
                              "cudaMemcpyAsync");
                        bool both = rng() % 4 == 0;
                        if (both) {
                            check(launch_spin(300'000, nullptr, 0, b.get()), "launch_spin");
                            check(cudaMemcpyAsync(db.data(), x, n, cudaMemcpyHostToDevice, b.get()),
                                  "cudaMemcpyAsync");
                        }
                        pool.record_use(x, a);
                        if (both) {
                            pool.record_use(x, b);
                        }
                        pool.deallocate(x);
                        auto* y = static_cast<std::uint8_t*>(pool.allocate(n));
                        st.hold(n);
                        std::memset(y, 0xcd, n);
                        check(cudaMemcpyAsync(y, da.data(), n, cudaMemcpyDeviceToHost, a.get()),
                              "cudaMemcpyAsync");
                        pool.record_use(y, a);
                        a.sync();
                        b.sync();
                        st.corrupt += equals_random(y, n, seed) ? 0 : 1;
                        if (both) {
                            std::memset(y, 0xcd, n);
                            check(cudaMemcpyAsync(y, db.data(), n, cudaMemcpyDeviceToHost, b.get()),
                                  "cudaMemcpyAsync");
                            pool.record_use(y, b);
                            b.sync();
                            st.corrupt += equals_random(y, n, seed) ? 0 : 1;
                        }
                        st.drop(n);
                        st.drop(n);
                        pool.deallocate(y);
                        ++st.churn_rounds;
                    }
                } catch (const std::exception& e) {
                    st.fail(e.what());
                }
            });
        }
        for (int t = 0; t < 8; ++t) {
            threads.emplace_back([&, t] {
                try {
                    std::mt19937_64 rng(static_cast<std::uint64_t>(t) + 100);
                    std::uniform_int_distribution<std::size_t> words(256, 256_KiB);
                    cudawait::stream s;
                    while (clock::now() < stop && !st.failed) {
                        // At most four trips of this thread in flight at once.
                        if (!wait_below(in_flight[t], 4, stop + std::chrono::seconds(60))) {
                            st.fail("coroutines stopped finishing");
                            break;
                        }
                        ++in_flight[t];
                        try {
                            sched.spawn(churn_trip(pool, s, words(rng), rng(), st, in_flight[t]));
                        } catch (...) {
                            --in_flight[t];
                            throw;
                        }
                    }
                    if (!wait_below(in_flight[t], 1, stop + std::chrono::seconds(60))) {
                        st.fail("coroutines stopped finishing");
                        (void)s.release(); // leaked rather than destroyed under its coroutines
                        return;
                    }
                    s.sync();
                } catch (const std::exception& e) {
                    st.fail(e.what());
                }
            });
        }
        for (auto& t : threads) {
            t.join();
        }
        runner.request_stop();
        runner.join();
    }
    EXPECT_EQ(st.error, "");
    EXPECT_EQ(st.corrupt.load(), 0) << "wrong data came back";
    EXPECT_GT(st.churn_rounds.load(), 0);
    EXPECT_GT(st.trips.load(), 0);

    pool.collect(); // every stream was synchronised: every pending block comes back
    auto s = pool.stats();
    std::string figures =
        "churn rounds " + std::to_string(st.churn_rounds.load()) + ", coroutine trips " +
        std::to_string(st.trips.load()) + ", peak reserved " +
        std::to_string(s.peak_reserved_bytes) + ", peak in use " +
        std::to_string(s.peak_in_use_bytes) + ", peak pending " +
        std::to_string(s.peak_pending_bytes) + ", peak in use + pending " +
        std::to_string(s.peak_in_use_and_pending_bytes) + ", peak held or in flight " +
        std::to_string(st.peak_demand.load()) + ", " + std::to_string(s.growth_count) +
        " growths, " + std::to_string(s.hits) + " hits";
    std::printf("churn over %.1f s: %s\n", seconds, figures.c_str());
    RecordProperty("figures", figures);
    EXPECT_LE(s.peak_reserved_bytes, 2 * s.peak_in_use_and_pending_bytes + 64_MiB) << figures;
    EXPECT_LE(s.peak_reserved_bytes, 2 * st.peak_demand.load() + 64_MiB) << figures;
    EXPECT_EQ(s.in_use_bytes, 0u);
    EXPECT_EQ(s.blocks_in_use, 0u);
    EXPECT_EQ(s.pending_bytes, 0u);
}

// Random allocate/free of 1 KiB..64 MiB (log-uniform) with live bytes held near 1 GiB: blocks
// are disjoint (each carries its own stamp at both ends, checked when it is freed), large ones
// 2 MiB-aligned, the statistics add up, and the pool holds at most 1.3x the peak live bytes
// (1.5x before own slabs).
TEST(pinned_pool, churn_of_mixed_sizes_keeps_blocks_apart_and_waste_bounded) {
    host_pool h;
    pinned_pool pool(h.options(2_GiB));
    std::mt19937_64 rng(23);
    // Spelled out rather than std::uniform_real_distribution, so every standard library draws
    // the same sizes (the bound below is checked on one fixed sequence).
    auto log_size = [](std::mt19937_64& g) {
        double u = std::ldexp(static_cast<double>(g() >> 11), -53);
        return std::log(1024.0) + (std::log(64.0 * (1 << 20)) - std::log(1024.0)) * u;
    };
    struct live_block {
        std::byte* p;
        std::size_t n;
        std::uint64_t stamp;
    };
    std::vector<live_block> live;
    std::size_t live_bytes = 0;
    std::size_t peak = 0;
    auto stamp_at = [](std::byte* p, std::size_t n, std::uint64_t v) {
        std::memcpy(p, &v, sizeof v);
        std::memcpy(p + n - sizeof v, &v, sizeof v);
    };
    auto stamp_ok = [](const live_block& b) {
        std::uint64_t head = 0;
        std::uint64_t tail = 0;
        std::memcpy(&head, b.p, sizeof head);
        std::memcpy(&tail, b.p + b.n - sizeof tail, sizeof tail);
        return head == b.stamp && tail == b.stamp;
    };
    for (int op = 0; op < 8000; ++op) {
        if (live.empty() || (live_bytes < 1_GiB && rng() % 100 < 55)) {
            auto n = static_cast<std::size_t>(std::exp(log_size(rng)));
            auto* p = static_cast<std::byte*>(pool.allocate(n));
            if (n >= 2_MiB - 255) {
                ASSERT_EQ(reinterpret_cast<std::uintptr_t>(p) % 2_MiB, 0u) << n;
            }
            live.push_back({p, n, rng()});
            stamp_at(p, n, live.back().stamp);
            live_bytes += n;
            peak = std::max(peak, live_bytes);
        } else {
            std::size_t i = rng() % live.size();
            ASSERT_TRUE(stamp_ok(live[i])) << "block of " << live[i].n << " bytes overwritten";
            pool.deallocate(live[i].p);
            live_bytes -= live[i].n;
            live[i] = live.back();
            live.pop_back();
        }
        auto s = pool.stats();
        ASSERT_EQ(s.requested_bytes, live_bytes);
        ASSERT_EQ(s.blocks_in_use, live.size());
        ASSERT_LE(s.in_use_bytes, s.reserved_bytes);
    }
    for (const live_block& b : live) {
        EXPECT_TRUE(stamp_ok(b));
        pool.deallocate(b.p);
    }
    auto s = pool.stats();
    EXPECT_EQ(s.peak_requested_bytes, peak);
    double waste = static_cast<double>(s.peak_reserved_bytes) / static_cast<double>(peak);
    RecordProperty("waste_ratio", std::to_string(waste));
    std::printf("churn waste %.3f (%llu growth steps)\n", waste,
                static_cast<unsigned long long>(s.growth_count));
    EXPECT_LE(waste, 1.3) << "reserved " << s.peak_reserved_bytes << " for a peak of " << peak;
    EXPECT_EQ(pool.release_unused(), s.reserved_bytes);
    EXPECT_EQ(h.slabs->live_bytes(), 0u);
}

} // namespace
