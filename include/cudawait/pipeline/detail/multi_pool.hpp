// SPDX-License-Identifier: Apache-2.0
#pragma once

// Where a multi_pipeline shard's memory comes from. Staging: the page-locked pool for its
// device, on a machine with several NUMA nodes the pool of the node nearest the device
// (numa_pinned_pool), so that the DMA does not cross the socket link; on a machine with one
// node, or where the device's node is unknown, default_pinned_pool(). Device memory: the
// resource shard_device_resource() chooses and checks.

#include <cudawait/memory/detail/numa.hpp>
#include <cudawait/memory/device_resource.hpp>
#include <cudawait/memory/numa_pool.hpp>
#include <cudawait/memory/pinned_pool.hpp>
#include <cudawait/pipeline/options.hpp>
#include <cudawait/runtime/device.hpp>
#include <cudawait/runtime/error.hpp>
#include <cudawait/runtime/stream.hpp>

#include <cstddef>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

namespace cudawait::detail {

/// device_numa_node(dev), asked once per device for the process (a driver query and possibly a
/// sysfs read, too slow for every copy).
/// @throws cuda_error for a bad device id
template <class Unused = void>
[[nodiscard]] int cached_device_numa_node(int dev) {
    static std::mutex m;
    static std::vector<int> nodes; // -2: not asked yet
    std::lock_guard lock(m);
    if (dev >= 0 && static_cast<std::size_t>(dev) < nodes.size() &&
        nodes[static_cast<std::size_t>(dev)] != -2) {
        return nodes[static_cast<std::size_t>(dev)];
    }
    int node = device_numa_node(dev); // validates dev
    if (static_cast<std::size_t>(dev) >= nodes.size()) {
        nodes.resize(static_cast<std::size_t>(dev) + 1, -2);
    }
    nodes[static_cast<std::size_t>(dev)] = node;
    return node;
}

/// The pool to stage copies to and from device `dev` through: numa_pinned_pool(the device's
/// node) where the machine has more than one NUMA node and the device's node is known, else
/// default_pinned_pool(). On a single-node machine no CUDA call is made and `dev` is not
/// checked.
/// @throws usage_error in a child process after fork() (as default_pinned_pool); cuda_error for
///         a bad device id on a machine with several nodes
/// (A template, as numa_pinned_pool and default_pinned_pool are.)
template <class Unused = void>
[[nodiscard]] pinned_pool& staging_pool_for_device(int dev) {
    using v = dependent_t<Unused, void>;
    static const int node_count = numa_node_count();
    if (node_count <= 1) {
        return default_pinned_pool<v>();
    }
    int node = cached_device_numa_node<v>(dev);
    return node >= 0 ? numa_pinned_pool<v>(node) : default_pinned_pool<v>();
}

/// The device_resource of the shard on `dev` whose options are `o`: `per_device(dev)` when set,
/// else o.memory.device_resource. It is checked with one allocation, made on a stream of `dev`,
/// looked at and freed: the memory must be `dev`'s, or memory of no one device (managed, mapped
/// host). This finds a resource made for one device (RMM's per-device resources, say) given to
/// shards on another. The default resource is not probed: it allocates on the stream's device.
/// @throws usage_error when the memory is another device's; cuda_error; what the resource or
///         `per_device` throws
template <class Unused = void>
[[nodiscard]] device_resource
shard_device_resource(const pipeline_options& o,
                      const std::function<device_resource(int)>& per_device, device_ref dev) {
    device_resource r = per_device ? per_device(dev.get()) : o.memory.device_resource;
    if (r.is_default()) {
        return r;
    }
    stream s(dev);
    void* p = r.allocate(device_resource::alignment, s);
    cudaPointerAttributes a{};
    try {
        s.sync(); // allocated by now
        check(cudaPointerGetAttributes(&a, p), "cudaPointerGetAttributes");
    } catch (...) {
        r.deallocate(p, device_resource::alignment, s);
        throw;
    }
    r.deallocate(p, device_resource::alignment, s);
    s.sync(); // freed before the stream goes
    if (a.type == cudaMemoryTypeDevice && a.device != dev.get()) {
        throw usage_error("multi_pipeline: the device_resource of a shard on device " +
                          std::to_string(dev.get()) + " gives memory of device " +
                          std::to_string(a.device) +
                          " (multi_pipeline_options::device_resource_for gives each device its "
                          "own resource)");
    }
    return r;
}

} // namespace cudawait::detail
