// SPDX-License-Identifier: Apache-2.0
#pragma once

// An asynchronous condition for coroutines on one scheduler: they wait until notified, then
// check their condition again (the pipeline's streaming calls wait on it for a free slot and for
// a submitted chunk). wait_until() also gives up at a deadline, for the calls that take one.

#include <cudawait/core/scheduler.hpp>
#include <cudawait/runtime/detail/chrono.hpp>

#include <coroutine>
#include <cstddef>
#include <memory>
#include <utility>
#include <vector>

namespace cudawait::detail {

/// Coroutines waiting for a condition on one scheduler's thread; notify resumes them all (they
/// check their condition again). A class template (`Unused` is always void; use wait_list) so
/// that only a translation unit that waits on one instantiates its vectors and shared state.
template <class Unused = void>
class basic_wait_list {
public:
    struct awaiter {
        basic_wait_list* list;
        scheduler* sched;
        bool await_ready() const noexcept { return false; }
        void await_suspend(std::coroutine_handle<> h) { list->m_waiting.emplace_back(h, sched); }
        void await_resume() const noexcept {}
    };
    [[nodiscard]] awaiter wait(scheduler& s) noexcept { return {this, &s}; }

    /// A waiter with a deadline: whichever comes first, a notify or the deadline, resumes it,
    /// and the other then does nothing. Shared by the list, the timer and the awaiter.
    struct timed_waiter {
        std::coroutine_handle<> handle;
        scheduler* sched = nullptr;
        timer_node* timer = nullptr;
        bool resumed = false;
        bool notified = false;
    };
    /// co_await resumes on a notify (true) or at `deadline` (false). Loop thread only, like
    /// the rest of the list; a deadline already passed returns false without suspending.
    struct timed_awaiter {
        basic_wait_list* list;
        scheduler* sched;
        std::chrono::steady_clock::time_point deadline;
        std::shared_ptr<timed_waiter> state = std::make_shared<timed_waiter>();
        bool await_ready() const noexcept { return std::chrono::steady_clock::now() >= deadline; }
        void await_suspend(std::coroutine_handle<> h) {
            state->handle = h;
            state->sched = sched;
            list->m_timed.push_back(state);
            std::weak_ptr<timed_waiter> weak = state;
            state->timer = scheduler_access::add_timer(*sched, deadline, [weak] {
                if (auto st = weak.lock(); st && !st->resumed) {
                    st->resumed = true;
                    st->timer = nullptr;
                    scheduler_access::resume_soon(*st->sched, st->handle);
                }
            });
        }
        [[nodiscard]] bool await_resume() const noexcept { return state->notified; }
        // A coroutine destroyed while it waits: neither its timer nor a notify may resume it.
        ~timed_awaiter() {
            if (state && state->sched != nullptr && !state->resumed) {
                state->resumed = true;
                scheduler_access::cancel_timer(*state->sched, std::exchange(state->timer, nullptr));
            }
        }
    };
    [[nodiscard]] timed_awaiter wait_until(scheduler& s,
                                           std::chrono::steady_clock::time_point deadline) {
        return {this, &s, deadline};
    }

    /// Resumes every waiter (each checks its condition again). Never throws, for the noexcept
    /// paths that give a slot back: where the scheduler cannot queue a resume (no memory), that
    /// waiter and the ones after it stay in the list for the next notify (a timed one still
    /// ends at its deadline).
    void notify_all() noexcept {
        std::size_t posted = 0;
        try {
            for (; posted < m_waiting.size(); ++posted) {
                m_waiting[posted].second->post(m_waiting[posted].first);
            }
        } catch (...) {
        }
        m_waiting.erase(m_waiting.begin(), m_waiting.begin() + static_cast<std::ptrdiff_t>(posted));
        // Timed waiters whose deadline passed are dropped here; the rest are resumed once.
        std::size_t done = 0;
        try {
            for (; done < m_timed.size(); ++done) {
                timed_waiter& st = *m_timed[done];
                if (!st.resumed) {
                    st.sched->post(st.handle);
                    st.resumed = true;
                    st.notified = true;
                    scheduler_access::cancel_timer(*st.sched, std::exchange(st.timer, nullptr));
                }
            }
        } catch (...) {
        }
        m_timed.erase(m_timed.begin(), m_timed.begin() + static_cast<std::ptrdiff_t>(done));
    }

private:
    std::vector<std::pair<std::coroutine_handle<>, scheduler*>> m_waiting;
    std::vector<std::shared_ptr<timed_waiter>> m_timed;
};

using wait_list = basic_wait_list<>;

} // namespace cudawait::detail
