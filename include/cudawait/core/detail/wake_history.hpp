// SPDX-License-Identifier: Apache-2.0
#pragma once

// detail::wake_history: how long the scheduler's recent long idle periods lasted, and from that
// when the present one is likely to end (poll_policy::predict). See docs/core.md#poll-policies.

#include <cudawait/runtime/detail/chrono.hpp>

#include <algorithm>
#include <array>
#include <cstddef>
#include <optional>

namespace cudawait::detail {

class wake_history {
public:
    using duration = std::chrono::nanoseconds;
    /// Idle periods remembered (the most recent ones).
    static constexpr std::size_t capacity = 8;

    /// How far before a predicted end the loop starts polling, and how long after it it keeps
    /// polling: 1/256 of the period, between 50 us and 500 us (a thread's timed sleep ends late
    /// by tens of microseconds; the GPU's own timing varies less than that on repeated work).
    [[nodiscard]] static constexpr duration lead(duration period) noexcept {
        return std::clamp<duration>(period / 256, std::chrono::microseconds(50),
                                    std::chrono::microseconds(500));
    }

    /// Remembers an idle period that a GPU completion ended after `period`.
    void record(duration period) noexcept {
        m_periods[m_next] = period;
        m_next = (m_next + 1) % capacity;
        m_size = std::min(m_size + 1, capacity);
    }

    /// The shortest remembered period whose polling window has not passed after `idle_for` of
    /// the present idle period; none when every window has passed or nothing was recorded.
    [[nodiscard]] std::optional<duration> predict(duration idle_for) const noexcept {
        std::optional<duration> best;
        for (std::size_t i = 0; i < m_size; ++i) {
            const duration d = m_periods[i];
            if (d + lead(d) > idle_for && (!best || d < *best)) {
                best = d;
            }
        }
        return best;
    }

    [[nodiscard]] std::size_t size() const noexcept { return m_size; }
    void clear() noexcept { m_size = m_next = 0; }

private:
    std::array<duration, capacity> m_periods{};
    std::size_t m_next = 0;
    std::size_t m_size = 0;
};

} // namespace cudawait::detail
