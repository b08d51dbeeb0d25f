// SPDX-License-Identifier: Apache-2.0
#pragma once

// The memory module: a pinned host pool, registered ranges, and typed buffers.
//   memory_kind, classify(ptr)                    memory/memory_kind.hpp
//   pinned_pool, default_pinned_pool()            memory/pinned_pool.hpp
//   pinned_pool_options, _stats, pool_exhausted   memory/pinned_pool_options.hpp
//   slab_source, use_tracker, 64_MiB              memory/slab_source.hpp, use_tracker.hpp,
//                                                 literals.hpp
//   numa_pinned_pool                              memory/numa_pool.hpp
//   host_registration                             memory/host_registration.hpp
//   device_resource (stream-ordered allocation)   memory/device_resource.hpp
//   pinned_buffer<T>, device_buffer<T>            memory/pinned_buffer.hpp, device_buffer.hpp
//   mapped_buffer<T>, managed_buffer<T>           memory/mapped_buffer.hpp, managed_buffer.hpp
// Manual: docs/memory.md.

#include <cudawait/memory/device_buffer.hpp>
#include <cudawait/memory/device_resource.hpp>
#include <cudawait/memory/host_registration.hpp>
#include <cudawait/memory/literals.hpp>
#include <cudawait/memory/managed_buffer.hpp>
#include <cudawait/memory/mapped_buffer.hpp>
#include <cudawait/memory/memory_kind.hpp>
#include <cudawait/memory/numa_pool.hpp>
#include <cudawait/memory/pinned_buffer.hpp>
#include <cudawait/memory/pinned_pool.hpp>
#include <cudawait/memory/pinned_pool_options.hpp>
#include <cudawait/memory/slab_source.hpp>
#include <cudawait/memory/use_tracker.hpp>
