// SPDX-License-Identifier: Apache-2.0
#pragma once

// Synopsis
//   R sync_wait(scheduler& s, work);   drives `s` on the calling thread until `work` (a task or
//                                      any awaitable) finished; returns its value or rethrows
//
// The bridge from ordinary code into coroutines: `int n = sync_wait(sched, count_things());`.

#include <cudawait/core/detail/detached.hpp>
#include <cudawait/core/scheduler.hpp>
#include <cudawait/core/task.hpp>
#include <cudawait/runtime/error.hpp>

#include <atomic>
#include <coroutine>
#include <utility>

namespace cudawait {

namespace detail {

template <class R>
struct sync_wait_state {
    result_slot<R> result;
    std::atomic<bool> done{false};
    scheduler* sched = nullptr;
};

template <class R>
struct sync_wait_sink {
    sync_wait_state<R>* state;
    void complete(result_slot<R>&& r) {
        scheduler* s = state->sched;
        state->result = std::move(r);
        if (scheduler_access::on_loop_thread(*s)) {
            state->done.store(true, std::memory_order_release);
            return;
        }
        // Finished on another thread: once `done` is seen, sync_wait may return and the caller
        // destroy the scheduler, so the store and the wake-up happen under its hand-off lock.
        scheduler_access::signal(*s,
                                 [st = state] { st->done.store(true, std::memory_order_release); });
    }
};

} // namespace detail

/// Runs `work` (moved in) on `s`, driving `s` on the calling thread until it finished.
///
/// Other coroutines on `s` make progress meanwhile; detached work that is still pending when
/// `work` finished stays with `s`.
/// @returns what `co_await work` yields
/// @throws whatever `work` throws; usage_error when `s` is already being driven (for example
///         when called from one of `s`'s own coroutines)
template <class A>
detail::awaited_t<A> sync_wait(scheduler& s, A&& work) {
    using R = detail::awaited_t<A>;
    detail::sync_wait_state<R> state;
    state.sched = &s;
    auto root = detail::run_detached<R>(std::forward<A>(work), detail::sync_wait_sink<R>{&state});
    root.handle().promise().set_scheduler(&s);
    try {
        detail::scheduler_access::run_from(
            s, root.handle(), [&state] { return state.done.load(std::memory_order_acquire); });
    } catch (const usage_error&) {
        if (!state.done.load()) {
            root.handle().destroy();
        }
        throw;
    }
    return state.result.take();
}

} // namespace cudawait
