// SPDX-License-Identifier: Apache-2.0
#pragma once

// The batch driver: run() cuts the host ranges into chunks (or, with chunk groups and pinned
// ranges, groups of chunks), starts them on the slots, awaits the oldest in flight, puts its
// output in place and degrades on errors and timeouts; pageable ranges go through the staging
// rings. See docs/pipeline.md#batches and docs/pipeline.md#recovery.

#include <cudawait/core/scheduler.hpp>
#include <cudawait/core/task.hpp>
#include <cudawait/core/timeout.hpp>
#include <cudawait/observe/timeline.hpp>
#include <cudawait/observe/trace.hpp>
#include <cudawait/pipeline/detail/group.hpp>
#include <cudawait/pipeline/detail/slots.hpp>
#include <cudawait/pipeline/detail/staging.hpp>
#include <cudawait/pipeline/options.hpp>
#include <cudawait/pipeline/report.hpp>
#include <cudawait/runtime/detail/chrono.hpp>
#include <cudawait/runtime/error.hpp>
#include <cudawait/runtime/event.hpp>

#include <algorithm>
#include <cstddef>
#include <deque>
#include <exception>
#include <source_location>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace cudawait::detail {

/// Runs batches through a pipeline_core.
template <class In, class Out>
class pipeline_batch {
public:
    using core = pipeline_core<In, Out>;
    using flight = typename core::flight;
    using slot = typename core::slot;

    explicit pipeline_batch(core& c) noexcept : m_core(c) {}

    /// Runs `in` through the pipeline into `out` (sizes and memory kinds already checked).
    /// @throws usage_error while a streaming session is open or another batch runs;
    ///         pipeline_error; what the fallback or a callback throws
    task<void> run(std::span<const In> in, std::span<Out> out, bool pinned_in, bool pinned_out) {
        core& k = m_core;
        check_idle();
        k.batch_running = true;
        struct running_flag {
            bool* flag;
            ~running_flag() { *flag = false; }
        } guard{&k.batch_running};

        batch b = make_batch(in, out, pinned_in, pinned_out);
        const std::size_t n = b.state.size();
        if (!b.runahead()) {
            scheduler& sched = co_await this_scheduler();
            m_staging.begin(sched, k.options.monitoring.timeline, *k.pool, k.options.depth,
                            k.options.chunk_elements, k.options.output_elements, !pinned_in,
                            !pinned_out);
        }
        k.monitor.reset();
        auto t0 = std::chrono::steady_clock::now();
        std::size_t next = 0;
        std::exception_ptr failure;
        try {
            while (next < n || !b.inflight.empty()) {
                if (!b.runahead() && co_await advance_staging(b, next, n)) {
                    continue;
                }
                if (next < n && k.gpu_abandoned) {
                    note_first_try(b, next);
                    run_fallback(b, next++);
                    continue;
                }
                std::size_t limit =
                    b.runahead() ? core::runahead_factor * k.active_depth : k.active_depth;
                if (next < n && b.inflight.size() < limit) {
                    flight f; // describes the group also when starting it fails
                    chunk_error error;
                    const chunk_group g = plan(b, next);
                    if (try_start(b, g, f, error)) {
                        next += g.chunks;
                    } else if (start_failed(b, g, f, error, next)) {
                        // Level 1: let everything in flight finish, then retry with one slot fewer.
                        while (!b.inflight.empty()) {
                            co_await retire(b);
                        }
                        k.lower_depth();
                        k.report_degradation(f, degrade_level::retry,
                                             degrade_action::retried_with_less_depth, error);
                    }
                    continue;
                }
                co_await retire(b);
            }
        } catch (...) {
            failure = std::current_exception();
        }
        if (!failure && !b.runahead()) {
            co_await settle_staging(b); // the last outputs' stage-outs
        }
        if (failure) {
            co_await drain(b); // not in the handler: a handler cannot co_await
            co_await settle_staging(b);
            if (k.monitor.give_ups() != 0) {
                write_failure_report(k);
            }
            std::rethrow_exception(failure);
        }
        finish(b, t0);
    }

private:
    enum class chunk_state { pending, gpu, fallback, failed };

    struct batch {
        std::span<const In> in;
        std::span<Out> out;
        bool pinned_in;
        bool pinned_out;
        std::vector<chunk_state> state;
        std::vector<unsigned> attempts;
        std::deque<flight> inflight;
        std::vector<bool> busy;    // slots with a chunk in flight (staging)
        std::size_t next_slot = 0; // round robin (run-ahead)
        std::vector<std::chrono::steady_clock::time_point> taken{}; // first tried (latency)
        std::size_t single_until = 0; // chunks before it start one at a time (a group split)
        [[nodiscard]] bool runahead() const noexcept { return pinned_in && pinned_out; }
    };

    // run() begins only with every slot free: no streaming session, no other batch.
    void check_idle() const {
        const core& k = m_core;
        if (k.session_open || k.free_slots.size() != k.slots.size()) {
            throw usage_error("pipeline::run: a streaming session is open (slots or results held, "
                              "chunks not yet taken, or next() has not returned the end after "
                              "close())");
        }
        if (k.batch_running) {
            throw usage_error("pipeline::run: another batch is running");
        }
    }

    // The batch of `in` and `out`: every chunk pending, none tried yet.
    batch make_batch(std::span<const In> in, std::span<Out> out, bool pinned_in,
                     bool pinned_out) const {
        const core& k = m_core;
        batch b{in, out, pinned_in, pinned_out, {}, {}, {}, std::vector<bool>(k.slots.size())};
        std::size_t n = (in.size() + k.options.chunk_elements - 1) / k.options.chunk_elements;
        b.state.assign(n, chunk_state::pending);
        b.attempts.assign(n, 0);
        b.taken.assign(n, {});
        return b;
    }

    // Starts group `g` as flight `f`: true once it is in flight; false with `error` when its
    // enqueue failed (a cuda_error; anything else propagates).
    bool try_start(batch& b, const chunk_group& g, flight& f, chunk_error& error) {
        try {
            for (std::size_t c = g.first; c < g.first + g.chunks; ++c) {
                note_first_try(b, c);
            }
            start_chunk(b, g, f);
            return true;
        } catch (const cuda_error& e) {
            error = chunk_error_of(e);
        }
        return false;
    }

    // Group `g` (from chunk `next`) could not start: a sticky error gives the GPU up, a retry
    // left returns true (run() drains and retries with one slot fewer), a group of several
    // chunks past its retries is retried once chunk by chunk, else the chunk goes to the
    // fallback and `next` moves past it.
    bool start_failed(batch& b, const chunk_group& g, const flight& f, const chunk_error& error,
                      std::size_t& next) {
        core& k = m_core;
        if (error.sticky) {
            k.report_degradation(f, degrade_level::give_up, degrade_action::gpu_lost, error);
            abandon_gpu(b, error);
            return false;
        }
        if (++b.attempts[next] <= k.options.recovery.max_retries) {
            ++k.monitor.counters().retries;
            return true;
        }
        if (g.chunks > 1) {
            // The group's retries are spent: one more retry, its chunks one at a time, so that
            // only a chunk that fails alone is given up (and reported as itself).
            b.single_until = g.first + g.chunks;
            for (std::size_t c = g.first; c < b.single_until; ++c) {
                b.attempts[c] = k.options.recovery.max_retries;
            }
            ++k.monitor.counters().retries;
            return true;
        }
        k.report_degradation(f, degrade_level::give_up,
                             k.on_gpu_failure ? degrade_action::fallback : degrade_action::failed,
                             error);
        for (std::size_t c = g.first; c < g.first + g.chunks; ++c) {
            run_fallback(b, c);
        }
        next += g.chunks;
        return false;
    }

    // A batch that ran to its end: the counts, the report of a level-2 step, and pipeline_error
    // (batch_failed) naming the failed chunks, if any.
    void finish(const batch& b, std::chrono::steady_clock::time_point t0) {
        core& k = m_core;
        pipeline_stats& stats = k.monitor.counters();
        const std::size_t n = b.state.size();
        auto t1 = std::chrono::steady_clock::now();
        stats.chunks = n;
        stats.wall_seconds = std::chrono::duration<double>(t1 - t0).count();
        if (k.monitor.give_ups() != 0) {
            write_failure_report(k); // a level-2 step: before pipeline_error, if one follows
        }
        if (stats.failed_chunks != 0) {
            std::vector<std::size_t> completed;
            std::vector<std::size_t> failed;
            for (std::size_t c = 0; c < n; ++c) {
                (b.state[c] == chunk_state::failed ? failed : completed).push_back(c);
            }
            throw batch_failed(std::move(completed), std::move(failed));
        }
    }

    // The group that starts at chunk `first`: one chunk where the batch stages (its rings and
    // workers move chunks; the slots' device buffers then use their first chunk only) and
    // within a group that was split.
    [[nodiscard]] chunk_group plan(const batch& b, std::size_t first) const {
        const pipeline_options& o = m_core.options;
        const bool whole = b.runahead() && first >= b.single_until;
        return plan_group(first, whole ? m_core.group_chunks : 1, b.in.size(), o.chunk_elements,
                          o.output_elements);
    }

    [[nodiscard]] std::span<const In> chunk_in(const batch& b, std::size_t c) const {
        std::size_t chunk = m_core.options.chunk_elements;
        std::size_t off = c * chunk;
        return b.in.subspan(off, std::min(chunk, b.in.size() - off));
    }
    [[nodiscard]] std::span<Out> chunk_out(const batch& b, std::size_t c) const {
        std::size_t off = c * m_core.options.output_elements;
        return b.out.subspan(off, m_core.output_count(chunk_in(b, c).size()));
    }

    void run_fallback(batch& b, std::size_t c) {
        if (!b.runahead()) {
            m_staging.drop(c); // the fallback reads and writes the caller's ranges
        }
        pipeline_stats& stats = m_core.monitor.counters();
        if (!m_core.on_gpu_failure) {
            b.state[c] = chunk_state::failed;
            ++stats.failed_chunks;
            return;
        }
        trace_range r("fallback", c);
        timeline_scope span(m_core.options.monitoring.timeline, "fallback", "fallback", c);
        m_core.on_gpu_failure(c, chunk_in(b, c), chunk_out(b, c));
        b.state[c] = chunk_state::fallback;
        ++stats.fallback_chunks;
        record_latency(b, c);
    }

    // Starts group g (one chunk without grouping) on the GPU (staging its input if needed) as
    // `f`, which describes the group also when this throws.
    void start_chunk(batch& b, const chunk_group& g, flight& f) {
        core& k = m_core;
        const std::size_t c = g.first;
        std::span<const In> in = b.in.subspan(g.in_offset, g.in_count);
        std::span<Out> out = b.out.subspan(g.out_offset, g.out_count);
        // With pinned host ranges the GPU alone orders slot reuse (event waits), so the host runs
        // ahead round robin. With staging, one chunk per slot is in flight (the batch's rings
        // hold the host ends, and advance_staging saw them ready): any slot without a chunk in
        // flight (after a depth change it need not be below the new depth).
        std::size_t s = 0;
        if (b.runahead()) {
            s = b.next_slot++ % k.active_depth;
        } else {
            while (b.busy[s]) {
                ++s;
            }
        }
        f.chunk = c;
        f.chunks = g.chunks;
        f.offset = g.in_offset;
        f.count = in.size();
        f.output_count = out.size();
        f.slot = s;
        f.host_in = in.data();
        f.host_out = out.data();
        k.start_flight(f);
        const In* src = b.pinned_in ? in.data() : m_staging.input(c);
        Out* dst = out.data();
        try {
            if (!b.pinned_out) {
                dst = m_staging.output(c);
                f.staged_out = out.data();
            }
            k.enqueue(f, src, dst);
        } catch (...) {
            if (!b.runahead()) {
                m_staging.unstart(c); // a retry, or the fallback, takes the chunk
            }
            throw;
        }
        b.busy[s] = true;
        b.inflight.push_back(std::move(f));
    }

    // The oldest flight (a chunk, or a group) completed on the GPU: its output goes in place.
    // Staged output goes in place on the stage-out workers; its latency is recorded when it
    // landed (note_landed).
    void finish(batch& b, flight& f) {
        bool staging_out = false;
        if (!b.runahead()) {
            staging_out = m_staging.landed(f.chunk, f.staged_out, f.output_count);
        }
        m_core.chunk_done(f);
        const bool clean = b.attempts[f.chunk] == 0;
        for (std::size_t c = f.chunk; c < f.chunk + f.chunks; ++c) {
            b.state[c] = chunk_state::gpu;
            ++m_core.monitor.counters().gpu_chunks;
            if (clean) {
                m_core.note_clean();
            }
            if (!staging_out) {
                record_latency(b, c);
            }
        }
    }

    // ---- staging (pageable ranges; detail/staging.hpp) ----

    // One step of a staged batch before the usual start-or-retire: records the outputs that
    // landed, retires a chunk the GPU finished (its stage-out starts at once), starts stage-ins
    // into free input buffers, and when the next chunk cannot start yet but copies run, waits
    // for one to finish (or ~100 us, to look at the GPU again). Returns whether it did a step;
    // false leaves the usual path to start the next chunk (ready) or to retire the oldest.
    task<bool> advance_staging(batch& b, std::size_t next, std::size_t n) {
        core& k = m_core;
        note_landed(b);
        if (oldest_done(b)) {
            co_await retire(b);
            co_return true;
        }
        if (k.gpu_abandoned) {
            co_return false;
        }
        m_staging.skip_to(next); // chunks before it are on the GPU, done, or the fallback's
        while (m_staging.can_start_in(n)) {
            std::span<const In> in = chunk_in(b, m_staging.next_in());
            m_staging.start_in(in.data(), in.size());
        }
        const bool room = next < n && b.inflight.size() < k.active_depth;
        if (!room || m_staging.ready(next)) {
            co_return false; // the usual path starts the next chunk, or retires the oldest
        }
        if (!m_staging.unsettled()) {
            // No copy runs, and none finished since note_landed() looked (a copy that finished
            // just after it is taken by the next step, after the wait below returns at once):
            // the buffers the next chunk needs are held by chunks on the GPU.
            if (b.inflight.empty()) {
                throw std::logic_error("cudawait pipeline: staging holds no chunk in flight but "
                                       "has no buffer free");
            }
            co_await retire(b);
            co_return true;
        }
        using namespace std::chrono_literals;
        co_await m_staging.wait(b.inflight.empty() ? std::chrono::nanoseconds(1ms)
                                                   : std::chrono::nanoseconds(100us));
        co_return true;
    }

    // The oldest chunk in flight finished on the GPU, or asking failed: retire() then waits
    // for it, and sees the error, itself.
    static bool oldest_done(const batch& b) {
        if (b.inflight.empty()) {
            return false;
        }
        try {
            return event_ready(b.inflight.front().done.get(), std::source_location::current());
        } catch (const cuda_error&) {
            return true;
        }
    }

    // Every copy of the batch finished (also after a failure: they use the caller's ranges).
    task<void> settle_staging(batch& b) {
        using namespace std::chrono_literals;
        while (m_staging.busy()) {
            co_await m_staging.wait(50us);
        }
        note_landed(b);
    }

    // Outputs that landed since the last look: their latency ends now.
    void note_landed(batch& b) {
        for (std::size_t c : m_staging.collect()) {
            record_latency(b, c);
        }
    }

    // Chunk c is tried (started, or handed to the fallback) for the first time: its latency
    // runs from here.
    static void note_first_try(batch& b, std::size_t c) {
        if (b.attempts[c] == 0) {
            b.taken[c] = std::chrono::steady_clock::now();
        }
    }

    // Chunk c's output is in place: its latency runs from its first try.
    void record_latency(const batch& b, std::size_t c) {
        m_core.monitor.chunk_latency(
            std::chrono::duration<double>(std::chrono::steady_clock::now() - b.taken[c]).count());
    }

    // The context is gone: nothing in flight can complete or write any more.
    void abandon_gpu(batch& b, const chunk_error& why) {
        core& k = m_core;
        k.gpu_abandoned = true;
        // The flights leave the batch before any fallback runs; their events go back with them,
        // also when a fallback throws.
        std::deque<flight> lost;
        lost.swap(b.inflight);
        for (flight& f : lost) {
            b.busy[f.slot] = false;
        }
        for (flight& f : lost) {
            k.report_degradation(f, degrade_level::give_up,
                                 k.on_gpu_failure ? degrade_action::fallback_after_gpu_lost
                                                  : degrade_action::failed_after_gpu_lost,
                                 why);
            for (std::size_t c = f.chunk; c < f.chunk + f.chunks; ++c) {
                run_fallback(b, c);
            }
        }
    }

    // After an exception (from the fallback, a callback, a stage): the chunks still in flight
    // must stop writing the caller's memory before run() passes it on, and their events go back
    // to the pool. One that times out may still land: its event stays out until destruction.
    task<void> drain(batch& b) {
        core& k = m_core;
        while (!b.inflight.empty()) {
            flight& f = b.inflight.front();
            bool landed = true;
            try {
                co_await await_completion(event_ref(f.done), k.options.recovery.chunk_timeout);
            } catch (const timeout_error&) {
                landed = false;
            } catch (const cuda_error&) {
                k.gpu_abandoned = true; // the context is gone: nothing can complete any more
            } catch (...) {
                landed = false; // not known to have landed
            }
            if (!landed) {
                k.abandoned_events.push_back(std::move(f.done));
            }
            if (!b.runahead()) {
                if (landed) {
                    m_staging.drop(f.chunk);
                } else {
                    m_staging.abandon(f.chunk, k.abandoned_inputs, k.abandoned_outputs);
                }
            }
            b.busy[f.slot] = false;
            b.inflight.pop_front();
        }
    }

    // Waits for the oldest chunk in flight and completes it, degrading on errors and timeouts.
    task<void> retire(batch& b) {
        core& k = m_core;
        pipeline_stats& stats = k.monitor.counters();
        flight& f = b.inflight.front();
        chunk_error error;
        {
            // Spans the await: a start/end range, which other coroutines' ranges cannot close.
            trace_async_range r("wait", f.chunk);
            timeline_scope span(k.options.monitoring.timeline, "wait", "wait", f.chunk);
            try {
                co_await await_completion(event_ref(f.done), k.options.recovery.chunk_timeout);
            } catch (const timeout_error& e) {
                error.timed_out = true;
                error.exception = std::current_exception();
                error.what = e.what();
            } catch (const cuda_error& e) {
                error = chunk_error_of(e);
                error.sticky = true; // the completion reported it: the device failed, lost
            }
        }
        if (!error.failed()) {
            finish(b, f);
            b.busy[f.slot] = false;
            b.inflight.pop_front();
            co_return;
        }
        if (error.sticky) {
            abandon_gpu(b, error);
            co_return;
        }
        // Timed out. The work cannot be cancelled, so it is waited for again, with less
        // concurrency for what follows; past the retries the chunk is given up.
        if (++b.attempts[f.chunk] <= k.options.recovery.max_retries) {
            ++stats.retries;
            k.lower_depth();
            k.report_degradation(f, degrade_level::retry, degrade_action::waited_again, error);
            co_return;
        }
        // Level 2: the GPU may still write these chunks' outputs later, so neither the fallback
        // nor anything else writes them; they are reported failed, and their events stay out of
        // the pool (a late completion must not signal a reused event).
        k.gpu_abandoned = true;
        std::deque<flight> lost;
        lost.swap(b.inflight);
        for (flight& g : lost) {
            for (std::size_t c = g.chunk; c < g.chunk + g.chunks; ++c) {
                b.state[c] = chunk_state::failed;
                ++stats.failed_chunks;
            }
            k.abandoned_events.push_back(std::move(g.done));
            if (!b.runahead()) {
                m_staging.abandon(g.chunk, k.abandoned_inputs, k.abandoned_outputs);
            }
        }
        for (flight& g : lost) {
            k.report_degradation(g, degrade_level::give_up, degrade_action::failed_timed_out,
                                 error);
        }
    }

    core& m_core;
    batch_staging<In, Out> m_staging; // pageable batches: the pinned rings, kept between runs
};

} // namespace cudawait::detail
