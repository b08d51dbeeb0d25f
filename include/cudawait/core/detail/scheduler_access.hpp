// SPDX-License-Identifier: Apache-2.0
#pragma once

// detail::scheduler_core: the interface of the loop behind a scheduler (its one implementation,
// basic_scheduler, is in scheduler_impl.hpp), and detail::scheduler_access: the loop's internals
// that the library's awaiters and drivers use (sync_wait, with_timeout, a watchdog, tests of the
// loop). Not part of the API.

#include <cudawait/core/detail/callback.hpp>
#include <cudawait/core/poll_policy.hpp>
#include <cudawait/runtime/detail/chrono.hpp>
#include <cudawait/runtime/detail/config.hpp>

#include <coroutine>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <stop_token>
#include <type_traits>
#include <utility>

#include <cuda_runtime_api.h>

namespace cudawait {
class scheduler;
}

namespace cudawait::detail {

/// Which device a watchdog found stalled and for how long: what a wait it failed throws.
struct stall_record {
    int device = -1;
    std::chrono::nanoseconds stalled_for{0};
};

/// What is pending on a scheduler (scheduler::pending()).
struct scheduler_pending_counts {
    std::size_t stream_waits = 0;
    std::size_t event_waits = 0;
    std::size_t streams = 0;
    std::size_t timers = 0;
    std::size_t ready = 0;
    std::size_t detached = 0;
};

struct timer_node;
template <class Unused>
class basic_scheduler;

/// The loop a scheduler drives: the queues, timers, idle strategy and hand-off state, behind one
/// pointer, so that the header users include declares calls, not the members' standard types.
/// The member functions are documented on basic_scheduler (scheduler_impl.hpp).
class scheduler_core {
public:
    using clock = std::chrono::steady_clock;

    scheduler_core() = default;
    scheduler_core(const scheduler_core&) = delete;
    scheduler_core& operator=(const scheduler_core&) = delete;
    virtual ~scheduler_core() = default;

    // ---- what scheduler's members forward to ----------------------------------------------
    virtual void post(callback fn) = 0;
    virtual void wake() noexcept = 0;
    virtual void start_detached(std::coroutine_handle<> h) = 0;
    virtual void finish_detached(std::exception_ptr error) = 0;
    virtual void run() = 0;
    virtual void run(std::stop_token stop) = 0;
    /// Drives the loop until `done(context)`, resuming `first` (if any) as its first work.
    virtual void run_from(std::coroutine_handle<> first, bool (*done)(void*), void* context) = 0;
    virtual bool poll() = 0;
    [[nodiscard]] virtual scheduler_pending_counts pending() const = 0;
    [[nodiscard]] virtual const poll_policy& policy() const noexcept = 0;
    virtual void set_policy(const poll_policy& p) noexcept = 0;

    // ---- what scheduler_access forwards to --------------------------------------------------
    virtual bool add_wait(cudaStream_t s, std::coroutine_handle<> h, cudaError_t& status,
                          const char*& api) noexcept = 0;
    virtual bool add_wait(cudaEvent_t e, std::coroutine_handle<> h, cudaError_t& status,
                          const char*& api) noexcept = 0;
    virtual void add_timer(clock::time_point deadline, std::coroutine_handle<> h) = 0;
    virtual timer_node* add_timer(clock::time_point deadline, callback fn) = 0;
    virtual timer_node* add_daemon_timer(clock::time_point deadline, callback fn) = 0;
    virtual void cancel_timer(timer_node* t) noexcept = 0;
    [[nodiscard]] virtual std::uint64_t completed_on(int dev) const noexcept = 0;
    /// Calls `each(context, dev)` for each device with stream waits pending.
    virtual void pending_devices(void (*each)(void*, int), void* context) const = 0;
    /// Calls `each(context, stream)` for each stream of `dev` with awaits pending; returns how
    /// many awaits are pending on `dev`.
    virtual std::size_t pending_on(int dev, void (*each)(void*, cudaStream_t),
                                   void* context) const = 0;
    virtual std::size_t fail_waits_on(int dev, std::chrono::nanoseconds stalled_for) = 0;
    [[nodiscard]] virtual const stall_record& last_stall() const noexcept = 0;
    /// Runs `change(context)` under the hand-off lock and wakes the loop.
    virtual void signal(void (*change)(void*), void* context) = 0;
    virtual void child_started() noexcept = 0;
    virtual void child_finished() noexcept = 0;
    virtual void resume_soon(std::coroutine_handle<> h) = 0;
    [[nodiscard]] virtual bool on_loop_thread() const noexcept = 0;
};

/// A new basic_scheduler (scheduler_impl.hpp). A template, so that a translation unit that
/// includes the headers and makes no scheduler does not compile the loop; linked from
/// cudawait::compiled under CUDAWAIT_SEPARATE_COMPILATION.
template <class Unused = void>
scheduler_core* new_scheduler_core(const poll_policy& policy);

/// A class template (scheduler_access is its one specialization) so that the scheduler, still
/// incomplete where the awaiters are declared, is named dependently.
template <class Unused = void>
struct scheduler_access_t {
    using clock = std::chrono::steady_clock;
    using sched = dependent_t<Unused, scheduler>;

    static scheduler_core& core(const sched& s) noexcept { return *s.m_core; }

    static bool add_wait(sched& s, cudaStream_t stream, std::coroutine_handle<> h,
                         cudaError_t& status, const char*& api) noexcept {
        return core(s).add_wait(stream, h, status, api);
    }
    static bool add_wait(sched& s, cudaEvent_t event, std::coroutine_handle<> h,
                         cudaError_t& status, const char*& api) noexcept {
        return core(s).add_wait(event, h, status, api);
    }
    static void add_timer(sched& s, clock::time_point deadline, std::coroutine_handle<> h) {
        core(s).add_timer(deadline, h);
    }
    static timer_node* add_timer(sched& s, clock::time_point deadline, callback fn) {
        return core(s).add_timer(deadline, std::move(fn));
    }
    static timer_node* add_daemon_timer(sched& s, clock::time_point deadline, callback fn) {
        return core(s).add_daemon_timer(deadline, std::move(fn));
    }
    static void cancel_timer(sched& s, timer_node* t) noexcept { core(s).cancel_timer(t); }
    [[nodiscard]] static std::uint64_t completed_on(const sched& s, int dev) noexcept {
        return core(s).completed_on(dev);
    }
    /// `out` (a vector of int) is cleared, then filled.
    template <class Out>
    static void pending_devices(const sched& s, Out& out) {
        out.clear();
        core(s).pending_devices([](void* o, int dev) { static_cast<Out*>(o)->push_back(dev); },
                                &out);
    }
    /// `out` (a vector of cudaStream_t) is cleared, then filled.
    template <class Out>
    static std::size_t pending_on(const sched& s, int dev, Out& out) {
        out.clear();
        return core(s).pending_on(
            dev, [](void* o, cudaStream_t st) { static_cast<Out*>(o)->push_back(st); }, &out);
    }
    static std::size_t fail_waits_on(sched& s, int dev, std::chrono::nanoseconds d) {
        return core(s).fail_waits_on(dev, d);
    }
    [[nodiscard]] static const stall_record& last_stall(const sched& s) noexcept {
        return core(s).last_stall();
    }
    /// Runs `change` under the scheduler's hand-off lock and wakes its loop; nothing of `s` is
    /// touched once the lock is released, so the loop may finish and `s` go at once.
    template <class Change>
    static void signal(sched& s, Change&& change) {
        using C = std::remove_reference_t<Change>;
        core(s).signal([](void* c) { (*static_cast<C*>(c))(); }, &change);
    }
    static void child_started(sched& s) noexcept { core(s).child_started(); }
    static void child_finished(sched& s) noexcept { core(s).child_finished(); }
    static void resume_soon(sched& s, std::coroutine_handle<> h) { core(s).resume_soon(h); }
    [[nodiscard]] static bool on_loop_thread(const sched& s) noexcept {
        return core(s).on_loop_thread();
    }
    template <class Pred>
    static void run_from(sched& s, std::coroutine_handle<> first, Pred&& done) {
        using P = std::remove_reference_t<Pred>;
        core(s).run_from(
            first, [](void* p) { return static_cast<bool>((*static_cast<P*>(p))()); }, &done);
    }
    // For tests and benchmarks of the loop, which include core/detail/scheduler_impl.hpp:
    /// Private streams the scheduler's sentinels made so far (0: none was ever armed).
    [[nodiscard]] static std::size_t sentinel_streams(const sched& s) noexcept {
        return loop(s).m_idle.sentinel_streams();
    }
    /// The doorbell the loop blocks on in deep idle.
    [[nodiscard]] static const auto& idle_doorbell(const sched& s) noexcept {
        return loop(s).m_idle.idle_doorbell();
    }

private:
    template <class S>
    static const auto& loop(const S& s) noexcept {
        return static_cast<const basic_scheduler<dependent_t<S, void>>&>(core(s));
    }
};

/// How the library names the scheduler's internals (see scheduler_access_t).
using scheduler_access = scheduler_access_t<>;

} // namespace cudawait::detail
