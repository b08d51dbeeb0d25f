// SPDX-License-Identifier: Apache-2.0
#pragma once

// What the pipeline measures: per-chunk stage timing events, the bandwidth and utilisation
// alert windows, the statistics of a run or session (counters the drivers bump, and the figures
// derived from them), the chunks' latencies, the failure records of the run, and the chunk-size
// advice drawn from those figures.

#include <cudawait/copy/detail/link_peak.hpp>
#include <cudawait/observe/timeline.hpp>
#include <cudawait/pipeline/detail/latency.hpp>
#include <cudawait/pipeline/options.hpp>
#include <cudawait/runtime/device.hpp>
#include <cudawait/runtime/error.hpp>
#include <cudawait/runtime/event.hpp>
#include <cudawait/runtime/stream.hpp>

#include <algorithm>
#include <cstddef>
#include <optional>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>

namespace cudawait::detail {

/// Everything pipeline_monitor is, as a class template it derives from: the pipelines (class
/// templates themselves) instantiate its members where they are used, not every translation unit
/// that includes the header. `Unused` is always void.
template <class Unused = void>
class basic_pipeline_monitor {
public:
    /// Where a chunk's timing events are recorded: start and end of each stage (a replayed
    /// graph records h2d_start and d2h_end only).
    enum mark : std::size_t {
        h2d_start,
        h2d_end,
        compute_start,
        compute_end,
        d2h_start,
        d2h_end,
        marks
    };

    /// With `o.monitoring.timing` (or a timeline, which needs the events), one set of timing events
    /// for each of `sets` chunks that can be in flight at once, and the link's peak measured (once
    /// per device and process); a timeline is anchored to the device's clock here, before any
    /// chunk runs.
    /// @throws cuda_error
    basic_pipeline_monitor(const pipeline_options& o, std::size_t sets) : m_options(&o) {
        if (!o.monitoring.timing && o.monitoring.timeline == nullptr) {
            return;
        }
        if (o.monitoring.timeline != nullptr) {
            o.monitoring.timeline->anchor(o.streams.device);
        }
        for (std::size_t i = 0; i < sets; ++i) {
            std::vector<event> set;
            for (std::size_t k = 0; k < marks; ++k) {
                set.emplace_back(device_ref(o.streams.device), cudaEventDefault);
            }
            m_timing.push_back(std::move(set));
        }
        m_link_peak = link_peak_gbps(o.streams.device);
        m_anchor.emplace(device_ref(o.streams.device), cudaEventDefault);
        m_anchor_stream.emplace(device_ref(o.streams.device));
    }

    /// Statistics start anew (a batch run or a streaming session begins).
    /// @throws cuda_error
    void reset() {
        m_stats = {};
        m_window.clear();
        m_spans.clear();
        if (m_anchor) {
            // The origin of the utilisation spans: recorded on an idle stream before any chunk
            // of the run is enqueued, and complete before any chunk is timed against it.
            m_anchor->record(*m_anchor_stream);
            m_anchor->sync();
        }
        m_latency.clear();
        m_failures.clear();
        m_give_ups = 0;
    }

    /// A chunk was produced `seconds` after it was first taken (see latency_summary).
    void chunk_latency(double seconds) { m_latency.add(seconds); }

    /// Failure records kept per run: the last ones, so that a long failing run stays bounded.
    static constexpr std::size_t max_failures = 256;

    /// Keeps a degradation step's record (the oldest goes beyond max_failures).
    void record_failure(const chunk_failure& f) {
        if (m_failures.size() == max_failures) {
            m_failures.erase(m_failures.begin());
        }
        m_failures.push_back(f);
        if (f.level == degrade_level::give_up) {
            ++m_give_ups;
        }
    }
    /// The records of the run (or session) so far, oldest first.
    [[nodiscard]] std::span<const chunk_failure> failures() const noexcept { return m_failures; }
    /// Level-2 steps in the run (or session) so far, also those no longer in failures().
    [[nodiscard]] std::size_t give_ups() const noexcept { return m_give_ups; }

    [[nodiscard]] bool timing() const noexcept { return !m_timing.empty(); }
    /// The timing set for the next chunk (they are used in turn).
    [[nodiscard]] std::size_t next_set() noexcept { return m_timing_seq++ % m_timing.size(); }
    /// The events of timing set `set`, indexed by `mark`.
    [[nodiscard]] std::vector<event>& set(std::size_t set) { return m_timing[set]; }

    /// The counters the drivers bump (chunks, retries, ...).
    [[nodiscard]] pipeline_stats& counters() noexcept { return m_stats; }

    /// A chunk completed on the GPU: its bytes count; with timing, its stage times are added
    /// (`timing_set` empty when the chunk was not timed) and the alert window is checked. A
    /// replayed graph (`graph_replay`) is timed as a whole.
    /// @throws cuda_error; what on_alert throws
    void chunk_done(std::size_t in_bytes, std::size_t out_bytes,
                    std::optional<std::size_t> timing_set, bool graph_replay) {
        m_stats.input_bytes += in_bytes;
        m_stats.output_bytes += out_bytes;
        if (!timing_set) {
            return;
        }
        std::vector<event>& t = m_timing[*timing_set];
        auto elapsed = [&](mark a, mark b) {
            float ms = 0;
            check(cudaEventElapsedTime(&ms, t[a].get(), t[b].get()), "cudaEventElapsedTime");
            return static_cast<double>(ms) * 1e-3;
        };
        if (graph_replay) {
            // A replayed graph is timed as a whole; its stages are not split, so stage times and
            // bandwidths come from plain mode only.
            m_stats.graph_seconds += elapsed(h2d_start, d2h_end);
            return;
        }
        double h2d = elapsed(h2d_start, h2d_end);
        double comp = elapsed(compute_start, compute_end);
        double d2h = elapsed(d2h_start, d2h_end);
        m_stats.h2d_seconds += h2d;
        m_stats.compute_seconds += comp;
        m_stats.d2h_seconds += d2h;
        check_utilisation(t, in_bytes, out_bytes);
        if (h2d <= 0 || d2h <= 0 || m_link_peak <= 0) {
            return;
        }
        m_window.push_back({in_bytes, h2d, out_bytes, d2h});
        if (m_window.size() < m_options->monitoring.alert_window) {
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
        double limit = m_options->monitoring.alert_fraction * m_link_peak;
        for (auto [dir, gbps] :
             {std::pair{"h2d", bin / tin / 1e9}, std::pair{"d2h", bout / tout / 1e9}}) {
            if (gbps < limit) {
                ++m_stats.alerts;
                if (m_options->monitoring.on_alert) {
                    m_options->monitoring.on_alert(
                        pipeline_alert{dir, gbps, m_link_peak, m_options->monitoring.alert_window,
                                       alert_kind::bandwidth, gbps / m_link_peak});
                }
            }
        }
    }

    /// With a timeline attached, the GPU spans of chunk `chunk`, timed with `timing_set`, which
    /// completed (its events are read, nothing waits): H2D, compute on `compute_track`, D2H; a
    /// replayed graph as one span on `graph_track`.
    /// @throws cuda_error
    void trace_chunk(std::size_t timing_set, std::size_t chunk, bool graph_replay,
                     std::string_view compute_track, std::string_view graph_track) {
        timeline* tl = m_options->monitoring.timeline;
        if (tl == nullptr) {
            return;
        }
        const std::vector<event>& t = m_timing[timing_set];
        const int dev = m_options->streams.device;
        if (graph_replay) {
            tl->record_gpu(dev, graph_track, "graph", t[h2d_start], t[d2h_end], chunk);
            return;
        }
        tl->record_gpu(dev, "h2d", "h2d", t[h2d_start], t[h2d_end], chunk);
        tl->record_gpu(dev, compute_track, "compute", t[compute_start], t[compute_end], chunk);
        tl->record_gpu(dev, "d2h", "d2h", t[d2h_start], t[d2h_end], chunk);
    }

    /// The counters with the derived figures filled in.
    [[nodiscard]] pipeline_stats stats(unsigned depth, bool gpu_abandoned) const {
        pipeline_stats s = m_stats;
        s.depth = depth;
        s.gpu_abandoned = gpu_abandoned;
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
        s.latency = m_latency.summary();
        return s;
    }

    /// The chunk size (elements of `element_bytes`) that stats `s` suggest; see
    /// pipeline::suggest_chunk_size for the rule.
    [[nodiscard]] std::size_t suggest_chunk_size(const pipeline_stats& s,
                                                 std::size_t element_bytes) const {
        std::size_t chunk = m_options->chunk_elements;
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
            std::max<std::size_t>(1, static_cast<std::size_t>(peak * 1e9 * 50e-6) / element_bytes);
        std::size_t ceiling = std::max<std::size_t>(1, (std::size_t{256} << 20) / element_bytes);
        return std::clamp(suggested, std::min(floor_elems, chunk), std::max(ceiling, chunk));
    }

private:
    /// One chunk's stages on the GPU's clock: seconds from the run's anchor.
    struct span_entry {
        std::size_t in_bytes;
        std::size_t out_bytes;
        double at[marks];
    };

    // The utilisation window: a chunk's stage starts and ends go in; after alert_window chunks,
    // each of H2D, compute and D2H has busy time (the sum of its stage times) over its span
    // (first start to last end in the window). Only when all three stay below
    // utilisation_fraction is neither the link nor the GPU the bound: the host does not feed
    // them, and one alert names the busier copy direction.
    void check_utilisation(std::vector<event>& t, std::size_t in_bytes, std::size_t out_bytes) {
        if (m_options->monitoring.utilisation_fraction <= 0 || !m_anchor ||
            m_options->monitoring.alert_window < 2) {
            return;
        }
        span_entry e{in_bytes, out_bytes, {}};
        for (std::size_t k = 0; k < marks; ++k) {
            float ms = 0;
            check(cudaEventElapsedTime(&ms, m_anchor->get(), t[k].get()), "cudaEventElapsedTime");
            e.at[k] = static_cast<double>(ms) * 1e-3;
        }
        m_spans.push_back(e);
        if (m_spans.size() < m_options->monitoring.alert_window) {
            return;
        }
        struct busy {
            double first = 0, last = 0, time = 0, bytes = 0;
            [[nodiscard]] double utilisation() const {
                return last > first ? time / (last - first) : 1.0;
            }
        };
        auto measure = [this](mark start, mark end, bool input) {
            busy b{m_spans.front().at[start], m_spans.front().at[end], 0, 0};
            for (const span_entry& c : m_spans) {
                b.first = std::min(b.first, c.at[start]);
                b.last = std::max(b.last, c.at[end]);
                b.time += std::max(0.0, c.at[end] - c.at[start]);
                b.bytes += static_cast<double>(input ? c.in_bytes : c.out_bytes);
            }
            return b;
        };
        busy up = measure(h2d_start, h2d_end, true);
        busy comp = measure(compute_start, compute_end, true);
        busy down = measure(d2h_start, d2h_end, false);
        m_spans.clear();
        const double limit = m_options->monitoring.utilisation_fraction;
        if (up.utilisation() >= limit || down.utilisation() >= limit ||
            comp.utilisation() >= limit) {
            return;
        }
        bool h2d_busier = up.utilisation() >= down.utilisation();
        const busy& dir = h2d_busier ? up : down;
        double gbps = dir.last > dir.first ? dir.bytes / (dir.last - dir.first) / 1e9 : 0;
        ++m_stats.alerts;
        if (m_options->monitoring.on_alert) {
            m_options->monitoring.on_alert(pipeline_alert{
                h2d_busier ? "h2d" : "d2h", gbps, m_link_peak, m_options->monitoring.alert_window,
                alert_kind::utilisation, dir.utilisation()});
        }
    }

    struct window_entry {
        std::size_t in_bytes;
        double h2d;
        std::size_t out_bytes;
        double d2h;
    };

    // The containers' types are named dependently (dep<T>): a translation unit that includes
    // the pipeline without running one then does not instantiate them (nvcc's front end
    // instantiates the non-dependent member types of a class template where it is defined).
    template <class T>
    using dep = dependent_t<Unused, T>;

    const pipeline_options* m_options;
    dep<std::vector<std::vector<event>>> m_timing; // per chunk in flight, indexed by `mark`
    std::size_t m_timing_seq = 0;
    dep<std::vector<window_entry>> m_window;
    dep<std::optional<event>> m_anchor; ///< with timing: the origin of m_spans, recorded per run
    dep<std::optional<stream>> m_anchor_stream;
    dep<std::vector<span_entry>> m_spans;
    pipeline_stats m_stats;
    double m_link_peak = 0;
    latency_window m_latency;
    dep<std::vector<chunk_failure>> m_failures;
    std::size_t m_give_ups = 0;
};

/// Stage timing, alerts and statistics of one pipeline. An alias, not a class of its own: the
/// pipelines name it dependently, so only a translation unit that instantiates a pipeline
/// instantiates the monitor's class.
using pipeline_monitor = basic_pipeline_monitor<>;

} // namespace cudawait::detail
