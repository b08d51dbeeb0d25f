// SPDX-License-Identifier: Apache-2.0
#pragma once

// The memory module: a pinned host pool, registered ranges, and typed buffers.
//   memory_kind, classify(ptr)                    memory/memory_kind.hpp
//   pinned_pool, default_pinned_pool()            memory/pinned_pool.hpp
//   numa_pinned_pool                              memory/numa_pool.hpp
//   host_registration                             memory/host_registration.hpp
//   device_resource (stream-ordered allocation)   memory/device_resource.hpp
//   pinned_buffer<T>, device_buffer<T>            memory/pinned_buffer.hpp, device_buffer.hpp
//   mapped_buffer<T>, managed_buffer<T>           memory/mapped_buffer.hpp, managed_buffer.hpp
// Manual: docs/memory.md.

#include <cudawait/memory/device_buffer.hpp>
#include <cudawait/memory/device_resource.hpp>
#include <cudawait/memory/host_registration.hpp>
#include <cudawait/memory/managed_buffer.hpp>
#include <cudawait/memory/mapped_buffer.hpp>
#include <cudawait/memory/memory_kind.hpp>
#include <cudawait/memory/numa_pool.hpp>
#include <cudawait/memory/pinned_buffer.hpp>
#include <cudawait/memory/pinned_pool.hpp>
