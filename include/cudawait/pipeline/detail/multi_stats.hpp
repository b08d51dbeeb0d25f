// SPDX-License-Identifier: Apache-2.0
#pragma once

// How multi_pipeline's stats() makes one pipeline_stats of its shards' (the rules:
// docs/pipeline.md#multi_pipeline): host code only, so that it is tested without a GPU.

#include <cudawait/pipeline/options.hpp>

#include <algorithm>
#include <cstddef>
#include <vector>

namespace cudawait::detail {

/// Input and output bytes.
struct byte_counts {
    std::size_t input = 0;
    std::size_t output = 0;
};

/// What the multi pipeline itself knows about the run that the shards' counters do not.
struct multi_run_counts {
    double wall_seconds = 0;       ///< the run's (or the session's) own wall time
    std::size_t rescued = 0;       ///< chunks another shard's GPU produced after a give-up
    std::size_t failed_rescue = 0; ///< given up, not rescued, and no fallback: failed
    /// The rescued chunks' bytes (count_rescued added them to the shards' stats; no copy stage
    /// of a shard moved them).
    byte_counts rescued_bytes;
};

/// Adds the bytes of a shard's chunks that other shards rescued to its stats `s` (the shard
/// counts those chunks, as fallback chunks, but not their bytes): input_bytes, output_bytes and
/// throughput_gbps then cover every chunk of the shard that a GPU produced. The copy rates stay
/// those of the shard's own copies.
inline void count_rescued(pipeline_stats& s, const byte_counts& rescued) {
    s.input_bytes += rescued.input;
    s.output_bytes += rescued.output;
    s.throughput_gbps =
        s.wall_seconds > 0 ? static_cast<double>(s.input_bytes) / s.wall_seconds / 1e9 : 0;
}

/// The shards' stats (with count_rescued applied) as one pipeline_stats. A rescued chunk is
/// counted by its shard as a fallback chunk (the shard called its fallback, which the rescue
/// is); here it is a GPU chunk, and a chunk that neither a rescue nor the user's fallback
/// produced is a failed one. The bytes are summed: each chunk's count once, on the shard whose
/// chunk it was.
[[nodiscard]] inline pipeline_stats combine_stats(const std::vector<pipeline_stats>& shards,
                                                  const multi_run_counts& run) {
    pipeline_stats c;
    bool all_abandoned = !shards.empty();
    double lowest_peak = 0;
    double longest = 0; // of the shards' longest stage times
    for (const pipeline_stats& s : shards) {
        c.chunks += s.chunks;
        c.gpu_chunks += s.gpu_chunks;
        c.fallback_chunks += s.fallback_chunks;
        c.failed_chunks += s.failed_chunks;
        c.retries += s.retries;
        c.input_bytes += s.input_bytes;
        c.output_bytes += s.output_bytes;
        c.h2d_seconds += s.h2d_seconds;
        c.compute_seconds += s.compute_seconds;
        c.d2h_seconds += s.d2h_seconds;
        c.graph_seconds += s.graph_seconds;
        c.depth += s.depth;
        c.recoveries += s.recoveries;
        c.alerts += s.alerts;
        all_abandoned = all_abandoned && s.gpu_abandoned;
        if (s.link_peak_gbps > 0 && (lowest_peak == 0 || s.link_peak_gbps < lowest_peak)) {
            lowest_peak = s.link_peak_gbps;
        }
        longest = std::max(longest, std::max({s.h2d_seconds, s.d2h_seconds, s.compute_seconds}));
        // Nearest-rank percentiles of a union lie between the parts' lowest and highest: the
        // highest is a bound that holds (and is exact for one shard).
        latency_summary& l = c.latency;
        if (s.latency.samples != 0) {
            l.p50_seconds = std::max(l.p50_seconds, s.latency.p50_seconds);
            l.p90_seconds = std::max(l.p90_seconds, s.latency.p90_seconds);
            l.p99_seconds = std::max(l.p99_seconds, s.latency.p99_seconds);
            l.samples += s.latency.samples;
        }
        l.max_seconds = std::max(l.max_seconds, s.latency.max_seconds);
    }
    const std::size_t moved = std::min(c.fallback_chunks, run.rescued + run.failed_rescue);
    c.fallback_chunks -= moved;
    c.gpu_chunks += std::min(run.rescued, moved);
    c.failed_chunks += moved - std::min(run.rescued, moved);
    c.gpu_abandoned = all_abandoned;
    c.link_peak_gbps = lowest_peak;
    c.wall_seconds = run.wall_seconds;
    // The copy rates are those of one link on average: the bytes the shards' copy stages moved
    // (not the rescued chunks', which no stage time covers) over the summed stage times.
    const std::size_t copied_in = c.input_bytes - std::min(c.input_bytes, run.rescued_bytes.input);
    const std::size_t copied_out =
        c.output_bytes - std::min(c.output_bytes, run.rescued_bytes.output);
    c.h2d_gbps = c.h2d_seconds > 0 ? static_cast<double>(copied_in) / c.h2d_seconds / 1e9 : 0;
    c.d2h_gbps = c.d2h_seconds > 0 ? static_cast<double>(copied_out) / c.d2h_seconds / 1e9 : 0;
    c.throughput_gbps =
        c.wall_seconds > 0 ? static_cast<double>(c.input_bytes) / c.wall_seconds / 1e9 : 0;
    const double transfer = std::max(c.h2d_seconds, c.d2h_seconds);
    c.compute_to_transfer = transfer > 0 ? c.compute_seconds / transfer : 0;
    // The busiest shard's longest stage over the wall time: 1 when that shard never waited.
    c.overlap_efficiency = c.wall_seconds > 0 && longest > 0 ? longest / c.wall_seconds : 0;
    return c;
}

} // namespace cudawait::detail
