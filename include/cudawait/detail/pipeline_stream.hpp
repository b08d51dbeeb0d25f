// SPDX-License-Identifier: Apache-2.0
#pragma once

// The streaming driver: a producer acquires a slot, fills its pinned input and submits it; a
// consumer takes the outputs in submission order with next(). A session runs from the first
// acquire() until next() returned the end after close() (the session rule in the pipeline
// synopsis).
//
// Degradation as in a batch: an enqueue that fails with a retryable error is retried at once
// (level 1, up to max_retries), and a chunk whose wait passes chunk_timeout is waited for again;
// each lowers the depth. The depth here bounds the chunks the GPU works on at once, on the GPU
// itself: a chunk's H2D (or graph replay) waits for the chunk `depth` submissions before it, so
// a producer that holds several slots never blocks on a lowered depth. recover_after clean
// chunks raise it again by one.

#include <cudawait/error.hpp>
#include <cudawait/event.hpp>
#include <cudawait/pipeline_options.hpp>
#include <cudawait/pipeline_report.hpp>
#include <cudawait/scheduler.hpp>
#include <cudawait/task.hpp>
#include <cudawait/timeline.hpp>
#include <cudawait/timeout.hpp>
#include <cudawait/trace.hpp>

#include <cudawait/detail/pipeline_slots.hpp>
#include <cudawait/detail/wait_list.hpp>

#include <algorithm>
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
        return m_owner->input_of(m_index);
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

    using clock = std::chrono::steady_clock;

    /// See pipeline::acquire. With a deadline: timeout_error(budget) once it passed (a deadline
    /// already passed polls: a slot free now, else the error), and no slot is taken.
    [[nodiscard]] task<input_slot> acquire(std::optional<clock::time_point> deadline = {},
                                           std::chrono::nanoseconds budget = {}) {
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
            if (!k.free_slots.empty() && m_submitted.size() + m_taken < k.options.queue_capacity) {
                break;
            }
            if (!deadline) {
                co_await m_slot_freed.wait(sched);
            } else if (clock::now() >= *deadline) {
                throw timeout_error(budget);
            } else {
                co_await m_slot_freed.wait_until(sched, *deadline);
            }
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
        // After the GPU was given up nothing is enqueued: next() hands the chunk to the fallback.
        for (unsigned attempt = 0; !k.gpu_abandoned; ++attempt) {
            chunk_error error;
            try {
                throttle(sl);
                k.enqueue(f, sl.host_in.data(), sl.host_out.data());
                break;
            } catch (const cuda_error& e) {
                error = chunk_error_of(e);
            }
            if (error.sticky || attempt >= k.options.max_retries) {
                // The chunk is still delivered in order: next() runs the fallback (or reports it).
                f.error = std::move(error);
                break;
            }
            // Level 1: retried at once with one slot fewer. What did launch before the error is
            // ordered before the retry by the slot's events, as for any reuse of the slot.
            ++k.monitor.counters().retries;
            m_core.lower_depth();
            try {
                k.report_degradation(f, degrade_level::retry,
                                     degrade_action::retried_with_less_depth, error);
            } catch (...) {
                f.error = std::move(error); // next() still reports the chunk, in order
                m_submitted.push_back(std::move(f));
                m_result_ready.notify_all();
                throw;
            }
        }
        m_submitted.push_back(std::move(f));
        m_result_ready.notify_all();
    }

    /// See pipeline::next. With a deadline: timeout_error(budget) once it passed (a deadline
    /// already passed polls: a chunk complete now, else the error), and the chunk stays first
    /// in line for the next call.
    [[nodiscard]] task<std::optional<result>> next(std::optional<clock::time_point> deadline = {},
                                                   std::chrono::nanoseconds budget = {}) {
        core& k = m_core;
        pipeline_stats& stats = k.monitor.counters();
        scheduler& sched = *co_await this_scheduler_ptr();
        const std::size_t session = m_sessions_ended;
        while (m_submitted.empty()) {
            if (m_closed) {
                end_session();
                co_return std::nullopt;
            }
            if (!deadline) {
                co_await m_result_ready.wait(sched);
            } else if (clock::now() >= *deadline) {
                throw timeout_error(budget);
            } else {
                co_await m_result_ready.wait_until(sched, *deadline);
            }
            if (m_sessions_ended != session) {
                co_return std::nullopt; // another consumer took the end of this one's session
            }
        }
        flight f = std::move(m_submitted.front());
        m_submitted.pop_front();
        // Until it is consumed (or put back in line after the caller's timeout) the chunk keeps
        // its place in the queue: a producer may not fill it meanwhile.
        ++m_taken;
        struct taken_guard {
            pipeline_stream* self;
            ~taken_guard() {
                --self->m_taken;
                self->m_slot_freed.notify_all(); // the queue has room again
            }
        } taken{this};
        chunk_error error = std::move(f.error);
        if (!error.failed() && !k.gpu_abandoned) {
            trace_async_range r("wait", f.chunk);
            timeline_scope span(k.options.timeline, "wait", "wait", f.chunk);
            for (;;) {
                wait_outcome w = co_await wait_for(f, deadline);
                if (w.error.failed()) {
                    error = std::move(w.error);
                    break;
                }
                if (!w.timed_out) {
                    break;
                }
                if (w.by_caller) {
                    // Not consumed: the chunk stays first in line, its slot and event with it.
                    m_submitted.push_front(std::move(f));
                    throw timeout_error(budget);
                }
                error.timed_out = true;
                error.exception = std::make_exception_ptr(timeout_error(k.options.chunk_timeout));
                error.what = "chunk did not complete within chunk_timeout";
                if (++m_front_attempts > k.options.max_retries) {
                    give_up_timed_out(f, error); // throws
                }
                // Level 1: the work cannot be cancelled; it is waited for again, with less
                // concurrency for the chunks that follow.
                ++stats.retries;
                m_core.lower_depth();
                k.report_degradation(f, degrade_level::retry, degrade_action::waited_again, error);
                error = {};
            }
        } else if (error.timed_out) {
            give_up_timed_out(f, error); // in flight behind a chunk given up: throws
        } else if (k.gpu_abandoned && !error.failed()) {
            error.what = "the GPU was abandoned after an earlier error";
        }
        const bool clean = m_front_attempts == 0;
        m_front_attempts = 0;
        slot& sl = *k.slots[f.slot];
        if (!error.failed()) {
            k.chunk_done(f);
            ++stats.gpu_chunks;
            ++stats.chunks;
            if (clean) {
                m_core.note_clean();
            }
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
            timeline_scope span(k.options.timeline, "fallback", "fallback", f.chunk);
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

    struct wait_outcome {
        bool timed_out = false; ///< not complete (yet)
        bool by_caller = false; ///< the caller's deadline passed, not chunk_timeout
        chunk_error error;      ///< a CUDA error seen while waiting
    };

    // Waits for f's completion until the caller's deadline or chunk_timeout, whichever is first.
    task<wait_outcome> wait_for(flight& f, std::optional<clock::time_point> deadline) {
        const std::chrono::nanoseconds limit = m_core.options.chunk_timeout;
        std::optional<clock::time_point> until = deadline;
        bool by_caller = deadline.has_value();
        if (limit.count() > 0 && (!deadline || clock::now() + limit < *deadline)) {
            until = clock::now() + limit;
            by_caller = false;
        }
        wait_outcome w;
        try {
            if (!until) {
                co_await event_ref(f.done);
            } else if (auto left = *until - clock::now(); left.count() > 0) {
                co_await with_timeout(event_ref(f.done),
                                      std::chrono::duration_cast<std::chrono::nanoseconds>(left));
            } else if (!event_ref(f.done).is_done()) {
                w.timed_out = true; // a deadline already passed: a poll
            }
        } catch (const timeout_error&) {
            w.timed_out = true;
        } catch (const cuda_error& e) {
            w.error = chunk_error_of(e);
        }
        w.by_caller = w.timed_out && by_caller;
        co_return w;
    }

    // The GPU may still write f's slot (and the chunks' behind it): they are reported failed,
    // their events and slots stay out of use, and the GPU is not used again (as in a batch).
    [[noreturn]] void give_up_timed_out(flight& f, const chunk_error& error) {
        core& k = m_core;
        pipeline_stats& stats = k.monitor.counters();
        k.gpu_abandoned = true;
        m_front_attempts = 0;
        for (flight& g : m_submitted) {
            if (!g.error.failed()) {
                g.error.timed_out = true;
                g.error.what = "in flight behind chunk " + std::to_string(f.chunk) +
                               ", which did not complete within chunk_timeout";
            }
        }
        ++stats.chunks;
        ++stats.failed_chunks;
        flight lost = std::move(f);
        k.abandoned_events.push_back(std::move(lost.done));
        // The GPU may still write the slot's pinned buffers: they are kept until the pipeline
        // goes (after its streams were synchronised), and the slot, whose device side is never
        // used again, gets fresh ones on its next acquire. So a producer never waits for a slot
        // that a hung chunk holds.
        slot& sl = *k.slots[lost.slot];
        k.abandon_host_buffers(sl);
        give_back(lost.slot);
        k.report_degradation(lost, degrade_level::give_up, degrade_action::failed_timed_out, error);
        throw pipeline_error("pipeline: chunk " + std::to_string(lost.chunk) +
                                 " failed: " + error.what,
                             {}, {lost.chunk});
    }

    // With a lowered depth, the chunk on `sl` starts on the GPU only once the chunk `depth`
    // submissions before it completed (a chunk already taken by next() has).
    void throttle(slot& sl) {
        core& k = m_core;
        const std::size_t d = k.active_depth;
        if (d >= k.options.depth || m_submitted.size() < d) {
            return;
        }
        cudaEvent_t before = m_submitted[m_submitted.size() - d].done.get();
        k.h2d.wait(before);
        sl.graph_stream.wait(before);
    }

    [[nodiscard]] slot& slot_of(std::size_t i) const { return *m_core.slots[i]; }
    // Slot i's input as the producer fills it: one chunk (a grouped pipeline's slot holds a
    // group; a streamed item uses its first chunk).
    [[nodiscard]] std::span<In> input_of(std::size_t i) const {
        return slot_of(i).host_in.span().first(m_core.options.chunk_elements);
    }

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
    unsigned m_front_attempts = 0; // chunk_timeout retries of the chunk next() waits for
    std::size_t m_taken = 0;       // chunks next() took from the queue and has not finished
    bool m_closed = false;         // close() called, and next() has not returned the end yet
};

} // namespace cudawait::detail
