// SPDX-License-Identifier: Apache-2.0
#pragma once

// The core module: coroutines that co_await CUDA work, and the loop that resumes them.
//   task<T>, co_await stream / event              core/task.hpp
//   scheduler, sleep_for, this_scheduler()        core/scheduler.hpp, core/task.hpp
//   poll_policy (balanced, sentinels, ...)        core/poll_policy.hpp
//   sync_wait(sched, task)                        core/sync_wait.hpp
//   when_all(tasks...)                            core/when_all.hpp
//   async_scope (spawn, join)                     core/scope.hpp
//   co_await with_timeout(awaitable, duration)    core/timeout.hpp
//   foreign streams and events (PyTorch, CCCL)    core/interop.hpp
// Manual: docs/core.md.

#include <cudawait/core/interop.hpp>
#include <cudawait/core/poll_policy.hpp>
#include <cudawait/core/scheduler.hpp>
#include <cudawait/core/scope.hpp>
#include <cudawait/core/sync_wait.hpp>
#include <cudawait/core/task.hpp>
#include <cudawait/core/timeout.hpp>
#include <cudawait/core/when_all.hpp>
