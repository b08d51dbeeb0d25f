// SPDX-License-Identifier: Apache-2.0
#pragma once

// docs/core.md's `scheduler& s = co_await this_scheduler();`, in coroutines that task_test.cpp
// (built by the host compiler) and task_cuda_test.cu (built by nvcc) both run, so the spelling
// is known to compile and to work under both.

#include <cudawait/core/scheduler.hpp>
#include <cudawait/core/sync_wait.hpp>
#include <cudawait/core/task.hpp>
#include <cudawait/runtime/error.hpp>

namespace cudawait::testing {

/// The scheduler the coroutine runs on, through docs/core.md's spelling.
inline task<scheduler*> bound_scheduler() {
    scheduler& s = co_await this_scheduler();
    co_return &s;
}

inline task<> count_up(int* counter) {
    ++*counter;
    co_return;
}

/// Uses the bound reference: spawns onto it, and checks that a child task and a second await
/// name the same scheduler. Returns how many of the three agree with `expected`.
inline task<int> use_bound_scheduler(scheduler* expected, int* spawned) {
    scheduler& s = co_await this_scheduler();
    s.spawn(count_up(spawned));
    scheduler* from_child = co_await bound_scheduler();
    scheduler& again = co_await this_scheduler();
    co_return int{&s == expected} + int{from_child == expected} + int{&again == expected};
}

/// Runs the cases on a scheduler of its own; returns the number of failed checks (0 = all good).
inline int run_this_scheduler_cases() {
    int failures = 0;
    scheduler s;
    failures += sync_wait(s, bound_scheduler()) == &s ? 0 : 1;
    int spawned = 0;
    failures += 3 - sync_wait(s, use_bound_scheduler(&s, &spawned));
    s.run(); // the spawned task
    failures += spawned == 1 ? 0 : 1;

    // Started by hand, outside any scheduler: the await throws usage_error.
    task<scheduler*> orphan = bound_scheduler();
    orphan.handle().resume();
    try {
        (void)orphan.handle().promise().result().take();
        ++failures;
    } catch (const usage_error&) {
    }
    return failures;
}

} // namespace cudawait::testing
