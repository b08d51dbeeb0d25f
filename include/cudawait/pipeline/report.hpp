// SPDX-License-Identifier: Apache-2.0
#pragma once

// Synopsis
//   write_report(out, options, stats, failures)    a pipeline's post-mortem as one JSON object
//   write_report(path, options, stats, failures)   the same into a file (throws when it cannot)
//   pipeline::write_report(out | path)             the pipeline's own (pipeline.hpp)
//
// The options, the stats, the degradation records and the device; the layout is in
// docs/pipeline.md#the-report.

#include <cudawait/observe/detail/json.hpp>
#include <cudawait/pipeline/options.hpp>
#include <cudawait/runtime/error.hpp> // first: the C++20 check (detail/config.hpp)

#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <fstream>
#include <optional>
#include <ostream>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

#include <cuda_runtime_api.h>

namespace cudawait {

namespace detail {

/// A handle or pointer as "0x..." (JSON has no pointers; a number would lose bits in readers
/// that hold numbers as doubles).
/// (The writers here are templates, the JSON writer a deduced parameter: only a translation unit
/// that writes a report compiles them.)
template <class Unused = void>
std::string hex_pointer(const void* p) {
    char buf[2 + 2 * sizeof(std::uintptr_t) + 1];
    std::snprintf(buf, sizeof buf, "0x%" PRIxPTR, reinterpret_cast<std::uintptr_t>(p));
    return buf;
}

template <class W, class T>
void write_optional(W& w, std::string_view name, const std::optional<T>& v) {
    w.key(name);
    if (v) {
        w.value(*v);
    } else {
        w.null();
    }
}

template <class W>
void write_options(W& w, const pipeline_options& o) {
    const auto& st = o.streams;
    const auto& mem = o.memory;
    const auto& mon = o.monitoring;
    const auto& rec = o.recovery;
    w.begin_object()
        .field("depth", o.depth)
        .field("chunk_elements", o.chunk_elements)
        .field("output_elements", o.output_elements)
        .field("graph", o.graph);
    w.key("streams")
        .begin_object()
        .field("device", st.device)
        .field("compute_streams", st.compute_streams);
    write_optional(w, "compute_priority", st.compute_priority);
    write_optional(w, "transfer_priority", st.transfer_priority);
    w.field("stage_streams", st.stage_streams).end_object();
    w.key("memory").begin_object().field("scratch_bytes", mem.scratch_bytes);
    write_optional(w, "group_bytes", mem.group_bytes);
    w.field("queue_capacity", mem.queue_capacity).key("pool");
    if (mem.pool != nullptr) {
        w.value(hex_pointer(mem.pool));
    } else {
        w.null();
    }
    w.end_object();
    w.key("monitoring")
        .begin_object()
        .field("timing", mon.timing)
        .field("alert_fraction", mon.alert_fraction)
        .field("utilisation_fraction", mon.utilisation_fraction)
        .field("alert_window", mon.alert_window)
        .field("on_alert", static_cast<bool>(mon.on_alert))
        .field("timeline", mon.timeline != nullptr)
        .end_object();
    w.key("recovery")
        .begin_object()
        .field("chunk_timeout_ns", static_cast<long long>(rec.chunk_timeout.count()))
        .field("max_retries", rec.max_retries)
        .field("recover_after", rec.recover_after)
        .field("on_degrade", static_cast<bool>(rec.on_degrade))
        .field("report_path", rec.report_path)
        .end_object();
    w.end_object();
}

template <class W>
void write_stats(W& w, const pipeline_stats& s) {
    w.begin_object()
        .field("chunks", s.chunks)
        .field("gpu_chunks", s.gpu_chunks)
        .field("fallback_chunks", s.fallback_chunks)
        .field("failed_chunks", s.failed_chunks)
        .field("retries", s.retries)
        .field("recoveries", s.recoveries)
        .field("input_bytes", s.input_bytes)
        .field("output_bytes", s.output_bytes)
        .field("wall_seconds", s.wall_seconds)
        .field("h2d_seconds", s.h2d_seconds)
        .field("compute_seconds", s.compute_seconds)
        .field("d2h_seconds", s.d2h_seconds)
        .field("graph_seconds", s.graph_seconds)
        .field("h2d_gbps", s.h2d_gbps)
        .field("d2h_gbps", s.d2h_gbps)
        .field("throughput_gbps", s.throughput_gbps)
        .field("compute_to_transfer", s.compute_to_transfer)
        .field("overlap_efficiency", s.overlap_efficiency)
        .field("link_peak_gbps", s.link_peak_gbps)
        .field("depth", s.depth)
        .field("gpu_abandoned", s.gpu_abandoned)
        .field("alerts", s.alerts)
        .key("latency")
        .begin_object()
        .field("p50_seconds", s.latency.p50_seconds)
        .field("p90_seconds", s.latency.p90_seconds)
        .field("p99_seconds", s.latency.p99_seconds)
        .field("max_seconds", s.latency.max_seconds)
        .field("samples", s.latency.samples)
        .end_object()
        .end_object();
}

template <class W>
void write_failure(W& w, const chunk_failure& f) {
    w.begin_object()
        .field("chunk", f.chunk)
        .field("offset", f.offset)
        .field("elements", f.elements)
        .field("output_elements", f.output_elements)
        .field("input_bytes", f.input_bytes)
        .field("output_bytes", f.output_bytes)
        .field("depth", f.depth)
        .field("compute_streams", f.compute_streams)
        .field("device", f.device)
        .field("graph", f.graph)
        .field("h2d_stream", hex_pointer(f.h2d_stream))
        .field("compute_stream", hex_pointer(f.compute_stream))
        .field("d2h_stream", hex_pointer(f.d2h_stream))
        .field("host_in", hex_pointer(f.host_in))
        .field("host_out", hex_pointer(f.host_out))
        .field("device_in", hex_pointer(f.device_in))
        .field("device_out", hex_pointer(f.device_out))
        .field("level", to_string(f.level))
        .field("action", to_string(f.action))
        .key("error")
        .begin_object()
        .field("status", cudaGetErrorName(f.error.status))
        .field("status_code", static_cast<int>(f.error.status))
        .field("sticky", f.error.sticky)
        .field("timed_out", f.error.timed_out)
        .field("exception", f.error.exception != nullptr)
        .field("what", f.error.what)
        .end_object()
        .end_object();
}

/// The device's id and name; the name is null (and the status is given) when the runtime cannot
/// tell, e.g. without a device or after the context was lost.
template <class W>
void write_device(W& w, int id) {
    w.begin_object().field("id", id);
    cudaDeviceProp p{};
    cudaError_t st = cudaGetDeviceProperties(&p, id);
    if (st == cudaSuccess) {
        w.field("name", static_cast<const char*>(p.name));
    } else {
        (void)cudaGetLastError(); // not left behind for an unrelated later call
        w.key("name").null().field("error", cudaGetErrorName(st));
    }
    w.end_object();
}

} // namespace detail

/// Writes a pipeline's post-mortem report (the synopsis above) as one JSON object to `out`.
/// @throws what writing to `out` throws (with exceptions enabled on it)
/// (Both write_report overloads are function templates, called as written: only a translation
/// unit that writes a report compiles them.)
template <class Unused = void>
void write_report(std::ostream& out, const pipeline_options& options, const pipeline_stats& stats,
                  std::span<const chunk_failure> failures) {
    detail::basic_json_writer<Unused> w(out);
    w.begin_object().key("options");
    detail::write_options(w, options);
    w.key("stats");
    detail::write_stats(w, stats);
    w.key("failures").begin_array();
    for (const chunk_failure& f : failures) {
        detail::write_failure(w, f);
    }
    w.end_array().key("device");
    detail::write_device(w, options.streams.device);
    w.end_object();
    out << '\n';
}

/// Writes the report into the file `path` (replacing it).
/// @throws std::runtime_error when the file cannot be opened or written
template <class Unused = void>
void write_report(const std::string& path, const pipeline_options& options,
                  const pipeline_stats& stats, std::span<const chunk_failure> failures) {
    detail::dependent_t<Unused, std::ofstream> file(path, std::ios::out | std::ios::trunc);
    if (!file) {
        throw std::runtime_error("write_report: cannot open " + path);
    }
    write_report<Unused>(static_cast<std::ostream&>(file), options, stats, failures);
    file.close();
    if (!file) {
        throw std::runtime_error("write_report: cannot write " + path);
    }
}

namespace detail {

/// After a failure: the report of pipeline core `k` into options.recovery.report_path, if one is
/// set. Best effort: what goes wrong is told on stderr, so that the failure being reported is the
/// one the caller sees.
template <class Core>
void write_failure_report(const Core& k) noexcept {
    if (k.options.recovery.report_path.empty()) {
        return;
    }
    try {
        write_report(k.options.recovery.report_path, k.options,
                     k.monitor.stats(k.active_depth, k.gpu_abandoned), k.monitor.failures());
    } catch (const std::exception& e) {
        std::fprintf(stderr, "cudawait pipeline: the failure report was not written: %s\n",
                     e.what());
    } catch (...) {
        std::fprintf(stderr, "cudawait pipeline: the failure report was not written\n");
    }
}

} // namespace detail

} // namespace cudawait
