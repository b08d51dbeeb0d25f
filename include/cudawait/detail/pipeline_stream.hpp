// SPDX-License-Identifier: Apache-2.0
#pragma once

// The streaming driver: a producer acquires a slot, fills its pinned input and submits it; a
// consumer takes the outputs in submission order with next(). A session runs from the first
// acquire() until next() returned the end after close() (the session rule in the pipeline
// synopsis).

#include <cudawait/error.hpp>
#include <cudawait/event.hpp>
#include <cudawait/pipeline_options.hpp>
#include <cudawait/pipeline_report.hpp>
#include <cudawait/scheduler.hpp>
#include <cudawait/task.hpp>
#include <cudawait/trace.hpp>

#include <cudawait/detail/pipeline_slots.hpp>
#include <cudawait/detail/wait_list.hpp>

#include <chrono>
#include <cstddef>
#include <deque>
#include <optional>
#include <span>
#include <string>
#include <utility>

namespace cudawait::detail {

template <class In, class Out>
class pipeline_stream;

/// pipeline<In, Out>::input_slot: a slot the producer fills before submit(); given back unused
/// if dropped.
template <class In, class Out>
class pipeline_input_slot {
public:
    pipeline_input_slot() = default;
    pipeline_input_slot(pipeline_input_slot&& o) noexcept
        : m_owner(std::exchange(o.m_owner, nullptr)), m_index(o.m_index) {}
    pipeline_input_slot& operator=(pipeline_input_slot&& o) noexcept {
        if (this != &o) {
            reset();
            m_owner = std::exchange(o.m_owner, nullptr);
            m_index = o.m_index;
        }
        return *this;
    }
    ~pipeline_input_slot() { reset(); }
    /// The slot's pinned input: chunk_elements elements.
    /// @throws usage_error when empty or already submitted
    [[nodiscard]] std::span<In> data() const {
        if (m_owner == nullptr) {
            throw usage_error("pipeline::input_slot: empty or already submitted");
        }
        return m_owner->slot_of(m_index).host_in.span();
    }

private:
    friend class pipeline_stream<In, Out>;
    pipeline_input_slot(pipeline_stream<In, Out>* p, std::size_t i) : m_owner(p), m_index(i) {}
    void reset() noexcept {
        if (m_owner != nullptr) {
            std::exchange(m_owner, nullptr)->give_back(m_index);
        }
    }
    pipeline_stream<In, Out>* m_owner = nullptr;
    std::size_t m_index = 0;
};

/// pipeline<In, Out>::result: a chunk's output, in submission order; the slot is reused once
/// this is destroyed.
template <class In, class Out>
class pipeline_result {
public:
    pipeline_result(pipeline_result&& o) noexcept
        : m_owner(std::exchange(o.m_owner, nullptr)), m_index(o.m_index), m_chunk(o.m_chunk),
          m_count(o.m_count), m_by_fallback(o.m_by_fallback) {}
    pipeline_result& operator=(pipeline_result&&) = delete;
    ~pipeline_result() {
        if (m_owner != nullptr) {
            m_owner->give_back(m_index);
        }
    }
    [[nodiscard]] std::span<const Out> data() const {
        return m_owner->slot_of(m_index).host_out.span().first(m_count);
    }
    /// Submission index.
    [[nodiscard]] std::size_t chunk() const noexcept { return m_chunk; }
    /// Produced by the fallback rather than the GPU.
    [[nodiscard]] bool by_fallback() const noexcept { return m_by_fallback; }

private:
    friend class pipeline_stream<In, Out>;
    pipeline_result(pipeline_stream<In, Out>* p, std::size_t i, std::size_t chunk, std::size_t n,
                    bool fb)
        : m_owner(p), m_index(i), m_chunk(chunk), m_count(n), m_by_fallback(fb) {}
    pipeline_stream<In, Out>* m_owner;
    std::size_t m_index;
    std::size_t m_chunk;
    std::size_t m_count;
    bool m_by_fallback;
};

/// Streams chunks through a pipeline_core.
template <class In, class Out>
class pipeline_stream {
public:
    using core = pipeline_core<In, Out>;
    using flight = typename core::flight;
    using slot = typename core::slot;
    using input_slot = pipeline_input_slot<In, Out>;
    using result = pipeline_result<In, Out>;

    explicit pipeline_stream(core& c) noexcept : m_core(c) {}
    pipeline_stream(const pipeline_stream&) = delete;
    pipeline_stream& operator=(const pipeline_stream&) = delete;
    /// The streams must have been synchronised (pipeline_core::synchronize) before the queued
    /// chunks' events go back to the pool.
    ~pipeline_stream() = default;

    /// See pipeline::acquire.
    [[nodiscard]] task<input_slot> acquire() {
        core& k = m_core;
        scheduler& sched = *co_await this_scheduler_ptr();
        for (;;) {
            if (k.batch_running) {
                throw usage_error("pipeline::acquire: a batch run is in progress");
            }
            if (!k.session_open) {
                begin_session();
            } else if (m_closed) {
                throw usage_error("pipeline::acquire: the pipeline is closed; a new streaming "
                                  "session may begin once next() has returned the end");
            }
            if (!k.free_slots.empty() && m_submitted.size() < k.options.queue_capacity) {
                break;
            }
            co_await m_slot_freed.wait(sched);
        }
        std::size_t i = k.free_slots.front();
        k.free_slots.pop_front();
        try {
            k.slots[i]->ensure_host_buffers(k.options, *k.pool);
        } catch (...) {
            give_back(i);
            throw;
        }
        co_return input_slot(this, i);
    }

    /// See pipeline::submit.
    void submit(input_slot&& s, std::size_t count) {
        core& k = m_core;
        if (s.m_owner != this) {
            throw usage_error("pipeline::submit: the slot is empty or from another pipeline");
        }
        if (count == 0 || count > k.options.chunk_elements) {
            throw usage_error("pipeline::submit: count must be in 1..chunk_elements");
        }
        if (m_closed || !k.session_open) {
            throw usage_error("pipeline::submit: the slot's streaming session is closed");
        }
        std::size_t i = s.m_index;
        s.m_owner = nullptr;
        slot& sl = *k.slots[i];
        flight f;
        f.chunk = m_stream_seq++;
        f.count = count;
        f.output_count = k.output_count(count);
        f.slot = i;
        f.host_in = sl.host_in.data();
        f.host_out = sl.host_out.data();
        f.started = std::chrono::steady_clock::now();
        k.start_flight(f);
        try {
            k.enqueue(f, sl.host_in.data(), sl.host_out.data());
        } catch (const cuda_error& e) {
            // The chunk is still delivered in order: next() runs the fallback (or reports it).
            f.error = chunk_error_of(e);
        }
        m_submitted.push_back(std::move(f));
        m_result_ready.notify_all();
    }

    /// See pipeline::next.
    [[nodiscard]] task<std::optional<result>> next() {
        core& k = m_core;
        pipeline_stats& stats = k.monitor.counters();
        scheduler& sched = *co_await this_scheduler_ptr();
        const std::size_t session = m_sessions_ended;
        while (m_submitted.empty()) {
            if (m_closed) {
                end_session();
                co_return std::nullopt;
            }
            co_await m_result_ready.wait(sched);
            if (m_sessions_ended != session) {
                co_return std::nullopt; // another consumer took the end of this one's session
            }
        }
        flight f = std::move(m_submitted.front());
        m_submitted.pop_front();
        m_slot_freed.notify_all(); // the queue has room again
        chunk_error error = std::move(f.error);
        if (!error.failed() && !k.gpu_abandoned) {
            trace_async_range r("wait", f.chunk);
            try {
                co_await event_ref(f.done);
            } catch (const cuda_error& e) {
                error = chunk_error_of(e);
            }
        } else if (k.gpu_abandoned && !error.failed()) {
            error.what = "the GPU was abandoned after an earlier error";
        }
        slot& sl = *k.slots[f.slot];
        if (!error.failed()) {
            k.chunk_done(f);
            ++stats.gpu_chunks;
            ++stats.chunks;
            record_latency(f);
            co_return result(this, f.slot, f.chunk, f.output_count, false);
        }
        if (error.sticky) {
            k.gpu_abandoned = true;
        }
        k.report_degradation(f, degrade_level::give_up,
                             k.on_gpu_failure ? degrade_action::fallback : degrade_action::failed,
                             error);
        ++stats.chunks;
        if (!k.on_gpu_failure) {
            ++stats.failed_chunks;
            write_failure_report(k);
            give_back(f.slot);
            throw pipeline_error("pipeline: chunk " + std::to_string(f.chunk) +
                                     " failed: " + error.what,
                                 {}, {f.chunk});
        }
        try {
            trace_range r("fallback", f.chunk);
            k.on_gpu_failure(f.chunk, std::span<const In>(sl.host_in.data(), f.count),
                             sl.host_out.span().first(f.output_count));
        } catch (...) {
            ++stats.failed_chunks;
            write_failure_report(k);
            give_back(f.slot);
            throw;
        }
        ++stats.fallback_chunks;
        record_latency(f);
        write_failure_report(k);
        co_return result(this, f.slot, f.chunk, f.output_count, true);
    }

    /// See pipeline::close.
    void close() {
        m_closed = true;
        m_result_ready.notify_all();
        m_slot_freed.notify_all();
    }

private:
    friend class pipeline_input_slot<In, Out>;
    friend class pipeline_result<In, Out>;

    [[nodiscard]] slot& slot_of(std::size_t i) const { return *m_core.slots[i]; }

    // Chunk f is delivered: its latency runs from its submission.
    void record_latency(const flight& f) {
        m_core.monitor.chunk_latency(
            std::chrono::duration<double>(std::chrono::steady_clock::now() - f.started).count());
    }

    void give_back(std::size_t i) {
        m_core.free_slots.push_back(i);
        m_slot_freed.notify_all();
    }

    void begin_session() {
        m_core.session_open = true;
        m_closed = false;
        m_stream_seq = 0;
        m_core.monitor.reset();
    }
    void end_session() {
        m_core.session_open = false;
        m_closed = false;
        ++m_sessions_ended;
    }

    core& m_core;
    std::deque<flight> m_submitted;
    wait_list m_slot_freed;
    wait_list m_result_ready;
    std::size_t m_stream_seq = 0;
    std::size_t m_sessions_ended = 0;
    bool m_closed = false; // close() called, and next() has not returned the end yet
};

} // namespace cudawait::detail
