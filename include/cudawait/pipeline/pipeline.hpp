// SPDX-License-Identifier: Apache-2.0
#pragma once

// Synopsis
//   pipeline<float> pipe(options, {stage...}, fallback);   options.hpp; stages: stage.hpp
//     fallback: void(std::size_t chunk, std::span<const float> in, std::span<float> out)
//   Batch:      co_await pipe.run(host_in, host_out);
//   Streaming:  auto slot = co_await pipe.acquire();  fill(slot.data());
//               pipe.submit(std::move(slot), n);   or   pipe.submit(std::move(slot), in, out);
//               while (auto r = co_await pipe.next()) use(r->data());  // submission order
//               pipe.close();  co_await pipe.acquire(50ms);  co_await pipe.next(deadline);
//   Afterwards: pipe.stats(), pipe.failures(), pipe.write_report(path)
//
// An N-buffered H2D -> stages -> D2H pipeline over chunks; every chunk is produced once or
// reported failed. A streaming session and batches exclude each other. See docs/pipeline.md.

#include <cudawait/copy/detail/link_peak.hpp>
#include <cudawait/core/task.hpp>
#include <cudawait/memory/memory_kind.hpp>
#include <cudawait/pipeline/detail/batch.hpp>
#include <cudawait/pipeline/detail/slots.hpp>
#include <cudawait/pipeline/detail/stream.hpp>
#include <cudawait/pipeline/options.hpp>
#include <cudawait/pipeline/report.hpp>
#include <cudawait/pipeline/stage.hpp>
#include <cudawait/runtime/detail/chrono.hpp>
#include <cudawait/runtime/error.hpp>
#include <cudawait/runtime/stream.hpp>

#include <algorithm>
#include <cstddef>
#include <optional>
#include <ostream>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace cudawait {

template <class In, class Out>
class multi_pipeline;

/// An N-buffered H2D -> stages -> D2H pipeline over chunks of `In`, producing `Out`.
///
/// Not thread-safe: drive one pipeline from one scheduler's coroutines. Destruction waits for
/// the GPU work in flight.
template <class In, class Out = In>
class pipeline {
    static_assert(std::is_trivially_copyable_v<In> && std::is_trivially_copyable_v<Out>);
    using core = detail::pipeline_core<In, Out>;

public:
    /// Launches a chunk's kernels on `ctx.stream` (or, the older form, on the stream it is
    /// given); see pipeline/stage.hpp. Stages are chained: `in` is the chunk's device input for
    /// the first stage and the previous stage's output for the others.
    using stage = typename core::stage;
    /// Computes chunk `chunk` on the host when the GPU cannot.
    using fallback = typename core::fallback;
    /// A slot the producer fills before submit(); given back unused if dropped.
    using input_slot = detail::pipeline_input_slot<In, Out>;
    /// A chunk's output, in submission order; the slot is reused once this is destroyed (in a
    /// grouped pipeline, once every chunk of its slot group was given back).
    using result = detail::pipeline_result<In, Out>;

    /// @throws usage_error for options that validate() refuses (pipeline_options), no stages or
    ///         an empty one, or several stages with In != Out; cuda_error
    pipeline(pipeline_options options, std::vector<stage> stages, fallback on_gpu_failure = {})
        : m_core(std::move(options), std::move(stages), std::move(on_gpu_failure)), m_batch(m_core),
          m_stream(m_core) {}

    pipeline(const pipeline&) = delete;
    pipeline& operator=(const pipeline&) = delete;

    ~pipeline() {
        // The GPU work first: the chunks still queued give their events back as the drivers go.
        m_core.synchronize();
    }

    /// Output elements for `inputs` input elements in chunks (for one chunk: its output count).
    [[nodiscard]] std::size_t output_size(std::size_t inputs) const noexcept {
        const pipeline_options& o = m_core.options;
        std::size_t full = inputs / o.chunk_elements;
        std::size_t rest = inputs % o.chunk_elements;
        return full * o.output_elements + (rest != 0 ? m_core.output_count(rest) : 0);
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
        return m_batch.run(in, out, kin == memory_kind::pinned, kout == memory_kind::pinned);
    }

    /// Waits for a free slot (every slot busy, or the submission queue full: back pressure).
    /// On an idle pipeline it begins a streaming session (stats() and chunk numbers start anew).
    /// @throws usage_error after close() until next() returned the end, or during a batch run
    [[nodiscard]] task<input_slot> acquire() { return m_stream.acquire(); }

    /// acquire() that gives up after `timeout` (from this call): no slot is taken then.
    /// Zero polls (a slot free now, else the error).
    /// @throws usage_error for a negative timeout (at the call) and as acquire();
    ///         timeout_error (after() == timeout) once it passed
    [[nodiscard]] task<input_slot> acquire(std::chrono::nanoseconds timeout) {
        return m_stream.acquire(deadline_after(timeout, "acquire"), timeout);
    }
    /// acquire() that gives up at `deadline`; one already passed polls.
    /// @throws usage_error as acquire(); timeout_error (after(): the time left at the call)
    [[nodiscard]] task<input_slot> acquire(std::chrono::steady_clock::time_point deadline) {
        return m_stream.acquire(deadline, time_left(deadline));
    }

    /// Starts the slot's chunk of `count` elements (at most chunk_elements) on the GPU; in a
    /// grouped pipeline it may be held back to go with the next chunks
    /// (docs/pipeline.md#streaming-in-groups).
    /// @throws usage_error for an empty slot, a bad count, or after close() (the slot is then
    ///         still the caller's); cuda_error
    void submit(input_slot&& s, std::size_t count) { m_stream.submit(std::move(s), count); }

    /// Submits the slot's chunk with its input read from `in` and its output written into `out`
    /// (out.size() == output_size(in.size()), 1 <= in.size() <= chunk_elements) instead of the
    /// slot's pinned buffers. Page-locked spans (pinned, registered, mapped) are copied from and
    /// to directly; a pageable one goes through the slot's pinned buffer (a memcpy on this thread
    /// now, for `in`; when next() delivers the chunk, for `out`). Both spans must stay valid, and
    /// `in` unchanged, until next() delivered the chunk; its result's data() is `out`. A failed
    /// chunk goes to the fallback with `in` and `out`.
    /// @throws usage_error for an empty slot, empty/null/too long `in`, a mis-sized or null
    ///         `out`, device memory, or after close() (the slot is then still the caller's);
    ///         cuda_error
    void submit(input_slot&& s, std::span<const In> in, std::span<Out> out) {
        m_stream.submit(std::move(s), in, out);
    }

    /// The next chunk's output, in submission order; std::nullopt once closed and drained,
    /// which ends the streaming session (a later call waits for the next session's chunks).
    /// @throws pipeline_error when the chunk failed and no fallback took it; what the fallback
    ///         throws (the chunk is then counted failed); what on_degrade throws when the chunk
    ///         is waited for again (it then stays first in line)
    [[nodiscard]] task<std::optional<result>> next() { return m_stream.next(); }

    /// next() that gives up after `timeout` (from this call): the chunk it waited for is not
    /// consumed (a later next() returns it, in order). Zero polls (a chunk complete now, else
    /// the error). chunk_timeout still applies within it (level 1, as next()).
    /// @throws usage_error for a negative timeout (at the call); timeout_error (after() ==
    ///         timeout) once it passed; as next()
    [[nodiscard]] task<std::optional<result>> next(std::chrono::nanoseconds timeout) {
        return m_stream.next(deadline_after(timeout, "next"), timeout);
    }
    /// next() that gives up at `deadline`; one already passed polls.
    /// @throws timeout_error (after(): the time left at the call); as next()
    [[nodiscard]] task<std::optional<result>> next(std::chrono::steady_clock::time_point deadline) {
        return m_stream.next(deadline, time_left(deadline));
    }

    /// No more submissions; next() returns what is queued, then std::nullopt, which ends the
    /// streaming session. Chunks held back (chunk groups) go to the GPU now; what on_degrade
    /// throws meanwhile is thrown by the next call of next().
    void close() { m_stream.close(); }

    /// What the last batch run (or the streaming session so far) achieved.
    [[nodiscard]] pipeline_stats stats() const {
        return m_core.monitor.stats(m_core.active_depth, m_core.gpu_abandoned);
    }

    /// The degradation records of the last batch run (or the streaming session so far), oldest
    /// first: the last 256 of them. Valid until the next degradation or run.
    [[nodiscard]] std::span<const chunk_failure> failures() const noexcept {
        return m_core.monitor.failures();
    }

    /// Writes the post-mortem report (options, stats, failures(), device) as JSON; see
    /// pipeline/report.hpp.
    /// @throws what writing to `out` throws
    void write_report(std::ostream& out) const {
        cudawait::write_report(out, options(), stats(), failures());
    }
    /// Writes the report into the file `path` (replacing it).
    /// @throws std::runtime_error when the file cannot be opened or written
    void write_report(const std::string& path) const {
        cudawait::write_report(path, options(), stats(), failures());
    }

    /// A chunk size (input elements) from the last run's measurements (needs `timing`):
    /// - a compute:transfer ratio above 3 (kernels dominate): half the chunk, so that the
    ///   pipeline fills sooner and overlaps more finely;
    /// - below 1.5 with chunks whose copy takes under 1 ms: twice the chunk, so that fixed
    ///   per-chunk costs (launches, event waits) weigh less; a copy-bound pipeline with larger
    ///   chunks than that gains nothing from growing them;
    /// - otherwise the current size. Never below ~50 us of transfer, never above 256 MiB.
    [[nodiscard]] std::size_t suggest_chunk_size() const {
        return m_core.monitor.suggest_chunk_size(stats(), sizeof(In));
    }

    /// The options as validated (defaults filled in).
    [[nodiscard]] const pipeline_options& options() const noexcept { return m_core.options; }

    /// The stream chunks are copied to the device on. The streams are exposed for inspection
    /// (priorities, names in a profiler); work enqueued on them delays the pipeline's.
    [[nodiscard]] stream_ref h2d_stream() const noexcept { return m_core.h2d; }
    /// The stream outputs are copied back on.
    [[nodiscard]] stream_ref d2h_stream() const noexcept { return m_core.d2h; }
    /// Compute stream `i` (chunks take them in turn; with stage_streams, stage i's stream); graph
    /// replays run on per-slot streams of the same priority.
    /// @throws usage_error when i >= options().streams.compute_streams (with stage_streams: the
    /// number
    ///         of stages)
    [[nodiscard]] stream_ref compute_stream(std::size_t i) const {
        if (i >= m_core.compute.size()) {
            throw usage_error("pipeline::compute_stream: index out of range");
        }
        return m_core.compute[i];
    }

private:
    // A negative timeout is a bug (an overflowed subtraction, say), not a poll.
    static std::chrono::steady_clock::time_point deadline_after(std::chrono::nanoseconds timeout,
                                                                const char* call) {
        if (timeout.count() < 0) {
            throw usage_error(std::string("pipeline::") + call + ": negative timeout");
        }
        return std::chrono::steady_clock::now() + timeout;
    }
    static std::chrono::nanoseconds time_left(std::chrono::steady_clock::time_point deadline) {
        auto left = deadline - std::chrono::steady_clock::now();
        return std::max(std::chrono::nanoseconds(0),
                        std::chrono::duration_cast<std::chrono::nanoseconds>(left));
    }

    // Reads which chunk a shard's next() left first in line (multi_pipeline::next).
    template <class, class>
    friend class multi_pipeline;

    core m_core;
    detail::pipeline_batch<In, Out> m_batch;
    detail::pipeline_stream<In, Out> m_stream;
};

} // namespace cudawait
