// SPDX-License-Identifier: Apache-2.0
#pragma once

// detail::wait_awaiter, sleep_awaiter, schedule_awaiter: what `co_await stream`, `co_await event`,
// `co_await sleep_for(d)` and `co_await sched.schedule()` turn into. See docs/core.md#awaiting.

#include <cudawait/core/detail/scheduler_access.hpp>
#include <cudawait/core/task.hpp>
#include <cudawait/runtime/detail/chrono.hpp>
#include <cudawait/runtime/detail/refs.hpp>
#include <cudawait/runtime/error.hpp>

#include <coroutine>
#include <source_location>

#include <cuda_runtime_api.h>

namespace cudawait::detail {

// The scheduler is incomplete here: what the awaiters call on it is named dependently
// (dependent_t), so it is looked up where an await instantiates it.

/// What scheduler::schedule() returns.
struct schedule_awaitable {
    scheduler* target;
};

/// `co_await sleep_for(d)` before it is bound to a scheduler.
struct sleep_request {
    std::chrono::nanoseconds duration;
};

/// `co_await stream` or `co_await event` (Handle: cudaStream_t or cudaEvent_t): resumes once the
/// work the stream held at the await, or the work the event captured, finished.
template <class Handle>
class wait_awaiter {
public:
    wait_awaiter(scheduler& s, Handle handle, std::source_location where) noexcept
        : m_scheduler(&s), m_handle(handle), m_where(where) {}
    bool await_ready() const noexcept { return false; }
    bool await_suspend(std::coroutine_handle<> h) noexcept {
        return scheduler_access::add_wait(*m_scheduler, m_handle, h, m_status, m_api);
    }
    /// @throws cuda_error carrying the status the poll observed and this await's call site
    /// @throws stall_error when a watchdog gave up on the await (its device made no progress)
    void await_resume() const {
        if (m_status == cudaErrorNotReady) [[unlikely]] {
            const stall_record& r = scheduler_access::last_stall(*m_scheduler);
            throw stall_error(r.device, r.stalled_for);
        }
        if (m_status != cudaSuccess) {
            throw cuda_error(m_status, m_api, m_where);
        }
    }

private:
    dependent_t<Handle, scheduler>* m_scheduler;
    Handle m_handle;
    std::source_location m_where;
    cudaError_t m_status = cudaSuccess;
    const char* m_api = nullptr;
};

class sleep_awaiter {
public:
    sleep_awaiter(scheduler& s, std::chrono::nanoseconds d) noexcept : m_scheduler(&s), m_for(d) {}
    bool await_ready() const noexcept { return m_for <= std::chrono::nanoseconds::zero(); }
    /// A template, as schedule_awaiter's: only a coroutine that awaits it instantiates the
    /// scheduler's timer and post paths.
    template <class P>
    void await_suspend(std::coroutine_handle<P> h) {
        dependent_t<P, scheduler>& s = *m_scheduler;
        scheduler_access::add_timer(s, std::chrono::steady_clock::now() + m_for,
                                    std::coroutine_handle<>(h));
    }
    void await_resume() const noexcept {}

private:
    scheduler* m_scheduler;
    std::chrono::nanoseconds m_for;
};

class schedule_awaiter {
public:
    explicit schedule_awaiter(scheduler& s) noexcept : m_scheduler(&s) {}
    bool await_ready() const noexcept { return false; }
    template <class P>
    void await_suspend(std::coroutine_handle<P> h) {
        dependent_t<P, scheduler>* s = m_scheduler;
        s->post(std::coroutine_handle<>(h));
    }
    void await_resume() const noexcept {}

private:
    scheduler* m_scheduler;
};

inline wait_awaiter<cudaStream_t> await_on(promise_base& p, stream_ref s,
                                           std::source_location where) {
    return {p.require_scheduler(), s.get(), where};
}
inline wait_awaiter<cudaEvent_t> await_on(promise_base& p, event_ref e,
                                          std::source_location where) {
    return {p.require_scheduler(), e.get(), where};
}
inline sleep_awaiter await_on(promise_base& p, sleep_request r, std::source_location) {
    return sleep_awaiter(p.require_scheduler(), r.duration);
}
inline schedule_awaiter await_on(promise_base& p, schedule_awaitable a, std::source_location) {
    p.set_scheduler(a.target);
    return schedule_awaiter(*a.target);
}

} // namespace cudawait::detail
