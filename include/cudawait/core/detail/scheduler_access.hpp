// SPDX-License-Identifier: Apache-2.0
#pragma once

// detail::scheduler_access: the scheduler's internals that the library's awaiters and drivers use
// (sync_wait, with_timeout, a watchdog, tests of the loop). Not part of the API.

#include <cudawait/runtime/detail/config.hpp>

#include <chrono>
#include <coroutine>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>

namespace cudawait::detail {

/// Which device a watchdog found stalled and for how long: what a wait it failed throws.
struct stall_record {
    int device = -1;
    std::chrono::nanoseconds stalled_for{0};
};

struct timer_node;
template <class Unused = void>
class basic_scheduler;

/// A class template (scheduler_access is its one specialization) so that a call instantiates
/// only the scheduler members it reaches.
template <class Unused = void>
struct scheduler_access_t {
    using clock = std::chrono::steady_clock;
    using sched = basic_scheduler<Unused>;

    static bool add_wait(sched& s, cudaStream_t stream, std::coroutine_handle<> h,
                         cudaError_t& status, const char*& api) noexcept {
        return s.add_wait(stream, h, status, api);
    }
    static bool add_wait(sched& s, cudaEvent_t event, std::coroutine_handle<> h,
                         cudaError_t& status, const char*& api) noexcept {
        return s.add_wait(event, h, status, api);
    }
    static void add_timer(sched& s, clock::time_point deadline, std::coroutine_handle<> h) {
        s.add_timer(deadline, h);
    }
    static timer_node* add_timer(sched& s, clock::time_point deadline, std::function<void()> fn) {
        return s.add_timer(deadline, std::move(fn));
    }
    static timer_node* add_daemon_timer(sched& s, clock::time_point deadline,
                                        std::function<void()> fn) {
        return s.add_daemon_timer(deadline, std::move(fn));
    }
    static void cancel_timer(sched& s, timer_node* t) noexcept { s.cancel_timer(t); }
    [[nodiscard]] static std::uint64_t completed_on(const sched& s, int dev) noexcept {
        return s.m_waits.completed_on(dev);
    }
    static void pending_devices(const sched& s, std::vector<int>& out) {
        s.m_waits.pending_devices(out);
    }
    static std::size_t pending_on(const sched& s, int dev, std::vector<cudaStream_t>& out) {
        return s.m_waits.pending_on(dev, out);
    }
    static std::size_t fail_waits_on(sched& s, int dev, std::chrono::nanoseconds d) {
        return s.fail_waits_on(dev, d);
    }
    [[nodiscard]] static const stall_record& last_stall(const sched& s) noexcept {
        return s.m_stall;
    }
    /// Runs `change` under the scheduler's hand-off lock and wakes its loop; nothing of `s` is
    /// touched once the lock is released, so the loop may finish and `s` go at once.
    template <class Change>
    static void signal(sched& s, Change&& change) {
        s.signal(std::forward<Change>(change));
    }
    static void child_started(sched& s) noexcept { s.child_started(); }
    static void child_finished(sched& s) noexcept { s.child_finished(); }
    static void resume_soon(sched& s, std::coroutine_handle<> h) { s.m_ready.push_back(h); }
    [[nodiscard]] static bool on_loop_thread(const sched& s) noexcept { return s.on_loop_thread(); }
    /// Private streams the scheduler's sentinels made so far (0: none was ever armed).
    [[nodiscard]] static std::size_t sentinel_streams(const sched& s) noexcept {
        return s.m_idle.sentinel_streams();
    }
    /// The doorbell the loop blocks on in deep idle, for tests and benchmarks.
    [[nodiscard]] static const auto& idle_doorbell(const sched& s) noexcept {
        return s.m_idle.idle_doorbell();
    }
    template <class Pred>
    static void run_from(sched& s, std::coroutine_handle<> first, Pred&& done) {
        s.run_from(first, std::forward<Pred>(done));
    }
};

/// How the library names the scheduler's internals (see scheduler_access_t).
using scheduler_access = scheduler_access_t<>;

} // namespace cudawait::detail
