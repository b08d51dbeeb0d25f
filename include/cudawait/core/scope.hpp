// SPDX-License-Identifier: Apache-2.0
#pragma once

// Synopsis
//   class async_scope;   spawn detached work onto a scheduler; `co_await scope.join()` waits
//                        for all of it and rethrows the first exception any of it threw
//
//   async_scope scope(sched);
//   for (auto& s : streams) scope.spawn(consume(s));
//   co_await scope.join();

#include <cudawait/core/detail/detached.hpp>
#include <cudawait/core/scheduler.hpp>
#include <cudawait/core/task.hpp>
#include <cudawait/runtime/error.hpp>

#include <coroutine>
#include <cstddef>
#include <cstdio>
#include <exception>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

namespace cudawait {

namespace detail {

/// What a scope and its running work share; outlives the scope while work is still running.
struct scope_state {
    explicit scope_state(scheduler& s) noexcept : sched(&s) {}
    scheduler* sched;
    std::mutex mutex;
    std::size_t active = 0;
    std::coroutine_handle<> joiner;
    std::vector<std::exception_ptr> errors;
    std::vector<std::exception_ptr> last_errors;
};

template <class R>
struct scope_sink {
    std::shared_ptr<scope_state> state;
    void complete(result_slot<R>&& r) {
        std::coroutine_handle<> joiner;
        {
            std::lock_guard lock(state->mutex);
            if (r.has_exception()) {
                state->errors.push_back(r.exception());
            }
            if (--state->active == 0) {
                joiner = std::exchange(state->joiner, {});
            }
        }
        if (joiner) {
            state->sched->post(joiner);
        }
    }
};

} // namespace detail

/// A group of detached coroutines running on one scheduler, joined together.
///
/// Thread-safe: spawn from any thread. Destroying a scope with work still running is a bug; it
/// is reported on stderr (the work itself goes on and its outcome is dropped).
///
/// The members that make or copy the shared state are templates (of an unused parameter), so
/// that only a translation unit that uses a scope instantiates them.
class async_scope {
public:
    template <class = void>
    explicit async_scope(scheduler& s) : m_state(std::make_shared<detail::scope_state>(s)) {}
    async_scope(const async_scope&) = delete;
    async_scope& operator=(const async_scope&) = delete;
    ~async_scope() {
        std::lock_guard lock(m_state->mutex);
        if (m_state->active > 0) {
            std::fprintf(stderr,
                         "cudawait: async_scope destroyed with %zu spawned tasks still running; "
                         "join it first\n",
                         m_state->active);
        }
    }

    /// Starts `work` (a task or any awaitable, moved in) on the scope's scheduler.
    template <class A>
    void spawn(A&& work) {
        using R = detail::awaited_t<A>;
        auto d = detail::run_detached<R>(std::forward<A>(work), detail::scope_sink<R>{m_state});
        d.handle().promise().set_scheduler(m_state->sched);
        {
            std::lock_guard lock(m_state->mutex);
            ++m_state->active;
        }
        m_state->sched->post(std::coroutine_handle<>(d.handle()));
    }

    /// Work spawned and not yet finished.
    [[nodiscard]] std::size_t active() const {
        std::lock_guard lock(m_state->mutex);
        return m_state->active;
    }

    class join_awaiter {
    public:
        explicit join_awaiter(detail::scope_state& s) noexcept : m_state(&s) {}
        bool await_ready() const {
            std::lock_guard lock(m_state->mutex);
            return m_state->active == 0;
        }
        bool await_suspend(std::coroutine_handle<> h) {
            std::lock_guard lock(m_state->mutex);
            if (m_state->active == 0) {
                return false;
            }
            if (m_state->joiner) {
                throw usage_error("cudawait::async_scope joined twice at once");
            }
            m_state->joiner = h;
            return true;
        }
        /// @throws the first exception spawned work threw since the last join
        template <class = void>
        void await_resume() const {
            std::exception_ptr first;
            {
                std::lock_guard lock(m_state->mutex);
                if (!m_state->errors.empty()) {
                    first = m_state->errors.front();
                    m_state->last_errors = std::exchange(m_state->errors, {});
                }
            }
            if (first) {
                std::rethrow_exception(first);
            }
        }

    private:
        detail::scope_state* m_state;
    };

    /// `co_await scope.join()` resumes once all spawned work finished, on the scope's
    /// scheduler. Rethrows the first exception (by completion order); errors() lists them all.
    [[nodiscard]] join_awaiter join() noexcept { return join_awaiter(*m_state); }

    /// Every exception reported by the last join that threw.
    template <class = void>
    [[nodiscard]] std::vector<std::exception_ptr> errors() const {
        std::lock_guard lock(m_state->mutex);
        return m_state->last_errors;
    }

private:
    std::shared_ptr<detail::scope_state> m_state;
};

} // namespace cudawait
