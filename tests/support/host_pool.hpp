// SPDX-License-Identifier: Apache-2.0
#pragma once

// Host-only stand-ins for a pinned_pool's upstream and for GPU completion, so that the pool's
// bookkeeping (and everything built on it) is tested on machines without a GPU.

#include <cudawait/memory/pinned_pool.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <mutex>
#include <new>
#include <thread>
#include <unordered_map>
#include <vector>

#include <gtest/gtest.h>

namespace cudawait::testing {

/// Slabs from the C heap, counted. Whatever the pool leaks is freed here at the end. Each
/// allocation can be made to take `grow_time`, as registering page-locked memory does.
class heap_slabs final : public cudawait::slab_source {
public:
    ~heap_slabs() override {
        for (auto [p, n] : m_live) {
            std::free(p);
        }
    }
    void* allocate(std::size_t bytes) override {
        std::this_thread::sleep_for(grow_time);
        std::lock_guard lock(m_mutex);
        if (fail_next) {
            fail_next = false;
            throw std::bad_alloc();
        }
        EXPECT_EQ(bytes % 2_MiB, 0u);
        void* p = std::aligned_alloc(2_MiB, bytes);
        if (p == nullptr) {
            throw std::bad_alloc();
        }
        m_live.emplace(p, bytes);
        ++allocations;
        return p;
    }
    void deallocate(void* p, std::size_t bytes) noexcept override {
        std::lock_guard lock(m_mutex);
        auto it = m_live.find(p);
        EXPECT_NE(it, m_live.end());
        if (it != m_live.end()) {
            EXPECT_EQ(it->second, bytes);
            m_live.erase(it);
        }
        ++deallocations;
        std::free(p);
    }
    [[nodiscard]] std::size_t live_bytes() {
        std::lock_guard lock(m_mutex);
        std::size_t n = 0;
        for (auto [p, b] : m_live) {
            n += b;
        }
        return n;
    }

    bool fail_next = false;
    int allocations = 0;
    int deallocations = 0;
    std::chrono::nanoseconds grow_time{0};

private:
    std::mutex m_mutex;
    std::unordered_map<void*, std::size_t> m_live;
};

/// Completion the test decides: record() hands out a numbered mark, complete(i) finishes it.
class manual_tracker final : public cudawait::use_tracker {
public:
    cudawait::use_token record(cudawait::stream_ref) override {
        std::lock_guard lock(m_mutex);
        m_done.push_back(false);
        ++outstanding;
        return {reinterpret_cast<void*>(m_done.size()), 0};
    }
    bool done(cudawait::use_token t) override {
        std::lock_guard lock(m_mutex);
        ++queries;
        return m_done.at(index(t));
    }
    void wait(cudawait::use_token t) override {
        std::lock_guard lock(m_mutex);
        ++waits;
        m_done.at(index(t)) = true;
    }
    void release(cudawait::use_token) noexcept override {
        std::lock_guard lock(m_mutex);
        --outstanding;
    }
    void complete(std::size_t mark) {
        std::lock_guard lock(m_mutex);
        m_done.at(mark) = true;
    }
    [[nodiscard]] std::size_t marks() {
        std::lock_guard lock(m_mutex);
        return m_done.size();
    }

    int outstanding = 0;
    int queries = 0;
    int waits = 0;

private:
    static std::size_t index(cudawait::use_token t) {
        return reinterpret_cast<std::size_t>(t.handle) - 1;
    }
    std::mutex m_mutex;
    std::vector<bool> m_done;
};

/// Completion by the clock, as a busy GPU gives it: a mark recorded on stream `s` completes
/// `delay(s)` later. Each query can be made to cost `query_cost` of busy time, as a driver query
/// does while other streams keep the GPU busy. Thread-safe.
class timed_tracker final : public cudawait::use_tracker {
public:
    using clock = std::chrono::steady_clock;

    explicit timed_tracker(std::function<std::chrono::nanoseconds(cudaStream_t)> delay,
                           std::chrono::nanoseconds query_cost = {})
        : m_delay(std::move(delay)), m_query_cost(query_cost) {}

    cudawait::use_token record(cudawait::stream_ref s) override {
        auto due = clock::now() + m_delay(s.get());
        m_outstanding.fetch_add(1);
        m_records.fetch_add(1);
        auto ticks = static_cast<std::uintptr_t>(due.time_since_epoch().count());
        return {reinterpret_cast<void*>(ticks), 0};
    }
    bool done(cudawait::use_token t) override {
        m_queries.fetch_add(1);
        auto start = clock::now();
        while (clock::now() - start < m_query_cost) {
        }
        return clock::now() >= due(t);
    }
    void wait(cudawait::use_token t) override { std::this_thread::sleep_until(due(t)); }
    void release(cudawait::use_token) noexcept override { m_outstanding.fetch_sub(1); }

    /// When a mark completes.
    [[nodiscard]] static clock::time_point due(cudawait::use_token t) {
        return clock::time_point(clock::duration(reinterpret_cast<std::uintptr_t>(t.handle)));
    }
    [[nodiscard]] long outstanding() const { return m_outstanding.load(); }
    [[nodiscard]] long records() const { return m_records.load(); }
    [[nodiscard]] long queries() const { return m_queries.load(); }

private:
    std::function<std::chrono::nanoseconds(cudaStream_t)> m_delay;
    std::chrono::nanoseconds m_query_cost;
    std::atomic<long> m_outstanding{0};
    std::atomic<long> m_records{0};
    std::atomic<long> m_queries{0};
};

// Stream handles are only compared by the pool when a stand-in tracker is used.
inline cudawait::stream_ref fake_stream(std::uintptr_t n) {
    return cudawait::stream_ref(reinterpret_cast<cudaStream_t>(n));
}

struct host_pool {
    std::shared_ptr<heap_slabs> slabs = std::make_shared<heap_slabs>();
    std::shared_ptr<manual_tracker> tracker = std::make_shared<manual_tracker>();

    cudawait::pinned_pool_options options(std::size_t cap = 1_GiB,
                                          std::size_t slab = 64_MiB) const {
        cudawait::pinned_pool_options o;
        o.max_pinned_bytes = cap;
        o.slab_bytes = slab;
        o.upstream = slabs;
        o.tracker = tracker;
        return o;
    }
};

} // namespace cudawait::testing
