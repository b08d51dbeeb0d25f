// SPDX-License-Identifier: Apache-2.0
#pragma once

// Staging: pageable host memory goes through page-locked buffers (cudaMemcpyAsync would copy it
// synchronously through the driver's small buffers). stage_in / stage_out copy one chunk on
// several threads; staged_copy is copy.hpp's pageable <-> device copy through a pinned ring.

#include <cudawait/copy/detail/parallel_memcpy.hpp>
#include <cudawait/memory/pinned_buffer.hpp>
#include <cudawait/memory/pinned_pool.hpp>
#include <cudawait/observe/trace.hpp>
#include <cudawait/runtime/error.hpp>
#include <cudawait/runtime/event.hpp>
#include <cudawait/runtime/stream.hpp>

#include <algorithm>
#include <cstddef>
#include <exception>
#include <source_location>
#include <vector>

#include <cuda_runtime_api.h>

namespace cudawait::detail {

/// Copies `bytes` of pageable `src` into page-locked `pinned_dst` (several threads).
template <class = void>
void stage_in(void* pinned_dst, const void* src, std::size_t bytes, std::size_t index) {
    trace_range r("stage-in", index);
    memcpy_workers::instance().copy(pinned_dst, src, bytes);
}

/// Copies `bytes` of page-locked `pinned_src` out to pageable `dst` (several threads).
template <class = void>
void stage_out(void* dst, const void* pinned_src, std::size_t bytes, std::size_t index) {
    trace_range r("stage-out", index);
    memcpy_workers::instance().copy(dst, pinned_src, bytes);
}

/// A pageable <-> device copy through a ring of pinned chunks, as a state machine: advance()
/// does everything that needs no waiting and returns the event to wait for next, or nullptr.
/// The blocking copy waits with cudaEventSynchronize, the awaitable one with co_await. A class
/// template of an unused parameter (staged_copy names it), so that only a translation unit that
/// stages a copy instantiates it.
template <class = void>
class basic_staged_copy {
public:
    /// `chunk_bytes` and `depth` as in copy_options (clamped to 4 KiB and 2..64).
    /// @throws std::bad_alloc, cuda_error
    basic_staged_copy(std::byte* dst, const std::byte* src, std::size_t n, bool to_device,
                      stream_ref s, pinned_pool& pool, std::size_t chunk_bytes,
                      unsigned depth_wanted)
        : m_dst(dst), m_src(src), m_bytes(n), m_to_device(to_device), m_stream(s), m_pool(&pool) {
        std::size_t chunk = std::max<std::size_t>(chunk_bytes, 4096);
        m_chunk = std::min(chunk, n);
        m_chunks = (n + m_chunk - 1) / m_chunk;
        std::size_t depth = std::clamp<std::size_t>(depth_wanted, 2, 64);
        depth = std::min(depth, m_chunks);
        event_pool& events = event_pool::for_device(s.device());
        m_slots.reserve(depth);
        for (std::size_t i = 0; i < depth; ++i) {
            // Nothing is in flight yet: a throw here gives every chunk and event straight back.
            m_slots.push_back({pinned_buffer<std::byte>(m_chunk, pool), events.acquire()});
        }
    }
    basic_staged_copy(const basic_staged_copy&) = delete;
    basic_staged_copy& operator=(const basic_staged_copy&) = delete;
    ~basic_staged_copy() { release_buffers(); }

    /// Progress without waiting; the event to wait on next, or nullptr when the copy needs no
    /// more host work (host to device: all enqueued; device to host: all written).
    cudaEvent_t advance() { return m_to_device ? advance_to_device() : advance_from_device(); }

    /// The event recorded after the last chunk's DMA (host to device).
    [[nodiscard]] cudaEvent_t last_event() const {
        return m_slots[(m_chunks - 1) % m_slots.size()].event.get();
    }

private:
    struct slot {
        pinned_buffer<std::byte> buffer;
        pooled_event event; // back to the pool with the slot
    };

    [[nodiscard]] std::size_t length(std::size_t chunk) const noexcept {
        return std::min(m_chunk, m_bytes - chunk * m_chunk);
    }

    static bool ready(const pooled_event& e) {
        return event_ready(e.get(), std::source_location::current());
    }

    void dma(void* dst, const void* src, std::size_t len, slot& sl) {
        check(cudaMemcpyAsync(dst, src, len, cudaMemcpyDefault, m_stream.get()), "cudaMemcpyAsync");
        sl.event.record(m_stream);
        m_in_flight = true;
    }

    cudaEvent_t advance_to_device() {
        while (m_next < m_chunks) {
            slot& sl = m_slots[m_next % m_slots.size()];
            if (m_next >= m_slots.size() && !ready(sl.event)) {
                return sl.event.get(); // its previous chunk is still being transferred
            }
            std::size_t off = m_next * m_chunk;
            std::size_t len = length(m_next);
            stage_in(sl.buffer.data(), m_src + off, len, m_next);
            dma(m_dst + off, sl.buffer.data(), len, sl);
            ++m_next;
        }
        return nullptr;
    }

    cudaEvent_t advance_from_device() {
        for (;;) {
            while (m_enqueued < m_chunks && m_enqueued < m_next + m_slots.size()) {
                slot& sl = m_slots[m_enqueued % m_slots.size()];
                std::size_t off = m_enqueued * m_chunk;
                dma(sl.buffer.data(), m_src + off, length(m_enqueued), sl);
                ++m_enqueued;
            }
            if (m_next == m_chunks) {
                m_in_flight = false; // every DMA was waited for
                return nullptr;
            }
            slot& sl = m_slots[m_next % m_slots.size()];
            if (!ready(sl.event)) {
                return sl.event.get();
            }
            std::size_t off = m_next * m_chunk;
            stage_out(m_dst + off, sl.buffer.data(), length(m_next), m_next);
            ++m_next;
        }
    }

    // Chunks whose DMA may still run go back to the pool marked with a use on the stream, so
    // nothing is handed out while the copy engine still reads or writes it. (The events go back
    // with the slots: a later record of a reused event replaces this copy's.)
    void release_buffers() noexcept {
        for (slot& sl : m_slots) {
            if (m_in_flight && sl.buffer) {
                try {
                    sl.buffer.record_use(m_stream);
                } catch (const std::exception&) {
                    // Recording failed: the context is broken and will not touch the chunk.
                }
            }
            sl.buffer.reset();
        }
    }

    std::byte* m_dst;
    const std::byte* m_src;
    std::size_t m_bytes;
    bool m_to_device;
    stream_ref m_stream;
    pinned_pool* m_pool;
    std::size_t m_chunk = 0;
    std::size_t m_chunks = 0;
    std::size_t m_next = 0;     ///< next chunk to fill (to device) or to drain (from device)
    std::size_t m_enqueued = 0; ///< chunks whose DMA is enqueued (from device)
    bool m_in_flight = false;
    std::vector<slot> m_slots;
};

/// The staged copy (basic_staged_copy).
using staged_copy = basic_staged_copy<>;

} // namespace cudawait::detail
