// SPDX-License-Identifier: Apache-2.0
#pragma once

// An asynchronous condition for coroutines on one scheduler: they wait until notified, then
// check their condition again (the pipeline's streaming calls wait on it for a free slot and for
// a submitted chunk).

#include <cudawait/scheduler.hpp>

#include <coroutine>
#include <utility>
#include <vector>

namespace cudawait::detail {

/// Coroutines waiting for a condition on one scheduler's thread; notify resumes them all (they
/// check their condition again).
class wait_list {
public:
    struct awaiter {
        wait_list* list;
        scheduler* sched;
        bool await_ready() const noexcept { return false; }
        void await_suspend(std::coroutine_handle<> h) { list->m_waiting.emplace_back(h, sched); }
        void await_resume() const noexcept {}
    };
    [[nodiscard]] awaiter wait(scheduler& s) noexcept { return {this, &s}; }
    void notify_all() {
        auto waiting = std::exchange(m_waiting, {});
        for (auto [h, s] : waiting) {
            s->post(h);
        }
    }

private:
    std::vector<std::pair<std::coroutine_handle<>, scheduler*>> m_waiting;
};

} // namespace cudawait::detail
