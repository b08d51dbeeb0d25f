// SPDX-License-Identifier: Apache-2.0
#pragma once

// A host-completed awaitable for the scheduler logic tests that run without a GPU: a coroutine
// awaiting it is resumed, through the scheduler's post(), when some thread calls fire().

#include <cudawait/core/scheduler.hpp>

#include <coroutine>
#include <mutex>

namespace cudawait::testing {

class host_signal {
public:
    explicit host_signal(scheduler& s) noexcept : m_scheduler(&s) {}

    bool await_ready() {
        std::lock_guard lock(m_mutex);
        return m_fired;
    }
    bool await_suspend(std::coroutine_handle<> h) {
        std::lock_guard lock(m_mutex);
        if (m_fired) {
            return false;
        }
        m_waiter = h;
        return true;
    }
    void await_resume() const noexcept {}

    /// Thread-safe.
    void fire() {
        std::coroutine_handle<> h;
        {
            std::lock_guard lock(m_mutex);
            m_fired = true;
            h = std::exchange(m_waiter, {});
        }
        if (h) {
            m_scheduler->post(h);
        }
    }

private:
    scheduler* m_scheduler;
    std::mutex m_mutex;
    bool m_fired = false;
    std::coroutine_handle<> m_waiter;
};

} // namespace cudawait::testing
