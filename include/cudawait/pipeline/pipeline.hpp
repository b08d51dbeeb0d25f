// SPDX-License-Identifier: Apache-2.0
#pragma once

// Synopsis
//   pipeline<float> pipe(options, {stage...}, fallback);
//       stage:    void(std::span<float> dev_in, std::span<float> dev_out, const stage_context& c)
//                 launches the chunk's kernels on `c.stream` (device spans, the chunk's own
//                 lengths: stage 0 reads the chunk's input, a later stage the previous one's
//                 output); or the older void(dev_in, dev_out, stream_ref s), launching on `s`
//       stage_context (pipeline_stage.hpp): stream, slot, stage, device, chunk, scratch
//       group stage: void(dev_in, dev_out, const group_context& g): one launch for a group of
//                 g.chunks consecutive chunks (with options.memory.group_bytes; below)
//       fallback: void(std::size_t chunk, std::span<const float> in, std::span<float> out)
//                 computes a chunk on the host when the GPU cannot (optional)
//
//   Batch:      co_await pipe.run(host_in, host_out);
//   Streaming:  auto slot = co_await pipe.acquire();     // waits while every slot is busy
//               fill(slot.data()); pipe.submit(std::move(slot), n);
//               while (auto r = co_await pipe.next()) use(r->data());   // in submission order
//               pipe.close();                             // next() drains, then ends
//               co_await pipe.acquire(50ms); co_await pipe.next(deadline);  // timeout_error
//                                        // when it passes; nothing is taken or lost then
//   Views:      pipe.submit(std::move(slot), in, out);   // the chunk from and into your spans
//               auto r = co_await pipe.next();           // r->data() is `out`, filled
//               (page-locked spans are copied directly; pageable ones through the slot)
//   Afterwards: pipe.stats() (latency percentiles among them), pipe.failures() (the run's
//               degradation records), pipe.write_report(path) (pipeline_report.hpp: all of it,
//               with the options and the device, as JSON; options.recovery.report_path: on failure)
//
// Stages are chained: stage 0 reads the chunk's device input, each later stage reads the
// previous stage's output, and the last writes the chunk's device output, which goes D2H. With
// several stages each slot has one more device buffer (an output chunk) and the stages' outputs
// alternate between it and the output buffer, so that the last lands in the output. A stage's
// input and output are then both spans of the one element type: several stages need In == Out
// (else the constructor throws usage_error); one stage may launch any number of kernels. A
// chunk's stages run in order on one compute stream (with stage_streams each on its own, below).
//
// Stage context. Each stage is told its stream, its slot (0 .. depth-1), its index, the device,
// the chunk (index in the batch, or submission index) and the slot's scratch: scratch_bytes of
// device memory per slot, allocated once at construction, 256-byte aligned, the same bytes for
// every chunk of the slot, uninitialised (it holds whatever the slot's last chunk left). A stage
// that calls a library (CUB temp storage, a cuBLAS workspace) hands it the scratch and allocates
// nothing per chunk. The stages of one chunk share it in order, and that is safe: a slot's next
// chunk starts its stages only after its previous chunk's stages (and D2H) finished, and other
// slots have their own scratch. In graph mode the stages are called once per slot, when its graph
// is captured, with the context of the chunk that built it (work that depends on ctx.chunk would
// replay that chunk's value): the context's stream is then the capture stream and the scratch the
// slot's, so the captured work uses that scratch in every replay.
//
// Stages that overlap across chunks: with `stage_streams`, stage k of every chunk runs on its own
// compute stream k (one per stage, compute_stream(k), created with the compute priority). Stage
// k of a chunk waits for stage k-1 of the same chunk, the first for the chunk's H2D and the
// slot's previous D2H, and the D2H for the last stage (events of the slot), so that stage 2 of
// chunk i runs while stage 1 of chunk i+1 does: decode, preprocess, infer and postprocess at
// once, given depth >= the number of stages. It replaces compute_streams (which must stay 1,
// else usage_error): the stages of one chunk are serial, so the stage streams are the lanes.
// Graph mode is not changed by it: a slot's graph captures the stages in order on one stream,
// and replays of different slots (each slot's graph stream) overlap one another anyway; a short
// chunk outside the graph takes the stage streams. With `timing`, a chunk's compute time runs
// from its first stage's start to its last stage's end (waits for an earlier chunk's stage on a
// stage's stream included).
//
// Each chunk goes H2D on one stream, through the stages on a compute stream, D2H on a third; the
// streams are non-blocking and ordered by events only, so copies in both directions and kernels
// of different chunks overlap. `depth` slots (2 = double buffering) each own device buffers; a
// slot is reused only after its previous chunk's last use of each buffer, which the GPU itself
// waits for (cudaStreamWaitEvent). The host waits only by co_await.
//
// Beside other copies. While a pipeline has chunks in flight, the device's small copy lane makes
// its small device-to-host copies by the SMs, not behind the pipeline's chunks on a copy engine
// (copy.hpp: copy_options::busy_sm_copy_bytes): the pipeline registers its D2H stream(s) for
// that, and on the process's first construction on a device it loads the SM copy kernel there
// (detail/sm_copy.hpp; where the kernel cannot run, a copy engine makes those copies).
//
// One mode at a time. A streaming session begins with the first acquire() and stays open while
// slots are acquired or results held, while chunks are submitted and not yet taken, and after
// close() until next() has returned the end; meanwhile run() throws usage_error. Once next() has
// returned the end after close(), and every result is destroyed, the pipeline is idle again:
// batch runs, or a new session (acquire() after the end), may follow. acquire() during a batch
// throws usage_error, and so do acquire() and submit() after close() until the session ended.
//
// Pinned host ranges (registered ones too: host_registration.hpp) are copied directly. In a
// batch, pageable ones are staged through rings of pinned chunks ((depth + 2) x (input + output
// chunk) bytes from the pool, kept between runs), the host copies on worker threads of their
// own per direction, off the scheduler's thread, so that stage-in, the GPU and stage-out
// overlap (detail/pipeline_staging.hpp).
// Graph mode records each slot's H2D -> stages -> D2H once as a CUDA graph and replays
// it. With `timing` on, stats() reports stage times, achieved bandwidths against the link's peak
// (measured once per device), overlap efficiency, and alerts on low bandwidth or on a link the
// host leaves idle (pipeline_alert::kind; describe_link in link.hpp tells what the link is).
//
// Degradation: a chunk whose work fails to enqueue (a launch error, say) is retried with one slot
// fewer (level 1), down to depth 1, then handed to the fallback (level 2). In a batch, a chunk
// that does not finish within `chunk_timeout` lowers the depth and is waited for again; after
// `max_retries` timeouts it is reported failed (its copy may still land, so the fallback does
// not write it) and the GPU is not used again. After a sticky error the context is gone: every
// chunk not yet seen complete goes to the fallback. A wait that cannot be set up (the driver
// makes no event or stream for it at the time) is no failure of the chunk, whose copies may
// still land: both modes then poll its completion, within chunk_timeout. Every chunk is
// produced once, by the GPU or by the fallback, or is reported failed; without a fallback, run()
// throws pipeline_error listing the chunks that completed and the ones that failed. Streaming
// keeps the order: a chunk that fails is produced by the fallback when next() reaches it, or
// next() throws pipeline_error for it (and the chunks after it can still be taken). An
// exception from the fallback (or from any callback) reaches the caller of run() or next(); run()
// first waits for the chunks still in flight, so that no copy lands in the caller's memory after
// it returned (one that outlives chunk_timeout meanwhile may still land, as above).
// Streaming degrades the same way: a retryable enqueue error is retried at once with one slot
// fewer, and a chunk whose wait in next() outlives chunk_timeout is waited for again with one
// slot fewer (level 1); past max_retries the first goes to the fallback, the second is reported
// failed like a batch's (the chunks behind it too). The slots of chunks reported failed so serve
// the producer again at once, with fresh pinned buffers: the old ones, which the GPU may still
// write, are kept until the pipeline goes. Depth in
// streaming bounds the chunks the GPU works on at once (a chunk's copy waits on the GPU for the
// one `depth` submissions earlier); it never makes acquire() wait, so no producer deadlocks.
// Recovery, both modes: after `recover_after` chunks completed cleanly at a lowered depth, the
// depth goes up by one (stats().recoveries), up to the configured one.
// Timeouts of the calls: acquire(timeout) and next(timeout) (or a steady_clock deadline) throw
// timeout_error once it passed; no slot is taken, and the chunk next() waited for stays first in
// line (a later next() returns it, in order). A zero timeout or a deadline already passed polls:
// what is ready now, else timeout_error at once. A negative timeout is a usage_error.
// Each step is reported to `on_degrade` (default: one line on stderr) as a chunk_failure: the
// degrade_level (retry, give_up) and degrade_action, the typed chunk_error (CUDA status, sticky,
// timed out), and what a post-mortem needs: the chunk, the configuration, the streams and the
// chunk's host and device pointers. The run (or session) keeps the last 256 records
// (failures()); write_report() dumps them with the options, stats and device as JSON, and with
// options.recovery.report_path set a failed batch (a level-2 step, or pipeline_error) writes it
// there when it ends, and a streaming session after each level-2 step.
//
// Latency: stats().latency gives per-chunk p50, p90, p99 (nearest rank, over the last 65536
// chunks) and the maximum: in a batch from a chunk's first enqueue attempt to its output in
// place, in streaming from submit() to next() delivering it (latency_summary). The samples go
// into a window reserved when the run begins: recording a chunk allocates nothing.
//
// Chunk groups (options.memory.group_bytes; 0, the default, is off). Small chunks are limited by
// what is paid per chunk, not by the link: a copy call, a launch (~3.4 us of host time), events and
// a scheduler wait each. With group_bytes set, G = group_bytes / chunk bytes consecutive chunks (at
// most 256; chunks of group_bytes or more are not grouped) move as one unit: each slot holds G
// chunks back to back (depth x G chunks of device memory, and of pinned memory for streaming), and
// a group takes one H2D copy, one D2H copy, one set of event waits and records and one wait on the
// host. Groups apply to batches over pinned ranges; a batch that stages pageable ranges moves one
// chunk per flight (its staging rings and workers move chunks; the slots then use their first
// chunk, and graph mode runs such chunks plainly, the slots' graphs being a group's). A group stage
// (group_context) is called once per group: one launch; a per-chunk stage is called once per chunk
// of the group, in order, on the group's stream; in graph mode a full group's copies and launches
// are one graph per slot (a short last group runs plainly). Per chunk as before: results, stats
// (chunks, gpu/fallback/failed chunks), latency samples, the fallback (a group given up hands each
// of its chunks to it once, in order), the pipeline_error lists and recovery's count. Per group:
// retries, chunk_timeout (the wait is the group's), depth (slots are slot groups), the degradation
// records (chunk_failure::chunks), the alert window and the trace and timeline ranges (named by the
// group's first chunk). pipeline_options::default_group_bytes (4 MiB) suits 64 KiB .. 1 MiB chunks;
// grouping is opt-in because it multiplies each slot's memory by G and changes the unit of slot
// reuse, retries and records. Streaming in a grouped pipeline: acquire() hands out the chunks of a
// slot group in order, and submit() holds chunks back until a run of consecutive full chunks
// (the last may be short) can go as one flight: when the group is used up, a chunk is short or
// cannot join the run, next() needs the run's first chunk, close() is called, or acquire() is
// about to wait. Results, order, next()/acquire() timeouts, the fallback and stats' chunk
// counts stay per chunk; the wait, chunk_timeout, retries and records are the run's; a slot
// group serves the producer again once all of its chunks were given back; queue_capacity
// counts groups (detail/pipeline_stream.hpp).
//
// How a chunk flows (batch), file by file:
//   1. pipeline.hpp                  run() checks the ranges and classifies their memory
//                                    (memory_kind.hpp), then hands them to the batch driver.
//   2. detail/pipeline_batch.hpp     start_chunk() picks a slot; pageable input was staged
//                                    ahead into a pinned ring chunk on the stage-in workers
//                                    (detail/pipeline_staging.hpp, advance_staging()).
//   3. detail/pipeline_slots.hpp     enqueue(): H2D, the stages, D2H on their streams, ordered by
//                                    the slot's events; or the slot's CUDA graph (graph.hpp).
//   4. detail/pipeline_batch.hpp     retire() co_awaits the chunk's completion event (with
//                                    chunk_timeout: with_timeout), degrading on errors;
//                                    finish() starts the stage-out of pageable output on the
//                                    stage-out workers (detail/pipeline_staging.hpp).
//   5. detail/pipeline_monitor.hpp   the chunk's bytes and stage times go into stats() and alerts.
// Streaming takes the same path through detail/pipeline_stream.hpp (submit() enqueues, or in a
// grouped pipeline holds the chunk back for its run; next() awaits), with the slot's pinned
// buffers as the producer's input and the consumer's output, or with views the caller's spans.
//
// Streaming from the caller's memory: submit(slot, in, out) takes the chunk's input from `in`
// and delivers its output into `out` (out.size() == output_size(in.size())). Items that live in
// page-locked memory already (a pinned_buffer, a registered span, a mapped buffer) are then
// copied by the GPU from and to where they are, with no host copy on the scheduler's thread;
// a pageable span is staged through the slot's pinned buffer (`in` at submit(), `out` when
// next() delivers the chunk). The memory is classified (memory_kind.hpp) at each submit. Order,
// timeouts, degradation (the fallback gets `in` and `out`), stats and records are as for slot
// chunks. In a grouped pipeline a run may mix slot chunks and views: its device buffers stay
// contiguous, its host ends are pieces (one per view, the slot's own chunks merged) copied as one
// cudaMemcpyBatchAsync each way, and such a run does not replay the slot's graph (its stages run
// plainly, as a short chunk's do). A chunk given up after chunk_timeout may still have its copy
// land in `out`, as a batch's may.
// The value types (options, stats, alert, chunk_failure, pipeline_error) are in
// pipeline_options.hpp; detail/link_peak.hpp measures the link's peak.

#include <cudawait/copy/detail/link_peak.hpp>
#include <cudawait/core/task.hpp>
#include <cudawait/memory/memory_kind.hpp>
#include <cudawait/pipeline/detail/batch.hpp>
#include <cudawait/pipeline/detail/slots.hpp>
#include <cudawait/pipeline/detail/stream.hpp>
#include <cudawait/pipeline/options.hpp>
#include <cudawait/pipeline/report.hpp>
#include <cudawait/pipeline/stage.hpp>
#include <cudawait/runtime/error.hpp>
#include <cudawait/runtime/stream.hpp>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <optional>
#include <ostream>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace cudawait {

/// An N-buffered H2D -> stages -> D2H pipeline over chunks of `In`, producing `Out`.
///
/// Not thread-safe: drive one pipeline from one scheduler's coroutines. Destruction waits for
/// the GPU work in flight.
template <class In, class Out>
class multi_pipeline;

template <class In, class Out = In>
class pipeline {
    static_assert(std::is_trivially_copyable_v<In> && std::is_trivially_copyable_v<Out>);
    using core = detail::pipeline_core<In, Out>;

public:
    /// Launches a chunk's kernels on `ctx.stream` (or, the older form, on the stream it is
    /// given); see pipeline_stage.hpp. Stages are chained: `in` is the chunk's device input for
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
    /// grouped pipeline it may be held back to go with the next chunks (see the synopsis).
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
    /// pipeline_report.hpp.
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
