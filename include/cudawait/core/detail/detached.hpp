// SPDX-License-Identifier: Apache-2.0
#pragma once

// The coroutine behind all detached work: scheduler::spawn, sync_wait's root, async_scope's
// children and the work a with_timeout runs. Each of them awaits something, hands the outcome to a
// sink of its own (what differs between them) and frees itself.

#include <cudawait/core/task.hpp>
#include <cudawait/runtime/error.hpp>

#include <coroutine>
#include <exception>
#include <type_traits>
#include <utility>

namespace cudawait::detail {

/// A coroutine that starts when resumed, runs to its end on its own and frees its frame there.
/// Nothing owns it once it started: its outcome goes to a sink (see run_detached).
class detached {
public:
    class promise_type : public promise_base {
    public:
        detached get_return_object() noexcept {
            return detached(std::coroutine_handle<promise_type>::from_promise(*this));
        }
        std::suspend_always initial_suspend() noexcept { return {}; }
        std::suspend_never final_suspend() noexcept { return {}; }
        void return_void() noexcept {}
        // The body catches everything; an exception here means the sink threw.
        void unhandled_exception() noexcept { std::terminate(); }
    };
    explicit detached(std::coroutine_handle<promise_type> h) noexcept : m_handle(h) {}
    /// The coroutine, not yet started: set its scheduler, then resume (or post) it.
    [[nodiscard]] std::coroutine_handle<promise_type> handle() const noexcept { return m_handle; }

private:
    std::coroutine_handle<promise_type> m_handle;
};

/// Awaits `a` and passes the outcome, as a result_slot<R>, to `sink.complete(...)`. A sink that
/// throws ends the program: nobody is left to take the exception.
template <class R, class A, class Sink>
detached run_detached(A a, Sink sink) {
    result_slot<R> r;
    try {
        if constexpr (std::is_void_v<R>) {
            co_await std::move(a);
            r.set_value();
        } else {
            r.set_value(co_await std::move(a));
        }
    } catch (...) {
        r.set_exception(std::current_exception());
    }
    sink.complete(std::move(r));
}

} // namespace cudawait::detail
