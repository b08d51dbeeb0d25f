// SPDX-License-Identifier: Apache-2.0
#pragma once

// A host memcpy split across a few long-lived threads. One thread copying from pageable memory
// into page-locked memory reaches well under the PCIe link's bandwidth; staged copies need
// several to keep the DMA engines fed.

#include <cudawait/detail/fork_guard.hpp>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstring>
#include <deque>
#include <latch>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace cudawait::detail {

template <class = void>
class basic_memcpy_workers {
public:
    /// Parts smaller than this are not worth a thread's wake-up.
    static constexpr std::size_t min_part = std::size_t{1} << 20;

    /// The process-wide set: half the hardware threads, at most 8 copying at once (the caller
    /// is one of them). Never destroyed, so copies during static destruction stay safe.
    ///
    /// In a child created by fork() the inherited set's threads do not exist (a copy handed to
    /// them would never finish) and their queues' locks may be held by a thread that is gone.
    /// The set holds no CUDA state, so the child gets a fresh one; the inherited set is left
    /// alone, never touched nor destroyed.
    static basic_memcpy_workers& instance() {
        static std::atomic<current*> now{nullptr};
        for (;;) {
            current* c = now.load(std::memory_order_acquire);
            if (c != nullptr && !c->stamp.inherited()) {
                return *c->workers;
            }
            auto fresh = std::make_unique<current>();
            fresh->workers = std::make_unique<basic_memcpy_workers>(default_threads());
            if (now.compare_exchange_strong(c, fresh.get(), std::memory_order_acq_rel)) {
                return *fresh.release()->workers; // never destroyed, as said above
            }
            // Another thread made one first: use it (the loop checks it).
        }
    }

    explicit basic_memcpy_workers(unsigned threads) {
        for (unsigned i = 0; i + 1 < threads; ++i) {
            auto w = std::make_unique<worker>();
            try {
                w->thread = std::thread([raw = w.get()] { raw->run(); });
            } catch (...) {
                break; // fewer helpers; the caller still copies
            }
            m_workers.push_back(std::move(w));
        }
    }
    basic_memcpy_workers(const basic_memcpy_workers&) = delete;
    basic_memcpy_workers& operator=(const basic_memcpy_workers&) = delete;
    ~basic_memcpy_workers() {
        for (auto& w : m_workers) {
            {
                std::lock_guard lock(w->mutex);
                w->stop = true;
            }
            w->cv.notify_one();
            w->thread.join();
        }
    }

    /// Threads that copy, counting the caller.
    [[nodiscard]] unsigned threads() const noexcept {
        return static_cast<unsigned>(m_workers.size()) + 1;
    }

    /// Copies `n` bytes; returns once every byte is in place.
    void copy(void* dst, const void* src, std::size_t n) {
        std::size_t parts = std::min<std::size_t>(threads(), n / min_part);
        if (parts <= 1) {
            std::memcpy(dst, src, n);
            return;
        }
        std::size_t per = part_bytes(n, parts);
        auto done = std::make_shared<std::latch>(static_cast<std::ptrdiff_t>(parts - 1));
        auto* d = static_cast<std::byte*>(dst);
        auto* s = static_cast<const std::byte*>(src);
        std::size_t off = per; // the caller takes the first part
        for (std::size_t i = 0; i + 1 < parts; ++i) {
            // The last worker takes the rest; parts * per >= n, so that is at most `per`.
            std::size_t len = i + 2 == parts ? n - off : per;
            m_workers[i]->push({d + off, s + off, len, done});
            off += len;
        }
        std::memcpy(d, s, per);
        done->wait();
    }

    /// The bytes of each part but the last: n / parts rounded up, then up to whole pages, so
    /// that `parts` of them cover all of `n` (rounding n / parts down lost the remainder).
    [[nodiscard]] static constexpr std::size_t part_bytes(std::size_t n, std::size_t parts) {
        std::size_t per = (n + parts - 1) / parts;
        return (per + 4095) / 4096 * 4096;
    }

private:
    struct current {
        fork_stamp stamp; ///< the process the set was made in
        std::unique_ptr<basic_memcpy_workers> workers;
    };

    struct part {
        std::byte* dst;
        const std::byte* src;
        std::size_t bytes;
        std::shared_ptr<std::latch> done;
    };

    struct worker {
        std::thread thread;
        std::mutex mutex;
        std::condition_variable cv;
        std::deque<part> queue;
        bool stop = false;

        void push(part p) {
            {
                std::lock_guard lock(mutex);
                queue.push_back(std::move(p));
            }
            cv.notify_one();
        }
        void run() {
            for (;;) {
                part p{};
                {
                    std::unique_lock lock(mutex);
                    cv.wait(lock, [this] { return stop || !queue.empty(); });
                    if (queue.empty()) {
                        return;
                    }
                    p = std::move(queue.front());
                    queue.pop_front();
                }
                std::memcpy(p.dst, p.src, p.bytes);
                p.done->count_down();
            }
        }
    };

    static unsigned default_threads() {
        unsigned hw = std::max(1u, std::thread::hardware_concurrency());
        return std::clamp(hw / 2, 1u, 8u);
    }

    std::vector<std::unique_ptr<worker>> m_workers;
};

/// The process's memcpy workers (basic_memcpy_workers: a class template of an unused
/// parameter, so that only a translation unit that copies through them instantiates them).
using memcpy_workers = basic_memcpy_workers<>;

} // namespace cudawait::detail
