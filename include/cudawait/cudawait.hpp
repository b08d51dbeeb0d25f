// SPDX-License-Identifier: Apache-2.0
#pragma once

// Synopsis
//   The whole library, plus <cuda_runtime.h>. Each header can also be included on its own.
//
// The umbrella includes <cuda_runtime.h> (host compilers accept it), so a .cpp file that
// includes only this header also has the runtime's typed C++ overloads, such as
// `cudaMalloc(&float_ptr, bytes)`, `cudaMallocAsync(&float_ptr, bytes, stream)` and
// `cudaMallocHost(&float_ptr, bytes)`. The individual headers include only <cuda_runtime_api.h>.

#include <cudawait/copy.hpp>
#include <cudawait/copy_lane.hpp>
#include <cudawait/device.hpp>
#include <cudawait/device_buffer.hpp>
#include <cudawait/error.hpp>
#include <cudawait/event.hpp>
#include <cudawait/graph.hpp>
#include <cudawait/host_registration.hpp>
#include <cudawait/interop.hpp>
#include <cudawait/link.hpp>
#include <cudawait/managed_buffer.hpp>
#include <cudawait/mapped_buffer.hpp>
#include <cudawait/memory_kind.hpp>
#include <cudawait/multi_pipeline.hpp>
#include <cudawait/numa_pool.hpp>
#include <cudawait/pinned_buffer.hpp>
#include <cudawait/pinned_pool.hpp>
#include <cudawait/pipeline.hpp>
#include <cudawait/pipeline_options.hpp>
#include <cudawait/scheduler.hpp>
#include <cudawait/scope.hpp>
#include <cudawait/stream.hpp>
#include <cudawait/sync_wait.hpp>
#include <cudawait/task.hpp>
#include <cudawait/timeline.hpp>
#include <cudawait/timeout.hpp>
#include <cudawait/trace.hpp>
#include <cudawait/version.hpp>
#include <cudawait/watchdog.hpp>
#include <cudawait/when_all.hpp>

#include <cuda_runtime.h>
