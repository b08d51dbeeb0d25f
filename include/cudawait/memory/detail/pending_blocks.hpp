// SPDX-License-Identifier: Apache-2.0
#pragma once

// pinned_pool's freed blocks whose recorded GPU uses may not have completed yet: a list, oldest
// first, with the checks that move completed ones back to the heap.

#include <cudawait/memory/use_tracker.hpp>
#include <cudawait/runtime/error.hpp>

#include <algorithm>
#include <cassert>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <mutex>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>

namespace cudawait::detail {

/// What pinned_pool keeps beside each block of its heap.
struct pool_block_extra {
    std::size_t requested = 0;
    std::vector<std::pair<cudaStream_t, use_token>> uses; ///< latest mark per stream
    bool pending = false;
    void* next_pending = nullptr;
};

/// The pending blocks of a pool and its checks of them. Every member is called under the pool's
/// lock unless it says otherwise. `Block` is the heap's block (a pool_block_extra with `size`).
template <class Block>
class pending_blocks {
public:
    /// Sets the slab size the thresholds of record_use's checks are reckoned from.
    void start(std::size_t slab_bytes) noexcept {
        m_slab_bytes = slab_bytes;
        m_check_at_bytes = slab_bytes / 8;
    }

    /// Appends a freed block with recorded uses.
    void push(Block* b) noexcept {
        b->pending = true;
        b->next_pending = nullptr;
        if (m_tail != nullptr) {
            m_tail->next_pending = b;
        } else {
            m_head = b;
        }
        m_tail = b;
        m_bytes += b->size;
        ++m_blocks;
        m_peak_bytes = std::max(m_peak_bytes, m_bytes);
    }

    [[nodiscard]] bool empty() const noexcept { return m_head == nullptr; }
    [[nodiscard]] std::size_t bytes() const noexcept { return m_bytes; }
    [[nodiscard]] std::size_t peak_bytes() const noexcept { return m_peak_bytes; }
    /// True while a check is querying the pending blocks it took out.
    [[nodiscard]] bool collecting() const noexcept { return m_collecting; }
    [[nodiscard]] std::uint64_t checks_started() const noexcept { return m_checks_started; }
    [[nodiscard]] std::uint64_t checks_finished() const noexcept { return m_checks_finished; }

    /// True when pending blocks have doubled since the last check and none is running.
    [[nodiscard]] bool check_due() const noexcept {
        return !m_collecting && (m_bytes >= m_check_at_bytes || m_blocks >= m_check_at_blocks);
    }

    /// One check of every pending block: those whose uses completed go to `free_block`. Called
    /// and returns with `lock` held and no other check running; the tracker is queried without
    /// the lock. Meanwhile collecting() tells other threads that the pending blocks are being
    /// looked at, so that they wait for the outcome instead of taking the pool for exhausted.
    /// Returns the bytes freed.
    template <class Free>
    std::size_t check(std::unique_lock<std::mutex>& lock, use_tracker& tracker,
                      Free free_block) noexcept {
        assert(!m_collecting);
        Block* list = std::exchange(m_head, nullptr);
        m_tail = nullptr;
        if (list == nullptr) {
            return 0;
        }
        m_collecting = true;
        ++m_checks_started;
        lock.unlock();
        Block* done = nullptr;
        Block* waiting = nullptr;
        Block* waiting_tail = nullptr;
        for (Block* b = list; b != nullptr;) {
            auto* next = static_cast<Block*>(b->next_pending);
            if (all_done(tracker, b)) {
                // Out of every list and owned by this check alone until it is freed below.
                for (auto& u : b->uses) {
                    tracker.release(u.second);
                }
                b->uses.clear();
                b->next_pending = done;
                done = b;
            } else {
                b->next_pending = nullptr;
                if (waiting_tail != nullptr) {
                    waiting_tail->next_pending = b;
                } else {
                    waiting = b;
                }
                waiting_tail = b;
            }
            b = next;
        }
        lock.lock();
        std::size_t freed = 0;
        for (Block* b = done; b != nullptr;) {
            auto* next = static_cast<Block*>(b->next_pending);
            b->pending = false;
            b->next_pending = nullptr;
            m_bytes -= b->size;
            --m_blocks;
            freed += b->size;
            free_block(b);
            b = next;
        }
        // Still pending: back in front of anything freed meanwhile, in their old order.
        if (waiting != nullptr) {
            waiting_tail->next_pending = m_head;
            if (m_head == nullptr) {
                m_tail = waiting_tail;
            }
            m_head = waiting;
        }
        m_collecting = false;
        ++m_checks_finished;
        m_check_at_bytes = 2 * m_bytes + m_slab_bytes / 8;
        m_check_at_blocks = 2 * m_blocks + 32;
        return freed;
    }

    /// Waits for every pending block's uses, then hands it to `free_block`. Takes `mutex` itself
    /// (called without it), and queries the tracker without it.
    template <class Free>
    void drain(std::mutex& mutex, use_tracker& tracker, Free free_block) noexcept {
        Block* list = nullptr;
        {
            std::lock_guard lock(mutex);
            list = m_head;
            m_head = m_tail = nullptr;
        }
        for (Block* b = list; b != nullptr;) {
            auto* next = static_cast<Block*>(b->next_pending);
            for (auto& u : b->uses) {
                try {
                    tracker.wait(u.second);
                } catch (const std::exception& e) {
                    std::fprintf(stderr, "cudawait: pinned_pool: %s\n", e.what());
                }
                tracker.release(u.second);
            }
            std::lock_guard lock(mutex);
            b->uses.clear();
            b->pending = false;
            m_bytes -= b->size;
            --m_blocks;
            free_block(b);
            b = next;
        }
    }

private:
    // True when every recorded use of `b` completed. Never throws: a query that fails leaves
    // the block pending, except after a sticky error (the context is broken, the device
    // touches no memory any more, and the error resurfaces at the next CUDA call).
    static bool all_done(use_tracker& tracker, Block* b) noexcept {
        for (auto& u : b->uses) {
            try {
                if (!tracker.done(u.second)) {
                    return false;
                }
            } catch (const cuda_error& e) {
                if (!e.sticky()) {
                    return false;
                }
                std::fprintf(stderr, "cudawait: pinned_pool: %s\n", e.what());
            } catch (const std::exception& e) {
                std::fprintf(stderr, "cudawait: pinned_pool: use_tracker::done: %s\n", e.what());
                return false;
            }
        }
        return true;
    }

    Block* m_head = nullptr; ///< oldest first
    Block* m_tail = nullptr;
    std::size_t m_bytes = 0;
    std::size_t m_blocks = 0;
    std::size_t m_peak_bytes = 0;
    std::size_t m_slab_bytes = 0;
    bool m_collecting = false;
    std::uint64_t m_checks_started = 0;
    std::uint64_t m_checks_finished = 0;
    std::size_t m_check_at_bytes = 0; ///< record_use checks pending blocks from here on
    std::size_t m_check_at_blocks = 32;
};

} // namespace cudawait::detail
