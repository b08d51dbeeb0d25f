// SPDX-License-Identifier: Apache-2.0
#pragma once

// The nccl module (CMake target cudawait::nccl, where NCCL is found): awaited collectives.
//   nccl::communicator, nccl::unique_id, nccl::group, co_await nccl::all_reduce(...)
// Manual: docs/nccl.md.

#include <cudawait/nccl/nccl.hpp>
