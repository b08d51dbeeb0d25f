// SPDX-License-Identifier: Apache-2.0
#pragma once

// The streaming driver: a producer acquires a slot, fills it and submits it; a consumer takes
// the outputs in submission order with next(). In a grouped pipeline submit() holds chunks back
// in runs (one flight each), and a chunk may be submitted with views of the caller's memory.
// See docs/pipeline.md#streaming and docs/pipeline.md#streaming-in-groups.

#include <cudawait/core/detail/wait_list.hpp>
#include <cudawait/core/scheduler.hpp>
#include <cudawait/core/task.hpp>
#include <cudawait/core/timeout.hpp>
#include <cudawait/memory/memory_kind.hpp>
#include <cudawait/observe/timeline.hpp>
#include <cudawait/observe/trace.hpp>
#include <cudawait/pipeline/detail/slots.hpp>
#include <cudawait/pipeline/detail/stream_run.hpp>
#include <cudawait/pipeline/options.hpp>
#include <cudawait/pipeline/report.hpp>
#include <cudawait/runtime/detail/chrono.hpp>
#include <cudawait/runtime/error.hpp>
#include <cudawait/runtime/event.hpp>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <deque>
#include <exception>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace cudawait::detail {

template <class In, class Out>
class pipeline_stream;

/// pipeline<In, Out>::input_slot: a slot the producer fills before submit(); given back unused
/// if dropped. In a grouped pipeline it is one chunk of a slot group.
template <class In, class Out>
class pipeline_input_slot {
public:
    pipeline_input_slot() = default;
    pipeline_input_slot(pipeline_input_slot&& o) noexcept
        : m_owner(std::exchange(o.m_owner, nullptr)), m_index(o.m_index), m_position(o.m_position) {
    }
    pipeline_input_slot& operator=(pipeline_input_slot&& o) noexcept {
        if (this != &o) {
            reset();
            m_owner = std::exchange(o.m_owner, nullptr);
            m_index = o.m_index;
            m_position = o.m_position;
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
        return m_owner->input_of(m_index, m_position);
    }

private:
    friend class pipeline_stream<In, Out>;
    pipeline_input_slot(pipeline_stream<In, Out>* p, std::size_t i, std::size_t position)
        : m_owner(p), m_index(i), m_position(position) {}
    void reset() noexcept {
        if (m_owner != nullptr) {
            std::exchange(m_owner, nullptr)->release(m_index);
        }
    }
    pipeline_stream<In, Out>* m_owner = nullptr;
    std::size_t m_index = 0;
    std::size_t m_position = 0; // chunk of the slot group
};

/// pipeline<In, Out>::result: a chunk's output, in submission order; the slot is reused once
/// this is destroyed (in a grouped pipeline: once every chunk of its slot group is).
template <class In, class Out>
class pipeline_result {
public:
    pipeline_result(pipeline_result&& o) noexcept
        : m_owner(std::exchange(o.m_owner, nullptr)), m_index(o.m_index), m_position(o.m_position),
          m_chunk(o.m_chunk), m_count(o.m_count), m_view(o.m_view), m_by_fallback(o.m_by_fallback) {
    }
    pipeline_result& operator=(pipeline_result&&) = delete;
    ~pipeline_result() {
        if (m_owner != nullptr) {
            m_owner->release(m_index);
        }
    }
    /// The chunk's output: the slot's pinned output, or the caller's `out` of a chunk submitted
    /// with views.
    [[nodiscard]] std::span<const Out> data() const {
        if (m_view != nullptr) {
            return std::span<const Out>(m_view, m_count);
        }
        return m_owner->output_of(m_index, m_position, m_count);
    }
    /// Submission index.
    [[nodiscard]] std::size_t chunk() const noexcept { return m_chunk; }
    /// Produced by the fallback rather than the GPU.
    [[nodiscard]] bool by_fallback() const noexcept { return m_by_fallback; }

private:
    friend class pipeline_stream<In, Out>;
    pipeline_result(pipeline_stream<In, Out>* p, std::size_t i, std::size_t position,
                    std::size_t chunk, std::size_t n, bool fb, const Out* view)
        : m_owner(p), m_index(i), m_position(position), m_chunk(chunk), m_count(n), m_view(view),
          m_by_fallback(fb) {}
    pipeline_stream<In, Out>* m_owner;
    std::size_t m_index;
    std::size_t m_position;
    std::size_t m_chunk;
    std::size_t m_count;
    const Out* m_view; // the caller's output (a chunk submitted with views), else null
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

    explicit pipeline_stream(core& c)
        : m_core(c), m_held(c.slots.size(), 0), m_tainted(c.slots.size(), false) {}
    pipeline_stream(const pipeline_stream&) = delete;
    pipeline_stream& operator=(const pipeline_stream&) = delete;
    /// The streams must have been synchronised (pipeline_core::synchronize) before the queued
    /// chunks' events go back to the pool.
    ~pipeline_stream() = default;

    using clock = std::chrono::steady_clock;

    /// See pipeline::acquire. With a deadline: timeout_error(budget) once it passed (a deadline
    /// already passed polls: a slot free now, else the error), and no slot is taken. Before it
    /// waits, the chunks held back go to the GPU (flush).
    [[nodiscard]] task<input_slot> acquire(std::optional<clock::time_point> deadline = {},
                                           std::chrono::nanoseconds budget = {}) {
        core& k = m_core;
        scheduler& sched = co_await this_scheduler();
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
            const bool position = m_open != npos || !k.free_slots.empty();
            if (position && m_items.size() + m_taken < capacity()) {
                break;
            }
            // What is held back must not wait for the producer: the consumer frees slots and
            // room only once the GPU has done it.
            flush();
            if (!deadline) {
                co_await m_slot_freed.wait(sched);
            } else if (clock::now() >= *deadline) {
                throw timeout_error(budget);
            } else {
                co_await m_slot_freed.wait_until(sched, *deadline);
            }
        }
        if (m_open == npos) {
            std::size_t i = k.free_slots.front();
            k.free_slots.erase(k.free_slots.begin());
            try {
                k.slots[i]->ensure_host_buffers(k.options, *k.pool);
            } catch (...) {
                k.free_slots.insert(k.free_slots.begin(), i); // within its capacity
                throw;
            }
            m_open = i;
            m_cursor = 0;
        }
        const std::size_t i = m_open;
        const std::size_t position = m_cursor++;
        ++m_held[i];
        if (m_cursor == k.group_chunks) {
            m_open = npos; // every chunk of the group handed out
        }
        co_return input_slot(this, i, position);
    }

    /// See pipeline::submit. In a grouped pipeline the chunk is held back to go with the ones
    /// submitted after it (see the top of this file).
    void submit(input_slot&& s, std::size_t count) {
        check_submit(s);
        if (count == 0 || count > m_core.options.chunk_elements) {
            throw usage_error("pipeline::submit: count must be in 1..chunk_elements");
        }
        submit_item(std::move(s), count, nullptr, nullptr, false, false);
    }

    /// See pipeline::submit with views. A page-locked span is the host end of the chunk's copy
    /// itself; a pageable (or managed) `in` is copied into the slot's pinned input now, and a
    /// pageable `out` receives the slot's pinned output when next() delivers the chunk.
    void submit(input_slot&& s, std::span<const In> in, std::span<Out> out) {
        core& k = m_core;
        check_submit(s);
        if (in.empty() || in.data() == nullptr || in.size() > k.options.chunk_elements) {
            throw usage_error("pipeline::submit: the input must hold 1..chunk_elements elements");
        }
        if (out.data() == nullptr || out.size() != k.output_count(in.size())) {
            throw usage_error("pipeline::submit: the output has " + std::to_string(out.size()) +
                              " elements, the input needs " +
                              std::to_string(k.output_count(in.size())));
        }
        const memory_kind kin = classify(in.data());
        const memory_kind kout = classify(out.data());
        if (kin == memory_kind::device || kout == memory_kind::device) {
            throw usage_error("pipeline::submit: input and output must be host memory");
        }
        const bool direct_in = kin == memory_kind::pinned;
        if (!direct_in) {
            std::memcpy(input_of(s.m_index, s.m_position).data(), in.data(), in.size_bytes());
        }
        submit_item(std::move(s), in.size(), in.data(), out.data(), direct_in,
                    kout == memory_kind::pinned);
    }

    /// See pipeline::next. With a deadline: timeout_error(budget) once it passed (a deadline
    /// already passed polls: a chunk complete now, else the error), and the chunk stays first
    /// in line for the next call.
    [[nodiscard]] task<std::optional<result>> next(std::optional<clock::time_point> deadline = {},
                                                   std::chrono::nanoseconds budget = {}) {
        core& k = m_core;
        scheduler& sched = co_await this_scheduler();
        if (m_deferred) {
            std::rethrow_exception(std::exchange(m_deferred, nullptr)); // from close()
        }
        const std::size_t session = m_sessions_ended;
        while (m_items.empty()) {
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
        if (!m_items.front().flight->sent) {
            flush(); // the chunk is held back: its run goes now
        }
        item it = std::move(m_items.front());
        m_items.pop_front();
        // Until it is consumed (or put back in line) the chunk keeps its place in the queue: a
        // producer may not fill it meanwhile.
        ++m_taken;
        struct taken_guard {
            pipeline_stream* self;
            ~taken_guard() {
                --self->m_taken;
                self->m_slot_freed.notify_all(); // the queue has room again
            }
        } taken{this};
        stream_flight& sf = *it.flight;
        chunk_error error = sf.f.error;
        // Until the chunk is consumed (its slot released) an exception leaves it first in line,
        // its slot and event with it, for a later next(): the caller's timeout, or what the wait
        // or on_degrade throws.
        bool consumed = false;
        try {
            if (sf.landed) {
                // An earlier chunk of the run saw it complete.
            } else if (!error.failed() && !k.gpu_abandoned) {
                trace_async_range r("wait", sf.f.chunk);
                timeline_scope span(k.options.monitoring.timeline, "wait", "wait", sf.f.chunk);
                for (;;) {
                    wait_outcome w =
                        co_await wait_for_run(sf.f, k.options.recovery.chunk_timeout, deadline);
                    if (!waited(it, w, error, consumed, budget)) {
                        break;
                    }
                }
            } else if (error.timed_out) {
                give_up_timed_out(it, error, consumed); // behind a chunk given up: throws
            } else if (k.gpu_abandoned && !error.failed()) {
                error.what = "the GPU was abandoned after an earlier error";
            }
        } catch (...) {
            if (!consumed) {
                m_items.push_front(std::move(it));
            }
            throw;
        }
        if (!error.failed()) {
            co_return delivered(it);
        }
        co_return fallen_back(it, error);
    }

    /// The submission index of the chunk next() returns next, if one is queued.
    [[nodiscard]] std::optional<std::size_t> next_seq() const noexcept {
        return m_items.empty() ? std::nullopt : std::optional<std::size_t>(m_items.front().seq);
    }

    /// See pipeline::close. The chunks held back go to the GPU; what on_degrade throws meanwhile
    /// reaches the next call of next().
    void close() {
        m_closed = true;
        if (m_open != npos) {
            const std::size_t i = std::exchange(m_open, npos);
            if (m_held[i] == 0) {
                recycle(i);
            }
        }
        m_result_ready.notify_all();
        m_slot_freed.notify_all();
        try {
            flush();
        } catch (...) {
            // Only what on_degrade throws, the run queued with its error: the consumer gets it.
            m_deferred = std::current_exception();
        }
    }

private:
    friend class pipeline_input_slot<In, Out>;
    friend class pipeline_result<In, Out>;

    static constexpr std::size_t npos = static_cast<std::size_t>(-1);

    using stream_flight = detail::stream_flight<flight>;
    using item = stream_item<In, Out, stream_flight>;
    using wait_outcome = stream_wait_outcome;

    // Chunks submitted and not taken: queue_capacity groups' worth.
    [[nodiscard]] std::size_t capacity() const noexcept {
        return m_core.options.memory.queue_capacity * m_core.group_chunks;
    }

    // An input_slot of this pipeline's open session.
    void check_submit(const input_slot& s) const {
        if (s.m_owner != this) {
            throw usage_error("pipeline::submit: the slot is empty or from another pipeline");
        }
        if (m_closed || !m_core.session_open) {
            throw usage_error("pipeline::submit: the slot's streaming session is closed");
        }
    }

    // Queues slot `s`'s chunk of `count` elements (arguments checked): into the run held back
    // when it joins it, else into a new one (the run before it goes to the GPU first). With
    // views, `in_view` / `out_view` are the caller's spans; `direct_in` / `direct_out`: the copy
    // uses them itself (page-locked), else the slot's pinned chunk (pageable: staged).
    void submit_item(input_slot&& s, std::size_t count, const In* in_view, Out* out_view,
                     bool direct_in, bool direct_out) {
        core& k = m_core;
        s.m_owner = nullptr;
        item it;
        it.seq = m_stream_seq++;
        it.slot = s.m_index;
        it.position = s.m_position;
        it.count = count;
        it.output_count = k.output_count(count);
        it.started = clock::now();
        it.in_view = in_view;
        it.out_view = out_view;
        it.copy_out = out_view != nullptr && !direct_out;
        // The run held back goes first when this chunk cannot join it.
        std::shared_ptr<stream_flight> before;
        if (m_pending && !joins(*m_pending, it)) {
            before = std::exchange(m_pending, nullptr);
        }
        slot& sl = slot_of(it.slot);
        const In* src = direct_in ? in_view : input_at(it.slot, it.position);
        Out* dst = direct_out ? out_view : output_at(it.slot, it.position);
        if (!m_pending) {
            m_pending = m_runs.fresh();
            flight& f = m_pending->f;
            f.chunk = it.seq;
            f.chunks = 0;
            f.slot = it.slot;
            f.position = it.position;
            f.host_in = src;
            f.host_out = dst;
        }
        flight& f = m_pending->f;
        ++f.chunks;
        f.count += it.count;
        f.output_count += it.output_count;
        // The run's copies chunk by chunk, in case one of its chunks is a view: the slot's own
        // chunks merge into one piece, the caller's spans stay pieces of their own.
        append_piece(f.h2d_pieces, sl.dev_in.data() + it.position * k.options.chunk_elements, src,
                     it.count * sizeof(In), !direct_in);
        append_piece(f.d2h_pieces, dst, sl.dev_out.data() + it.position * k.options.output_elements,
                     it.output_count * sizeof(Out), !direct_out);
        f.views = f.views || direct_in || direct_out;
        m_pending->last_full = count == k.options.chunk_elements;
        it.flight = m_pending;
        m_items.push_back(std::move(it));
        const bool ends_group = f.position + f.chunks == k.group_chunks || !m_pending->last_full;
        m_result_ready.notify_all();
        if (before) {
            send(std::move(before)); // throws only what on_degrade throws, all queued by then
        }
        if (ends_group) {
            flush();
        }
    }

    // The run held back goes to the GPU.
    void flush() {
        if (m_pending) {
            send(std::exchange(m_pending, nullptr));
        }
    }

    // Enqueues run `p` as one flight: H2D of its chunks, the stages, D2H (pipeline_core), with
    // the level-1 retries of a failed enqueue. A run that cannot be enqueued keeps the error in
    // f.error: next() hands its chunks to the fallback (or reports them), in order. Everything
    // is in place before this throws (only what on_degrade throws).
    void send(std::shared_ptr<stream_flight> p) {
        core& k = m_core;
        stream_flight& sf = *p;
        sf.sent = true;
        flight& f = sf.f;
        slot& sl = *k.slots[f.slot];
        // Without views the run's host ends are one range each way, from the first chunk on.
        const In* src = f.host_in;
        Out* dst = f.host_out;
        // After the GPU was given up nothing is enqueued: next() hands the chunks to the fallback.
        if (k.gpu_abandoned) {
            return;
        }
        try {
            k.start_flight(f);
        } catch (const cuda_error& e) {
            f.error = chunk_error_of(e);
            return;
        }
        for (unsigned attempt = 0; !k.gpu_abandoned; ++attempt) {
            chunk_error error;
            try {
                throttle(sl);
                k.enqueue(f, src, dst);
                break;
            } catch (const cuda_error& e) {
                error = chunk_error_of(e);
            }
            if (error.sticky || attempt >= k.options.recovery.max_retries) {
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
                f.error = std::move(error); // next() still reports the chunks, in order
                throw;
            }
        }
        if (!f.error.failed()) { // on the GPU: a later run may wait for it (throttle)
            m_recent.push_back(std::move(p));
            if (m_recent.size() > k.options.depth) {
                m_recent.pop_front();
            }
        }
    }

    // One wait of next() for chunk `it`'s run ended as `w`: whether to wait again (level 1:
    // chunk_timeout passed with retries left). Sets `error` for a failed run; throws
    // timeout_error(budget) when the caller's deadline passed (the chunk not consumed), and
    // pipeline_error once the retries are used up (give_up_timed_out).
    bool waited(item& it, wait_outcome& w, chunk_error& error, bool& consumed,
                std::chrono::nanoseconds budget) {
        core& k = m_core;
        stream_flight& sf = *it.flight;
        if (sf.landed) {
            return false; // another consumer saw the run complete meanwhile
        }
        if (w.error.failed()) {
            error = std::move(w.error);
            sf.f.error = error; // the run's other chunks fail with it
            return false;
        }
        if (!w.timed_out) {
            sf.landed = true;
            consumed = true;
            try {
                k.chunk_done(sf.f);
            } catch (...) {
                release(it.slot);
                throw;
            }
            return false;
        }
        if (w.by_caller) {
            throw timeout_error(budget); // not consumed
        }
        error.timed_out = true;
        error.exception = std::make_exception_ptr(timeout_error(k.options.recovery.chunk_timeout));
        error.what = "chunk did not complete within chunk_timeout";
        if (++sf.waits > k.options.recovery.max_retries) {
            give_up_timed_out(it, error, consumed); // throws
        }
        // Level 1: the work cannot be cancelled; it is waited for again, with less concurrency
        // for the chunks that follow.
        ++k.monitor.counters().retries;
        m_core.lower_depth();
        k.report_degradation(sf.f, degrade_level::retry, degrade_action::waited_again, error);
        error = {};
        return true;
    }

    // Chunk `it` came from the GPU: counted, its output copied into a pageable view, delivered.
    result delivered(const item& it) {
        pipeline_stats& stats = m_core.monitor.counters();
        ++stats.gpu_chunks;
        ++stats.chunks;
        if (it.flight->waits == 0) {
            m_core.note_clean();
        }
        if (it.copy_out) {
            std::memcpy(it.out_view, output_at(it.slot, it.position),
                        it.output_count * sizeof(Out));
        }
        record_latency(it);
        return result(this, it.slot, it.position, it.seq, it.output_count, false, it.out_view);
    }

    // Chunk `it` failed with `error`: its run's give-up reported once, then the fallback computes
    // it into the caller's spans (a view) or the slot's; without a fallback, pipeline_error.
    result fallen_back(const item& it, const chunk_error& error) {
        core& k = m_core;
        pipeline_stats& stats = k.monitor.counters();
        stream_flight& sf = *it.flight;
        if (error.sticky) {
            k.gpu_abandoned = true;
        }
        ++stats.chunks;
        try {
            if (!std::exchange(sf.reported, true)) {
                // One record per run (a group), as in a batch.
                k.report_degradation(
                    sf.f, degrade_level::give_up,
                    k.on_gpu_failure ? degrade_action::fallback : degrade_action::failed, error);
            }
            if (!k.on_gpu_failure) {
                throw pipeline_error("pipeline: chunk " + std::to_string(it.seq) +
                                         " failed: " + error.what,
                                     {}, {it.seq});
            }
            trace_range r("fallback", it.seq);
            timeline_scope span(k.options.monitoring.timeline, "fallback", "fallback", it.seq);
            // A chunk submitted with views: the caller's spans, staged or not.
            std::span<const In> in = input_of(it.slot, it.position).first(it.count);
            std::span<Out> out = output_of(it.slot, it.position, it.output_count);
            if (it.out_view != nullptr) {
                in = std::span<const In>(it.in_view, it.count);
                out = std::span<Out>(it.out_view, it.output_count);
            }
            k.on_gpu_failure(it.seq, in, out);
        } catch (...) {
            ++stats.failed_chunks;
            write_failure_report(k);
            release(it.slot);
            throw;
        }
        ++stats.fallback_chunks;
        record_latency(it);
        write_failure_report(k);
        return result(this, it.slot, it.position, it.seq, it.output_count, true, it.out_view);
    }

    // The GPU may still write the run's chunks (and those of the runs behind it): they are
    // reported failed, the event stays out of use, and the GPU is not used again (as in a batch).
    // `consumed` is set once the chunk's slot went back: what throws before that leaves the
    // chunk to next() to put back in line, counted nowhere yet.
    [[noreturn]] void give_up_timed_out(item& it, const chunk_error& error, bool& consumed) {
        core& k = m_core;
        pipeline_stats& stats = k.monitor.counters();
        stream_flight& sf = *it.flight;
        k.reserve_abandoned(); // for recycle(), which abandons the slot's buffers
        k.abandoned_events.reserve(k.abandoned_events.size() + 1);
        k.gpu_abandoned = true;
        if (!sf.f.error.failed()) {
            sf.f.error = error; // the run's later chunks fail with it
        }
        for (item& g : m_items) {
            stream_flight& h = *g.flight;
            if (h.sent && !h.landed && !h.f.error.failed()) {
                h.f.error.timed_out = true;
                h.f.error.what = "in flight behind chunk " + std::to_string(it.seq) +
                                 ", which did not complete within chunk_timeout";
            }
        }
        if (sf.f.done) {
            k.abandoned_events.push_back(std::move(sf.f.done));
        }
        ++stats.chunks;
        ++stats.failed_chunks;
        // The GPU may still write the slot group's pinned buffers: once its chunks are all
        // given back they move to the abandoned ones (kept until the pipeline goes, after its
        // streams were synchronised), and the slot gets fresh ones on its next use. So a
        // producer never waits for a slot that a hung chunk holds.
        m_tainted[it.slot] = true;
        consumed = true;
        release(it.slot);
        if (!std::exchange(sf.reported, true)) {
            k.report_degradation(sf.f, degrade_level::give_up, degrade_action::failed_timed_out,
                                 error);
        }
        throw pipeline_error("pipeline: chunk " + std::to_string(it.seq) + " failed: " + error.what,
                             {}, {it.seq});
    }

    // With a lowered depth, a run starts on the GPU only once the run `depth` flights before it
    // completed.
    void throttle(slot& sl) {
        core& k = m_core;
        const std::size_t d = k.active_depth;
        if (d >= k.options.depth || m_recent.size() < d) {
            return;
        }
        const flight& before = m_recent[m_recent.size() - d]->f;
        if (!before.done) {
            return; // given up: its event is out of use
        }
        k.h2d.wait(before.done.get());
        sl.graph_stream.wait(before.done.get());
    }

    [[nodiscard]] slot& slot_of(std::size_t i) const { return *m_core.slots[i]; }
    // Chunk `position` of slot group i's input, as the producer fills it.
    [[nodiscard]] std::span<In> input_of(std::size_t i, std::size_t position) const {
        const std::size_t n = m_core.options.chunk_elements;
        return slot_of(i).host_in.span().subspan(position * n, n);
    }
    // Chunk `position` of slot group i's output: its first `count` elements.
    [[nodiscard]] std::span<Out> output_of(std::size_t i, std::size_t position,
                                           std::size_t count) const {
        return slot_of(i).host_out.span().subspan(position * m_core.options.output_elements, count);
    }
    // Where chunk `position` of slot group i begins in its pinned input and output.
    [[nodiscard]] In* input_at(std::size_t i, std::size_t position) const {
        return slot_of(i).host_in.data() + position * m_core.options.chunk_elements;
    }
    [[nodiscard]] Out* output_at(std::size_t i, std::size_t position) const {
        return slot_of(i).host_out.data() + position * m_core.options.output_elements;
    }

    // Chunk `it` is delivered: its latency runs from its submission.
    void record_latency(const item& it) {
        m_core.monitor.chunk_latency(
            std::chrono::duration<double>(clock::now() - it.started).count());
    }

    // One chunk of slot group i is given back (unused, consumed or failed): the group serves
    // the producer again once all of its chunks are, and it is not the one being handed out.
    // Allocates nothing (the free slots and abandoned buffers have their room) but what the
    // scheduler takes to resume a waiting producer, whose failure leaves it waiting
    // (wait_list::notify_all).
    void release(std::size_t i) noexcept {
        if (--m_held[i] == 0 && i != m_open) {
            recycle(i);
        }
    }
    void recycle(std::size_t i) noexcept {
        if (m_tainted[i]) {
            m_core.abandon_host_buffers(*m_core.slots[i]);
            m_tainted[i] = false;
        }
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
        m_recent.clear();       // their events go back to the pool with the session
        m_runs.return_events(); // and those of the runs kept for reuse
        m_core.session_open = false;
        m_closed = false;
        ++m_sessions_ended;
    }

    core& m_core;
    std::deque<item> m_items;                            // submitted, not taken by next()
    std::shared_ptr<stream_flight> m_pending;            // the run held back (not sent yet)
    std::deque<std::shared_ptr<stream_flight>> m_recent; // the last `depth` runs sent (throttle)
    stream_run_pool<stream_flight> m_runs;               // every run made: reused when free
    std::vector<std::size_t> m_held; // per slot group: chunks handed out, not back
    std::vector<bool> m_tainted;     // per slot group: pinned buffers to abandon
    std::size_t m_open = npos;       // the slot group acquire() hands out from
    std::size_t m_cursor = 0;        // its next chunk
    wait_list m_slot_freed;
    wait_list m_result_ready;
    std::size_t m_stream_seq = 0;
    std::size_t m_sessions_ended = 0;
    std::size_t m_taken = 0;       // chunks next() took from the queue and has not finished
    std::exception_ptr m_deferred; // what close() could not throw (on_degrade), for next()
    bool m_closed = false;         // close() called, and next() has not returned the end yet
};

} // namespace cudawait::detail
