// SPDX-License-Identifier: Apache-2.0
#pragma once

// detail::idle_strategy: how the scheduler's loop waits when nothing is ready (spin, yield, sleep,
// sentinels, the doorbell, predicted ends). See docs/core.md#poll-policies.

#include <cudawait/core/detail/doorbell.hpp>
#include <cudawait/core/detail/idle_watch.hpp>
#include <cudawait/core/detail/timer_heap.hpp>
#include <cudawait/core/detail/wait_queues.hpp>
#include <cudawait/core/detail/wake_history.hpp>
#include <cudawait/core/poll_policy.hpp>
#include <cudawait/runtime/detail/chrono.hpp>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <thread>

#include <cuda_runtime_api.h>

namespace cudawait::detail {

inline void cpu_relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
}

/// What ends an idle wait from another thread: the owner's hand-off lock, the condition variable
/// it notifies and the flag it sets.
struct remote_signal {
    std::mutex& mutex;
    std::condition_variable& cv;
    const std::atomic<bool>& posted;
};

/// Loop thread only, but ring_if_blocked() (any thread, under the owner's hand-off lock). A class
/// template (`Unused` is always void) so that only a scheduler that is driven instantiates it.
template <class Unused = void>
class idle_strategy {
public:
    using clock = std::chrono::steady_clock;

    /// `wake(context)` is what a sentinel's host function calls.
    idle_strategy(idle_watch::wake_fn wake, void* context) noexcept : m_idle_watch{wake, context} {}

    /// A wait that outlasted the spin phase ended after `d`: remembered for predict.
    void record(std::chrono::nanoseconds d) { m_wake_history.record(d); }
    /// Ends a block on the doorbell (a post, a stop, a host-function sentinel).
    void ring_if_blocked() noexcept { m_doorbell.ring_if_blocked(); }

    /// Private streams the sentinels made so far (0: none was ever armed).
    [[nodiscard]] std::size_t sentinel_streams() const noexcept {
        return m_idle_watch.stream_count();
    }
    [[nodiscard]] const doorbell& idle_doorbell() const noexcept { return m_doorbell; }

    /// Waits once, as `policy` says, for GPU progress, a timer or a post; `backoff` is the sleep
    /// phase's present sleep.
    void wait(const poll_policy& policy, wait_queues<Unused>& waits, timer_heap<Unused>& timers,
              remote_signal remote, clock::time_point last_progress,
              std::chrono::nanoseconds& backoff) {
        timers.drop_cancelled();
        const bool gpu = waits.has_waits();
        const bool timed = !timers.empty();
        auto now = clock::now();
        bool watched = false;
        std::optional<clock::time_point> wake_at; // shortly before a predicted end
        if (gpu) {
            auto idle_for = now - last_progress;
            if (idle_for < policy.spin) {
                cpu_relax();
                return;
            }
            const bool yield_phase = idle_for - policy.spin < policy.yield;
            bool far = false; // a predicted end at least kSentinelLead sleeps away
            if (policy.predict) {
                if (const auto d = m_wake_history.predict(idle_for)) {
                    const auto lead = wake_history::lead(*d);
                    if (idle_for >= *d - lead) {
                        cpu_relax(); // within the window around the predicted end
                        return;
                    }
                    // In the yield phase only an end far ahead is slept towards: nearer ones,
                    // and whatever else may complete before them, are left to its polling.
                    far = *d - lead - idle_for >= kSentinelLead * policy.sleep_max;
                    if (!yield_phase || far) {
                        wake_at = last_progress + (*d - lead);
                    }
                }
            }
            if (!wake_at && yield_phase) {
                std::this_thread::yield();
                return;
            }
            // Sentinels cost driver calls to arm and a host function (or a doorbell round) to
            // fire: they are armed once the back-off has grown to sleep_max, or at once where the
            // predicted end is further away than a few of the longest sleeps; host-function
            // sentinels only in a wait of host_function_after or more.
            const bool long_wait = backoff >= policy.sleep_max || (wake_at && far);
            if (policy.sentinel && long_wait) {
                if (policy.doorbell && !timed &&
                    doorbell_wait(policy, waits, remote.posted, wake_at)) {
                    return;
                }
                if (host_function_wait(idle_for + backoff, wake_at, now)) {
                    watched = watch_pending(waits);
                    now = clock::now();
                }
            }
        }
        std::unique_lock lock(remote.mutex);
        if (remote.posted.load(std::memory_order_relaxed)) {
            return;
        }
        if (gpu) {
            auto until = now + (watched ? policy.sentinel_poll : backoff);
            if (wake_at) {
                until = std::min(until, *wake_at);
            }
            if (timed) {
                until = std::min(until, timers.next_deadline());
            }
            remote.cv.wait_until(lock, until);
            if (!watched) {
                backoff = std::min(backoff * 2, policy.sleep_max);
            }
        } else if (timed) {
            remote.cv.wait_until(lock, timers.next_deadline());
        } else {
            remote.cv.wait(lock);
        }
    }

    /// A wait is long enough for host-function sentinels once it has lasted this long with the
    /// coming sleep, or once its predicted end is this far away. While a host function is
    /// pending, the device runs other streams' copies and kernels measurably slower
    /// (pipeline_bench section 2b: armed after ~2 ms of idle, a heavy pipeline fell to 0.86-0.93
    /// of the hand-written ring), so a pipeline whose chunks complete more often than this never
    /// arms one; its loop sleeps with the back-off or towards a predicted end instead.
    static constexpr std::chrono::milliseconds host_function_after{8};

    /// Whether a wait that has lasted `waited` (with the coming sleep), or that is predicted to
    /// end at `wake_at`, is long enough for host-function sentinels.
    [[nodiscard]] static bool host_function_wait(std::chrono::nanoseconds waited,
                                                 std::optional<clock::time_point> wake_at,
                                                 clock::time_point now) noexcept {
        return waited >= host_function_after || (wake_at && *wake_at - now >= host_function_after);
    }

private:
    /// A predicted end this many sleep_max away, or more, arms the sentinels at once.
    static constexpr int kSentinelLead = 4;

    /// Arms a sentinel on every pending wait that has none. Returns whether every pending wait
    /// is watched now (false: the loop must keep polling with its back-off).
    bool watch_pending(wait_queues<Unused>& waits) noexcept {
        bool all = true;
        waits.for_each_head([this, &all](wait_node* n) noexcept {
            if (!n->watched && all) {
                if (m_idle_watch.arm(n->event, n->device) == cudaSuccess) {
                    n->watched = true;
                } else {
                    all = false; // the rest keep polling; retried at the next sleep
                }
            }
        });
        return all;
    }

    /// Deep idle with no timer pending: blocks in the driver until a doorbell sentinel, a post
    /// or the backstop rings. False where the doorbell cannot be used this round: the caller
    /// arms host-function sentinels and sleeps instead. A post stores `posted`, then reads whether
    /// the loop is blocked; block() stores that, then reads `posted`: either the post rings or
    /// the loop does not block.
    bool doorbell_wait(const poll_policy& policy, wait_queues<Unused>& waits,
                       const std::atomic<bool>& posted,
                       std::optional<clock::time_point> wake_at) noexcept {
        if (!m_doorbell.begin()) {
            return false;
        }
        bool done = false;
        bool armed = true;
        waits.for_each_head([this, &done, &armed](wait_node* n) noexcept {
            if (done || !armed) {
                return;
            }
            // A completion from before the doorbell was cleared rang nothing: caught here.
            if (cudaEventQuery(n->event) != cudaErrorNotReady) {
                done = true; // the next step completes it (or reports its error)
            } else if (!n->watched && !n->rung) { // a host-function sentinel rings too
                armed = m_doorbell.watch(n->event, n->device) == cudaSuccess;
                n->rung = armed;
            }
        });
        if (done || !armed) {
            m_doorbell.abandon();
            return done;
        }
        auto backstop = policy.sentinel_poll;
        if (wake_at) {
            backstop = std::min<std::chrono::nanoseconds>(
                backstop, std::max<std::chrono::nanoseconds>(*wake_at - clock::now(), {}));
        }
        return m_doorbell.block(posted, backstop) != doorbell::outcome::failed;
    }

    wake_history m_wake_history; ///< long idle periods GPU work ended (predict)
    /// Rung by posts and by host-function sentinels; destroyed after m_idle_watch.
    doorbell m_doorbell;
    /// Last: destroyed first, so a sentinel firing while the owner is destroyed still finds the
    /// owner's members (it takes the hand-off lock), and none fires once it is gone.
    idle_watch m_idle_watch;
};

} // namespace cudawait::detail
