// SPDX-License-Identifier: Apache-2.0
#pragma once

// Synopsis
//   pipeline<float> pipe(options, {stage...}, fallback);
//       stage:    void(std::span<float> dev_in, std::span<float> dev_out, stream_ref s)
//                 launches the chunk's kernels on `s` (device spans, the chunk's own lengths:
//                 stage 0 reads the chunk's input, a later stage the previous one's output)
//       fallback: void(std::size_t chunk, std::span<const float> in, std::span<float> out)
//                 computes a chunk on the host when the GPU cannot (optional)
//
//   Batch:      co_await pipe.run(host_in, host_out);
//   Streaming:  auto slot = co_await pipe.acquire();     // waits while every slot is busy
//               fill(slot.data()); pipe.submit(std::move(slot), n);
//               while (auto r = co_await pipe.next()) use(r->data());   // in submission order
//               pipe.close();                             // next() drains, then ends
//
// Stages are chained: stage 0 reads the chunk's device input, each later stage reads the
// previous stage's output, and the last writes the chunk's device output, which goes D2H. With
// several stages each slot has one more device buffer (an output chunk) and the stages' outputs
// alternate between it and the output buffer, so that the last lands in the output. A stage's
// input and output are then both spans of the one element type: several stages need In == Out
// (else the constructor throws usage_error); one stage may launch any number of kernels. A
// chunk's stages run in order on one compute stream.
//
// Each chunk goes H2D on one stream, through the stages on a compute stream, D2H on a third; the
// streams are non-blocking and ordered by events only, so copies in both directions and kernels
// of different chunks overlap. `depth` slots (2 = double buffering) each own device buffers; a
// slot is reused only after its previous chunk's last use of each buffer, which the GPU itself
// waits for (cudaStreamWaitEvent). The host waits only by co_await.
//
// One mode at a time. A streaming session begins with the first acquire() and stays open while
// slots are acquired or results held, while chunks are submitted and not yet taken, and after
// close() until next() has returned the end; meanwhile run() throws usage_error. Once next() has
// returned the end after close(), and every result is destroyed, the pipeline is idle again:
// batch runs, or a new session (acquire() after the end), may follow. acquire() during a batch
// throws usage_error, and so do acquire() and submit() after close() until the session ended.
//
// Pinned host ranges are copied directly. Pageable ones are staged through the slot's pinned
// buffers (depth x (input + output chunk) bytes from the pool), the host memcpy on several
// threads. Graph mode records each slot's H2D -> stages -> D2H once as a CUDA graph and replays
// it. With `timing` on, stats() reports stage times, achieved bandwidths against the link's peak
// (measured once per device), overlap efficiency, and alerts on low bandwidth.
//
// Degradation: a chunk whose work fails to enqueue (a launch error, say) is retried with one slot
// fewer (level 1), down to depth 1, then handed to the fallback (level 2). In a batch, a chunk
// that does not finish within `chunk_timeout` lowers the depth and is waited for again; after
// `max_retries` timeouts it is reported failed (its copy may still land, so the fallback does
// not write it) and the GPU is not used again. After a sticky error the context is gone: every
// chunk not yet seen complete goes to the fallback. Every chunk is produced once, by the GPU or by
// the fallback, or is reported failed; without a fallback, run() throws pipeline_error listing the
// chunks that completed and the ones that failed. Streaming keeps the order: a chunk that fails
// is produced by the fallback when next() reaches it, or next() throws pipeline_error for it
// (and the chunks after it can still be taken). An exception from the fallback (or from any
// callback) reaches the caller of run() or next(); run() first waits for the chunks still in
// flight, so that no copy lands in the caller's memory after it returned (one that outlives
// chunk_timeout meanwhile may still land, as above).

#include <cudawait/device.hpp>
#include <cudawait/device_buffer.hpp>
#include <cudawait/error.hpp>
#include <cudawait/event.hpp>
#include <cudawait/memory_kind.hpp>
#include <cudawait/pinned_buffer.hpp>
#include <cudawait/pinned_pool.hpp>
#include <cudawait/scheduler.hpp>
#include <cudawait/stream.hpp>
#include <cudawait/task.hpp>
#include <cudawait/timeout.hpp>
#include <cudawait/trace.hpp>

#include <cudawait/detail/parallel_memcpy.hpp>

#include <algorithm>
#include <chrono>
#include <coroutine>
#include <cstddef>
#include <cstdio>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>

namespace cudawait {

/// Passed to pipeline_options::on_alert when achieved bandwidth stayed low over a window.
struct pipeline_alert {
    const char* direction; ///< "h2d" or "d2h"
    double achieved_gbps;  ///< over the window
    double peak_gbps;      ///< the link's measured one-way peak
    std::size_t window;    ///< chunks in the window
};

/// One degradation step, passed to pipeline_options::on_degrade (default: printed to stderr).
struct chunk_failure {
    std::size_t chunk;    ///< chunk index within the run (or submission index)
    std::size_t offset;   ///< first input element of the chunk
    std::size_t elements; ///< input elements in the chunk
    std::size_t output_elements;
    unsigned depth; ///< slots in use when it failed
    unsigned compute_streams;
    int device;
    bool graph;
    int level;          ///< 1: retried with less concurrency; 2: fallback or failed
    std::string action; ///< what the pipeline did about it
    std::string error;  ///< what went wrong
};

/// How a pipeline is built; chunk_elements is required.
struct pipeline_options {
    /// Slots, each with its own device (and if needed pinned) buffers: 2 = double buffering.
    unsigned depth = 2;
    /// Input elements per chunk (the last chunk of a batch may be shorter).
    std::size_t chunk_elements = 0;
    /// Output elements for a full chunk; 0 means as many as input elements. A chunk of k inputs
    /// has ceil(k * output_elements / chunk_elements) outputs.
    std::size_t output_elements = 0;
    int device = 0;
    unsigned compute_streams = 1;
    /// Stream priorities; unset: compute streams highest, copy streams lowest.
    std::optional<int> compute_priority;
    std::optional<int> transfer_priority;
    /// Replay each slot's work as a CUDA graph (full chunks; a short last chunk runs plainly).
    bool graph = false;
    /// Timing events per stage, for stats() and alerts.
    bool timing = false;
    /// Alert when achieved H2D or D2H bandwidth over `alert_window` chunks stays below this
    /// fraction of the link's peak.
    double alert_fraction = 0.6;
    std::size_t alert_window = 8;
    std::function<void(const pipeline_alert&)> on_alert;
    /// Batch runs: how long to wait for one chunk before degrading; 0: as long as it takes.
    /// Streaming consumers (next()) wait as long as it takes.
    std::chrono::nanoseconds chunk_timeout{0};
    /// Level-1 retries per chunk before level 2.
    unsigned max_retries = 2;
    std::function<void(const chunk_failure&)> on_degrade;
    /// Streaming: chunks submitted and not yet taken by next(); 0 means
    /// (2 copy streams + compute streams) x 2.
    std::size_t queue_capacity = 0;
    /// Staging buffers come from here; nullptr: default_pinned_pool().
    pinned_pool* pool = nullptr;
};

/// What the last run (or the stream so far) achieved. Stage times need `timing`.
struct pipeline_stats {
    std::size_t chunks = 0;
    std::size_t gpu_chunks = 0;
    std::size_t fallback_chunks = 0;
    std::size_t failed_chunks = 0;
    std::size_t retries = 0;
    std::size_t input_bytes = 0;
    std::size_t output_bytes = 0;
    double wall_seconds = 0; ///< the batch, first enqueue to last chunk retired
    double h2d_seconds = 0;  ///< sums of the stages' GPU times
    double compute_seconds = 0;
    double d2h_seconds = 0;
    double graph_seconds = 0; ///< graph mode: whole replays (stages are not split there)
    double h2d_gbps = 0;      ///< bytes over the H2D stage's own time
    double d2h_gbps = 0;
    double throughput_gbps = 0;     ///< input bytes over wall time
    double compute_to_transfer = 0; ///< compute time over the longer copy stage's time
    double overlap_efficiency = 0;  ///< the longest stage's time over wall time (1 = perfect)
    double link_peak_gbps = 0;      ///< measured once per device (with `timing`)
    unsigned depth = 0;             ///< slots in use now (lower after level-1 degradation)
    bool gpu_abandoned = false;
    std::size_t alerts = 0;
};

/// A batch did not complete on the GPU and no fallback took over.
class pipeline_error : public std::runtime_error {
public:
    pipeline_error(const std::string& what, std::vector<std::size_t> completed,
                   std::vector<std::size_t> failed)
        : std::runtime_error(what), m_completed(std::move(completed)), m_failed(std::move(failed)) {
    }
    /// Chunks whose output is in place.
    [[nodiscard]] const std::vector<std::size_t>& completed() const noexcept { return m_completed; }
    /// Chunks without output.
    [[nodiscard]] const std::vector<std::size_t>& failed() const noexcept { return m_failed; }

private:
    std::vector<std::size_t> m_completed;
    std::vector<std::size_t> m_failed;
};

namespace detail {
/// The error of a batch in which chunks failed. The message is written before the lists move
/// into the error (in one call's arguments the moves may come first).
inline pipeline_error batch_failed(std::vector<std::size_t> completed,
                                   std::vector<std::size_t> failed) {
    std::string what = "pipeline: " + std::to_string(failed.size()) + " of " +
                       std::to_string(completed.size() + failed.size()) + " chunks failed";
    return pipeline_error(what, std::move(completed), std::move(failed));
}
} // namespace detail

/// The link's one-way peak in GB/s for `device`: the better of H2D and D2H for 64 MiB pinned
/// copies, measured on first use (a few milliseconds) and cached for the process.
/// @throws cuda_error
inline double link_peak_gbps(int device) {
    static std::mutex mutex;
    static std::map<int, double> cache;
    {
        std::lock_guard lock(mutex);
        if (auto it = cache.find(device); it != cache.end()) {
            return it->second;
        }
    }
    device_guard guard{device_ref(device)};
    constexpr std::size_t bytes = std::size_t{64} << 20;
    stream s(device_ref(device), 0);
    pinned_buffer<std::byte> host(bytes);
    device_buffer<std::byte> dev(bytes, s);
    event start(device_ref(device), cudaEventDefault);
    event stop(device_ref(device), cudaEventDefault);
    double best = 0;
    for (int dir = 0; dir < 2; ++dir) {
        for (int rep = 0; rep < 4; ++rep) {
            start.record(s);
            if (dir == 0) {
                check(cudaMemcpyAsync(dev.data(), host.data(), bytes, cudaMemcpyHostToDevice,
                                      s.get()),
                      "cudaMemcpyAsync");
            } else {
                check(cudaMemcpyAsync(host.data(), dev.data(), bytes, cudaMemcpyDeviceToHost,
                                      s.get()),
                      "cudaMemcpyAsync");
            }
            stop.record(s);
            stop.sync();
            float ms = 0;
            check(cudaEventElapsedTime(&ms, start.get(), stop.get()), "cudaEventElapsedTime");
            if (rep > 0 && ms > 0) { // the first of each direction warms up
                best = std::max(best, static_cast<double>(bytes) / (ms * 1e-3) / 1e9);
            }
        }
    }
    host.record_use(s);
    s.sync();
    std::lock_guard lock(mutex);
    cache[device] = best;
    return best;
}

namespace detail {

/// Coroutines waiting for a condition on one scheduler's thread; notify resumes them all (they
/// check their condition again).
class wait_list {
public:
    struct awaiter {
        wait_list* list;
        scheduler* sched;
        bool await_ready() const noexcept { return false; }
        void await_suspend(std::coroutine_handle<> h) { list->m_waiting.emplace_back(h, sched); }
        void await_resume() const noexcept {}
    };
    [[nodiscard]] awaiter wait(scheduler& s) noexcept { return {this, &s}; }
    void notify_all() {
        auto waiting = std::exchange(m_waiting, {});
        for (auto [h, s] : waiting) {
            s->post(h);
        }
    }

private:
    std::vector<std::pair<std::coroutine_handle<>, scheduler*>> m_waiting;
};

} // namespace detail

/// An N-buffered H2D -> stages -> D2H pipeline over chunks of `In`, producing `Out`.
///
/// Not thread-safe: drive one pipeline from one scheduler's coroutines. Destruction waits for
/// the GPU work in flight.
template <class In, class Out = In>
class pipeline {
    static_assert(std::is_trivially_copyable_v<In> && std::is_trivially_copyable_v<Out>);

public:
    /// Launches a chunk's kernels on `s`. Stages are chained: `in` is the chunk's device input
    /// for the first stage and the previous stage's output for the others.
    using stage = std::function<void(std::span<In> in, std::span<Out> out, stream_ref s)>;
    using fallback =
        std::function<void(std::size_t chunk, std::span<const In> in, std::span<Out> out)>;

    class input_slot;
    class result;

    /// @throws usage_error for a zero chunk size, depth, stream count or no stages, or several
    ///         stages with In != Out; cuda_error
    pipeline(pipeline_options options, std::vector<stage> stages, fallback on_gpu_failure = {})
        : m_options(validated(std::move(options))), m_stages(checked(std::move(stages))),
          m_fallback(std::move(on_gpu_failure)),
          m_pool(m_options.pool != nullptr ? m_options.pool : &default_pinned_pool()),
          m_h2d(device_ref(m_options.device), transfer_priority()),
          m_d2h(device_ref(m_options.device), transfer_priority()) {
        device_ref dev(m_options.device);
        int high = m_options.compute_priority.value_or(priority_high(dev));
        for (unsigned i = 0; i < m_options.compute_streams; ++i) {
            m_compute.emplace_back(dev, high);
        }
        m_slots.reserve(m_options.depth);
        for (unsigned i = 0; i < m_options.depth; ++i) {
            m_slots.push_back(std::make_unique<slot>(*this));
            m_free_slots.push_back(i);
        }
        m_active_depth = m_options.depth;
        if (m_options.timing) {
            // One set of stage events per chunk that can be in flight (run-ahead included).
            for (std::size_t i = 0; i < runahead_factor * m_options.depth; ++i) {
                std::vector<event> set;
                for (int k = 0; k < 6; ++k) {
                    set.emplace_back(device_ref(m_options.device), cudaEventDefault);
                }
                m_timing.push_back(std::move(set));
            }
            m_link_peak = link_peak_gbps(m_options.device);
        }
        // The slots' device buffers were allocated in the H2D stream's order; every other stream
        // (the graph streams among them) may use them from now on.
        m_h2d.sync();
    }

    pipeline(const pipeline&) = delete;
    pipeline& operator=(const pipeline&) = delete;

    ~pipeline() {
        // Every stream the slots' work ran on, before their buffers and events go.
        for (stream* s : all_streams()) {
            if (*s) {
                detail::report(cudaStreamSynchronize(s->get()), "cudaStreamSynchronize");
            }
        }
        for (auto& f : m_submitted) {
            event_pool::for_device(m_options.device).release_raw(f.done);
        }
        for (cudaEvent_t e : m_abandoned_events) {
            event_pool::for_device(m_options.device).release_raw(e);
        }
    }

    /// Output elements of a chunk with `inputs` input elements.
    [[nodiscard]] std::size_t output_count(std::size_t inputs) const noexcept {
        return (inputs * m_options.output_elements + m_options.chunk_elements - 1) /
               m_options.chunk_elements;
    }
    /// Output elements for `inputs` input elements in chunks.
    [[nodiscard]] std::size_t output_size(std::size_t inputs) const noexcept {
        std::size_t full = inputs / m_options.chunk_elements;
        std::size_t rest = inputs % m_options.chunk_elements;
        return full * m_options.output_elements + (rest != 0 ? output_count(rest) : 0);
    }

    /// Runs `in` through the pipeline into `out` (output_size(in.size()) elements).
    /// @throws usage_error for empty or mis-sized ranges, device memory, or while a streaming
    ///         session is open; pipeline_error when chunks failed and no fallback took them;
    ///         what the fallback or a callback throws, once the chunks in flight finished
    [[nodiscard]] task<void> run(std::span<const In> in, std::span<Out> out) {
        if (in.empty() || in.data() == nullptr) {
            throw usage_error("pipeline::run: empty input");
        }
        if (out.size() != output_size(in.size()) || out.data() == nullptr) {
            throw usage_error("pipeline::run: output has " + std::to_string(out.size()) +
                              " elements, the input needs " +
                              std::to_string(output_size(in.size())));
        }
        memory_kind kin = classify(in.data());
        memory_kind kout = classify(out.data());
        if (kin == memory_kind::device || kout == memory_kind::device) {
            throw usage_error("pipeline::run: input and output must be host memory");
        }
        return run_batch(in, out, kin == memory_kind::pinned, kout == memory_kind::pinned);
    }

    /// A slot the producer fills before submit(); given back unused if dropped.
    class input_slot {
    public:
        input_slot() = default;
        input_slot(input_slot&& o) noexcept
            : m_owner(std::exchange(o.m_owner, nullptr)), m_index(o.m_index) {}
        input_slot& operator=(input_slot&& o) noexcept {
            if (this != &o) {
                reset();
                m_owner = std::exchange(o.m_owner, nullptr);
                m_index = o.m_index;
            }
            return *this;
        }
        ~input_slot() { reset(); }
        /// The slot's pinned input: chunk_elements elements.
        [[nodiscard]] std::span<In> data() const {
            if (m_owner == nullptr) {
                throw usage_error("pipeline::input_slot: empty or already submitted");
            }
            return m_owner->m_slots[m_index]->host_in.span();
        }

    private:
        friend class pipeline;
        input_slot(pipeline* p, std::size_t i) : m_owner(p), m_index(i) {}
        void reset() noexcept {
            if (m_owner != nullptr) {
                std::exchange(m_owner, nullptr)->give_back(m_index);
            }
        }
        pipeline* m_owner = nullptr;
        std::size_t m_index = 0;
    };

    /// A chunk's output, in submission order; the slot is reused once this is destroyed.
    class result {
    public:
        result(result&& o) noexcept
            : m_owner(std::exchange(o.m_owner, nullptr)), m_index(o.m_index), m_chunk(o.m_chunk),
              m_count(o.m_count), m_by_fallback(o.m_by_fallback) {}
        result& operator=(result&&) = delete;
        ~result() {
            if (m_owner != nullptr) {
                m_owner->give_back(m_index);
            }
        }
        [[nodiscard]] std::span<const Out> data() const {
            return m_owner->m_slots[m_index]->host_out.span().first(m_count);
        }
        /// Submission index.
        [[nodiscard]] std::size_t chunk() const noexcept { return m_chunk; }
        /// Produced by the fallback rather than the GPU.
        [[nodiscard]] bool by_fallback() const noexcept { return m_by_fallback; }

    private:
        friend class pipeline;
        result(pipeline* p, std::size_t i, std::size_t chunk, std::size_t n, bool fb)
            : m_owner(p), m_index(i), m_chunk(chunk), m_count(n), m_by_fallback(fb) {}
        pipeline* m_owner;
        std::size_t m_index;
        std::size_t m_chunk;
        std::size_t m_count;
        bool m_by_fallback;
    };

    /// Waits for a free slot (every slot busy, or the submission queue full: back pressure).
    /// On an idle pipeline it begins a streaming session (stats() and chunk numbers start anew).
    /// @throws usage_error after close() until next() returned the end, or during a batch run
    [[nodiscard]] task<input_slot> acquire() {
        scheduler& sched = *co_await this_scheduler_ptr();
        for (;;) {
            if (m_batch_running) {
                throw usage_error("pipeline::acquire: a batch run is in progress");
            }
            if (!m_session_open) {
                begin_session();
            } else if (m_closed) {
                throw usage_error("pipeline::acquire: the pipeline is closed; a new streaming "
                                  "session may begin once next() has returned the end");
            }
            if (!m_free_slots.empty() && m_submitted.size() < m_options.queue_capacity) {
                break;
            }
            co_await m_slot_freed.wait(sched);
        }
        std::size_t i = m_free_slots.front();
        m_free_slots.pop_front();
        try {
            m_slots[i]->ensure_host_buffers();
        } catch (...) {
            give_back(i);
            throw;
        }
        co_return input_slot(this, i);
    }

    /// Starts the slot's chunk of `count` elements (at most chunk_elements) on the GPU.
    /// @throws usage_error for an empty slot, a bad count, or after close() (the slot is then
    ///         still the caller's); cuda_error
    void submit(input_slot&& s, std::size_t count) {
        if (s.m_owner != this) {
            throw usage_error("pipeline::submit: the slot is empty or from another pipeline");
        }
        if (count == 0 || count > m_options.chunk_elements) {
            throw usage_error("pipeline::submit: count must be in 1..chunk_elements");
        }
        if (m_closed || !m_session_open) {
            throw usage_error("pipeline::submit: the slot's streaming session is closed");
        }
        std::size_t i = s.m_index;
        s.m_owner = nullptr;
        slot& sl = *m_slots[i];
        flight f = make_flight(m_stream_seq++, 0, count, i);
        f.by_fallback = false;
        try {
            enqueue(f, sl.host_in.data(), sl.host_out.data());
        } catch (const cuda_error& e) {
            // The chunk is still delivered in order: next() runs the fallback (or reports it).
            f.enqueue_error = e.what();
            f.sticky = e.sticky();
        }
        m_submitted.push_back(f);
        m_result_ready.notify_all();
    }

    /// The next chunk's output, in submission order; std::nullopt once closed and drained,
    /// which ends the streaming session (a later call waits for the next session's chunks).
    /// @throws pipeline_error when the chunk failed and no fallback took it; what the fallback
    ///         throws (the chunk is then counted failed)
    [[nodiscard]] task<std::optional<result>> next() {
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
        flight f = m_submitted.front();
        m_submitted.pop_front();
        m_slot_freed.notify_all(); // the queue has room again
        std::string error = f.enqueue_error;
        bool sticky = f.sticky;
        if (error.empty() && !m_gpu_abandoned) {
            trace_async_range r("wait", f.chunk);
            try {
                co_await event_ref(f.done);
            } catch (const cuda_error& e) {
                error = e.what();
                sticky = e.sticky();
            }
        } else if (m_gpu_abandoned && error.empty()) {
            error = "the GPU was abandoned after an earlier error";
        }
        event_pool::for_device(m_options.device).release_raw(f.done);
        slot& sl = *m_slots[f.slot];
        if (error.empty()) {
            record_timing(f);
            ++m_stats.gpu_chunks;
            ++m_stats.chunks;
            co_return result(this, f.slot, f.chunk, f.output_count, false);
        }
        if (sticky) {
            m_gpu_abandoned = true;
        }
        report(f, 2, m_fallback ? "handed to the fallback" : "failed (no fallback)", error);
        ++m_stats.chunks;
        if (!m_fallback) {
            ++m_stats.failed_chunks;
            give_back(f.slot);
            throw pipeline_error("pipeline: chunk " + std::to_string(f.chunk) + " failed: " + error,
                                 {}, {f.chunk});
        }
        try {
            trace_range r("fallback", f.chunk);
            m_fallback(f.chunk, std::span<const In>(sl.host_in.data(), f.count),
                       sl.host_out.span().first(f.output_count));
        } catch (...) {
            ++m_stats.failed_chunks;
            give_back(f.slot);
            throw;
        }
        ++m_stats.fallback_chunks;
        co_return result(this, f.slot, f.chunk, f.output_count, true);
    }

    /// No more submissions; next() returns what is queued, then std::nullopt, which ends the
    /// streaming session.
    void close() {
        m_closed = true;
        m_result_ready.notify_all();
        m_slot_freed.notify_all();
    }

    [[nodiscard]] pipeline_stats stats() const {
        pipeline_stats s = m_stats;
        s.depth = m_active_depth;
        s.gpu_abandoned = m_gpu_abandoned;
        s.link_peak_gbps = m_link_peak;
        s.h2d_gbps =
            s.h2d_seconds > 0 ? static_cast<double>(s.input_bytes) / s.h2d_seconds / 1e9 : 0;
        s.d2h_gbps =
            s.d2h_seconds > 0 ? static_cast<double>(s.output_bytes) / s.d2h_seconds / 1e9 : 0;
        s.throughput_gbps =
            s.wall_seconds > 0 ? static_cast<double>(s.input_bytes) / s.wall_seconds / 1e9 : 0;
        double transfer = std::max(s.h2d_seconds, s.d2h_seconds);
        s.compute_to_transfer = transfer > 0 ? s.compute_seconds / transfer : 0;
        double longest = std::max(transfer, s.compute_seconds);
        s.overlap_efficiency = s.wall_seconds > 0 && longest > 0 ? longest / s.wall_seconds : 0;
        return s;
    }

    /// A chunk size (input elements) from the last run's measurements (needs `timing`):
    /// - a compute:transfer ratio above 3 (kernels dominate): half the chunk, so that the
    ///   pipeline fills sooner and overlaps more finely;
    /// - below 1.5 with chunks whose copy takes under 1 ms: twice the chunk, so that fixed
    ///   per-chunk costs (launches, event waits) weigh less; a copy-bound pipeline with larger
    ///   chunks than that gains nothing from growing them;
    /// - otherwise the current size. Never below ~50 us of transfer, never above 256 MiB.
    [[nodiscard]] std::size_t suggest_chunk_size() const {
        pipeline_stats s = stats();
        std::size_t chunk = m_options.chunk_elements;
        if (s.compute_to_transfer <= 0 || s.chunks == 0) {
            return chunk;
        }
        double per_chunk_copy = std::max(s.h2d_seconds, s.d2h_seconds) /
                                static_cast<double>(std::max<std::size_t>(1, s.gpu_chunks));
        std::size_t suggested = chunk;
        if (s.compute_to_transfer > 3.0) {
            suggested = chunk / 2;
        } else if (s.compute_to_transfer < 1.5 && per_chunk_copy < 1e-3) {
            suggested = chunk * 2;
        }
        double peak = m_link_peak > 0 ? m_link_peak : 25.0;
        auto floor_elems =
            std::max<std::size_t>(1, static_cast<std::size_t>(peak * 1e9 * 50e-6) / sizeof(In));
        std::size_t ceiling = std::max<std::size_t>(1, (std::size_t{256} << 20) / sizeof(In));
        return std::clamp(suggested, std::min(floor_elems, chunk), std::max(ceiling, chunk));
    }

    [[nodiscard]] const pipeline_options& options() const noexcept { return m_options; }

    /// The stream chunks are copied to the device on. The streams are exposed for inspection
    /// (priorities, names in a profiler); work enqueued on them delays the pipeline's.
    [[nodiscard]] stream_ref h2d_stream() const noexcept { return m_h2d; }
    /// The stream outputs are copied back on.
    [[nodiscard]] stream_ref d2h_stream() const noexcept { return m_d2h; }
    /// Compute stream `i` (chunks take them in turn); graph replays run on per-slot streams of
    /// the same priority.
    /// @throws usage_error when i >= options().compute_streams
    [[nodiscard]] stream_ref compute_stream(std::size_t i) const {
        if (i >= m_compute.size()) {
            throw usage_error("pipeline::compute_stream: index out of range");
        }
        return m_compute[i];
    }

private:
    static pipeline_options validated(pipeline_options o) {
        if (o.chunk_elements == 0) {
            throw usage_error("pipeline: chunk_elements must be non-zero");
        }
        if (o.depth == 0 || o.compute_streams == 0) {
            throw usage_error("pipeline: depth and compute_streams must be at least 1");
        }
        if (o.output_elements == 0) {
            o.output_elements = o.chunk_elements;
        }
        if (o.queue_capacity == 0) {
            o.queue_capacity = (2 + std::size_t{o.compute_streams}) * 2;
        }
        return o;
    }
    static std::vector<stage> checked(std::vector<stage> stages) {
        if (stages.empty() ||
            std::any_of(stages.begin(), stages.end(), [](const stage& s) { return !s; })) {
            throw usage_error("pipeline: at least one stage, and no empty ones");
        }
        if (stages.size() > 1 && !std::is_same_v<In, Out>) {
            throw usage_error("pipeline: stages are chained (each reads the previous one's "
                              "output), which needs In == Out; with In != Out pass one stage, "
                              "which may launch several kernels");
        }
        return stages;
    }
    int transfer_priority() const {
        return m_options.transfer_priority.value_or(priority_low(device_ref(m_options.device)));
    }

    struct slot {
        explicit slot(pipeline& p)
            : owner(&p), dev_in(p.m_options.chunk_elements, p.m_h2d),
              dev_out(p.m_options.output_elements, p.m_h2d),
              dev_mid(p.m_stages.size() > 1
                          ? device_buffer<Out>(p.m_options.output_elements, p.m_h2d)
                          : device_buffer<Out>()),
              h2d_done(device_ref(p.m_options.device)),
              compute_done(device_ref(p.m_options.device)),
              d2h_done(device_ref(p.m_options.device)),
              graph_stream(device_ref(p.m_options.device), p.m_compute.front().priority()) {}
        slot(const slot&) = delete;
        slot& operator=(const slot&) = delete;
        ~slot() {
            if (graph_exec != nullptr) {
                detail::report(cudaGraphExecDestroy(graph_exec), "cudaGraphExecDestroy");
            }
            if (graph != nullptr) {
                detail::report(cudaGraphDestroy(graph), "cudaGraphDestroy");
            }
        }
        void ensure_host_buffers() {
            if (!host_in) {
                host_in = pinned_buffer<In>(owner->m_options.chunk_elements, *owner->m_pool);
            }
            if (!host_out) {
                host_out = pinned_buffer<Out>(owner->m_options.output_elements, *owner->m_pool);
            }
        }

        pipeline* owner;
        device_buffer<In> dev_in;
        device_buffer<Out> dev_out;
        device_buffer<Out> dev_mid; // chained stages: the outputs alternate with dev_out
        pinned_buffer<In> host_in;  // staging, streaming and graph placeholders only
        pinned_buffer<Out> host_out;
        event h2d_done;
        event compute_done;
        event d2h_done;
        stream graph_stream;
        cudaGraph_t graph = nullptr;
        cudaGraphExec_t graph_exec = nullptr;
        cudaGraphNode_t h2d_node = nullptr;
        cudaGraphNode_t d2h_node = nullptr;
    };

    struct flight {
        std::size_t chunk = 0;
        std::size_t offset = 0; // input elements
        std::size_t count = 0;
        std::size_t output_count = 0;
        std::size_t slot = 0;
        cudaEvent_t done = nullptr;
        std::size_t timing_set = 0;
        bool timed = false;
        bool by_fallback = false;
        bool sticky = false;
        std::string enqueue_error;
        Out* staged_out = nullptr; // batch with pageable output: copy from the slot here
    };

    enum class chunk_state { pending, gpu, fallback, failed };

    std::vector<stream*> all_streams() {
        std::vector<stream*> v{&m_h2d, &m_d2h};
        for (auto& s : m_compute) {
            v.push_back(&s);
        }
        for (auto& sl : m_slots) {
            v.push_back(&sl->graph_stream);
        }
        return v;
    }

    void give_back(std::size_t i) {
        m_free_slots.push_back(i);
        m_slot_freed.notify_all();
    }

    void begin_session() {
        m_session_open = true;
        m_closed = false;
        m_stream_seq = 0;
        m_stats = {};
        m_window.clear();
    }
    void end_session() {
        m_session_open = false;
        m_closed = false;
        ++m_sessions_ended;
    }

    flight make_flight(std::size_t chunk, std::size_t offset, std::size_t count, std::size_t s) {
        flight f;
        f.chunk = chunk;
        f.offset = offset;
        f.count = count;
        f.output_count = output_count(count);
        f.slot = s;
        if (!m_timing.empty()) {
            f.timing_set = m_timing_seq++ % m_timing.size();
        }
        f.done = event_pool::for_device(m_options.device).acquire_raw();
        return f;
    }

    void report(const flight& f, int level, const std::string& action, const std::string& error) {
        chunk_failure c{f.chunk,
                        f.offset,
                        f.count,
                        f.output_count,
                        m_active_depth,
                        m_options.compute_streams,
                        m_options.device,
                        m_options.graph,
                        level,
                        action,
                        error};
        if (m_options.on_degrade) {
            m_options.on_degrade(c);
        } else {
            std::fprintf(stderr,
                         "cudawait pipeline: chunk %zu (elements %zu..%zu, %zu out) level %d: %s; "
                         "depth %u, %u compute stream(s), device %d%s: %s\n",
                         c.chunk, c.offset, c.offset + c.elements, c.output_elements, c.level,
                         c.action.c_str(), c.depth, c.compute_streams, c.device,
                         c.graph ? ", graph" : "", c.error.c_str());
        }
    }

    // Launches the stages for a chunk of `count` inputs and `out_count` outputs on `s`, chained:
    // stage 0 reads dev_in, each later one the previous one's output; the destinations alternate
    // between dev_mid and dev_out so that the last stage writes dev_out. A slot's next chunk
    // reaches its stages only after this one's finished (its H2D waits for compute_done), so
    // dev_mid needs no event of its own.
    void launch_stages(slot& sl, std::size_t count, std::size_t out_count, stream_ref s,
                       bool check_launches) {
        std::span<In> din(sl.dev_in.data(), count);
        std::span<Out> dout(sl.dev_out.data(), out_count);
        if (m_stages.size() == 1) {
            m_stages.front()(din, dout, s);
            if (check_launches) {
                check(cudaGetLastError(), "pipeline stage launch");
            }
            return;
        }
        if constexpr (std::is_same_v<In, Out>) { // several stages need it (checked())
            std::span<Out> dmid(sl.dev_mid.data(), out_count);
            const std::size_t n = m_stages.size();
            std::span<In> src = din;
            for (std::size_t i = 0; i < n; ++i) {
                std::span<Out> dst = (n - 1 - i) % 2 == 0 ? dout : dmid;
                m_stages[i](src, dst, s);
                if (check_launches) {
                    check(cudaGetLastError(), "pipeline stage launch");
                }
                src = dst;
            }
        }
    }

    // Enqueues one chunk: H2D from `src`, the stages, D2H to `dst`; records f.done after it.
    void enqueue(flight& f, const In* src, Out* dst) {
        slot& sl = *m_slots[f.slot];
        f.timed = !m_timing.empty();
        std::vector<event>* t = f.timed ? &m_timing[f.timing_set] : nullptr;
        bool full = f.count == m_options.chunk_elements;
        if (m_options.graph && full) {
            enqueue_graph(f, sl, src, dst, t);
            return;
        }
        stream_ref cs = m_compute[m_compute_next++ % m_compute.size()];
        {
            trace_range r("h2d", f.chunk);
            m_h2d.wait(sl.compute_done.get()); // the previous chunk's stages read dev_in
            if (f.timed) {
                (*t)[0].record(m_h2d);
            }
            check(cudaMemcpyAsync(sl.dev_in.data(), src, f.count * sizeof(In),
                                  cudaMemcpyHostToDevice, m_h2d.get()),
                  "cudaMemcpyAsync");
            if (f.timed) {
                (*t)[1].record(m_h2d);
            }
            sl.h2d_done.record(m_h2d);
        }
        {
            trace_range r("compute", f.chunk);
            cs.wait(sl.h2d_done.get());
            cs.wait(sl.d2h_done.get()); // the previous chunk's D2H read dev_out
            if (f.timed) {
                (*t)[2].record(cs);
            }
            try {
                launch_stages(sl, f.count, f.output_count, cs, true);
            } catch (...) {
                // Whatever the stages did launch must finish before the slot is reused.
                (void)cudaEventRecord(sl.compute_done.get(), cs.get());
                throw;
            }
            if (f.timed) {
                (*t)[3].record(cs);
            }
            sl.compute_done.record(cs);
        }
        {
            trace_range r("d2h", f.chunk);
            m_d2h.wait(sl.compute_done.get());
            if (f.timed) {
                (*t)[4].record(m_d2h);
            }
            check(cudaMemcpyAsync(dst, sl.dev_out.data(), f.output_count * sizeof(Out),
                                  cudaMemcpyDeviceToHost, m_d2h.get()),
                  "cudaMemcpyAsync");
            if (f.timed) {
                (*t)[5].record(m_d2h);
            }
            sl.d2h_done.record(m_d2h);
            check(cudaEventRecord(f.done, m_d2h.get()), "cudaEventRecord");
        }
    }

    // The memcpy nodes are built with the first chunk's host pointers; later chunks set theirs.
    void build_graph(slot& sl, const In* src, Out* dst) {
        check(cudaGraphCreate(&sl.graph, 0), "cudaGraphCreate");
        std::size_t in_bytes = m_options.chunk_elements * sizeof(In);
        std::size_t out_bytes = m_options.output_elements * sizeof(Out);
        check(cudaGraphAddMemcpyNode1D(&sl.h2d_node, sl.graph, nullptr, 0, sl.dev_in.data(), src,
                                       in_bytes, cudaMemcpyHostToDevice),
              "cudaGraphAddMemcpyNode1D");
        stream capture(device_ref(m_options.device), 0);
        check(cudaStreamBeginCapture(capture.get(), cudaStreamCaptureModeThreadLocal),
              "cudaStreamBeginCapture");
        cudaGraph_t stages = nullptr;
        try {
            launch_stages(sl, m_options.chunk_elements, m_options.output_elements, capture, false);
        } catch (...) {
            (void)cudaStreamEndCapture(capture.get(), &stages);
            if (stages != nullptr) {
                (void)cudaGraphDestroy(stages);
            }
            throw;
        }
        check(cudaStreamEndCapture(capture.get(), &stages), "cudaStreamEndCapture");
        cudaGraphNode_t kernels = nullptr;
        cudaError_t st = cudaGraphAddChildGraphNode(&kernels, sl.graph, &sl.h2d_node, 1, stages);
        detail::report(cudaGraphDestroy(stages), "cudaGraphDestroy");
        check(st, "cudaGraphAddChildGraphNode");
        check(cudaGraphAddMemcpyNode1D(&sl.d2h_node, sl.graph, &kernels, 1, dst, sl.dev_out.data(),
                                       out_bytes, cudaMemcpyDeviceToHost),
              "cudaGraphAddMemcpyNode1D");
        check(cudaGraphInstantiate(&sl.graph_exec, sl.graph, 0), "cudaGraphInstantiate");
    }

    void enqueue_graph(flight& f, slot& sl, const In* src, Out* dst, std::vector<event>* t) {
        trace_range r("graph", f.chunk);
        if (sl.graph_exec == nullptr) {
            build_graph(sl, src, dst);
        }
        // The addresses of the host ends change per chunk; the device ones are the slot's.
        check(cudaGraphExecMemcpyNodeSetParams1D(sl.graph_exec, sl.h2d_node, sl.dev_in.data(), src,
                                                 f.count * sizeof(In), cudaMemcpyHostToDevice),
              "cudaGraphExecMemcpyNodeSetParams1D");
        check(cudaGraphExecMemcpyNodeSetParams1D(sl.graph_exec, sl.d2h_node, dst, sl.dev_out.data(),
                                                 f.output_count * sizeof(Out),
                                                 cudaMemcpyDeviceToHost),
              "cudaGraphExecMemcpyNodeSetParams1D");
        stream& gs = sl.graph_stream;
        // Plain-path work on this slot (a short chunk) must be done first.
        gs.wait(sl.compute_done.get());
        gs.wait(sl.d2h_done.get());
        if (f.timed) {
            (*t)[0].record(gs);
        }
        check(cudaGraphLaunch(sl.graph_exec, gs.get()), "cudaGraphLaunch");
        if (f.timed) {
            (*t)[5].record(gs);
        }
        sl.h2d_done.record(gs);
        sl.compute_done.record(gs);
        sl.d2h_done.record(gs);
        check(cudaEventRecord(f.done, gs.get()), "cudaEventRecord");
    }

    void record_timing(const flight& f) {
        m_stats.input_bytes += f.count * sizeof(In);
        m_stats.output_bytes += f.output_count * sizeof(Out);
        if (!f.timed) {
            return;
        }
        std::vector<event>& t = m_timing[f.timing_set];
        auto elapsed = [&](int a, int b) {
            float ms = 0;
            check(cudaEventElapsedTime(&ms, t[static_cast<std::size_t>(a)].get(),
                                       t[static_cast<std::size_t>(b)].get()),
                  "cudaEventElapsedTime");
            return static_cast<double>(ms) * 1e-3;
        };
        if (m_options.graph && f.count == m_options.chunk_elements) {
            // A replayed graph is timed as a whole; its stages are not split, so stage times and
            // bandwidths come from plain mode only.
            m_stats.graph_seconds += elapsed(0, 5);
            return;
        }
        double h2d = elapsed(0, 1);
        double comp = elapsed(2, 3);
        double d2h = elapsed(4, 5);
        m_stats.h2d_seconds += h2d;
        m_stats.compute_seconds += comp;
        m_stats.d2h_seconds += d2h;
        if (h2d <= 0 || d2h <= 0 || m_link_peak <= 0) {
            return;
        }
        m_window.push_back({f.count * sizeof(In), h2d, f.output_count * sizeof(Out), d2h});
        if (m_window.size() < m_options.alert_window) {
            return;
        }
        double bin = 0, tin = 0, bout = 0, tout = 0;
        for (auto& w : m_window) {
            bin += static_cast<double>(w.in_bytes);
            tin += w.h2d;
            bout += static_cast<double>(w.out_bytes);
            tout += w.d2h;
        }
        m_window.clear();
        double limit = m_options.alert_fraction * m_link_peak;
        for (auto [dir, gbps] :
             {std::pair{"h2d", bin / tin / 1e9}, std::pair{"d2h", bout / tout / 1e9}}) {
            if (gbps < limit) {
                ++m_stats.alerts;
                if (m_options.on_alert) {
                    m_options.on_alert(
                        pipeline_alert{dir, gbps, m_link_peak, m_options.alert_window});
                }
            }
        }
    }

    struct window_entry {
        std::size_t in_bytes;
        double h2d;
        std::size_t out_bytes;
        double d2h;
    };

    // ---- the batch ------------------------------------------------------------------------

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
        [[nodiscard]] bool runahead() const noexcept { return pinned_in && pinned_out; }
    };

    [[nodiscard]] std::span<const In> chunk_in(const batch& b, std::size_t c) const {
        std::size_t off = c * m_options.chunk_elements;
        return b.in.subspan(off, std::min(m_options.chunk_elements, b.in.size() - off));
    }
    [[nodiscard]] std::span<Out> chunk_out(const batch& b, std::size_t c) const {
        std::size_t off = c * m_options.output_elements;
        return b.out.subspan(off, output_count(chunk_in(b, c).size()));
    }

    void run_fallback(batch& b, std::size_t c) {
        if (!m_fallback) {
            b.state[c] = chunk_state::failed;
            ++m_stats.failed_chunks;
            return;
        }
        trace_range r("fallback", c);
        m_fallback(c, chunk_in(b, c), chunk_out(b, c));
        b.state[c] = chunk_state::fallback;
        ++m_stats.fallback_chunks;
    }

    // Starts chunk c on the GPU (staging its input if needed).
    void start_chunk(batch& b, std::size_t c) {
        std::span<const In> in = chunk_in(b, c);
        std::span<Out> out = chunk_out(b, c);
        // With pinned host ranges the GPU alone orders slot reuse (event waits), so the host runs
        // ahead round robin. With staging, the slot's host buffers must be free: any slot
        // without a chunk in flight (after a depth change it need not be below the new depth).
        std::size_t s = 0;
        if (b.runahead()) {
            s = b.next_slot++ % m_active_depth;
        } else {
            while (b.busy[s]) {
                ++s;
            }
        }
        slot& sl = *m_slots[s];
        flight f = make_flight(c, c * m_options.chunk_elements, in.size(), s);
        try {
            const In* src = in.data();
            Out* dst = out.data();
            if (!b.runahead()) {
                sl.ensure_host_buffers();
            }
            if (!b.pinned_in) {
                // The slot's previous chunk has retired (in flight <= depth), so its H2D is done.
                trace_range r("stage-in", c);
                detail::memcpy_workers::instance().copy(sl.host_in.data(), in.data(),
                                                        in.size_bytes());
                src = sl.host_in.data();
            }
            if (!b.pinned_out) {
                dst = sl.host_out.data();
                f.staged_out = out.data();
            }
            enqueue(f, src, dst);
        } catch (...) {
            event_pool::for_device(m_options.device).release_raw(f.done);
            throw;
        }
        b.busy[s] = true;
        b.inflight.push_back(std::move(f));
    }

    // The oldest chunk in flight completed on the GPU: its output goes in place.
    void finish(batch& b, flight& f) {
        if (f.staged_out != nullptr) {
            trace_range r("stage-out", f.chunk);
            detail::memcpy_workers::instance().copy(f.staged_out, m_slots[f.slot]->host_out.data(),
                                                    f.output_count * sizeof(Out));
        }
        record_timing(f);
        b.state[f.chunk] = chunk_state::gpu;
        ++m_stats.gpu_chunks;
    }

    // The context is gone: nothing in flight can complete or write any more.
    void abandon_gpu(batch& b, const std::string& why) {
        m_gpu_abandoned = true;
        // Every event goes back before any fallback runs: one that throws leaves none out.
        std::deque<flight> lost;
        lost.swap(b.inflight);
        for (flight& f : lost) {
            b.busy[f.slot] = false;
            event_pool::for_device(m_options.device).release_raw(f.done);
        }
        for (flight& f : lost) {
            report(f, 2, m_fallback ? "handed to the fallback (GPU lost)" : "failed (GPU lost)",
                   why);
            run_fallback(b, f.chunk);
        }
    }

    // After an exception (from the fallback, a callback, a stage): the chunks still in flight
    // must stop writing the caller's memory before run() passes it on, and their events go back
    // to the pool. One that times out may still land: its event stays out until destruction.
    task<void> drain(batch& b) {
        while (!b.inflight.empty()) {
            flight& f = b.inflight.front();
            bool landed = true;
            try {
                if (m_options.chunk_timeout.count() > 0) {
                    co_await with_timeout(event_ref(f.done), m_options.chunk_timeout);
                } else {
                    co_await event_ref(f.done);
                }
            } catch (const timeout_error&) {
                landed = false;
            } catch (const cuda_error&) {
                m_gpu_abandoned = true; // the context is gone: nothing can complete any more
            } catch (...) {
                landed = false; // not known to have landed
            }
            if (landed) {
                event_pool::for_device(m_options.device).release_raw(f.done);
            } else {
                m_abandoned_events.push_back(f.done);
            }
            b.busy[f.slot] = false;
            b.inflight.pop_front();
        }
    }

    task<void> run_batch(std::span<const In> in, std::span<Out> out, bool pinned_in,
                         bool pinned_out) {
        if (m_session_open || !m_submitted.empty() || m_free_slots.size() != m_slots.size()) {
            throw usage_error("pipeline::run: a streaming session is open (slots or results held, "
                              "chunks not yet taken, or next() has not returned the end after "
                              "close())");
        }
        if (m_batch_running) {
            throw usage_error("pipeline::run: another batch is running");
        }
        m_batch_running = true;
        struct running_flag {
            bool* flag;
            ~running_flag() { *flag = false; }
        } guard{&m_batch_running};

        batch b{in, out, pinned_in, pinned_out, {}, {}, {}, std::vector<bool>(m_slots.size())};
        std::size_t n = (in.size() + m_options.chunk_elements - 1) / m_options.chunk_elements;
        b.state.assign(n, chunk_state::pending);
        b.attempts.assign(n, 0);
        m_stats = {};
        m_window.clear();
        auto t0 = std::chrono::steady_clock::now();
        std::size_t next = 0;
        std::exception_ptr failure;
        try {
            while (next < n || !b.inflight.empty()) {
                if (next < n && m_gpu_abandoned) {
                    run_fallback(b, next++);
                    continue;
                }
                std::size_t limit =
                    b.runahead() ? runahead_factor * m_active_depth : m_active_depth;
                if (next < n && b.inflight.size() < limit) {
                    std::string error;
                    bool sticky = false;
                    try {
                        start_chunk(b, next);
                        ++next;
                        continue;
                    } catch (const cuda_error& e) {
                        error = e.what();
                        sticky = e.sticky();
                    }
                    flight f;
                    f.chunk = next;
                    f.offset = next * m_options.chunk_elements;
                    f.count = chunk_in(b, next).size();
                    f.output_count = output_count(f.count);
                    if (sticky) {
                        report(f, 2, "GPU lost", error);
                        abandon_gpu(b, error);
                        continue;
                    }
                    if (++b.attempts[next] <= m_options.max_retries) {
                        // Level 1: let everything in flight finish, then retry with one slot fewer.
                        ++m_stats.retries;
                        while (!b.inflight.empty()) {
                            co_await retire(b);
                        }
                        m_active_depth = std::max(1u, m_active_depth - 1);
                        report(f, 1, "retrying with depth " + std::to_string(m_active_depth),
                               error);
                        continue;
                    }
                    report(f, 2, m_fallback ? "handed to the fallback" : "failed (no fallback)",
                           error);
                    run_fallback(b, next++);
                    continue;
                }
                co_await retire(b);
            }
        } catch (...) {
            failure = std::current_exception();
        }
        if (failure) {
            co_await drain(b); // not in the handler: a handler cannot co_await
            std::rethrow_exception(failure);
        }
        auto t1 = std::chrono::steady_clock::now();
        m_stats.chunks = n;
        m_stats.wall_seconds = std::chrono::duration<double>(t1 - t0).count();
        if (m_stats.failed_chunks != 0) {
            std::vector<std::size_t> completed;
            std::vector<std::size_t> failed;
            for (std::size_t c = 0; c < n; ++c) {
                (b.state[c] == chunk_state::failed ? failed : completed).push_back(c);
            }
            throw detail::batch_failed(std::move(completed), std::move(failed));
        }
    }

    // Waits for the oldest chunk in flight and completes it, degrading on errors and timeouts.
    task<void> retire(batch& b) {
        flight& f = b.inflight.front();
        std::string error;
        bool sticky = false;
        {
            // Spans the await: a start/end range, which other coroutines' ranges cannot close.
            trace_async_range r("wait", f.chunk);
            try {
                if (m_options.chunk_timeout.count() > 0) {
                    co_await with_timeout(event_ref(f.done), m_options.chunk_timeout);
                } else {
                    co_await event_ref(f.done);
                }
            } catch (const timeout_error& e) {
                error = e.what();
            } catch (const cuda_error& e) {
                error = e.what();
                sticky = true; // an error seen while waiting comes from the device: context lost
            }
        }
        if (error.empty()) {
            finish(b, f);
            b.busy[f.slot] = false;
            event_pool::for_device(m_options.device).release_raw(f.done);
            b.inflight.pop_front();
            co_return;
        }
        if (sticky) {
            abandon_gpu(b, error);
            co_return;
        }
        // Timed out. The work cannot be cancelled, so it is waited for again, with less
        // concurrency for what follows; past the retries the chunk is given up.
        if (++b.attempts[f.chunk] <= m_options.max_retries) {
            ++m_stats.retries;
            m_active_depth = std::max(1u, m_active_depth - 1);
            report(f, 1, "waiting again; depth lowered to " + std::to_string(m_active_depth),
                   error);
            co_return;
        }
        // Level 2: the GPU may still write these chunks' outputs later, so neither the fallback
        // nor anything else writes them; they are reported failed, and their events stay out of
        // the pool (a late completion must not signal a reused event).
        m_gpu_abandoned = true;
        std::deque<flight> lost;
        lost.swap(b.inflight);
        for (flight& g : lost) {
            b.state[g.chunk] = chunk_state::failed;
            ++m_stats.failed_chunks;
            m_abandoned_events.push_back(g.done);
        }
        for (flight& g : lost) {
            report(g, 2, "failed (timed out; its copy may still land)", error);
        }
    }

    /// Chunks in flight per slot when the host may run ahead (pinned host ranges).
    static constexpr std::size_t runahead_factor = 4;

    pipeline_options m_options;
    std::vector<stage> m_stages;
    fallback m_fallback;
    pinned_pool* m_pool = nullptr;
    stream m_h2d;
    stream m_d2h;
    std::vector<stream> m_compute;
    std::vector<std::unique_ptr<slot>> m_slots;
    std::deque<std::size_t> m_free_slots;
    std::deque<flight> m_submitted;
    std::vector<cudaEvent_t> m_abandoned_events;
    detail::wait_list m_slot_freed;
    detail::wait_list m_result_ready;
    std::vector<window_entry> m_window;
    std::vector<std::vector<event>> m_timing; // per chunk in flight: h2d, compute, d2h start/end
    std::size_t m_timing_seq = 0;
    pipeline_stats m_stats;
    double m_link_peak = 0;
    unsigned m_active_depth = 1;
    std::size_t m_compute_next = 0;
    std::size_t m_stream_seq = 0;
    bool m_gpu_abandoned = false;
    std::size_t m_sessions_ended = 0;
    bool m_closed = false;       // close() called, and next() has not returned the end yet
    bool m_session_open = false; // from acquire() until next() returned the end after close()
    bool m_batch_running = false;
};

} // namespace cudawait
