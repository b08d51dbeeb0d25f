// SPDX-License-Identifier: Apache-2.0
#pragma once

// Synopsis
//   with_timeout(a, d)   inside a task: `co_await with_timeout(stream, 2s);` resumes once the
//                        work is done, or throws timeout_error after d. `a` is a stream or an
//                        event (used only during the call) or a task or other awaitable (moved
//                        in; after a timeout it runs on to its end, and the scheduler tracks it)
//
// The work runs in a detached coroutine of its own, so a timeout leaves nothing behind that the
// GPU may still touch: the awaiting coroutine gets timeout_error, and the work (or the wait on
// an event recorded at the call) goes on under the scheduler until it finished.

#include <cudawait/core/detail/detached.hpp>
#include <cudawait/core/scheduler.hpp>
#include <cudawait/core/task.hpp>
#include <cudawait/runtime/detail/chrono.hpp>
#include <cudawait/runtime/device.hpp>
#include <cudawait/runtime/error.hpp>
#include <cudawait/runtime/event.hpp>
#include <cudawait/runtime/stream.hpp>

#include <atomic>
#include <coroutine>
#include <cstddef>
#include <memory>
#include <mutex>
#include <source_location>
#include <type_traits>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>

namespace cudawait {

namespace detail {

/// Shared between a with_timeout awaiter and the detached coroutine that awaits the work.
template <class R>
struct timeout_state {
    result_slot<R> result;
    bool done = false;
    std::coroutine_handle<> waiter;
    timer_node* timer = nullptr;
    scheduler* sched = nullptr;

    void complete(result_slot<R>&& r) {
        result = std::move(r);
        done = true;
        scheduler_access::child_finished(*sched);
        if (waiter) {
            scheduler_access::cancel_timer(*sched, timer);
            scheduler_access::resume_soon(*sched, std::exchange(waiter, {}));
        }
    }
};

/// Where the detached coroutine that awaits the work leaves its outcome.
template <class R>
struct timeout_sink {
    std::shared_ptr<timeout_state<R>> state;
    void complete(result_slot<R>&& r) {
        if (scheduler_access::on_loop_thread(*state->sched)) {
            state->complete(std::move(r));
            return;
        }
        // The work finished on another scheduler's thread: hand the outcome over, since the
        // timer and the waiter belong to this loop.
        auto moved = std::make_shared<result_slot<R>>(std::move(r));
        state->sched->post([st = state, moved] { st->complete(std::move(*moved)); });
    }
};

/// What a with_timeout's coroutine awaits: the outcome of the work, or the timer, whichever
/// comes first.
template <class R>
class timeout_awaiter {
public:
    timeout_awaiter(std::shared_ptr<timeout_state<R>> st, std::chrono::nanoseconds d)
        : m_state(std::move(st)), m_after(d) {}
    bool await_ready() const noexcept { return m_state->done; }
    void await_suspend(std::coroutine_handle<> h) {
        m_state->waiter = h;
        std::weak_ptr<timeout_state<R>> weak = m_state;
        m_state->timer = scheduler_access::add_timer(
            *m_state->sched, std::chrono::steady_clock::now() + m_after, [weak] {
                if (auto st = weak.lock(); st && st->waiter) {
                    st->timer = nullptr;
                    scheduler_access::resume_soon(*st->sched, std::exchange(st->waiter, {}));
                }
            });
    }
    R await_resume() {
        if (!m_state->done) {
            throw timeout_error(m_after);
        }
        return m_state->result.take();
    }

private:
    std::shared_ptr<timeout_state<R>> m_state;
    std::chrono::nanoseconds m_after;
};

/// Fault injection for tests: while positive, relay_stream_cache::acquire() fails as a stream
/// creation the driver refused (cudaErrorMemoryAllocation) and counts it down. Zero outside
/// tests (one relaxed load per acquire()).
inline std::atomic<int> g_failing_relay_acquires{0};

/// Non-blocking streams that with_timeout borrows to turn the work an event captured into an
/// event of its own (`cudaStreamWaitEvent(relay, e)`, then a record on the relay). One
/// process-wide cache, per device; thread-safe, and no CUDA call is made under its lock. A
/// stream is cached again only once its last record completed, so a later wait never queues
/// behind an earlier one that is still unsatisfied. A class template (of an unused parameter,
/// always void) so that only a translation unit that times out an event instantiates it;
/// spelled relay_stream_cache.
template <class Unused = void>
class basic_relay_stream_cache {
public:
    [[nodiscard]] static basic_relay_stream_cache& instance() {
        static basic_relay_stream_cache cache;
        return cache;
    }
    basic_relay_stream_cache(const basic_relay_stream_cache&) = delete;
    basic_relay_stream_cache& operator=(const basic_relay_stream_cache&) = delete;
    ~basic_relay_stream_cache() {
        for (const auto& streams : m_free) {
            for (cudaStream_t s : streams) {
                report(cudaStreamDestroy(s), "cudaStreamDestroy");
            }
        }
    }

    /// A stream of device `dev` with no pending work.
    /// @throws cuda_error
    [[nodiscard]] cudaStream_t acquire(int dev, const std::source_location& where) {
        if (g_failing_relay_acquires.load(std::memory_order_relaxed) > 0 &&
            g_failing_relay_acquires.fetch_sub(1, std::memory_order_relaxed) > 0) {
            throw cuda_error(cudaErrorMemoryAllocation, "cudaStreamCreateWithFlags", where);
        }
        {
            std::lock_guard lock(m_mutex);
            if (static_cast<std::size_t>(dev) < m_free.size()) {
                auto& streams = m_free[static_cast<std::size_t>(dev)];
                if (!streams.empty()) {
                    cudaStream_t s = streams.back();
                    streams.pop_back();
                    return s;
                }
            }
        }
        device_guard guard(device_ref(dev, where), where);
        cudaStream_t s = nullptr;
        check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags",
              where);
        return s;
    }

    /// Takes back a stream from acquire(): cached when `idle`, destroyed otherwise (the driver
    /// frees a destroyed stream once its pending work is done).
    void release(int dev, cudaStream_t s, bool idle) noexcept {
        if (idle) {
            try {
                std::lock_guard lock(m_mutex);
                if (static_cast<std::size_t>(dev) >= m_free.size()) {
                    m_free.resize(static_cast<std::size_t>(dev) + 1);
                }
                m_free[static_cast<std::size_t>(dev)].push_back(s);
                return;
            } catch (...) {
                // No room to cache it: destroy it instead.
            }
        }
        report(cudaStreamDestroy(s), "cudaStreamDestroy");
    }

    /// Idle streams of device `dev` held for reuse.
    [[nodiscard]] std::size_t cached(int dev) {
        std::lock_guard lock(m_mutex);
        return static_cast<std::size_t>(dev) < m_free.size()
                   ? m_free[static_cast<std::size_t>(dev)].size()
                   : 0;
    }

private:
    basic_relay_stream_cache() = default;
    std::mutex m_mutex;
    std::vector<std::vector<cudaStream_t>> m_free;
};

using relay_stream_cache = basic_relay_stream_cache<>;

/// What with_timeout awaits for a stream or an event: a pooled event of its own, recorded at the
/// call, that completes with the work the stream or event held then. The wait, which may
/// outlive the caller, refers to nothing the caller owns: the stream or event may be destroyed
/// as soon as with_timeout returned. Move-only. A class template (of an unused parameter, always
/// void) for the reason relay_stream_cache is one; spelled captured_wait.
template <class Unused = void>
class basic_captured_wait {
public:
    /// Captures the work enqueued on `s` so far.
    /// @throws cuda_error, usage_error (a moved-from stream)
    [[nodiscard]] static basic_captured_wait of_stream(stream_ref s,
                                                       const std::source_location& where) {
        const int dev = s.device(where);
        basic_captured_wait w(event_pool::for_device(dev).acquire(), where);
        w.m_event.record(s, where);
        return w;
    }

    /// Captures the work `e`'s last record captured (none for a never-recorded event), through
    /// a relay stream of the current device that waits for `e`.
    /// @throws cuda_error, usage_error (a moved-from event)
    [[nodiscard]] static basic_captured_wait of_event(event_ref e,
                                                      const std::source_location& where) {
        const int dev = current_device(where).get();
        basic_captured_wait w(event_pool::for_device(dev).acquire(), where);
        w.m_relay = basic_relay_stream_cache<Unused>::instance().acquire(dev, where);
        w.m_relay_device = dev;
        check(cudaStreamWaitEvent(w.m_relay, e.get(), 0), "cudaStreamWaitEvent", where);
        w.m_event.record(stream_ref(w.m_relay), where);
        w.m_relay_recorded = true;
        return w;
    }

    basic_captured_wait(basic_captured_wait&& o) noexcept
        : m_event(std::move(o.m_event)), m_where(o.m_where),
          m_relay(std::exchange(o.m_relay, nullptr)), m_relay_device(o.m_relay_device),
          m_relay_recorded(o.m_relay_recorded) {}
    basic_captured_wait& operator=(basic_captured_wait&&) = delete;
    basic_captured_wait(const basic_captured_wait&) = delete;
    basic_captured_wait& operator=(const basic_captured_wait&) = delete;
    ~basic_captured_wait() { release_relay(); }

    [[nodiscard]] cudaEvent_t event() const { return m_event.get(); }
    /// The with_timeout call, reported by errors the wait observes.
    [[nodiscard]] const std::source_location& where() const noexcept { return m_where; }

private:
    basic_captured_wait(pooled_event ev, const std::source_location& where) noexcept
        : m_event(std::move(ev)), m_where(where) {}

    void release_relay() noexcept {
        if (m_relay == nullptr) {
            return;
        }
        // The record is the relay's last work: once it completed the relay is idle.
        bool idle = false;
        if (m_relay_recorded) {
            const cudaError_t st = cudaEventQuery(m_event.get());
            idle = st == cudaSuccess;
            if (st != cudaSuccess) {
                (void)cudaGetLastError();
            }
        }
        basic_relay_stream_cache<Unused>::instance().release(m_relay_device,
                                                             std::exchange(m_relay, nullptr), idle);
    }

    pooled_event m_event;
    std::source_location m_where;
    cudaStream_t m_relay = nullptr;
    int m_relay_device = -1;
    bool m_relay_recorded = false;
};

using captured_wait = basic_captured_wait<>;

template <class Unused>
wait_awaiter<cudaEvent_t> await_on(promise_base& p, const basic_captured_wait<Unused>& w,
                                   std::source_location) {
    return {p.require_scheduler(), w.event(), w.where()};
}

/// The coroutine behind every with_timeout: `work` runs in a detached coroutine that owns it,
/// and the caller waits for that coroutine's outcome or the timer, whichever comes first.
template <class R, class A>
task<R> await_with_timeout(A work, std::chrono::nanoseconds d) {
    scheduler& s = co_await this_scheduler();
    if (!scheduler_access::on_loop_thread(s)) {
        co_await s.schedule();
    }
    auto state = std::make_shared<timeout_state<R>>();
    state->sched = &s;
    auto child = run_detached<R>(std::move(work), timeout_sink<R>{state});
    child.handle().promise().set_scheduler(&s);
    scheduler_access::child_started(s);
    child.handle().resume();
    if constexpr (std::is_void_v<R>) {
        co_await timeout_awaiter<R>(state, d);
    } else {
        co_return co_await timeout_awaiter<R>(state, d);
    }
}

/// What the generic with_timeout takes: anything but a stream or an event, which have overloads
/// of their own.
template <class A>
concept timeout_work =
    !std::is_convertible_v<A, stream_ref> && !std::is_convertible_v<A, event_ref>;

} // namespace detail

/// Inside a library coroutine: `co_await with_timeout(s, 2s)` resumes once the work enqueued
/// on `s` before the call finished, or throws `timeout_error` after `d`.
///
/// `s` is anything that converts to stream_ref: a `cudawait::stream` (taken by reference), a
/// stream_ref, a cudaStream_t, a cuda::stream_ref. It is used only during the call, which
/// records a pooled event on it: the wait that goes on after a timeout holds that event, not
/// the stream. So the stream may be destroyed (or moved from, or reused) as soon as the call
/// returned or threw; the GPU work and the wait go on, and the scheduler tracks the wait until
/// the work completed. (Destroying a `cudawait::stream` still synchronises it first.)
/// @throws cuda_error, usage_error at the call (a moved-from stream, no device);
///         timeout_error, or cuda_error for a failure the wait observed, at the `co_await`
/// (This overload and the event's are function templates, called as `with_timeout(s, d)`: only
/// a translation unit that calls them instantiates the coroutine behind them.)
template <class Unused = void>
[[nodiscard]] task<void>
with_timeout(stream_ref s, std::chrono::nanoseconds d,
             std::source_location where = std::source_location::current()) {
    return detail::await_with_timeout<void>(detail::captured_wait::of_stream(s, where), d);
}

/// Inside a library coroutine: `co_await with_timeout(ev, 2s)` resumes once the work `ev`'s
/// last record (before the call) captured finished, or throws `timeout_error` after `d`.
///
/// `ev` is anything that converts to event_ref: a `cudawait::event` or `pooled_event` (taken by
/// reference), an event_ref, a cudaEvent_t. It is used only during the call: a stream of the
/// library's own is made to wait for it (cudaStreamWaitEvent) and a pooled event is recorded
/// there, which is what the wait holds. So `ev` may be destroyed or recorded again as soon as
/// the call returned or threw.
/// @throws cuda_error, usage_error at the call (a moved-from event, no device);
///         timeout_error, or cuda_error for a failure the wait observed, at the `co_await`
template <class Unused = void>
[[nodiscard]] task<void>
with_timeout(event_ref ev, std::chrono::nanoseconds d,
             std::source_location where = std::source_location::current()) {
    return detail::await_with_timeout<void>(detail::captured_wait::of_event(ev, where), d);
}

/// Inside a library coroutine: `co_await with_timeout(work, 2s)` awaits `work` (a task, or any
/// other awaitable, moved in: `with_timeout(std::move(t), d)` for a task variable) for at most
/// `d`, and yields what it yields.
///
/// On expiry the awaiting coroutine gets `timeout_error`; the work is not cancelled. It runs on
/// to its end in a detached coroutine that owns it and that the scheduler keeps tracking (run()
/// and the scheduler's destructor wait for it), so no event is recycled and no frame freed while
/// the GPU may still touch them. Hence whatever `work` refers to must outlive the work itself,
/// not only the `co_await`: a task that takes references (or a lambda coroutine that captures
/// them) must not be handed locals of a caller that may return on timeout; pass such a task its
/// data by value or in shared ownership.
/// @throws timeout_error, or whatever `work` throws
template <detail::timeout_work A>
[[nodiscard]] task<detail::awaited_t<A>> with_timeout(A work, std::chrono::nanoseconds d) {
    return detail::await_with_timeout<detail::awaited_t<A>>(std::move(work), d);
}

} // namespace cudawait
