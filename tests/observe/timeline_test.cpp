// SPDX-License-Identifier: Apache-2.0
#include <cudawait/core/scheduler.hpp>
#include <cudawait/core/sync_wait.hpp>
#include <cudawait/observe/timeline.hpp>
#include <cudawait/pipeline/pipeline.hpp>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <cuda_runtime.h>

#include "gpu_fixture.hpp"
#include "test_kernels.hpp"
#include <gtest/gtest.h>

namespace {

using namespace cudawait::literals;
using cudawait::timeline;
using cudawait::timeline_span;
using clk = std::chrono::steady_clock;
using u32 = std::uint32_t;

// ---- a tiny JSON reader: the trace must parse back, whatever produced it ----------------------

struct json {
    enum kind { null, boolean, number, string, array, object } k = null;
    bool b = false;
    double n = 0;
    std::string s;
    std::vector<json> a;
    std::vector<std::pair<std::string, json>> o;

    [[nodiscard]] const json* get(const std::string& key) const {
        for (const auto& [name, v] : o) {
            if (name == key) {
                return &v;
            }
        }
        return nullptr;
    }
};

class json_reader {
public:
    explicit json_reader(std::string text) : m_text(std::move(text)) {}

    /// The one value of the text (only whitespace may follow); throws std::runtime_error.
    json parse() {
        json v = value();
        skip();
        if (m_pos != m_text.size()) {
            fail("trailing characters");
        }
        return v;
    }

private:
    [[noreturn]] void fail(const std::string& why) const {
        throw std::runtime_error("json at " + std::to_string(m_pos) + ": " + why);
    }
    void skip() {
        while (m_pos < m_text.size() &&
               std::string(" \t\r\n").find(m_text[m_pos]) != std::string::npos) {
            ++m_pos;
        }
    }
    char peek() {
        skip();
        if (m_pos >= m_text.size()) {
            fail("unexpected end");
        }
        return m_text[m_pos];
    }
    void expect(char c) {
        if (peek() != c) {
            fail(std::string("expected ") + c);
        }
        ++m_pos;
    }
    bool literal(const std::string& word) {
        if (m_text.compare(m_pos, word.size(), word) == 0) {
            m_pos += word.size();
            return true;
        }
        return false;
    }
    json value() {
        json v;
        char c = peek();
        if (c == '{') {
            v.k = json::object;
            ++m_pos;
            if (peek() == '}') {
                ++m_pos;
                return v;
            }
            for (;;) {
                if (peek() != '"') {
                    fail("object key");
                }
                std::string key = string_body();
                expect(':');
                v.o.emplace_back(std::move(key), value());
                if (peek() == ',') {
                    ++m_pos;
                    continue;
                }
                expect('}');
                return v;
            }
        }
        if (c == '[') {
            v.k = json::array;
            ++m_pos;
            if (peek() == ']') {
                ++m_pos;
                return v;
            }
            for (;;) {
                v.a.push_back(value());
                if (peek() == ',') {
                    ++m_pos;
                    continue;
                }
                expect(']');
                return v;
            }
        }
        if (c == '"') {
            v.k = json::string;
            v.s = string_body();
            return v;
        }
        if (literal("true") || literal("false")) {
            v.k = json::boolean;
            v.b = m_text[m_pos - 1] == 'e' && m_text[m_pos - 2] == 'u';
            return v;
        }
        if (literal("null")) {
            return v;
        }
        // A number: -?digits(.digits)?([eE][+-]?digits)?
        std::size_t start = m_pos;
        if (m_text[m_pos] == '-') {
            ++m_pos;
        }
        auto digits = [&] {
            std::size_t d = m_pos;
            while (m_pos < m_text.size() &&
                   std::isdigit(static_cast<unsigned char>(m_text[m_pos]))) {
                ++m_pos;
            }
            if (d == m_pos) {
                fail("digits");
            }
        };
        digits();
        if (m_pos < m_text.size() && m_text[m_pos] == '.') {
            ++m_pos;
            digits();
        }
        if (m_pos < m_text.size() && (m_text[m_pos] == 'e' || m_text[m_pos] == 'E')) {
            ++m_pos;
            if (m_text[m_pos] == '+' || m_text[m_pos] == '-') {
                ++m_pos;
            }
            digits();
        }
        v.k = json::number;
        v.n = std::stod(m_text.substr(start, m_pos - start));
        return v;
    }
    std::string string_body() {
        ++m_pos; // the opening quote
        std::string out;
        for (;;) {
            if (m_pos >= m_text.size()) {
                fail("unterminated string");
            }
            char c = m_text[m_pos++];
            if (c == '"') {
                return out;
            }
            if (static_cast<unsigned char>(c) < 0x20) {
                fail("control character in a string");
            }
            if (c != '\\') {
                out += c;
                continue;
            }
            char e = m_text.at(m_pos++);
            switch (e) {
            case '"':
            case '\\':
            case '/':
                out += e;
                break;
            case 'n':
                out += '\n';
                break;
            case 't':
                out += '\t';
                break;
            case 'r':
                out += '\r';
                break;
            case 'b':
                out += '\b';
                break;
            case 'f':
                out += '\f';
                break;
            case 'u': {
                unsigned code = std::stoul(m_text.substr(m_pos, 4), nullptr, 16);
                m_pos += 4;
                out += code < 0x80 ? static_cast<char>(code) : '?';
                break;
            }
            default:
                fail("bad escape");
            }
        }
    }

    std::string m_text;
    std::size_t m_pos = 0;
};

/// A trace's complete events, by track name (from the thread_name metadata).
struct parsed_trace {
    struct span {
        std::string name;
        double ts = 0;
        double dur = 0;
        double chunk = -1;
        bool gpu = false;
    };
    std::map<std::string, std::vector<span>> tracks;
    std::size_t complete_events = 0;
};

/// Parses `text` as a Chrome trace and checks its shape: every X event on a named track, with
/// numeric ts and dur >= 0, and no two X events of one track overlapping.
parsed_trace read_trace(const std::string& text) {
    json root = json_reader(text).parse();
    EXPECT_EQ(root.k, json::object);
    const json* events = root.get("traceEvents");
    if (events == nullptr || events->k != json::array) {
        ADD_FAILURE() << "no traceEvents array";
        return {};
    }
    std::map<std::pair<double, double>, std::string> names; // (pid, tid) -> track
    for (const json& e : events->a) {
        if (e.get("ph")->s == "M" && e.get("name")->s == "thread_name") {
            names[{e.get("pid")->n, e.get("tid")->n}] = e.get("args")->get("name")->s;
        }
    }
    parsed_trace out;
    for (const json& e : events->a) {
        if (e.get("ph")->s != "X") {
            continue;
        }
        ++out.complete_events;
        auto key = std::make_pair(e.get("pid")->n, e.get("tid")->n);
        EXPECT_TRUE(names.count(key)) << "an event on a track without a name";
        parsed_trace::span s;
        s.name = e.get("name")->s;
        EXPECT_EQ(e.get("ts")->k, json::number);
        EXPECT_EQ(e.get("dur")->k, json::number);
        s.ts = e.get("ts")->n;
        s.dur = e.get("dur")->n;
        EXPECT_GE(s.dur, 0);
        s.gpu = e.get("cat")->s == "gpu";
        if (const json* c = e.get("args")->get("chunk")) {
            s.chunk = c->n;
        }
        out.tracks[names[key]].push_back(s);
    }
    for (auto& [name, spans] : out.tracks) {
        std::sort(spans.begin(), spans.end(),
                  [](const auto& a, const auto& b) { return a.ts < b.ts; });
        for (std::size_t i = 1; i < spans.size(); ++i) {
            EXPECT_LE(spans[i - 1].ts + spans[i - 1].dur, spans[i].ts)
                << "overlapping events on track " << name << " at " << i;
        }
    }
    return out;
}

std::string chrome_trace_of(const timeline& t) {
    std::ostringstream os;
    t.write_chrome_trace(os);
    return os.str();
}

std::string svg_of(const timeline& t) {
    std::ostringstream os;
    t.write_svg(os);
    return os.str();
}

std::size_t count_of(const std::string& text, const std::string& what) {
    std::size_t n = 0;
    for (std::size_t p = text.find(what); p != std::string::npos; p = text.find(what, p + 1)) {
        ++n;
    }
    return n;
}

// ---- host: a timeline built by hand ------------------------------------------------------------

TEST(timeline, overlapping_spans_of_a_track_are_split_into_lanes) {
    timeline t;
    auto at = [&](int us) { return clk::time_point{} + std::chrono::microseconds(us); };
    // Time points far from the timeline's origin: only differences matter.
    t.record("wait", "wait", at(0), at(10), 0);
    t.record("wait", "wait", at(5), at(15), 1);  // overlaps the first: lane 2
    t.record("wait", "wait", at(10), at(20), 2); // starts as the first ends: lane 1 again
    t.record("wait", "wait", at(6), at(7), 3);   // inside both: lane 3
    auto tracks = t.tracks();
    ASSERT_EQ(tracks.size(), 3u);
    EXPECT_EQ(tracks[0].name, "wait");
    EXPECT_EQ(tracks[1].name, "wait #2");
    EXPECT_EQ(tracks[2].name, "wait #3");
    ASSERT_EQ(tracks[0].spans.size(), 2u);
    EXPECT_EQ(tracks[0].spans[0].chunk, 0u);
    EXPECT_EQ(tracks[0].spans[1].chunk, 2u);
    ASSERT_EQ(tracks[1].spans.size(), 1u);
    EXPECT_EQ(tracks[1].spans[0].chunk, 1u);
    ASSERT_EQ(tracks[2].spans.size(), 1u);
    EXPECT_EQ(tracks[2].spans[0].chunk, 3u);
    EXPECT_EQ(tracks[2].spans[0].end - tracks[2].spans[0].start, 1000);
}

TEST(timeline, random_spans_keep_every_span_and_no_lane_overlaps) {
    timeline t;
    std::mt19937_64 rng(7);
    const char* names[] = {"stage-in", "wait", "my work"};
    std::map<std::string, std::size_t> recorded;
    const clk::time_point base = clk::now();
    for (std::size_t i = 0; i < 300; ++i) {
        auto start = base + std::chrono::nanoseconds(rng() % 1'000'000);
        auto len = std::chrono::nanoseconds(rng() % 50'000);
        const char* track = names[rng() % 3];
        t.record(track, "x", start, start + len, i);
        ++recorded[track];
    }
    std::map<std::string, std::size_t> found;
    std::set<std::size_t> chunks;
    for (const auto& tr : t.tracks()) {
        for (std::size_t i = 0; i < tr.spans.size(); ++i) {
            ++found[tr.spans[i].track];
            chunks.insert(tr.spans[i].chunk);
            if (i > 0) {
                EXPECT_LE(tr.spans[i - 1].end, tr.spans[i].start) << tr.name;
            }
            EXPECT_EQ(tr.name.rfind(tr.spans[i].track, 0), 0u) << "lane of its own track";
        }
    }
    EXPECT_EQ(found, recorded);
    EXPECT_EQ(chunks.size(), 300u);
    // The export keeps that: every span once, no overlap per track, valid JSON.
    parsed_trace p = read_trace(chrome_trace_of(t));
    EXPECT_EQ(p.complete_events, 300u);
}

TEST(timeline, the_chrome_trace_is_valid_json_with_named_tracks_and_escaped_names) {
    timeline t;
    const clk::time_point t0 = clk::now();
    auto at = [&](int us) { return t0 + std::chrono::microseconds(us); };
    t.record("stage-in", "stage-in", at(100), at(350), 0);
    t.record("stage-in", "stage-in", at(400), at(600), 1);
    t.record("user \"quoted\"\ttrack", "a\nname\\with<odd>&chars", at(120), at(130));
    const std::string text = chrome_trace_of(t);
    parsed_trace p = read_trace(text);
    EXPECT_EQ(p.complete_events, 3u);
    ASSERT_EQ(p.tracks.count("stage-in"), 1u);
    const auto& in = p.tracks["stage-in"];
    ASSERT_EQ(in.size(), 2u);
    // Times from the earliest span, in whole microseconds.
    EXPECT_EQ(in[0].ts, 0);
    EXPECT_EQ(in[0].dur, 250);
    EXPECT_EQ(in[1].ts, 300);
    EXPECT_EQ(in[1].dur, 200);
    EXPECT_EQ(in[0].chunk, 0);
    EXPECT_EQ(in[1].chunk, 1);
    EXPECT_FALSE(in[0].gpu);
    ASSERT_EQ(p.tracks.count("user \"quoted\"\ttrack"), 1u);
    const auto& user = p.tracks["user \"quoted\"\ttrack"];
    ASSERT_EQ(user.size(), 1u);
    EXPECT_EQ(user[0].name, "a\nname\\with<odd>&chars");
    EXPECT_EQ(user[0].chunk, -1) << "no chunk: no chunk argument";
    EXPECT_NE(text.find("\"process_name\""), std::string::npos);
}

TEST(timeline, an_empty_timeline_still_exports_valid_files) {
    timeline t;
    parsed_trace p = read_trace(chrome_trace_of(t));
    EXPECT_EQ(p.complete_events, 0u);
    const std::string svg = svg_of(t);
    EXPECT_EQ(svg.rfind("<?xml", 0), 0u);
    EXPECT_NE(svg.find("</svg>"), std::string::npos);
    EXPECT_EQ(count_of(svg, "class=\"span\""), 0u);
}

TEST(timeline, the_svg_has_a_rect_per_span_a_row_per_track_and_escapes_text) {
    timeline t;
    const clk::time_point t0 = clk::now();
    auto at = [&](int us) { return t0 + std::chrono::microseconds(us); };
    std::size_t spans = 0;
    for (int c = 0; c < 5; ++c) {
        t.record("stage-in", "stage-in", at(c * 100), at(c * 100 + 60), c);
        t.record("wait", "wait", at(c * 100 + 10), at(c * 100 + 150), c); // overlaps: 2 lanes
        spans += 2;
    }
    t.record("mine", "<b>&</b>", at(5), at(7));
    ++spans;
    const std::string svg = svg_of(t);
    EXPECT_EQ(svg.rfind("<?xml", 0), 0u);
    EXPECT_NE(svg.find("<svg xmlns=\"http://www.w3.org/2000/svg\""), std::string::npos);
    EXPECT_NE(svg.find("</svg>\n"), std::string::npos);
    EXPECT_EQ(count_of(svg, "class=\"span\""), spans);
    EXPECT_EQ(count_of(svg, "<title>"), spans);
    for (const char* row : {">host stage-in<", ">host wait<", ">host wait #2<", ">host mine<"}) {
        EXPECT_NE(svg.find(row), std::string::npos) << row;
    }
    EXPECT_EQ(svg.find("<b>"), std::string::npos) << "text is escaped";
    EXPECT_NE(svg.find("&lt;b&gt;&amp;&lt;/b&gt;"), std::string::npos);
    // A time axis with unit labels, and a legend entry per span name.
    EXPECT_NE(svg.find(" us</text>"), std::string::npos);
    EXPECT_EQ(t.tracks().size(), 4u);
}

TEST(timeline, a_scope_records_one_span_and_a_null_timeline_none) {
    timeline t;
    { cudawait::timeline_scope s(nullptr, "wait", "wait", 3); }
    EXPECT_TRUE(t.spans().empty());
    const auto before = t.to_ns(clk::now());
    {
        cudawait::timeline_scope s(&t, "host work", "load", 7);
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    const auto after = t.to_ns(clk::now());
    auto spans = t.spans();
    ASSERT_EQ(spans.size(), 1u);
    EXPECT_EQ(spans[0].track, "host work");
    EXPECT_EQ(spans[0].name, "load");
    EXPECT_EQ(spans[0].chunk, 7u);
    EXPECT_FALSE(spans[0].gpu);
    EXPECT_GE(spans[0].start, before);
    EXPECT_LE(spans[0].end, after);
    EXPECT_GE(spans[0].end - spans[0].start, 2'000'000);
}

TEST(timeline, files_are_written_and_an_unwritable_path_throws) {
    timeline t;
    const clk::time_point t0 = clk::now();
    t.record("a", "a", t0, t0 + std::chrono::microseconds(5));
    const auto dir = std::filesystem::temp_directory_path();
    const std::string json_path = (dir / "cudawait_timeline_test.json").string();
    const std::string svg_path = (dir / "cudawait_timeline_test.svg").string();
    t.write_chrome_trace(json_path);
    t.write_svg(svg_path);
    auto slurp = [](const std::string& p) {
        std::ifstream f(p, std::ios::binary);
        return std::string(std::istreambuf_iterator<char>(f), {});
    };
    EXPECT_EQ(slurp(json_path), chrome_trace_of(t));
    EXPECT_EQ(slurp(svg_path), svg_of(t));
    std::filesystem::remove(json_path);
    std::filesystem::remove(svg_path);
    EXPECT_THROW(t.write_svg((dir / "no such dir" / "x.svg").string()), std::runtime_error);
    EXPECT_THROW(t.write_chrome_trace((dir / "no such dir" / "x.json").string()),
                 std::runtime_error);
}

// ---- host: GPU spans on simulated clocks ----------------------------------------------------

// The GPU side of a timeline, simulated: a host clock that moves only when the test or an
// anchor's wait moves it, a GPU clock that runs from it at a chosen rate, events that hold their
// GPU time, and elapsed times as the runtime reports them, in float milliseconds. An anchor's
// event runs 4 us into a bracket of 10 to 20 us, as on an H200.
struct simulated_timing {
    using clock = std::chrono::steady_clock;
    static constexpr std::chrono::nanoseconds reanchor_after =
        cudawait::detail::cuda_timing::reanchor_after;

    struct event_type {
        std::unique_ptr<std::int64_t> gpu_ns; // on the heap: the handle survives moves
        [[nodiscard]] cudaEvent_t get() const noexcept {
            return reinterpret_cast<cudaEvent_t>(gpu_ns.get());
        }
    };
    struct sample {
        event_type ev;
        clock::time_point before;
        clock::time_point after;
    };

    static inline clock::time_point host_now{};
    static inline double gpu_rate = 1.0; // GPU nanoseconds per host nanosecond
    static inline std::size_t anchors = 0;
    static inline std::mt19937_64 rng;

    static void reset(double rate) {
        host_now = clock::time_point{} + std::chrono::hours(100);
        gpu_rate = rate;
        anchors = 0;
        rng.seed(5);
    }
    static clock::time_point now() noexcept { return host_now; }
    /// An event that ran at host time `t` (the GPU clock counts from its own zero).
    static event_type event_at(clock::time_point t) {
        const auto host =
            std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch());
        const double gpu = static_cast<double>(host.count()) * gpu_rate;
        return {std::make_unique<std::int64_t>(std::llround(gpu) - 123'456'789'000)};
    }
    static sample record_anchor(int device) {
        EXPECT_EQ(device, 0);
        ++anchors;
        const clock::time_point before = host_now;
        host_now += std::chrono::microseconds(10 + static_cast<int>(rng() % 11));
        return {event_at(before + std::chrono::microseconds(4)), before, host_now};
    }
    static float elapsed_ms(cudaEvent_t from, cudaEvent_t to) {
        const std::int64_t ns = *reinterpret_cast<const std::int64_t*>(to) -
                                *reinterpret_cast<const std::int64_t*>(from);
        return static_cast<float>(static_cast<double>(ns) / 1e6);
    }
};

using simulated_timeline = cudawait::detail::basic_timeline<simulated_timing>;

// A span that ran between host times `start` and `end`, recorded on track "stream".
void record_simulated(simulated_timeline& tl, clk::time_point start, clk::time_point end,
                      std::size_t chunk) {
    const auto s = simulated_timing::event_at(start);
    const auto e = simulated_timing::event_at(end);
    tl.record_gpu(0, "stream", "kernel", s.get(), e.get(), chunk);
}

TEST(timeline, gpu_spans_keep_sub_microsecond_steps_an_hour_after_the_anchor) {
    simulated_timing::reset(1.0);
    simulated_timeline tl;
    tl.anchor(0);
    simulated_timing::host_now += std::chrono::hours(1);
    // Ten kernels of 1 to 2.2 us, 10.3 us apart, that ended a millisecond ago. Measured from
    // the hour-old anchor, the float's step would be 250 us.
    const clk::time_point first = simulated_timing::host_now - std::chrono::milliseconds(1);
    auto start_of = [&](std::size_t k) { return first + std::chrono::nanoseconds(10'300 * k); };
    auto length_of = [](std::size_t k) { return static_cast<std::int64_t>(1'000 + 137 * k); };
    for (std::size_t k = 0; k < 10; ++k) {
        record_simulated(tl, start_of(k), start_of(k) + std::chrono::nanoseconds(length_of(k)), k);
    }
    EXPECT_EQ(simulated_timing::anchors, 2u) << "the hour-old anchor was replaced, once";
    const std::vector<timeline_span> spans = tl.spans();
    ASSERT_EQ(spans.size(), 10u);
    for (std::size_t k = 0; k < spans.size(); ++k) {
        EXPECT_EQ(spans[k].chunk, k);
        EXPECT_NEAR(spans[k].end - spans[k].start, length_of(k), 100) << k;
        // On the host clock, to within the anchor's bracket.
        EXPECT_NEAR(spans[k].start, tl.to_ns(start_of(k)), 20'000) << k;
        if (k > 0) {
            EXPECT_NEAR(spans[k].start - spans[k - 1].start, 10'300, 100) << k;
        }
    }
}

// Ten simulated minutes of a stream that is never idle: one kernel a second, each starting
// 1 us after the last one ended, recorded a millisecond after it ended. The anchor is replaced
// every few seconds; its bracket's width varies, so the middle of each would put the event at a
// different place in it. The new anchors continue the old mapping: the kernels still line up.
TEST(timeline, spans_of_a_stream_line_up_across_new_anchors) {
    simulated_timing::reset(1.0);
    simulated_timeline tl;
    tl.anchor(0);
    clk::time_point last_end = simulated_timing::host_now;
    std::vector<std::pair<std::int64_t, std::int64_t>> truth;
    for (std::size_t i = 0; i < 600; ++i) {
        simulated_timing::host_now += std::chrono::seconds(1);
        const clk::time_point start = last_end + std::chrono::microseconds(1);
        last_end = simulated_timing::host_now - std::chrono::milliseconds(1);
        record_simulated(tl, start, last_end, i);
        truth.emplace_back(tl.to_ns(start), tl.to_ns(last_end));
    }
    EXPECT_GE(simulated_timing::anchors, 100u);
    EXPECT_LE(simulated_timing::anchors, 200u);
    const std::vector<cudawait::timeline_track> tracks = tl.tracks();
    ASSERT_EQ(tracks.size(), 1u) << "a span overlapped the one before it";
    ASSERT_EQ(tracks[0].spans.size(), truth.size());
    for (std::size_t i = 0; i < truth.size(); ++i) {
        const timeline_span& s = tracks[0].spans[i];
        ASSERT_EQ(s.chunk, i);
        EXPECT_NEAR(s.start, truth[i].first, 20'000) << i;
        EXPECT_NEAR(s.end - s.start, truth[i].second - truth[i].first, 1'000) << i;
    }
}

// A GPU clock 5 ppm fast or slow drifts 3 ms from the host's in ten minutes. The new anchors
// follow the host clock: spans stay within a bracket plus one anchor's drift of it.
TEST(timeline, new_anchors_follow_a_drifting_gpu_clock) {
    for (double rate : {1.0 + 5e-6, 1.0 - 5e-6}) {
        simulated_timing::reset(rate);
        simulated_timeline tl;
        tl.anchor(0);
        std::int64_t worst = 0;
        for (std::size_t i = 0; i < 600; ++i) {
            simulated_timing::host_now += std::chrono::seconds(1);
            const clk::time_point start = simulated_timing::host_now - std::chrono::milliseconds(3);
            record_simulated(tl, start, start + std::chrono::milliseconds(2), i);
            const timeline_span s = tl.spans().back();
            ASSERT_EQ(s.chunk, i);
            worst = std::max(worst, std::abs(s.start - tl.to_ns(start)));
            EXPECT_NEAR(s.end - s.start, 2'000'000, 1'000) << rate << " " << i;
        }
        EXPECT_LE(worst, 40'000) << "rate " << rate;
    }
}

// ---- GPU: a pipeline's timeline ------------------------------------------------------------

// Pipelines leave pool blocks pending on their events until the pool collects them: the
// fixture drains the device and the default pool, then checks that nothing is left.
class timeline_gpu : public cudawait::testing::pool_gpu_test {};

/// The union of a track's busy intervals, in us (spans of one track never overlap).
double busy_us(const std::vector<parsed_trace::span>& spans) {
    double sum = 0;
    for (const auto& s : spans) {
        sum += s.dur;
    }
    return sum;
}

cudawait::pipeline<u32>::stage transform_stage(u32 salt) {
    return [salt](std::span<u32> in, std::span<u32> out, cudawait::stream_ref s) {
        cudawait::check(
            cudawait::testing::launch_transform(in.data(), out.data(), in.size(), salt, 0, s.get()),
            "launch_transform");
    };
}

TEST_F(timeline_gpu, a_pipeline_timeline_has_a_span_per_chunk_and_stage_and_the_trace_overlaps) {
    const std::size_t chunk = 8_MiB / sizeof(u32);
    const std::size_t chunks = 24;
    const std::size_t n = chunk * chunks;
    const u32 salt = 0x71e;
    cudawait::pinned_buffer<u32> in(n);
    cudawait::pinned_buffer<u32> out(n);
    std::mt19937 rng(11);
    for (auto& x : in) {
        x = static_cast<u32>(rng());
    }
    cudawait::pipeline_options o;
    o.memory.group_bytes = 0; // one chunk per flight: per-chunk spans
    o.chunk_elements = chunk;
    o.depth = 3;
    cudawait::scheduler sched;
    {
        // Warm-up (kernel loading, the pool's first pinned blocks) in a pipeline of its own.
        cudawait::pipeline<u32> warm(o, {transform_stage(salt)});
        cudawait::sync_wait(sched, warm.run(in.span(), out.span()));
    }
    std::fill(out.begin(), out.end(), 0xdeadbeefu);
    timeline tl;
    o.monitoring.timeline = &tl;
    cudawait::pipeline<u32> p(o, {transform_stage(salt)});
    const std::int64_t t0 = tl.to_ns(clk::now());
    cudawait::sync_wait(sched, p.run(in.span(), out.span()));
    const std::int64_t t1 = tl.to_ns(clk::now());
    const cudawait::pipeline_stats st = p.stats();
    for (std::size_t c = 0; c < chunks; ++c) {
        std::vector<u32> want(chunk);
        cudawait::testing::transform_on_host(in.data() + c * chunk, want.data(), chunk, salt);
        ASSERT_TRUE(std::equal(want.begin(), want.end(), out.data() + c * chunk)) << "chunk " << c;
    }

    // Every chunk once on each GPU track and on "wait", within the run (the GPU clock is
    // pinned to the host's to within microseconds: 200 us of slack).
    constexpr std::int64_t slack = 200'000;
    std::map<std::string, std::set<std::size_t>> chunks_of;
    for (const timeline_span& s : tl.spans()) {
        EXPECT_GE(s.start, t0 - slack) << s.track << " chunk " << s.chunk;
        EXPECT_LE(s.end, t1 + slack) << s.track << " chunk " << s.chunk;
        EXPECT_LE(s.start, s.end);
        EXPECT_LT(s.chunk, chunks);
        EXPECT_TRUE(chunks_of[s.track].insert(s.chunk).second)
            << s.track << " chunk " << s.chunk << " twice";
        EXPECT_EQ(s.gpu, s.track == "h2d" || s.track == "compute" || s.track == "d2h") << s.track;
    }
    EXPECT_EQ(tl.spans().size(), 4 * chunks) << "h2d, compute, d2h and wait per chunk";
    for (const char* track : {"h2d", "compute", "d2h", "wait"}) {
        EXPECT_EQ(chunks_of[track].size(), chunks) << track;
    }

    // The exported trace, parsed back: no overlap on a track (read_trace checks), and the
    // overlap it shows close to the pipeline's own figure. Trace overlap: the busiest GPU
    // track's busy time over the time from the first GPU span's start to the last one's end;
    // stats: the longest stage's summed time over the run's wall time.
    parsed_trace pt = read_trace(chrome_trace_of(tl));
    EXPECT_EQ(pt.complete_events, 4 * chunks);
    double first = 1e300;
    double last = -1e300;
    double busiest = 0;
    for (const char* track : {"h2d", "compute", "d2h"}) {
        ASSERT_EQ(pt.tracks.count(track), 1u) << track;
        EXPECT_EQ(pt.tracks.count(std::string(track) + " #2"), 0u) << "one stream, one lane";
        const auto& spans = pt.tracks[track];
        ASSERT_EQ(spans.size(), chunks) << track;
        for (const auto& s : spans) {
            EXPECT_TRUE(s.gpu);
            first = std::min(first, s.ts);
            last = std::max(last, s.ts + s.dur);
        }
        busiest = std::max(busiest, busy_us(spans));
    }
    ASSERT_GT(last, first);
    const double trace_overlap = busiest / (last - first);
    EXPECT_GT(st.overlap_efficiency, 0);
    EXPECT_GE(trace_overlap, 0.9 * st.overlap_efficiency)
        << "trace " << trace_overlap << ", stats " << st.overlap_efficiency;
    EXPECT_LE(trace_overlap, 1.0 + 1e-9);
    // H2D of a later chunk runs while D2H of an earlier one does: the tracks overlap in time.
    const auto& h2d = pt.tracks["h2d"];
    const auto& d2h = pt.tracks["d2h"];
    bool overlapped = false;
    for (const auto& a : h2d) {
        for (const auto& b : d2h) {
            overlapped = overlapped || (a.ts < b.ts + b.dur && b.ts < a.ts + a.dur);
        }
    }
    EXPECT_TRUE(overlapped) << "no H2D ran while a D2H did";
    const std::string svg = svg_of(tl);
    EXPECT_EQ(count_of(svg, "class=\"span\""), tl.spans().size());
}

TEST_F(timeline_gpu, pageable_ranges_show_stage_in_and_stage_out_per_chunk) {
    const std::size_t chunk = 1_MiB / sizeof(u32);
    const std::size_t chunks = 6;
    const std::size_t n = chunk * chunks + 1000; // a short last chunk
    const u32 salt = 0x5a;
    std::vector<u32> in(n);
    std::mt19937 rng(12);
    for (auto& x : in) {
        x = static_cast<u32>(rng());
    }
    std::vector<u32> out(n, 0xdeadbeefu);
    timeline tl;
    cudawait::pipeline_options o;
    o.memory.group_bytes = 0; // one chunk per flight: per-chunk spans
    o.chunk_elements = chunk;
    o.depth = 2;
    o.monitoring.timeline = &tl;
    cudawait::pipeline<u32> p(o, {transform_stage(salt)});
    cudawait::scheduler sched;
    cudawait::sync_wait(sched, p.run(in, out));
    for (std::size_t c = 0; c <= chunks; ++c) {
        const std::size_t len = std::min(chunk, n - c * chunk);
        std::vector<u32> want(len);
        cudawait::testing::transform_on_host(in.data() + c * chunk, want.data(), len, salt);
        ASSERT_TRUE(std::equal(want.begin(), want.end(), out.begin() + c * chunk)) << c;
    }
    std::map<std::string, std::set<std::size_t>> chunks_of;
    for (const timeline_span& s : tl.spans()) {
        chunks_of[s.track].insert(s.chunk);
    }
    for (const char* track : {"stage-in", "stage-out", "wait", "h2d", "compute", "d2h"}) {
        EXPECT_EQ(chunks_of[track].size(), chunks + 1) << track;
    }
    parsed_trace pt = read_trace(chrome_trace_of(tl));
    EXPECT_EQ(pt.complete_events, tl.spans().size());
}

TEST_F(timeline_gpu, work_awaited_outside_a_pipeline_is_recorded_between_its_events) {
    timeline tl;
    tl.anchor(0);
    cudawait::stream s(cudawait::device_ref(0));
    cudawait::event start(cudawait::device_ref(0), cudaEventDefault);
    cudawait::event end(cudawait::device_ref(0), cudaEventDefault);
    cudawait::device_buffer<u32> out(1, s);
    const std::int64_t before = tl.to_ns(clk::now());
    start.record(s);
    cudawait::check(cudawait::testing::launch_spin(3'000'000, out.data(), 1, s.get()),
                    "launch_spin"); // 3 ms on the GPU
    end.record(s);
    cudawait::scheduler sched;
    cudawait::sync_wait(sched, [&]() -> cudawait::task<void> {
        cudawait::timeline_scope span(&tl, "my host", "await spin");
        co_await cudawait::event_ref(end);
    }());
    tl.record_gpu(0, "my stream", "spin", start, end, 42);
    const std::int64_t after = tl.to_ns(clk::now());
    std::map<std::string, timeline_span> by_track;
    for (const auto& sp : tl.spans()) {
        by_track[sp.track] = sp;
    }
    ASSERT_EQ(by_track.size(), 2u);
    const timeline_span& gpu = by_track["my stream"];
    EXPECT_TRUE(gpu.gpu);
    EXPECT_EQ(gpu.chunk, 42u);
    EXPECT_GE(gpu.end - gpu.start, 2'900'000) << "the spin's 3 ms";
    EXPECT_GE(gpu.start, before - 200'000);
    EXPECT_LE(gpu.end, after + 200'000);
    const timeline_span& host = by_track["my host"];
    EXPECT_FALSE(host.gpu);
    EXPECT_LE(host.end, after);
    // The await ended after the GPU span did (to within the clock pinning).
    EXPECT_GE(host.end + 200'000, gpu.end);
    auto tracks = tl.tracks();
    ASSERT_EQ(tracks.size(), 2u);
    EXPECT_TRUE(tracks[0].gpu) << "GPU tracks come first";
    EXPECT_EQ(tracks[0].name, "my stream");
}

// The CUDA timing with a new anchor for every span, taken after the span's events ran (the
// elapsed times from it are negative).
struct anchor_per_span : cudawait::detail::cuda_timing {
    static constexpr std::chrono::nanoseconds reanchor_after{0};
};

TEST_F(timeline_gpu, spans_measured_from_new_anchors_stay_between_their_events_and_line_up) {
    cudawait::detail::basic_timeline<anchor_per_span> tl;
    tl.anchor(0);
    cudawait::stream s(cudawait::device_ref(0));
    constexpr std::size_t kernels = 8;
    std::vector<cudawait::event> starts;
    std::vector<cudawait::event> ends;
    for (std::size_t i = 0; i < kernels; ++i) {
        starts.emplace_back(cudawait::device_ref(0), cudaEventDefault);
        ends.emplace_back(cudawait::device_ref(0), cudaEventDefault);
    }
    cudawait::device_buffer<u32> out(kernels, s);
    const std::int64_t before = tl.to_ns(clk::now());
    for (std::size_t i = 0; i < kernels; ++i) {
        starts[i].record(s);
        cudawait::check(cudawait::testing::launch_spin(1'000'000, out.data() + i,
                                                       static_cast<u32>(i + 1), s.get()),
                        "launch_spin"); // 1 ms on the GPU
        ends[i].record(s);
    }
    std::vector<u32> got(kernels, 0xdeadbeefu);
    cudawait::check(cudaMemcpyAsync(got.data(), out.data(), kernels * sizeof(u32),
                                    cudaMemcpyDeviceToHost, s.get()),
                    "cudaMemcpyAsync");
    cudawait::check(cudaStreamSynchronize(s.get()), "cudaStreamSynchronize");
    const std::int64_t after = tl.to_ns(clk::now());
    for (std::size_t i = 0; i < kernels; ++i) {
        EXPECT_EQ(got[i], i + 1);
        tl.record_gpu(0, "spins", "spin", starts[i], ends[i], i);
    }
    const std::vector<timeline_span> spans = tl.spans();
    ASSERT_EQ(spans.size(), kernels);
    for (std::size_t i = 0; i < kernels; ++i) {
        EXPECT_EQ(spans[i].chunk, i);
        EXPECT_GE(spans[i].end - spans[i].start, 999'000) << "the spin's 1 ms";
        EXPECT_GE(spans[i].start, before - 200'000);
        EXPECT_LE(spans[i].end, after + 200'000);
        if (i > 0) {
            EXPECT_GE(spans[i].start, spans[i - 1].end - 2'000) << "measured from other anchors";
        }
    }
}

TEST_F(timeline_gpu, the_demo_writes_a_trace_and_a_picture_of_its_overlapping_run) {
    // Run by ctest after the pipeline example, in the directory it wrote to.
    const char* dir = std::getenv("CUDAWAIT_DEMO_DIR");
    if (dir == nullptr) {
        GTEST_SKIP() << "CUDAWAIT_DEMO_DIR is not set (ctest's example.pipeline_trace sets it)";
    }
    auto slurp = [&](const char* name) {
        std::ifstream f(std::filesystem::path(dir) / name, std::ios::binary);
        EXPECT_TRUE(f.good()) << name << " was not written";
        return std::string(std::istreambuf_iterator<char>(f), {});
    };
    parsed_trace pt = read_trace(slurp("pipeline_trace.json"));
    // 1 GiB in 64 MiB chunks: 16 per stage, one lane per stream.
    for (const char* track : {"h2d", "compute", "d2h"}) {
        ASSERT_EQ(pt.tracks.count(track), 1u) << track;
        EXPECT_EQ(pt.tracks[track].size(), 16u) << track;
        EXPECT_EQ(pt.tracks.count(std::string(track) + " #2"), 0u) << track;
    }
    // Busy intervals of the copy tracks overlap, and the busiest track is busy most of the time.
    double first = 1e300;
    double last = -1e300;
    double busiest = 0;
    for (const char* track : {"h2d", "compute", "d2h"}) {
        for (const auto& s : pt.tracks[track]) {
            first = std::min(first, s.ts);
            last = std::max(last, s.ts + s.dur);
        }
        busiest = std::max(busiest, busy_us(pt.tracks[track]));
    }
    EXPECT_GT(busiest / (last - first), 0.5);
    bool overlapped = false;
    for (const auto& a : pt.tracks["h2d"]) {
        for (const auto& b : pt.tracks["d2h"]) {
            overlapped = overlapped || (a.ts < b.ts + b.dur && b.ts < a.ts + a.dur);
        }
    }
    EXPECT_TRUE(overlapped) << "no H2D ran while a D2H did";
    const std::string svg = slurp("pipeline_timeline.svg");
    EXPECT_NE(svg.find("</svg>"), std::string::npos);
    EXPECT_EQ(count_of(svg, "class=\"span\""), pt.complete_events);
}

} // namespace
