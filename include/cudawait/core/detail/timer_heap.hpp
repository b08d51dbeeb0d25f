// SPDX-License-Identifier: Apache-2.0
#pragma once

// detail::timer_heap: the scheduler's timers, a min-heap by deadline (then by order of arming).
// See docs/core.md#timers.

#include <cudawait/core/detail/callback.hpp>
#include <cudawait/runtime/detail/chrono.hpp>
#include <cudawait/runtime/detail/config.hpp>

#include <algorithm>
#include <coroutine>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

namespace cudawait::detail {

struct timer_node {
    std::chrono::steady_clock::time_point deadline;
    std::uint64_t seq = 0;
    std::coroutine_handle<> waiter;
    callback fn;
    bool cancelled = false;
    /// Set by add_daemon_timer: not counted as pending work (run() and the destructor do not
    /// wait for it), for periodic checks such as a watchdog's.
    bool daemon = false;
};

/// Owns its nodes; a node stays valid until it fired or, cancelled, reached the top of the heap.
/// A class template (`Unused` is always void) so that only a scheduler that is driven
/// instantiates it.
template <class Unused = void>
class timer_heap {
public:
    using clock = std::chrono::steady_clock;

    timer_heap() = default;
    timer_heap(const timer_heap&) = delete;
    timer_heap& operator=(const timer_heap&) = delete;
    ~timer_heap() { clear(); }

    /// Resumes `h` (through `ready`, see fire) at `deadline`.
    void add(clock::time_point deadline, std::coroutine_handle<> h) {
        push(new timer_node{deadline, m_seq++, h, {}, false});
    }
    /// Calls `fn` at `deadline` unless cancelled first.
    timer_node* add(clock::time_point deadline, callback fn) {
        auto* t = new timer_node{deadline, m_seq++, {}, std::move(fn), false};
        push(t);
        return t;
    }
    /// add(deadline, fn) for a periodic check: not counted by live().
    timer_node* add_daemon(clock::time_point deadline, callback fn) {
        auto* t = new timer_node{deadline, m_seq++, {}, std::move(fn), false};
        t->daemon = true;
        push(t);
        return t;
    }
    /// Cancels a callback timer that has not fired yet.
    void cancel(timer_node* t) noexcept {
        if (t != nullptr && !t->cancelled) {
            t->cancelled = true;
            t->fn = nullptr;
            m_live -= t->daemon ? 0 : 1;
        }
    }

    /// Timers that are neither cancelled nor daemons.
    [[nodiscard]] std::size_t live() const noexcept { return m_live; }
    [[nodiscard]] bool empty() const noexcept { return m_heap.empty(); }
    /// The earliest deadline; the heap must not be empty.
    [[nodiscard]] clock::time_point next_deadline() const noexcept {
        return m_heap.front()->deadline;
    }

    /// Fires the timers due at `now`: a coroutine's goes to `ready`, a callback runs here.
    /// Returns whether a timer other than a daemon fired.
    bool fire(clock::time_point now, std::vector<std::coroutine_handle<>>& ready) {
        bool progress = false;
        while (!m_heap.empty() && m_heap.front()->deadline <= now) {
            std::pop_heap(m_heap.begin(), m_heap.end(), later{});
            std::unique_ptr<dependent_t<Unused, timer_node>> t(m_heap.back());
            m_heap.pop_back();
            if (t->cancelled) {
                continue;
            }
            m_live -= t->daemon ? 0 : 1;
            progress |= !t->daemon; // a periodic check is not progress of the loop
            if (t->waiter) {
                ready.push_back(t->waiter);
            } else if (t->fn) {
                t->fn();
            }
        }
        return progress;
    }

    /// Drops the cancelled timers at the top of the heap.
    void drop_cancelled() {
        while (!m_heap.empty() && m_heap.front()->cancelled) {
            std::pop_heap(m_heap.begin(), m_heap.end(), later{});
            delete m_heap.back();
            m_heap.pop_back();
        }
    }

    /// Deletes every timer, fired or not.
    void clear() noexcept {
        for (timer_node* t : m_heap) {
            delete t;
        }
        m_heap.clear();
    }

private:
    struct later {
        bool operator()(const timer_node* a, const timer_node* b) const noexcept {
            return a->deadline != b->deadline ? a->deadline > b->deadline : a->seq > b->seq;
        }
    };
    void push(timer_node* t) {
        m_heap.push_back(t);
        std::push_heap(m_heap.begin(), m_heap.end(), later{});
        m_live += t->daemon ? 0 : 1;
    }

    std::vector<timer_node*> m_heap;
    std::size_t m_live = 0;
    std::uint64_t m_seq = 0;
};

} // namespace cudawait::detail
