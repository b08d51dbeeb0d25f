// SPDX-License-Identifier: Apache-2.0
#pragma once

// The streams on which the library makes bulk device-to-host copies (a pipeline's D2H and graph
// streams, the bulk lane's D2H stream), per device, so that a small copy can ask whether one of
// them has work pending (copy_options::busy_sm_copy_bytes). Why, and what asking costs:
// docs/copy.md#inside.

#include <cudawait/runtime/error.hpp>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>

namespace cudawait::detail {

/// The registry (docs/copy.md#inside). Thread-safe. A class template (of an unused
/// parameter, always void) so that only a translation unit that registers or asks instantiates
/// its members; spelled bulk_streams.
template <class Unused = void>
class basic_bulk_streams {
public:
    /// Streams of one device registered together, with their owner's work count.
    struct group {
        int device;
        std::vector<cudaStream_t> streams;
        std::atomic<std::uint64_t> work{1}; ///< bumped by the owner once it enqueued work
        std::uint64_t idle_at = 0;          ///< the work count when all were last seen idle
    };

    /// The process's registry.
    static basic_bulk_streams& instance() {
        static basic_bulk_streams* const r = new basic_bulk_streams(); // never destroyed
        return *r;
    }

    /// Adds `streams`, of device `device`; the group lives until remove().
    /// @throws std::bad_alloc
    group* add(int device, std::vector<cudaStream_t> streams) {
        auto g = std::make_unique<group>();
        g->device = device;
        g->streams = std::move(streams);
        std::lock_guard lock(m_mutex);
        m_groups.push_back(std::move(g));
        return m_groups.back().get();
    }

    /// Removes a group add() returned.
    void remove(const group* g) noexcept {
        std::lock_guard lock(m_mutex);
        auto it = std::find_if(m_groups.begin(), m_groups.end(),
                               [g](const std::unique_ptr<group>& e) { return e.get() == g; });
        if (it != m_groups.end()) {
            m_groups.erase(it);
        }
    }

    /// Bumps the work count of the group that holds `s` (none if no group does): call after
    /// enqueueing work on `s` (not before: docs/copy.md#inside).
    void note_work(cudaStream_t s) noexcept {
        std::lock_guard lock(m_mutex);
        for (const auto& g : m_groups) {
            if (std::find(g->streams.begin(), g->streams.end(), s) != g->streams.end()) {
                g->work.fetch_add(1, std::memory_order_release);
                return;
            }
        }
    }

    /// True where a registered stream of `device` has work that has not completed. Streams
    /// whose work count has not moved since they were last found idle are not asked.
    /// @throws cuda_error (an error a stream reports)
    [[nodiscard]] bool pending(int device) {
        std::lock_guard lock(m_mutex);
        for (const auto& g : m_groups) {
            if (g->device != device) {
                continue;
            }
            const std::uint64_t work = g->work.load(std::memory_order_acquire);
            if (work == g->idle_at) {
                continue;
            }
            for (cudaStream_t s : g->streams) {
                const cudaError_t st = cudaStreamQuery(s);
                if (st == cudaErrorNotReady) {
                    return true;
                }
                check(st, "cudaStreamQuery (a bulk copy stream)");
            }
            g->idle_at = work;
        }
        return false;
    }

    /// How many streams are registered for `device`.
    [[nodiscard]] std::size_t count(int device) const {
        std::lock_guard lock(m_mutex);
        std::size_t n = 0;
        for (const auto& g : m_groups) {
            n += g->device == device ? g->streams.size() : 0;
        }
        return n;
    }

private:
    basic_bulk_streams() = default;

    mutable std::mutex m_mutex;
    std::vector<std::unique_ptr<group>> m_groups;
};

using bulk_streams = basic_bulk_streams<>;

/// Registers streams of one device in bulk_streams for its lifetime. Move-only. A class template
/// for the reason bulk_streams is one; spelled bulk_stream_registration.
template <class Unused = void>
class basic_bulk_stream_registration {
public:
    basic_bulk_stream_registration() = default;
    /// @throws std::bad_alloc (nothing stays registered)
    basic_bulk_stream_registration(int device, std::vector<cudaStream_t> streams)
        : m_group(basic_bulk_streams<Unused>::instance().add(device, std::move(streams))) {}
    basic_bulk_stream_registration(basic_bulk_stream_registration&& o) noexcept
        : m_group(std::exchange(o.m_group, nullptr)) {}
    basic_bulk_stream_registration& operator=(basic_bulk_stream_registration&& o) noexcept {
        if (this != &o) {
            release();
            m_group = std::exchange(o.m_group, nullptr);
        }
        return *this;
    }
    basic_bulk_stream_registration(const basic_bulk_stream_registration&) = delete;
    basic_bulk_stream_registration& operator=(const basic_bulk_stream_registration&) = delete;
    ~basic_bulk_stream_registration() { release(); }

    /// Call after enqueueing work on the streams: the next pending() asks them again.
    void note_work() const noexcept {
        if (m_group != nullptr) {
            m_group->work.fetch_add(1, std::memory_order_release);
        }
    }

    /// Notes work on the registration's streams when it goes (note_work), so that the note comes
    /// after the enqueue calls made in its scope, however they end. The registration must
    /// outlive it.
    class enqueue_scope {
    public:
        explicit enqueue_scope(const basic_bulk_stream_registration& r) noexcept : m_owner(&r) {}
        enqueue_scope(const enqueue_scope&) = delete;
        enqueue_scope& operator=(const enqueue_scope&) = delete;
        ~enqueue_scope() { m_owner->note_work(); }

    private:
        const basic_bulk_stream_registration* m_owner;
    };

    /// An enqueue_scope of this registration: hold it while enqueueing work on the streams.
    [[nodiscard]] enqueue_scope enqueuing() const noexcept { return enqueue_scope(*this); }

private:
    void release() noexcept {
        if (m_group != nullptr) {
            basic_bulk_streams<Unused>::instance().remove(m_group);
            m_group = nullptr;
        }
    }

    typename basic_bulk_streams<Unused>::group* m_group = nullptr;
};

using bulk_stream_registration = basic_bulk_stream_registration<>;

} // namespace cudawait::detail
