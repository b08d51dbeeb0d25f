// SPDX-License-Identifier: Apache-2.0
#pragma once

// Synopsis
//   timeline tl;                          spans of what ran where, on one steady_clock clock
//   opt.monitoring.timeline = &tl;        a pipeline records its GPU and host spans into it
//   tl.record(track, name, t0, t1, chunk) a host span from two steady_clock time points
//   timeline_scope s(&tl, track, name);   a host span to the end of the scope (may span co_await)
//   tl.anchor(device)                     pins the device's GPU clock to the host clock
//   tl.record_gpu(device, track, name, start_event, end_event, chunk)   a GPU span
//   tl.spans()  tl.tracks()               the spans; the tracks, none with overlapping spans
//   tl.write_chrome_trace(path | ostream)  tl.write_svg(path | ostream)
//
// Recording adds no synchronisation: GPU times are read once the work completed. Thread-safe.
// See docs/observe.md#timeline.

#include <cudawait/observe/detail/json.hpp>
#include <cudawait/runtime/detail/chrono.hpp>
#include <cudawait/runtime/device.hpp>
#include <cudawait/runtime/error.hpp>
#include <cudawait/runtime/event.hpp>
#include <cudawait/runtime/stream.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>
#include <mutex>
#include <ostream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>

namespace cudawait {

/// One interval of work on a track.
struct timeline_span {
    std::string track;
    std::string name;
    std::size_t chunk = 0;  ///< the chunk, or timeline::no_chunk
    std::int64_t start = 0; ///< ns since the timeline was made
    std::int64_t end = 0;   ///< ns since the timeline was made, >= start
    bool gpu = false;       ///< from timing events (a stream's track)
};

/// A track as exported: spans sorted by start, none overlapping the next.
struct timeline_track {
    std::string name;
    bool gpu = false;
    std::vector<timeline_span> spans;
};

namespace detail {

/// The GPU clock of a timeline: timing events recorded on a device, bracketed by the host
/// clock, and the time between two of them as the runtime reports it. A class template for the
/// reason basic_timeline is one (`Unused` is always void; use cuda_timing). The tests give
/// basic_timeline a stand-in of the same shape that simulates both clocks.
template <class Unused = void>
struct basic_cuda_timing {
    using clock = std::chrono::steady_clock;
    using event_type = event;
    /// An event that ran on the GPU at some host time between `before` and `after`.
    struct sample {
        event_type ev;
        clock::time_point before;
        clock::time_point after;
    };

    /// How old an anchor may be when a span is measured from it: elapsed times are float
    /// milliseconds, whose step is at most 0.24 us below 2^12 ms (about 4.2 s).
    static constexpr std::chrono::nanoseconds reanchor_after = std::chrono::seconds(4);

    [[nodiscard]] static clock::time_point now() noexcept { return clock::now(); }

    /// An event recorded on device `device` and waited for, a few times: the narrowest bracket.
    /// @throws cuda_error
    [[nodiscard]] static sample record_anchor(int device) {
        device_ref dev(device);
        stream s(dev);
        sample best{event(dev, cudaEventDefault), {}, {}};
        for (int i = 0; i < 3; ++i) {
            event e(dev, cudaEventDefault);
            const clock::time_point before = clock::now();
            e.record(s);
            check(cudaEventSynchronize(e.get()), "cudaEventSynchronize");
            const clock::time_point after = clock::now();
            if (i == 0 || after - before < best.after - best.before) {
                best = sample{std::move(e), before, after};
            }
        }
        return best;
    }

    /// Milliseconds from `from` to `to`, both complete; negative when `to` ran first.
    /// @throws cuda_error
    [[nodiscard]] static float elapsed_ms(cudaEvent_t from, cudaEvent_t to) {
        float ms = 0;
        check(cudaEventElapsedTime(&ms, from, to), "cudaEventElapsedTime");
        return ms;
    }
};

using cuda_timing = basic_cuda_timing<>;

/// Everything `timeline` is, as a class template that `timeline` derives from: the members of a
/// template are instantiated only where they are used, so a translation unit that includes
/// this header and makes no timeline does not instantiate them. `Timing` is cuda_timing except
/// in the tests.
template <class Timing = cuda_timing>
class basic_timeline {
public:
    using clock = std::chrono::steady_clock;
    static_assert(std::is_same_v<typename Timing::clock, clock>);
    /// The chunk of a span that belongs to none.
    static constexpr std::size_t no_chunk = std::numeric_limits<std::size_t>::max();

    /// Time 0 is now.
    basic_timeline() : m_origin(Timing::now()) {}
    basic_timeline(const basic_timeline&) = delete;
    basic_timeline& operator=(const basic_timeline&) = delete;

    /// Nanoseconds from the timeline's start to `t`.
    [[nodiscard]] std::int64_t to_ns(clock::time_point t) const noexcept {
        return std::chrono::duration_cast<std::chrono::nanoseconds>(t - m_origin).count();
    }

    /// Records a host span from `start` to `end` (swapped if given the wrong way round).
    void record(std::string_view track, std::string_view name, clock::time_point start,
                clock::time_point end, std::size_t chunk = no_chunk) {
        add(track, name, chunk, to_ns(start), to_ns(end), false);
    }

    /// Pins device `device`'s GPU clock to the host clock: records an event and waits for it
    /// (a few times, keeping the tightest bracket). Later calls return at once unless the
    /// device's anchor is older than Timing::reanchor_after, which they replace.
    /// @throws cuda_error
    void anchor(int device) {
        std::lock_guard lock(m_mutex);
        anchor_locked(device);
    }

    /// Records a GPU span between timing events `start` and `end` of device `device` (events
    /// made without cudaEventDisableTiming, both complete). Anchors the device first if needed
    /// (a first anchor should rather be taken before the work: anchor()), and replaces an anchor
    /// older than Timing::reanchor_after.
    /// @throws cuda_error
    void record_gpu(int device, std::string_view track, std::string_view name, event_ref start,
                    event_ref end, std::size_t chunk = no_chunk) {
        std::int64_t s = 0;
        std::int64_t e = 0;
        {
            std::lock_guard lock(m_mutex);
            const gpu_anchor& a = anchor_locked(device);
            s = a.host_ns + gpu_ns(Timing::elapsed_ms(a.ev.get(), start.get()));
            e = a.host_ns + gpu_ns(Timing::elapsed_ms(a.ev.get(), end.get()));
        }
        add(track, name, chunk, s, e, true);
    }

    /// A copy of the spans, sorted by start.
    [[nodiscard]] std::vector<timeline_span> spans() const {
        std::vector<timeline_span> v;
        {
            std::lock_guard lock(m_mutex);
            v = m_spans;
        }
        std::stable_sort(v.begin(), v.end(), [](const timeline_span& a, const timeline_span& b) {
            return a.start < b.start;
        });
        return v;
    }

    /// The tracks as exported: GPU tracks, then host tracks, in order of first appearance; a
    /// track whose spans overlap is split into lanes "<track>", "<track> #2", ...
    [[nodiscard]] std::vector<timeline_track> tracks() const {
        std::vector<timeline_span> all = spans();
        // Base tracks in order of first appearance (by start time), GPU ones first.
        std::vector<std::pair<std::string, bool>> order;
        for (const timeline_span& s : all) {
            std::pair<std::string, bool> key{s.track, s.gpu};
            if (std::find(order.begin(), order.end(), key) == order.end()) {
                order.push_back(std::move(key));
            }
        }
        std::stable_partition(order.begin(), order.end(), [](const auto& k) { return k.second; });
        std::vector<timeline_track> out;
        for (const auto& [name, gpu] : order) {
            std::vector<timeline_track> lanes;
            for (const timeline_span& s : all) {
                if (s.track != name || s.gpu != gpu) {
                    continue;
                }
                // The first lane whose last span ended by this one's start (spans by start).
                auto lane = std::find_if(lanes.begin(), lanes.end(), [&](const timeline_track& l) {
                    return l.spans.back().end <= s.start;
                });
                if (lane == lanes.end()) {
                    timeline_track t;
                    t.name = lanes.empty() ? name : name + " #" + std::to_string(lanes.size() + 1);
                    t.gpu = gpu;
                    lanes.push_back(std::move(t));
                    lane = lanes.end() - 1;
                }
                lane->spans.push_back(s);
            }
            for (timeline_track& l : lanes) {
                out.push_back(std::move(l));
            }
        }
        return out;
    }

    /// Writes the Chrome / Perfetto trace JSON.
    void write_chrome_trace(std::ostream& os) const {
        const std::vector<timeline_track> ts = tracks();
        const std::int64_t base = earliest(ts);
        detail::json_writer w(os);
        w.begin_object();
        w.field("displayTimeUnit", "ns");
        w.key("traceEvents").begin_array();
        for (int pid : {1, 2}) {
            w.begin_object()
                .field("ph", "M")
                .field("name", "process_name")
                .field("pid", pid)
                .field("tid", 0);
            w.key("args").begin_object().field("name", pid == 1 ? "GPU" : "host").end_object();
            w.end_object();
        }
        for (std::size_t i = 0; i < ts.size(); ++i) {
            const int pid = ts[i].gpu ? 1 : 2;
            const auto tid = static_cast<long long>(i + 1);
            w.begin_object()
                .field("ph", "M")
                .field("name", "thread_name")
                .field("pid", pid)
                .field("tid", tid);
            w.key("args").begin_object().field("name", ts[i].name).end_object();
            w.end_object();
            w.begin_object()
                .field("ph", "M")
                .field("name", "thread_sort_index")
                .field("pid", pid)
                .field("tid", tid);
            w.key("args").begin_object().field("sort_index", tid).end_object();
            w.end_object();
            for (const timeline_span& s : ts[i].spans) {
                // Whole microseconds, start and end rounded alike: the rounding is monotonic, so
                // spans of a lane that did not overlap still do not, and no parser's floating
                // point can make them.
                const std::int64_t b = to_us(s.start - base);
                const std::int64_t e = to_us(s.end - base);
                w.begin_object()
                    .field("ph", "X")
                    .field("name", s.name)
                    .field("cat", s.gpu ? "gpu" : "host")
                    .field("pid", pid)
                    .field("tid", tid)
                    .field("ts", b)
                    .field("dur", e - b);
                w.key("args").begin_object();
                if (s.chunk != no_chunk) {
                    w.field("chunk", s.chunk);
                }
                w.end_object();
                w.end_object();
            }
        }
        w.end_array();
        w.end_object();
        os << '\n';
    }

    /// Writes the trace JSON to the file `path`.
    /// @throws std::runtime_error when the file cannot be written
    void write_chrome_trace(const std::string& path) const {
        write_file(path, [&](std::ostream& os) { write_chrome_trace(os); });
    }

    /// Writes the SVG picture: a row per track, a rect per span, a time axis and a legend.
    void write_svg(std::ostream& os) const {
        const std::vector<timeline_track> ts = tracks();
        const std::int64_t base = earliest(ts);
        std::int64_t last = base;
        std::vector<std::string> names; // legend, in order of first appearance
        for (const timeline_track& t : ts) {
            for (const timeline_span& s : t.spans) {
                last = std::max(last, s.end);
                if (std::find(names.begin(), names.end(), s.name) == names.end()) {
                    names.push_back(s.name);
                }
            }
        }
        const double total_ns = static_cast<double>(std::max<std::int64_t>(1, last - base));
        constexpr double width = 1200, left = 170, right = 20, top = 40, row = 24;
        const double plot = width - left - right;
        const double rows_end = top + row * static_cast<double>(ts.size());
        const double height = rows_end + 30 + 22 * std::ceil(static_cast<double>(names.size()) / 6);
        auto x_of = [&](std::int64_t ns) {
            return left + plot * static_cast<double>(ns - base) / total_ns;
        };
        os << "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n";
        os << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << num(width) << "\" height=\""
           << num(height) << "\" viewBox=\"0 0 " << num(width) << ' ' << num(height)
           << "\" font-family=\"sans-serif\" font-size=\"12\">\n";
        os << "<rect x=\"0\" y=\"0\" width=\"" << num(width) << "\" height=\"" << num(height)
           << "\" fill=\"white\"/>\n";
        // The time axis: a tick every 1, 2 or 5 x 10^k ns, about ten over the width.
        const double step = nice_step(total_ns / 10);
        const double unit = step >= 1e6 ? 1e6 : step >= 1e3 ? 1e3 : 1;
        const char* unit_name = unit == 1e6 ? "ms" : unit == 1e3 ? "us" : "ns";
        for (double t = 0; t <= total_ns + 0.5; t += step) {
            const double x = left + plot * t / total_ns;
            os << "<line x1=\"" << num(x) << "\" y1=\"" << num(top - 6) << "\" x2=\"" << num(x)
               << "\" y2=\"" << num(rows_end) << "\" stroke=\"#dddddd\"/>\n";
            os << "<text x=\"" << num(x) << "\" y=\"" << num(top - 10)
               << "\" text-anchor=\"middle\">" << num(t / unit) << ' ' << unit_name << "</text>\n";
        }
        for (std::size_t i = 0; i < ts.size(); ++i) {
            const double y = top + row * static_cast<double>(i);
            os << "<text x=\"" << num(left - 8) << "\" y=\"" << num(y + row * 0.65)
               << "\" text-anchor=\"end\">"
               << xml(std::string(ts[i].gpu ? "GPU " : "host ") + ts[i].name) << "</text>\n";
            for (const timeline_span& s : ts[i].spans) {
                const double x0 = x_of(s.start);
                const double w = std::max(0.5, x_of(s.end) - x0);
                os << "<rect class=\"span\" x=\"" << num(x0) << "\" y=\"" << num(y + 3)
                   << "\" width=\"" << num(w) << "\" height=\"" << num(row - 6) << "\" fill=\""
                   << color_of(s.name) << "\" stroke=\"#333333\" stroke-width=\"0.3\"><title>"
                   << xml(s.name);
                if (s.chunk != no_chunk) {
                    os << " chunk " << s.chunk;
                }
                os << ": " << num(static_cast<double>(s.start - base) / 1e3) << " us + "
                   << num(static_cast<double>(s.end - s.start) / 1e3) << " us</title></rect>\n";
            }
        }
        for (std::size_t i = 0; i < names.size(); ++i) {
            const double x = left + static_cast<double>(i % 6) * 160;
            const double y = rows_end + 20 + 22 * static_cast<double>(i / 6);
            os << "<rect x=\"" << num(x) << "\" y=\"" << num(y - 11) << "\" width=\"14\" "
               << "height=\"14\" fill=\"" << color_of(names[i]) << "\"/>\n";
            os << "<text x=\"" << num(x + 20) << "\" y=\"" << num(y) << "\">" << xml(names[i])
               << "</text>\n";
        }
        os << "</svg>\n";
    }

    /// Writes the SVG picture to the file `path`.
    /// @throws std::runtime_error when the file cannot be written
    void write_svg(const std::string& path) const {
        write_file(path, [&](std::ostream& os) { write_svg(os); });
    }

private:
    struct gpu_anchor {
        typename Timing::event_type ev;
        std::int64_t host_ns = 0;
    };

    void add(std::string_view track, std::string_view name, std::size_t chunk, std::int64_t s,
             std::int64_t e, bool gpu) {
        if (e < s) {
            std::swap(s, e);
        }
        timeline_span span{std::string(track), std::string(name), chunk, s, e, gpu};
        std::lock_guard lock(m_mutex);
        m_spans.push_back(std::move(span));
    }

    /// Device `device`'s anchor, taken first if it has none or it is older than reanchor_after.
    const gpu_anchor& anchor_locked(int device) {
        auto it = m_anchors.find(device);
        const std::int64_t now = to_ns(Timing::now());
        if (it != m_anchors.end() &&
            now - it->second.host_ns < std::chrono::nanoseconds(Timing::reanchor_after).count()) {
            return it->second;
        }
        typename Timing::sample fresh = Timing::record_anchor(device);
        const std::int64_t before = to_ns(fresh.before);
        const std::int64_t after = to_ns(fresh.after);
        if (it == m_anchors.end()) {
            // The middle of the bracket is the closest guess of the event's host time.
            gpu_anchor first{std::move(fresh.ev), before + (after - before) / 2};
            return m_anchors.emplace(device, std::move(first)).first->second;
        }
        // The old anchor's mapping continued, so that spans measured from the two anchors line
        // up, unless that lies outside the bracket: the clocks drifted apart.
        gpu_anchor& a = it->second;
        const std::int64_t continued =
            a.host_ns + gpu_ns(Timing::elapsed_ms(a.ev.get(), fresh.ev.get()));
        a = gpu_anchor{std::move(fresh.ev), std::clamp(continued, before, after)};
        return a;
    }

    static std::int64_t gpu_ns(float ms) { return std::llround(static_cast<double>(ms) * 1e6); }

    static std::int64_t earliest(const std::vector<timeline_track>& ts) {
        std::int64_t base = std::numeric_limits<std::int64_t>::max();
        for (const timeline_track& t : ts) {
            if (!t.spans.empty()) {
                base = std::min(base, t.spans.front().start);
            }
        }
        return ts.empty() ? 0 : base;
    }

    // Nearest microsecond, halves up (monotonic also for negative values).
    static std::int64_t to_us(std::int64_t ns) {
        const std::int64_t q = ns / 1000;
        const std::int64_t r = ns % 1000;
        if (r >= 500) {
            return q + 1;
        }
        return r < -500 ? q - 1 : q;
    }

    static double nice_step(double raw) {
        double p = std::pow(10.0, std::floor(std::log10(std::max(raw, 1.0))));
        for (double m : {1.0, 2.0, 5.0, 10.0}) {
            if (m * p >= raw) {
                return m * p;
            }
        }
        return 10 * p;
    }

    static std::string num(double v) {
        char buf[32];
        std::snprintf(buf, sizeof buf, "%.6g", v);
        return buf;
    }

    static std::string xml(std::string_view s) {
        std::string out;
        for (char c : s) {
            switch (c) {
            case '&':
                out += "&amp;";
                break;
            case '<':
                out += "&lt;";
                break;
            case '>':
                out += "&gt;";
                break;
            case '"':
                out += "&quot;";
                break;
            default:
                // Control characters are not allowed in XML 1.0 text.
                out += static_cast<unsigned char>(c) < 0x20 ? ' ' : c;
            }
        }
        return out;
    }

    static const char* color_of(std::string_view name) {
        static constexpr std::pair<std::string_view, const char*> known[] = {
            {"h2d", "#4e79a7"},   {"compute", "#59a14f"},  {"d2h", "#f28e2b"},
            {"graph", "#b07aa1"}, {"stage-in", "#76b7b2"}, {"stage-out", "#edc948"},
            {"wait", "#bab0ac"},  {"fallback", "#e15759"},
        };
        for (const auto& [n, c] : known) {
            if (n == name) {
                return c;
            }
        }
        static constexpr const char* palette[] = {"#9c755f", "#ff9da7", "#8cd17d", "#499894",
                                                  "#d37295", "#a0cbe8", "#ffbe7d", "#86bcb6"};
        std::size_t h = 0;
        for (char c : name) {
            h = h * 131 + static_cast<unsigned char>(c);
        }
        return palette[h % std::size(palette)];
    }

    template <class Write>
    static void write_file(const std::string& path, Write&& write) {
        std::ofstream f(path, std::ios::binary | std::ios::trunc);
        if (!f) {
            throw std::runtime_error("timeline: cannot open " + path + " for writing");
        }
        write(f);
        f.flush();
        if (!f) {
            throw std::runtime_error("timeline: writing " + path + " failed");
        }
    }

    clock::time_point m_origin;
    mutable std::mutex m_mutex;
    std::vector<timeline_span> m_spans;
    std::map<int, gpu_anchor> m_anchors;
};

} // namespace detail

/// Spans of GPU and host work on one clock, exported as a Chrome trace or an SVG.
///
/// (Its members are those of detail::basic_timeline.)
class timeline : public detail::basic_timeline<> {
public:
    using detail::basic_timeline<>::basic_timeline;
};

namespace detail {
/// Everything `timeline_scope` is, as a class template it derives from, so that only a
/// translation unit that makes a scope instantiates timeline::record. `Unused` is always void.
template <class Unused = void>
class basic_timeline_scope {
public:
    basic_timeline_scope(timeline* t, std::string_view track, std::string_view name,
                         std::size_t chunk = timeline::no_chunk)
        : m_timeline(t), m_track(track), m_name(name), m_chunk(chunk) {
        if (m_timeline != nullptr) {
            m_start = timeline::clock::now();
        }
    }
    basic_timeline_scope(const basic_timeline_scope&) = delete;
    basic_timeline_scope& operator=(const basic_timeline_scope&) = delete;
    /// Records the span; a failure to record (out of memory) is not thrown from here.
    ~basic_timeline_scope() {
        if (m_timeline == nullptr) {
            return;
        }
        try {
            m_timeline->record(m_track, m_name, m_start, timeline::clock::now(), m_chunk);
        } catch (...) { // a destructor does not throw; the span is lost
        }
    }

private:
    timeline* m_timeline;
    std::string_view m_track; // string literals in the library's uses
    std::string_view m_name;
    std::size_t m_chunk;
    timeline::clock::time_point m_start{};
};

} // namespace detail

/// A host span on `track` from construction to destruction; records nothing when the
/// timeline is null. `track` and `name` are kept as views: they must outlive the scope. Safe across
/// co_await (it lives in the coroutine's frame).
///
/// (Its members are those of detail::basic_timeline_scope.)
class timeline_scope : public detail::basic_timeline_scope<> {
public:
    using detail::basic_timeline_scope<>::basic_timeline_scope;
};

} // namespace cudawait
