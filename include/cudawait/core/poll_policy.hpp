// SPDX-License-Identifier: Apache-2.0
#pragma once

// Synopsis
//   poll_policy::balanced()     the default: spin, yield, then sleep (sentinels in long waits)
//   poll_policy::sentinels()    balanced(), the loop blocking in the driver on a doorbell
//   poll_policy::sleeping()     sleeps between polls from the start: little CPU
//   poll_policy::yielding()     polls between std::this_thread::yield() calls
//   poll_policy::spinning()     busy-polls: lowest latency, one core busy
//   scheduler s(poll_policy::sleeping());   s.set_policy(poll_policy::spinning());
//
// How an idle scheduler waits while GPU work is pending and nothing is ready. Pick a preset; the
// fields they set, and what each phase costs, are described in docs/core.md#poll-policies.

#include <cudawait/runtime/detail/chrono.hpp>

namespace cudawait {

/// How a scheduler waits while GPU work is pending and nothing is ready: pick one of the presets
/// (docs/core.md#poll-policies describes the fields).
struct poll_policy {
    /// Busy-polls this long after the last progress.
    std::chrono::nanoseconds spin = std::chrono::microseconds(200);
    /// Then polls with std::this_thread::yield() this long.
    std::chrono::nanoseconds yield = std::chrono::microseconds(800);
    /// Then sleeps between polls, backing off from `sleep_min` ...
    std::chrono::nanoseconds sleep_min = std::chrono::microseconds(20);
    /// ... to `sleep_max`.
    std::chrono::nanoseconds sleep_max = std::chrono::microseconds(1000);
    /// Sentinels wake the sleep phase when the GPU work completes (host functions: only in waits
    /// of 8 ms or more, see docs/core.md#poll-policies).
    bool sentinel = true;
    /// While sentinels watch every pending wait, the loop still polls this often.
    std::chrono::nanoseconds sentinel_poll = std::chrono::milliseconds(50);
    /// Sentinels ring a doorbell the loop blocks on in the driver.
    bool doorbell = false;
    /// Sleeps until shortly before the end its recent idle periods predict.
    bool predict = true;

    /// Lowest latency, one core busy while anything is pending.
    [[nodiscard]] static constexpr poll_policy spinning() noexcept {
        return busy(std::chrono::nanoseconds::max() / 4, std::chrono::nanoseconds(0));
    }
    /// Polls between `std::this_thread::yield()` calls; gives the core away to other threads.
    [[nodiscard]] static constexpr poll_policy yielding() noexcept {
        return busy(std::chrono::nanoseconds(0), std::chrono::nanoseconds::max() / 4);
    }
    /// Sleeps between polls from the start, backing off from `min` to `max`: little CPU, a
    /// resume latency of up to `max` (less for repeated work). No sentinels.
    [[nodiscard]] static constexpr poll_policy
    sleeping(std::chrono::nanoseconds min = std::chrono::microseconds(50),
             std::chrono::nanoseconds max = std::chrono::microseconds(2000)) noexcept {
        poll_policy p;
        p.spin = p.yield = std::chrono::nanoseconds(0);
        p.sleep_min = min;
        p.sleep_max = max;
        p.sentinel = false;
        return p;
    }
    /// The default: spin 200 us, yield until 1 ms, then sleep, woken by the end that the last
    /// idle periods predict and, in waits of 8 ms or more, by host-function sentinels.
    [[nodiscard]] static constexpr poll_policy balanced() noexcept { return {}; }
    /// balanced(), but the sentinels ring a doorbell the loop thread blocks on in the driver
    /// (polling every 10 ms); the doorbell's wait holds one of the device's hardware queues.
    [[nodiscard]] static constexpr poll_policy sentinels() noexcept {
        poll_policy p;
        p.doorbell = true;
        p.sentinel_poll = std::chrono::milliseconds(10);
        return p;
    }

private:
    // A policy that never sleeps while GPU work is pending: nothing to arm or predict.
    static constexpr poll_policy busy(std::chrono::nanoseconds spin,
                                      std::chrono::nanoseconds yield) noexcept {
        poll_policy p;
        p.spin = spin;
        p.yield = yield;
        p.sentinel = false;
        p.predict = false;
        return p;
    }
};

} // namespace cudawait
