// SPDX-License-Identifier: Apache-2.0
#pragma once

// The observe module: NVTX ranges, a timeline of the GPU's work, and a stall watchdog.
//   trace_range, trace_async_range                observe/trace.hpp
//   timeline (SVG, Chrome trace)                  observe/timeline.hpp
//   watchdog                                      observe/watchdog.hpp
// Manual: docs/observe.md.

#include <cudawait/observe/timeline.hpp>
#include <cudawait/observe/trace.hpp>
#include <cudawait/observe/watchdog.hpp>
