// SPDX-License-Identifier: Apache-2.0
#pragma once

// The copy module: awaited copies between any two kinds of memory, and per-device copy lanes.
//   co_await copy(dst, src, stream); copy_async(dst, src, stream)     copy/copy.hpp
//   co_await copy(dst, src); small_copy_stream(device, ...)           copy/copy_lane.hpp
//   link_info describe_link(device), link_peak_gbps(device)          copy/link.hpp
// Manual: docs/copy.md.

#include <cudawait/copy/copy.hpp>
#include <cudawait/copy/copy_lane.hpp>
#include <cudawait/copy/link.hpp>
