// SPDX-License-Identifier: Apache-2.0
#pragma once

// The nccl module (CMake target cudawait::nccl, where NCCL is found): awaited collectives.
//   nccl::error                                   nccl/error.hpp
//   nccl::unique_id                               nccl/unique_id.hpp
//   nccl::communicator, nccl::wait_options        nccl/communicator.hpp
//   nccl::group, co_await nccl::all_reduce(...)   nccl/nccl.hpp
// Manual: docs/nccl.md.

#include <cudawait/nccl/communicator.hpp>
#include <cudawait/nccl/error.hpp>
#include <cudawait/nccl/nccl.hpp>
#include <cudawait/nccl/unique_id.hpp>
