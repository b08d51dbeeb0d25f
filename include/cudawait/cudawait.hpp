// SPDX-License-Identifier: Apache-2.0
#pragma once

// The whole library. Each header can also be included on its own.

#include <cudawait/copy.hpp>
#include <cudawait/device.hpp>
#include <cudawait/device_buffer.hpp>
#include <cudawait/error.hpp>
#include <cudawait/event.hpp>
#include <cudawait/mapped_buffer.hpp>
#include <cudawait/pinned_buffer.hpp>
#include <cudawait/pinned_pool.hpp>
#include <cudawait/pipeline.hpp>
#include <cudawait/scheduler.hpp>
#include <cudawait/scope.hpp>
#include <cudawait/stream.hpp>
#include <cudawait/sync_wait.hpp>
#include <cudawait/task.hpp>
#include <cudawait/trace.hpp>
#include <cudawait/version.hpp>
#include <cudawait/when_all.hpp>
