// SPDX-License-Identifier: Apache-2.0
#pragma once

// Per-chunk latency samples of a run and their percentiles (pipeline_stats::latency): a window of
// the last `capacity` samples, reserved up front so that recording a chunk never allocates, and
// nearest-rank percentiles drawn from it when stats are asked for.

#include <cudawait/pipeline/options.hpp>

#include <algorithm>
#include <cstddef>
#include <span>
#include <stdexcept>
#include <vector>

namespace cudawait::detail {

/// The nearest-rank `percent` percentile of `v`: the sample at rank ceil(percent / 100 * n) in
/// ascending order (rank 1 at least), so that p100 is the maximum and every result is one of the
/// samples. `v` is reordered. The rank is computed in integers: a double product such as
/// 0.29 * 100 would round the wrong way.
/// @throws std::invalid_argument for an empty `v` or `percent` outside 1..100
///
/// A function template (`Unused` is always void), like basic_latency_window, whose samples are
/// named dependently (config.hpp's dependent_t): only a translation unit that asks for
/// percentiles instantiates std::nth_element.
template <class Unused = void>
[[nodiscard]] double nearest_rank(std::span<dependent_t<Unused, double>> v, unsigned percent) {
    if (v.empty() || percent == 0 || percent > 100) {
        throw std::invalid_argument("nearest_rank: needs samples and a percent in 1..100");
    }
    std::size_t rank = (static_cast<std::size_t>(percent) * v.size() + 99) / 100;
    auto at = v.begin() + static_cast<std::ptrdiff_t>(std::max<std::size_t>(rank, 1) - 1);
    std::nth_element(v.begin(), at, v.end());
    return *at;
}

/// The latencies of the last `capacity` chunks, and the maximum of all since clear(). A class
/// template (`Unused` is always void; use latency_window) so that only a translation unit that
/// records latencies instantiates its vector and std::nth_element.
template <class Unused = void>
class basic_latency_window {
public:
    static constexpr std::size_t default_capacity = 65536;

    explicit basic_latency_window(std::size_t capacity = default_capacity)
        : m_capacity(std::max<std::size_t>(capacity, 1)) {}

    /// Forgets the samples; the first call also reserves the window, which is kept.
    void clear() {
        m_samples.reserve(m_capacity);
        m_samples.clear();
        m_next = 0;
        m_max = 0;
    }

    /// Records one chunk's latency; once the window is full the oldest sample is replaced.
    void add(double seconds) {
        if (m_samples.size() < m_capacity) {
            m_samples.push_back(seconds); // within the reserved capacity after clear()
        } else {
            m_samples[m_next] = seconds;
            m_next = (m_next + 1) % m_capacity;
        }
        m_max = std::max(m_max, seconds);
    }

    [[nodiscard]] std::size_t size() const noexcept { return m_samples.size(); }

    /// The percentiles of the window (nearest rank) and the maximum since clear().
    [[nodiscard]] latency_summary summary() const {
        latency_summary s;
        if (m_samples.empty()) {
            return s;
        }
        auto v = m_samples;
        s.p50_seconds = nearest_rank<Unused>(v, 50);
        s.p90_seconds = nearest_rank<Unused>(v, 90);
        s.p99_seconds = nearest_rank<Unused>(v, 99);
        s.max_seconds = m_max;
        s.samples = v.size();
        return s;
    }

private:
    std::size_t m_capacity;
    std::vector<dependent_t<Unused, double>> m_samples;
    std::size_t m_next = 0; // the oldest sample once the window is full
    double m_max = 0;
};

/// The window the pipelines' monitor keeps.
using latency_window = basic_latency_window<>;

} // namespace cudawait::detail
