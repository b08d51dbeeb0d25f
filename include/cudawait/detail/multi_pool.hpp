// SPDX-License-Identifier: Apache-2.0
#pragma once

// The page-locked pool that staging for one device draws from: on a machine with several NUMA
// nodes, the pool of the node nearest the device (numa_pinned_pool), so that the DMA does not
// cross the socket link; on a machine with one node, or where the device's node is unknown,
// default_pinned_pool().

#include <cudawait/numa_pool.hpp>
#include <cudawait/pinned_pool.hpp>

#include <cudawait/detail/numa.hpp>

#include <cstddef>
#include <mutex>
#include <vector>

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

} // namespace cudawait::detail
