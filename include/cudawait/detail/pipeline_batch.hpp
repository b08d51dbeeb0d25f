// SPDX-License-Identifier: Apache-2.0
#pragma once

// The batch driver: run() cuts the host ranges into chunks, starts them on the slots (staging
// pageable ones through the slots' pinned buffers), awaits the oldest in flight, puts its output
// in place, and degrades on errors and timeouts (see the pipeline synopsis).
//
// With chunk groups (options.group_bytes) the unit started, awaited and retired is a group of
// up to G consecutive chunks (detail/pipeline_group.hpp plans them): one flight, one wait. What
// is per chunk stays per chunk: the chunks' states, stats (chunks, gpu_chunks, fallback_chunks,
// failed_chunks), latency samples (from the group's first try), recovery's clean count, the
// fallback (a group given up hands each of its chunks to it once) and pipeline_error's lists.
// Retries and chunk_timeout apply to the group (attempts are counted on its first chunk; a
// group retried after a lowered depth has the same chunks), and so do degradation records
// (chunk_failure::chunks) and the trace and timeline ranges.

#include <cudawait/error.hpp>
#include <cudawait/event.hpp>
#include <cudawait/pipeline_options.hpp>
#include <cudawait/pipeline_report.hpp>
#include <cudawait/scheduler.hpp>
#include <cudawait/task.hpp>
#include <cudawait/timeline.hpp>
#include <cudawait/timeout.hpp>
#include <cudawait/trace.hpp>

#include <cudawait/detail/pipeline_group.hpp>
#include <cudawait/detail/pipeline_slots.hpp>
#include <cudawait/detail/staging.hpp>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <deque>
#include <exception>
#include <span>
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
        if (k.session_open || k.free_slots.size() != k.slots.size()) {
            throw usage_error("pipeline::run: a streaming session is open (slots or results held, "
                              "chunks not yet taken, or next() has not returned the end after "
                              "close())");
        }
        if (k.batch_running) {
            throw usage_error("pipeline::run: another batch is running");
        }
        k.batch_running = true;
        struct running_flag {
            bool* flag;
            ~running_flag() { *flag = false; }
        } guard{&k.batch_running};

        batch b{in, out, pinned_in, pinned_out, {}, {}, {}, std::vector<bool>(k.slots.size())};
        std::size_t n = (in.size() + k.options.chunk_elements - 1) / k.options.chunk_elements;
        b.state.assign(n, chunk_state::pending);
        b.attempts.assign(n, 0);
        b.taken.assign(n, {});
        k.monitor.reset();
        pipeline_stats& stats = k.monitor.counters();
        auto t0 = std::chrono::steady_clock::now();
        std::size_t next = 0;
        std::exception_ptr failure;
        try {
            while (next < n || !b.inflight.empty()) {
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
                    try {
                        for (std::size_t c = g.first; c < g.first + g.chunks; ++c) {
                            note_first_try(b, c);
                        }
                        start_chunk(b, g, f);
                        next += g.chunks;
                        continue;
                    } catch (const cuda_error& e) {
                        error = chunk_error_of(e);
                    }
                    if (error.sticky) {
                        k.report_degradation(f, degrade_level::give_up, degrade_action::gpu_lost,
                                             error);
                        abandon_gpu(b, error);
                        continue;
                    }
                    if (++b.attempts[next] <= k.options.max_retries) {
                        // Level 1: let everything in flight finish, then retry with one slot fewer.
                        ++stats.retries;
                        while (!b.inflight.empty()) {
                            co_await retire(b);
                        }
                        k.lower_depth();
                        k.report_degradation(f, degrade_level::retry,
                                             degrade_action::retried_with_less_depth, error);
                        continue;
                    }
                    k.report_degradation(f, degrade_level::give_up,
                                         k.on_gpu_failure ? degrade_action::fallback
                                                          : degrade_action::failed,
                                         error);
                    for (std::size_t c = g.first; c < g.first + g.chunks; ++c) {
                        run_fallback(b, c);
                    }
                    next += g.chunks;
                    continue;
                }
                co_await retire(b);
            }
        } catch (...) {
            failure = std::current_exception();
        }
        if (failure) {
            co_await drain(b); // not in the handler: a handler cannot co_await
            if (k.monitor.give_ups() != 0) {
                write_failure_report(k);
            }
            std::rethrow_exception(failure);
        }
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
        [[nodiscard]] bool runahead() const noexcept { return pinned_in && pinned_out; }
    };

    // The group that starts at chunk `first`.
    [[nodiscard]] chunk_group plan(const batch& b, std::size_t first) const {
        const pipeline_options& o = m_core.options;
        return plan_group(first, m_core.group_chunks, b.in.size(), o.chunk_elements,
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
        pipeline_stats& stats = m_core.monitor.counters();
        if (!m_core.on_gpu_failure) {
            b.state[c] = chunk_state::failed;
            ++stats.failed_chunks;
            return;
        }
        trace_range r("fallback", c);
        timeline_scope span(m_core.options.timeline, "fallback", "fallback", c);
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
        // ahead round robin. With staging, the slot's host buffers must be free: any slot
        // without a chunk in flight (after a depth change it need not be below the new depth).
        std::size_t s = 0;
        if (b.runahead()) {
            s = b.next_slot++ % k.active_depth;
        } else {
            while (b.busy[s]) {
                ++s;
            }
        }
        slot& sl = *k.slots[s];
        f.chunk = c;
        f.chunks = g.chunks;
        f.offset = g.in_offset;
        f.count = in.size();
        f.output_count = out.size();
        f.slot = s;
        f.host_in = in.data();
        f.host_out = out.data();
        k.start_flight(f);
        const In* src = in.data();
        Out* dst = out.data();
        if (!b.runahead()) {
            sl.ensure_host_buffers(k.options, *k.pool);
        }
        if (!b.pinned_in) {
            // The slot's previous chunk has retired (in flight <= depth), so its H2D is done.
            timeline_scope span(k.options.timeline, "stage-in", "stage-in", c);
            stage_in(sl.host_in.data(), in.data(), in.size_bytes(), c);
            src = sl.host_in.data();
        }
        if (!b.pinned_out) {
            dst = sl.host_out.data();
            f.staged_out = out.data();
        }
        k.enqueue(f, src, dst);
        b.busy[s] = true;
        b.inflight.push_back(std::move(f));
    }

    // The oldest group in flight completed on the GPU: its output goes in place.
    void finish(batch& b, flight& f) {
        if (f.staged_out != nullptr) {
            timeline_scope span(m_core.options.timeline, "stage-out", "stage-out", f.chunk);
            stage_out(f.staged_out, m_core.slots[f.slot]->host_out.data(),
                      f.output_count * sizeof(Out), f.chunk);
        }
        m_core.chunk_done(f);
        const bool clean = b.attempts[f.chunk] == 0;
        for (std::size_t c = f.chunk; c < f.chunk + f.chunks; ++c) {
            b.state[c] = chunk_state::gpu;
            ++m_core.monitor.counters().gpu_chunks;
            if (clean) {
                m_core.note_clean();
            }
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
                if (k.options.chunk_timeout.count() > 0) {
                    co_await with_timeout(event_ref(f.done), k.options.chunk_timeout);
                } else {
                    co_await event_ref(f.done);
                }
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
            timeline_scope span(k.options.timeline, "wait", "wait", f.chunk);
            try {
                if (k.options.chunk_timeout.count() > 0) {
                    co_await with_timeout(event_ref(f.done), k.options.chunk_timeout);
                } else {
                    co_await event_ref(f.done);
                }
            } catch (const timeout_error& e) {
                error.timed_out = true;
                error.exception = std::current_exception();
                error.what = e.what();
            } catch (const cuda_error& e) {
                error = chunk_error_of(e);
                error.sticky = true; // an error seen while waiting comes from the device: lost
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
        if (++b.attempts[f.chunk] <= k.options.max_retries) {
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
        }
        for (flight& g : lost) {
            k.report_degradation(g, degrade_level::give_up, degrade_action::failed_timed_out,
                                 error);
        }
    }

    core& m_core;
};

} // namespace cudawait::detail
