// SPDX-License-Identifier: Apache-2.0
#pragma once

// The runtime module: owning wrappers of CUDA's handles, each with a non-owning view.
//   cudawait::error, usage_error, check(...)       runtime/error.hpp
//   device_ref, device_guard, enable_peer_access   runtime/device.hpp
//   stream, stream_ref                             runtime/stream.hpp
//   event, event_ref, pooled_event, event_pool    runtime/event.hpp
//   graph, graph_exec, capture                     runtime/graph.hpp
// Manual: docs/runtime.md.

#include <cudawait/runtime/device.hpp>
#include <cudawait/runtime/error.hpp>
#include <cudawait/runtime/event.hpp>
#include <cudawait/runtime/graph.hpp>
#include <cudawait/runtime/stream.hpp>
