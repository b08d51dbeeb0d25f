// SPDX-License-Identifier: Apache-2.0
#pragma once

// Synopsis
//   class scheduler;            the event loop that resumes coroutines when their GPU work finished
//     scheduler s(poll_policy::balanced());   s.run();  s.run(stop_token);  s.run_until(pred);
//     s.poll();  s.post(fn or handle);  s.spawn(task);  s.wake();  s.pending();  s.set_policy(p);
//     co_await s.schedule();  co_await s.wait(stream or event);  co_await s.sleep_for(d);
//   sleep_for(d)                inside a task: `co_await sleep_for(5ms);`
//
// One thread at a time drives a scheduler and coroutines resume on it; post, spawn, wake and
// schedule() are safe from any thread. See docs/core.md#the-scheduler.
//
// The loop itself is core/detail/scheduler_impl.hpp, included at the end of this header; built
// with CUDAWAIT_SEPARATE_COMPILATION (linking cudawait::compiled) it is compiled once, in the
// library, instead (docs/getting-started.md#compile-time).

#include <cudawait/core/detail/awaiters.hpp>
#include <cudawait/core/detail/callback.hpp>
#include <cudawait/core/detail/detached.hpp>
#include <cudawait/core/detail/scheduler_access.hpp>
#include <cudawait/core/poll_policy.hpp>
#include <cudawait/core/task.hpp>
#include <cudawait/runtime/detail/chrono.hpp>
#include <cudawait/runtime/detail/refs.hpp>

#include <coroutine>
#include <exception>
#include <source_location>
#include <stop_token>
#include <type_traits>
#include <utility>

#include <cuda_runtime_api.h>

namespace cudawait {

namespace detail {
/// Where a task that scheduler::spawn started hands its outcome.
struct spawn_sink {
    scheduler_core* core;
    template <class R>
    void complete(result_slot<R>&& r) {
        core->finish_detached(r.has_exception() ? r.exception() : std::exception_ptr());
    }
};
} // namespace detail

/// The event loop. Resumes coroutines when the GPU work they await finished, when their timers
/// expire, or when other threads post them.
class scheduler {
public:
    using pending_counts = detail::scheduler_pending_counts;

    /// A template only so that a translation unit that makes no scheduler does not compile the
    /// loop (`Unused` is always void).
    template <class Unused = void>
    explicit scheduler(poll_policy policy = {})
        : m_core(detail::new_scheduler_core<Unused>(policy)) {}
    scheduler(const scheduler&) = delete;
    scheduler& operator=(const scheduler&) = delete;

    /// Drives the loop until no GPU wait is pending and nothing is ready, so no recycled event
    /// is handed back while the GPU may still complete it. Coroutines still suspended on timers
    /// or on other schedulers are reported on stderr and not resumed.
    ~scheduler() { delete m_core; }

    /// `co_await sched.schedule()` continues the awaiting coroutine on this scheduler's thread,
    /// and makes it the coroutine's scheduler from then on.
    [[nodiscard]] detail::schedule_awaitable schedule() noexcept {
        detail::schedule_awaitable a;
        a.target = this;
        return a;
    }

    /// Resumes `h` on the scheduler's thread. Thread-safe.
    void post(std::coroutine_handle<> h) {
        m_core->post([h] { h.resume(); });
    }
    /// Runs `fn` (callable with no arguments) on the scheduler's thread. Thread-safe. An
    /// exception from `fn` is kept and rethrown by the next `run()`.
    template <class F>
    requires std::is_invocable_v < std::decay_t<F>
    & > void post(F&& fn) { m_core->post(detail::callback(std::forward<F>(fn))); }
    /// Makes a waiting loop re-check its stop condition. Thread-safe; allocates nothing.
    void wake() noexcept { m_core->wake(); }

    /// Starts `work` (a task or any awaitable) on this scheduler, detached. Its exception, if
    /// any, is rethrown by the next `run()`. Thread-safe.
    template <class A>
    void spawn(A&& work) {
        using R = detail::awaited_t<A>;
        auto d = detail::run_detached<R>(std::forward<A>(work), detail::spawn_sink{m_core});
        d.handle().promise().set_scheduler(this);
        // Counted as the post publishes it, so that a failed post (or frame allocation) leaves
        // no count behind that run() would wait for.
        try {
            m_core->start_detached(d.handle());
        } catch (...) {
            d.handle().destroy();
            throw;
        }
    }

    /// Drives the loop until no work is left: nothing ready, no GPU wait, no timer and no
    /// detached task. Rethrows the first exception of a detached task.
    /// @throws usage_error when another thread is driving this scheduler
    void run() { m_core->run(); }
    /// Drives the loop until `stop` is requested, waiting for posts when idle.
    void run(std::stop_token stop) { m_core->run(std::move(stop)); }

    /// Drives the loop on the calling thread until `done()` is true. `done` is checked after
    /// every step; whoever makes it true from another thread must call wake().
    /// @throws usage_error when another thread is driving this scheduler
    template <class Pred>
    void run_until(Pred&& done) {
        detail::scheduler_access::run_from(*this, {}, done);
    }

    /// One non-blocking turn of the loop. Returns whether anything happened.
    /// @throws usage_error when another thread is driving this scheduler
    bool poll() { return m_core->poll(); }

    /// What is pending, for diagnostics and tests. Call from the driving thread or while idle.
    [[nodiscard]] pending_counts pending() const { return m_core->pending(); }

    [[nodiscard]] const poll_policy& policy() const noexcept { return m_core->policy(); }
    /// Call from the driving thread or while idle.
    void set_policy(const poll_policy& p) noexcept { m_core->set_policy(p); }

    /// For coroutines other than the library's: `co_await sched.wait(stream)`.
    [[nodiscard]] detail::wait_awaiter<cudaStream_t>
    wait(stream_ref s, std::source_location where = std::source_location::current()) {
        return {*this, s.get(), where};
    }
    /// For coroutines other than the library's: `co_await sched.wait(event)`.
    [[nodiscard]] detail::wait_awaiter<cudaEvent_t>
    wait(event_ref e, std::source_location where = std::source_location::current()) {
        return {*this, e.get(), where};
    }
    /// For coroutines other than the library's: `co_await sched.sleep_for(d)`.
    [[nodiscard]] detail::sleep_awaiter sleep_for(std::chrono::nanoseconds d) {
        return detail::sleep_awaiter(*this, d);
    }

private:
    template <class>
    friend struct detail::scheduler_access_t;

    detail::scheduler_core* m_core;
};

/// Inside a library coroutine: `co_await sleep_for(10ms)` resumes after at least `d`, without
/// blocking the scheduler's thread.
[[nodiscard]] inline detail::sleep_request sleep_for(std::chrono::nanoseconds d) noexcept {
    return {d};
}

} // namespace cudawait

#if defined(CUDAWAIT_SEPARATE_COMPILATION)
namespace cudawait::detail {
// Instantiated once, in cudawait::compiled (src/cudawait.cpp), even where a translation unit
// includes the loop's definition itself.
extern template scheduler_core* new_scheduler_core<void>(const poll_policy& policy);
} // namespace cudawait::detail
#else
#include <cudawait/core/detail/scheduler_impl.hpp>
#endif
