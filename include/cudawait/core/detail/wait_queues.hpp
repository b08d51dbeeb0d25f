// SPDX-License-Identifier: Apache-2.0
#pragma once

// detail::wait_queues: the scheduler's pending GPU waits, a FIFO of recycled events per awaited
// stream and a list of awaited user events, and the events it recycles. See docs/core.md#polling.

#include <cudawait/runtime/error.hpp>
#include <cudawait/runtime/event.hpp>

#include <algorithm>
#include <coroutine>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <unordered_map>
#include <vector>

#include <cuda_runtime_api.h>

namespace cudawait::detail {

/// One pending GPU wait: the event to poll and the coroutine to resume.
struct wait_node {
    wait_node* next = nullptr;
    cudaEvent_t event = nullptr;
    int device = -1; ///< >= 0: a recycled event of that device; -1: the user's event
    std::coroutine_handle<> waiter;
    cudaError_t* status = nullptr;
    bool watched = false; ///< a sentinel was armed on `event` (idle_watch)
    bool rung = false;    ///< a doorbell sentinel was armed on `event` (doorbell)
};

struct stream_fifo {
    cudaStream_t stream = nullptr;
    int device = 0;
    /// `stream` is 0, cudaStreamLegacy or cudaStreamPerThread: a handle that names a different
    /// stream on each device, kept apart by `device` (and not in the by-handle map).
    bool per_device = false;
    wait_node* head = nullptr;
    wait_node* tail = nullptr;
    /// Completed events of this stream, recorded on it again first: re-recording an event on
    /// the stream it last ran on is about twice as cheap in the driver as moving it.
    std::vector<cudaEvent_t> spare;
};

/// Loop thread only. A class template (`Unused` is always void) so that only a scheduler that is
/// driven instantiates it.
template <class Unused = void>
class wait_queues {
public:
    /// 0, cudaStreamLegacy and cudaStreamPerThread name the calling thread's stream of its
    /// current device: one handle, a different stream per device (and per thread).
    [[nodiscard]] static bool names_stream_per_device(cudaStream_t s) noexcept {
        return s == nullptr || s == cudaStreamLegacy || s == cudaStreamPerThread;
    }

    [[nodiscard]] bool has_waits() const noexcept {
        return m_stream_waits > 0 || !m_event_waits.empty();
    }
    [[nodiscard]] std::size_t stream_waits() const noexcept { return m_stream_waits; }
    [[nodiscard]] std::size_t event_waits() const noexcept { return m_event_waits.size(); }
    [[nodiscard]] std::size_t streams() const noexcept { return m_active.size(); }

    /// The FIFO of `s` (made where there is none yet), or the failing call's status with `what`
    /// naming it.
    cudaError_t fifo_for(cudaStream_t s, stream_fifo*& f, const char*& what) {
        f = nullptr;
        if (names_stream_per_device(s)) {
            int dev = 0;
            if (cudaError_t st = cudaGetDevice(&dev); st != cudaSuccess) {
                what = "cudaGetDevice";
                return st;
            }
            for (stream_fifo* a : m_active) {
                if (a->per_device && a->stream == s && a->device == dev) {
                    f = a;
                    break;
                }
            }
            if (f == nullptr) {
                f = new_fifo(s, dev, true);
            }
        } else if (m_last_fifo != nullptr && m_last_fifo->stream == s) {
            f = m_last_fifo;
        } else if (auto it = m_by_stream.find(s); it != m_by_stream.end()) {
            f = it->second;
        } else {
            int dev = 0;
            if (cudaError_t st = cudaStreamGetDevice(s, &dev); st != cudaSuccess) {
                what = "cudaStreamGetDevice";
                return st;
            }
            f = new_fifo(s, dev, false);
        }
        m_last_fifo = f;
        return cudaSuccess;
    }

    /// An event to record on `f`'s stream: one of its spares, else one of the device's.
    cudaError_t event_for(stream_fifo* f, cudaEvent_t& ev) noexcept {
        if (!f->spare.empty()) {
            ev = f->spare.back();
            f->spare.pop_back();
            return cudaSuccess;
        }
        return take_event(f->device, ev);
    }

    /// Appends `n` (its event recorded on `f`'s stream) to `f`.
    void push(stream_fifo* f, wait_node* n) noexcept {
        if (f->tail != nullptr) {
            f->tail->next = n;
        } else {
            f->head = n;
        }
        f->tail = n;
        ++m_stream_waits;
    }
    /// Adds a wait on an event queried on its own (a user event, or a stream wait recorded off
    /// the loop thread).
    void push_event_wait(wait_node* n) { m_event_waits.push_back(n); }

    /// Takes the head node off `f` and keeps its event as a spare; an emptied FIFO is forgotten
    /// (its stream may be destroyed and its handle reused from now on).
    wait_node* pop_head(stream_fifo* f) {
        wait_node* n = f->head;
        f->head = n->next;
        --m_stream_waits;
        ++m_completed[static_cast<std::size_t>(f->device)];
        f->spare.push_back(n->event);
        if (f->head == nullptr) {
            f->tail = nullptr;
            drop_fifo_if_empty(f);
        }
        return n;
    }

    wait_node* new_node() {
        if (m_free_nodes.empty()) {
            m_node_storage.emplace_back();
            return &m_node_storage.back();
        }
        wait_node* n = m_free_nodes.back();
        m_free_nodes.pop_back();
        return n;
    }
    /// Hands back a node that was never queued.
    void free_node(wait_node* n) { m_free_nodes.push_back(n); }
    /// Stores the wait's outcome, recycles its node and returns the coroutine to resume.
    std::coroutine_handle<> release(wait_node* n, cudaError_t st) {
        if (st != cudaSuccess) {
            (void)cudaGetLastError();
        }
        *n->status = st;
        std::coroutine_handle<> h = n->waiter;
        *n = wait_node{};
        m_free_nodes.push_back(n);
        return h;
    }

    void drop_fifo_if_empty(stream_fifo* f) {
        if (f->head != nullptr) {
            return;
        }
        release_fifo(f);
        auto it = std::find(m_active.begin(), m_active.end(), f);
        *it = m_active.back();
        m_active.pop_back();
    }

    /// The FIFOs with pending waits; an emptied one leaves (pop_head), the last taking its place.
    [[nodiscard]] const std::vector<stream_fifo*>& active() const noexcept { return m_active; }

    /// How many nodes from `head` on (whose event completed) are known done, without a query per
    /// node; `next_not_ready` tells whether the node after them was found not ready.
    /// See docs/core.md#polling.
    static std::size_t done_prefix(const wait_node* head, bool& next_not_ready) noexcept {
        // Gallop: probe the nodes 1, 2, 4, ... places after the head until one is not done.
        std::size_t lo = 0; // the last place known done
        const wait_node* lo_node = head;
        std::size_t hi = 0; // the first place known not ready; 0: none found
        const wait_node* probe = head;
        std::size_t at = 0; // probe's place
        for (std::size_t target = 1; probe->next != nullptr; target *= 2) {
            while (at < target && probe->next != nullptr) {
                probe = probe->next;
                ++at;
            }
            const cudaError_t pst = cudaEventQuery(probe->event);
            if (pst == cudaSuccess) {
                lo = at;
                lo_node = probe;
                continue;
            }
            // An error stops the search at `lo`; the new head's own query reports it.
            hi = pst == cudaErrorNotReady ? at : 0;
            break;
        }
        // Bisect between the last done place and the first not-ready one: the prefix ends
        // exactly where the first not-ready node starts.
        while (hi != 0 && hi - lo > 1) {
            const std::size_t mid = lo + (hi - lo) / 2;
            const wait_node* m = lo_node;
            for (std::size_t place = lo; place < mid; ++place) {
                m = m->next;
            }
            const cudaError_t mst = cudaEventQuery(m->event);
            if (mst == cudaSuccess) {
                lo = mid;
                lo_node = m;
            } else {
                hi = mst == cudaErrorNotReady ? mid : 0;
            }
        }
        next_not_ready = hi == lo + 1;
        return lo + 1;
    }

    /// Queries every event wait once; calls `done(node, status)` for each that completed, after
    /// taking it off the list (and recycling a pooled event).
    template <class Done>
    bool poll_events(Done&& done) {
        bool progress = false;
        for (std::size_t i = 0; i < m_event_waits.size();) {
            wait_node* n = m_event_waits[i];
            cudaError_t st = cudaEventQuery(n->event);
            if (st == cudaErrorNotReady) {
                ++i;
                continue;
            }
            m_event_waits[i] = m_event_waits.back();
            m_event_waits.pop_back();
            if (n->device >= 0) { // a stream wait recorded off the loop thread: a pooled event
                const auto dev = static_cast<std::size_t>(n->device);
                if (dev >= m_completed.size()) {
                    m_completed.resize(dev + 1, 0);
                }
                ++m_completed[dev];
                if (dev >= m_event_cache.size()) {
                    m_event_cache.resize(dev + 1);
                }
                give_event(n->device, n->event);
            }
            done(n, st);
            progress = true;
        }
        return progress;
    }

    /// Calls `fn(node)` for the head of every FIFO and every event wait: the waits a sentinel
    /// watches.
    template <class Fn>
    void for_each_head(Fn&& fn) {
        for (stream_fifo* f : m_active) {
            if (f->head != nullptr) {
                fn(f->head);
            }
        }
        for (wait_node* n : m_event_waits) {
            fn(n);
        }
    }

    // ---- for a watchdog ---------------------------------------------------------------------

    /// Stream waits completed on `dev` so far.
    [[nodiscard]] std::uint64_t completed_on(int dev) const noexcept {
        return static_cast<std::size_t>(dev) < m_completed.size()
                   ? m_completed[static_cast<std::size_t>(dev)]
                   : 0;
    }
    /// Devices with stream waits pending (failed awaits no longer count).
    void pending_devices(std::vector<int>& out) const {
        out.clear();
        for (const stream_fifo* f : m_active) {
            if (std::find(out.begin(), out.end(), f->device) == out.end() && live_waits(f) > 0) {
                out.push_back(f->device);
            }
        }
        for (const wait_node* n : m_event_waits) {
            if (n->device >= 0 && n->status != &m_orphan_status &&
                std::find(out.begin(), out.end(), n->device) == out.end()) {
                out.push_back(n->device);
            }
        }
    }
    /// The streams of `dev` with pending awaits, and how many awaits are pending on them.
    std::size_t pending_on(int dev, std::vector<cudaStream_t>& streams) const {
        streams.clear();
        std::size_t waits = 0;
        for (const stream_fifo* f : m_active) {
            if (f->device == dev) {
                if (std::size_t n = live_waits(f); n > 0) {
                    streams.push_back(f->stream);
                    waits += n;
                }
            }
        }
        for (const wait_node* n : m_event_waits) {
            waits += n->device == dev && n->status != &m_orphan_status ? 1 : 0;
        }
        return waits;
    }
    /// Fails every live await of a stream of `dev`: calls `failed(waiter)` for each, stores
    /// cudaErrorNotReady (never a completion's status) in its status, and leaves its event
    /// queued until the GPU completes it, then recycled without resuming anyone.
    template <class Failed>
    void fail_waits_on(int dev, Failed&& failed) {
        auto fail_node = [&](wait_node* n) {
            if (n->status != &m_orphan_status) {
                failed(n->waiter);
                *n->status = cudaErrorNotReady;
                n->status = &m_orphan_status;
                n->waiter = std::noop_coroutine();
            }
        };
        for (stream_fifo* f : m_active) {
            if (f->device == dev) {
                for (wait_node* n = f->head; n != nullptr; n = n->next) {
                    fail_node(n);
                }
            }
        }
        for (wait_node* n : m_event_waits) {
            if (n->device == dev) { // a stream wait recorded off the loop thread
                fail_node(n);
            }
        }
    }

    /// Hands the recycled events back to their devices' pools.
    void release_events() {
        for (std::size_t d = 0; d < m_event_cache.size(); ++d) {
            for (cudaEvent_t e : m_event_cache[d]) {
                event_pool::for_device(static_cast<int>(d)).release_raw(e);
            }
        }
    }

private:
    stream_fifo* new_fifo(cudaStream_t s, int dev, bool per_device) {
        stream_fifo* f = nullptr;
        if (m_free_fifos.empty()) {
            m_fifo_storage.emplace_back();
            f = &m_fifo_storage.back();
        } else {
            f = m_free_fifos.back();
            m_free_fifos.pop_back();
        }
        if (static_cast<std::size_t>(dev) >= m_completed.size()) {
            m_completed.resize(static_cast<std::size_t>(dev) + 1, 0);
        }
        f->stream = s;
        f->device = dev;
        f->per_device = per_device;
        f->head = nullptr;
        f->tail = nullptr;
        if (!per_device) {
            m_by_stream.emplace(s, f);
        }
        m_active.push_back(f);
        return f;
    }
    /// Forgets an empty FIFO: its stream may be destroyed and its handle reused from now on.
    void release_fifo(stream_fifo* f) {
        for (cudaEvent_t e : f->spare) {
            give_event(f->device, e);
        }
        f->spare.clear();
        if (!f->per_device) {
            m_by_stream.erase(f->stream);
        }
        if (m_last_fifo == f) {
            m_last_fifo = nullptr;
        }
        m_free_fifos.push_back(f);
    }

    cudaError_t take_event(int dev, cudaEvent_t& ev) noexcept {
        if (static_cast<std::size_t>(dev) < m_event_cache.size() &&
            !m_event_cache[static_cast<std::size_t>(dev)].empty()) {
            ev = m_event_cache[static_cast<std::size_t>(dev)].back();
            m_event_cache[static_cast<std::size_t>(dev)].pop_back();
            return cudaSuccess;
        }
        try {
            if (static_cast<std::size_t>(dev) >= m_event_cache.size()) {
                m_event_cache.resize(static_cast<std::size_t>(dev) + 1);
            }
            ev = event_pool::for_device(dev).acquire_raw();
            return cudaSuccess;
        } catch (const cuda_error& e) {
            return e.status();
        } catch (...) {
            return cudaErrorMemoryAllocation;
        }
    }
    void give_event(int dev, cudaEvent_t ev) {
        m_event_cache[static_cast<std::size_t>(dev)].push_back(ev);
    }

    [[nodiscard]] std::size_t live_waits(const stream_fifo* f) const noexcept {
        std::size_t n = 0;
        for (const wait_node* w = f->head; w != nullptr; w = w->next) {
            n += w->status != &m_orphan_status ? 1 : 0;
        }
        return n;
    }

    std::unordered_map<cudaStream_t, stream_fifo*> m_by_stream;
    stream_fifo* m_last_fifo = nullptr;
    std::vector<stream_fifo*> m_active;
    std::vector<stream_fifo*> m_free_fifos;
    std::deque<stream_fifo> m_fifo_storage;
    std::size_t m_stream_waits = 0;
    std::vector<wait_node*> m_event_waits;
    std::vector<wait_node*> m_free_nodes;
    std::deque<wait_node> m_node_storage;
    std::vector<std::vector<cudaEvent_t>> m_event_cache;
    std::vector<std::uint64_t> m_completed;    ///< stream waits completed, by device
    cudaError_t m_orphan_status = cudaSuccess; ///< where failed awaits' completions go
};

} // namespace cudawait::detail
