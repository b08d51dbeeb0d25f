// SPDX-License-Identifier: Apache-2.0
#pragma once

// Synopsis
//   pipeline_options  depth, chunk_elements, output_elements, graph; .streams, .memory,
//                     .monitoring, .recovery; validate()
//   pipeline_stats    what a batch run (or the streaming session so far) achieved; .latency
//   pipeline_alert    passed to on_alert when bandwidth or the link's utilisation stays low
//   chunk_failure     passed to on_degrade for each degradation step
//   chunk_error       what went wrong: CUDA status, sticky, timed out, or another exception
//   pipeline_error    a batch (or a streamed chunk) failed and no fallback took over
//
// The value types of pipeline.hpp, on their own so that the pipeline's parts can use them. See
// docs/pipeline.md#options.

#include <cudawait/memory/device_resource.hpp>
#include <cudawait/runtime/detail/chrono.hpp>
#include <cudawait/runtime/error.hpp>

#include <cstddef>
#include <exception>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>

namespace cudawait {

class pinned_pool; // pinned_pool.hpp
class timeline;    // timeline.hpp

/// Why pipeline_options::monitoring_options::on_alert was called.
enum class alert_kind {
    /// The copies of one direction ran below alert_fraction of the link's peak while they ran.
    bandwidth,
    /// The link was idle too much of the time: in each copy direction and on the compute
    /// streams, busy time over the window's span stayed below utilisation_fraction, so neither
    /// the link nor the GPU bounds the pipeline; the host does not feed it fast enough.
    utilisation
};

/// The enumerator's name, e.g. "utilisation".
[[nodiscard]] constexpr std::string_view to_string(alert_kind k) noexcept {
    switch (k) {
    case alert_kind::bandwidth:
        return "bandwidth";
    case alert_kind::utilisation:
        return "utilisation";
    }
    return "unknown";
}

/// Passed to pipeline_options::monitoring_options::on_alert when achieved bandwidth, or the link's
/// utilisation, stayed low over a window.
struct pipeline_alert {
    const char* direction; ///< "h2d" or "d2h" (utilisation: the busier direction)
    double achieved_gbps;  ///< over the window (utilisation: bytes over the direction's span)
    double peak_gbps;      ///< the link's measured one-way peak
    std::size_t window;    ///< chunks in the window
    alert_kind kind = alert_kind::bandwidth;
    /// Utilisation alerts: the direction's busy time over its span in the window (0 to 1);
    /// bandwidth alerts: achieved_gbps / peak_gbps.
    double utilisation = 0;
};

/// What went wrong with a chunk.
struct chunk_error {
    /// The CUDA status of a failed CUDA call (a launch, a copy, an await that saw a device
    /// error); cudaSuccess when no CUDA call failed (a timeout, a chunk not tried because the
    /// GPU was abandoned earlier).
    cudaError_t status = cudaSuccess;
    /// The status left the context unusable: the GPU is not used again.
    bool sticky = false;
    /// The chunk did not complete within pipeline_options::recovery_options::chunk_timeout.
    bool timed_out = false;
    /// A non-CUDA exception behind the failure (the timeout_error of a timeout), else null.
    std::exception_ptr exception;
    /// The message, for printing.
    std::string what;

    /// True when this describes a failure (a default-constructed chunk_error does not).
    [[nodiscard]] bool failed() const noexcept {
        return status != cudaSuccess || timed_out || exception != nullptr || !what.empty();
    }
};

/// How far a degradation step went.
enum class degrade_level {
    retry = 1,  ///< level 1: the chunk is tried (or waited for) again with less concurrency
    give_up = 2 ///< level 2: the chunk goes to the fallback or is reported failed
};

/// What the pipeline did about a failed chunk.
enum class degrade_action {
    retried_with_less_depth, ///< a failed enqueue: retried with one slot fewer (level 1)
    waited_again,            ///< a timeout: waited for again with one slot fewer (level 1)
    fallback,                ///< handed to the fallback (level 2)
    failed,                  ///< no fallback: reported failed (level 2)
    gpu_lost,                ///< a sticky error while enqueuing: the GPU is abandoned (level 2)
    fallback_after_gpu_lost, ///< in flight when the GPU was lost: handed to the fallback
    failed_after_gpu_lost,   ///< in flight when the GPU was lost, no fallback: failed
    /// Timed out past max_retries, or in flight behind such a chunk: failed; its copy may still
    /// land, so the fallback does not write it (level 2).
    failed_timed_out
};

/// The enumerator's name, e.g. "give_up".
[[nodiscard]] constexpr std::string_view to_string(degrade_level l) noexcept {
    switch (l) {
    case degrade_level::retry:
        return "retry";
    case degrade_level::give_up:
        return "give_up";
    }
    return "unknown";
}

/// The enumerator's name, e.g. "waited_again".
[[nodiscard]] constexpr std::string_view to_string(degrade_action a) noexcept {
    switch (a) {
    case degrade_action::retried_with_less_depth:
        return "retried_with_less_depth";
    case degrade_action::waited_again:
        return "waited_again";
    case degrade_action::fallback:
        return "fallback";
    case degrade_action::failed:
        return "failed";
    case degrade_action::gpu_lost:
        return "gpu_lost";
    case degrade_action::fallback_after_gpu_lost:
        return "fallback_after_gpu_lost";
    case degrade_action::failed_after_gpu_lost:
        return "failed_after_gpu_lost";
    case degrade_action::failed_timed_out:
        return "failed_timed_out";
    }
    return "unknown";
}

/// One degradation step, passed to pipeline_options::recovery_options::on_degrade (default: printed
/// to stderr). It carries what a post-mortem needs: where the chunk is, how the pipeline was
/// configured, the streams and the data pointers of the chunk, and the typed error. With chunk
/// groups (pipeline_options::memory_options::group_bytes) a step applies to a group: `chunk` is its
/// first chunk, `chunks` the number of chunks, and the sizes and pointers are the group's.
struct chunk_failure {
    std::size_t chunk = 0;           ///< chunk index within the run (or submission index)
    std::size_t offset = 0;          ///< first input element of the chunk (0 when streaming)
    std::size_t elements = 0;        ///< input elements in the chunk (the group)
    std::size_t output_elements = 0; ///< output elements of the chunk (the group)
    std::size_t chunks = 1;          ///< chunks the step applies to (a group's, else 1)
    std::size_t input_bytes = 0;
    std::size_t output_bytes = 0;
    unsigned depth = 0; ///< slots in use after this step
    unsigned compute_streams = 0;
    int device = 0;
    bool graph = false; ///< the pipeline replays CUDA graphs (pipeline_options::graph)
    /// The streams of the chunk's copies and stages (a replayed graph's: its slot's stream for
    /// all three; the compute stream is null when the chunk failed before one was chosen).
    cudaStream_t h2d_stream = nullptr;
    cudaStream_t compute_stream = nullptr;
    cudaStream_t d2h_stream = nullptr;
    /// The chunk's host input and output (in the caller's ranges, or the streaming slot's), and
    /// its slot's device buffers.
    const void* host_in = nullptr;
    const void* host_out = nullptr;
    const void* device_in = nullptr;
    const void* device_out = nullptr;
    degrade_level level = degrade_level::retry;
    degrade_action action = degrade_action::failed;
    chunk_error error; ///< what went wrong
};

/// How a pipeline is built; chunk_elements is required. The fields most pipelines set are flat;
/// the rest are grouped by concern: streams, memory, monitoring, recovery. validate() states the
/// rules between them (the pipeline calls it at construction). See docs/pipeline.md#options.
struct pipeline_options {
    /// The device and the streams the chunks run on.
    struct stream_options {
        /// The CUDA device id (as cudaSetDevice takes it) the pipeline runs on: its streams,
        /// events and slot buffers are made there, and its stages are called (and graphs captured
        /// and launched) with it current, whichever device the driving thread has current; that
        /// one is current again after each call. One that names no visible device is a
        /// cuda_error (cudaErrorInvalidDevice) at construction.
        int device = 0;
        /// Compute streams; chunks take them in turn.
        unsigned compute_streams = 1;
        /// Stream priorities; unset: compute streams highest, copy streams lowest.
        std::optional<int> compute_priority{};
        std::optional<int> transfer_priority{};
        /// Each stage on its own compute stream (stage k of every chunk on stream k), so that
        /// stage k of one chunk runs while stage k+1 of the chunk before it does. Needs
        /// compute_streams == 1; graph replays are not affected (pipeline.hpp).
        bool stage_streams = false;
    };

    /// What each slot holds and where the memory comes from.
    struct memory_options {
        /// Bytes of device scratch per slot, allocated once at construction and handed to every
        /// stage as stage_context::scratch (256-byte aligned, uninitialised, the same bytes for
        /// all chunks of a slot): temp storage for a library a stage calls, so that no chunk
        /// allocates. 0: an empty span.
        std::size_t scratch_bytes = 0;
        /// Chunk groups: runs of G consecutive chunks, G = group_bytes / (chunk_elements x
        /// sizeof(In)) (at most max_group_chunks), move through the pipeline as one unit (one
        /// copy each way, one set of events and one wait per group); each slot then holds G
        /// chunks. Chunks of group_bytes or more are not grouped; 0: no grouping. Unset: the
        /// pipeline chooses, default_group_bytes where a chunk is under half of it, else 0
        /// (and graph replay where every stage is replayable()); pipeline::options() shows the
        /// choice.
        std::optional<std::size_t> group_bytes{};
        /// Streaming: chunks submitted and not yet taken by next() (a producer waits in
        /// acquire() while the queue is full); 0 means (2 copy streams + compute streams) x 2.
        /// With chunk groups it counts groups.
        std::size_t queue_capacity = 0;
        /// Staging buffers come from here; nullptr: default_pinned_pool().
        pinned_pool* pool = nullptr;
        /// The slots' device buffers (inputs, outputs, chained stages' and the scratch) come
        /// from here, once, when the pipeline is built. Default (or nullptr): cudaMallocAsync.
        /// A cuda::mr stream-ordered, device-accessible resource (or device_resource_ref)
        /// converts to it; it must outlive the pipeline.
        cudawait::device_resource device_resource{};
    };

    /// Timing, alerts and the timeline.
    struct monitoring_options {
        /// Timing events per stage, for stats() and alerts.
        bool timing = false;
        /// Alert when achieved H2D or D2H bandwidth over `alert_window` chunks stays below this
        /// fraction of the link's peak.
        double alert_fraction = 0.6;
        /// Alert (alert_kind::utilisation) when, over `alert_window` chunks, each copy direction
        /// was busy less than this fraction of its span (first copy start to last copy end in
        /// the window, on the GPU's clock) and so were the compute streams: the host is not
        /// keeping the link fed. 0: never.
        double utilisation_fraction = 0.8;
        /// Chunks (with chunk groups: groups) per alert window.
        std::size_t alert_window = 8;
        std::function<void(const pipeline_alert&)> on_alert{};
        /// Records what ran where into this timeline (timeline.hpp): each chunk's GPU stage
        /// spans (which needs the timing events, so stats() then has stage times as with
        /// `timing`) and its host spans. nullptr: nothing is recorded. It must outlive the
        /// pipeline.
        cudawait::timeline* timeline = nullptr;
    };

    /// Timeouts, retries, recovery and the post-mortem report.
    struct recovery_options {
        /// How long to wait for one chunk before degrading (a batch's retire, streaming's
        /// next()); 0: as long as it takes.
        std::chrono::nanoseconds chunk_timeout{0};
        /// Level-1 retries per chunk before level 2.
        unsigned max_retries = 2;
        /// After this many chunks completed cleanly on the GPU at a lowered depth, the depth
        /// goes up by one (stats().recoveries counts it), until it is `depth` again; 0: it stays
        /// low.
        unsigned recover_after = 16;
        /// Called for each degradation step; unset: one line on stderr.
        std::function<void(const chunk_failure&)> on_degrade{};
        /// Where a post-mortem report (report.hpp) is written when a batch ends with a level-2
        /// degradation or throws pipeline_error, and after each level-2 degradation in a
        /// streaming session (rewritten each time). Best effort: a write failure is reported on
        /// stderr, never thrown. Empty: no report.
        std::string report_path{};
    };

    /// Slots, each with its own device (and if needed pinned) buffers: 2 = double buffering.
    unsigned depth = 2;
    /// Input elements per chunk (the last chunk of a batch may be shorter).
    std::size_t chunk_elements = 0;
    /// Output elements for a full chunk; 0 means as many as input elements. A chunk of k inputs
    /// has ceil(k * output_elements / chunk_elements) outputs.
    std::size_t output_elements = 0;
    /// Replay each slot's work as a CUDA graph (full chunks; a short last chunk runs plainly).
    /// With chunk groups, full groups replay; a short last group runs plainly. With
    /// memory.group_bytes unset the pipeline turns it on for small chunks whose stages are all
    /// replayable() (stage.hpp).
    bool graph = false;
    // Each with an initialiser, so that a designated initialiser may leave any of them out.
    stream_options streams{};
    memory_options memory{};
    monitoring_options monitoring{};
    recovery_options recovery{};

    /// A group size that makes 64 KiB .. 1 MiB chunks move at close to the link's rate; what
    /// an unset memory.group_bytes chooses for chunks under half of it.
    static constexpr std::size_t default_group_bytes = std::size_t{4} << 20;
    /// The most chunks in one group.
    static constexpr std::size_t max_group_chunks = 256;

    /// Checks the fields and the rules between them; a pipeline calls it when it is built.
    /// `name` is how the message names this object (multi_pipeline: its per_shard).
    /// @throws usage_error naming the first field that breaks one, e.g.
    ///         "pipeline_options.recovery.chunk_timeout must be >= 0"
    void validate(std::string_view name = "pipeline_options") const {
        auto fail = [name](const char* rule) { throw usage_error(std::string(name) + "." + rule); };
        if (chunk_elements == 0) {
            fail("chunk_elements must be non-zero");
        }
        if (depth == 0) {
            fail("depth must be at least 1");
        }
        if (streams.compute_streams == 0) {
            fail("streams.compute_streams must be at least 1");
        }
        if (streams.stage_streams && streams.compute_streams != 1) {
            fail("streams.compute_streams must be 1 with streams.stage_streams (each stage gets "
                 "its own compute stream)");
        }
        if (memory.scratch_bytes > std::size_t(-1) / 2) {
            fail("memory.scratch_bytes is too large");
        }
        // Written so that NaN fails too.
        if (!(monitoring.alert_fraction >= 0)) {
            fail("monitoring.alert_fraction must be >= 0");
        }
        if (!(monitoring.utilisation_fraction >= 0)) {
            fail("monitoring.utilisation_fraction must be >= 0");
        }
        if (monitoring.alert_window == 0) {
            fail("monitoring.alert_window must be at least 1");
        }
        if (recovery.chunk_timeout.count() < 0) {
            fail("recovery.chunk_timeout must be >= 0");
        }
    }
};

/// Per-chunk latency: in a batch from the chunk's first enqueue attempt to its output in place,
/// in streaming from submit() to next() delivering it; chunks produced by the GPU or by the
/// fallback count, failed ones do not. Percentiles are nearest-rank (the smallest sample with
/// at least p% of the samples at or below it) over the last `samples` chunks (at most 65536);
/// `max_seconds` is over every chunk of the run. All zero when no chunk was produced.
struct latency_summary {
    double p50_seconds = 0;
    double p90_seconds = 0;
    double p99_seconds = 0;
    double max_seconds = 0;
    std::size_t samples = 0; ///< chunks the percentiles are drawn from
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
    std::size_t recoveries = 0;     ///< depth raised by one after recover_after clean chunks
    bool gpu_abandoned = false;
    std::size_t alerts = 0;
    latency_summary latency; ///< per-chunk latency (does not need `timing`)
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
/// into the error (in one call's arguments the moves may come first). A template (of an unused
/// parameter) so that only a translation unit that runs a batch instantiates it.
template <class = void>
pipeline_error batch_failed(std::vector<std::size_t> completed, std::vector<std::size_t> failed) {
    std::string what = "pipeline: " + std::to_string(failed.size()) + " of " +
                       std::to_string(completed.size() + failed.size()) + " chunks failed";
    return pipeline_error(what, std::move(completed), std::move(failed));
}
} // namespace detail

} // namespace cudawait
