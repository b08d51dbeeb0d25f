// SPDX-License-Identifier: Apache-2.0
#pragma once

// Synopsis
//   numa_slab_source src(node);              page-locked slabs placed on one NUMA node (mbind)
//   numa_slab_source src(node, numa_policy::preferred);   placed there where the system lets
//   pinned_pool& numa_pinned_pool(int node); the process-wide pool of one node's memory
//
// Where mbind is refused (containers without CAP_SYS_NICE), numa_policy::bind throws
// std::system_error and numa_policy::preferred places the slab by first touch. See
// docs/memory.md#numa.

#include <cudawait/memory/detail/numa.hpp>
#include <cudawait/memory/pinned_pool.hpp>
#include <cudawait/runtime/detail/fork_guard.hpp>
#include <cudawait/runtime/error.hpp>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <system_error>

#include <cuda_runtime_api.h>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace cudawait {

/// How strictly a numa_slab_source places its slabs.
enum class numa_policy {
    bind,      ///< MPOL_BIND: only the node's memory; a refused mbind is an error
    preferred, ///< MPOL_PREFERRED: the node's memory while it has free pages; a refused
               ///< mbind leaves the slab placed by first touch
};

namespace detail {

/// Everything numa_slab_source is, as a class template it derives from, so that only a
/// translation unit that makes one instantiates it. `Unused` is always void.
template <class Unused = void>
class basic_numa_slab_source : public slab_source {
public:
    /// The largest range one cudaHostRegister call accepts here.
    static constexpr std::size_t max_slab_bytes = 64_GiB;
    static constexpr std::size_t alignment = 2_MiB;

    /// @throws usage_error when `node` is no NUMA node of this machine (where sysfs does not
    ///         list the nodes, only node 0 is)
    explicit basic_numa_slab_source(int node, numa_policy policy = numa_policy::bind)
        : m_node(node), m_policy(policy) {
        if (!numa_node_exists(node)) {
            throw usage_error("numa_slab_source: " + std::to_string(node) +
                              " is no NUMA node of this machine (it has " +
                              std::to_string(numa_node_count()) + ")");
        }
    }

    basic_numa_slab_source(const basic_numa_slab_source&) = delete;
    basic_numa_slab_source& operator=(const basic_numa_slab_source&) = delete;

    /// @throws usage_error for a size that is not a non-zero multiple of 2 MiB up to 64 GiB;
    ///         std::bad_alloc when mmap fails; std::system_error when mbind is refused under
    ///         numa_policy::bind (errno in code()); cuda_error from cudaHostRegister
    void* allocate(std::size_t bytes) override {
        if (bytes == 0 || bytes % alignment != 0 || bytes > max_slab_bytes) {
            throw usage_error("numa_slab_source: slab size must be a non-zero multiple of 2 MiB "
                              "and at most 64 GiB");
        }
#if defined(__linux__)
        std::byte* p = map_huge_aligned(bytes, alignment);
        try {
            place(p, bytes);
            fault_in(p, bytes);
        } catch (...) {
            ::munmap(p, bytes);
            throw;
        }
        cudaError_t st = cudaHostRegister(p, bytes, cudaHostRegisterPortable);
        if (st != cudaSuccess) {
            ::munmap(p, bytes);
            check(st, "cudaHostRegister");
        }
        return p;
#else
        throw std::system_error(ENOSYS, std::generic_category(), "numa_slab_source: no mmap");
#endif
    }

    void deallocate(void* p, std::size_t bytes) noexcept override {
        report(cudaHostUnregister(p), "cudaHostUnregister");
#if defined(__linux__)
        ::munmap(p, bytes);
#else
        (void)bytes;
#endif
    }

    /// The node the slabs are placed on.
    [[nodiscard]] int node() const noexcept { return m_node; }
    /// How strictly.
    [[nodiscard]] numa_policy policy() const noexcept { return m_policy; }
    /// Slabs made under numa_policy::preferred although mbind was refused (placed by first
    /// touch, that is on the node of the thread that grew the pool, as a rule).
    [[nodiscard]] std::uint64_t unplaced_slabs() const noexcept {
        return m_unplaced.load(std::memory_order_relaxed);
    }

private:
    // Before the first touch: the policy decides where each page is faulted in.
    void place(std::byte* p, std::size_t bytes) {
        int mode = m_policy == numa_policy::bind ? mpol_bind : mpol_preferred;
        try {
            bind_to_node(p, bytes, m_node, mode);
        } catch (const std::system_error&) {
            if (m_policy == numa_policy::bind) {
                throw;
            }
            m_unplaced.fetch_add(1, std::memory_order_relaxed);
        }
    }

    int m_node;
    numa_policy m_policy;
    std::atomic<std::uint64_t> m_unplaced{0};
};

} // namespace detail

/// A slab_source whose slabs live on one NUMA node: an anonymous mapping (transparent huge
/// pages requested), bound to the node with mbind, faulted in on several threads, then
/// registered with cudaHostRegister (portable). Slabs are 2 MiB-aligned, as a pinned_pool needs.
///
/// (Its members are those of detail::basic_numa_slab_source.)
class numa_slab_source final : public detail::basic_numa_slab_source<> {
public:
    using detail::basic_numa_slab_source<>::basic_numa_slab_source;
};

namespace detail {

/// Node ids numa_pinned_pool serves (the kernel's usual MAX_NUMNODES on x86-64 distributions).
inline constexpr int max_numa_pools = 1024;

struct numa_pool_entry {
    detail::fork_stamp stamp; ///< the process the pool was made in
    pinned_pool pool;
};

inline std::atomic<numa_pool_entry*>& numa_pool_slot(int node) noexcept {
    static std::atomic<numa_pool_entry*> slots[max_numa_pools] = {};
    return slots[node];
}

inline std::mutex& numa_pool_mutex() noexcept {
    static std::mutex m;
    return m;
}

} // namespace detail

/// The process-wide pool whose slabs are placed on NUMA node `node` (numa_policy::preferred, so
/// that a container that forbids mbind still gets page-locked memory). Its cap is the default
/// pool's (a quarter of the memory the process may use) divided by the number of nodes, so
/// that the node pools together hold no more than the default pool may. Like
/// default_pinned_pool(), it lives until the process ends.
/// @throws usage_error when `node` is no NUMA node of this machine, or in a child process
///         created by fork() after the pool was made (its memory is registered with the
///         parent's CUDA context)
/// (A function template, called as `numa_pinned_pool(node)`: only a translation unit that calls
/// it instantiates the pool.)
template <class Unused = void>
[[nodiscard]] pinned_pool& numa_pinned_pool(int node) {
    if (node < 0 || node >= detail::max_numa_pools) {
        throw usage_error("numa_pinned_pool: " + std::to_string(node) +
                          " is no NUMA node of this machine");
    }
    std::atomic<detail::numa_pool_entry*>& slot = detail::numa_pool_slot(node);
    detail::numa_pool_entry* e = slot.load(std::memory_order_acquire);
    if (e == nullptr) {
        std::lock_guard lock(detail::numa_pool_mutex());
        e = slot.load(std::memory_order_acquire);
        if (e == nullptr) {
            if (!detail::numa_node_exists(node)) {
                throw usage_error("numa_pinned_pool: " + std::to_string(node) +
                                  " is no NUMA node of this machine");
            }
            // Dependent names: only a translation unit that calls this makes a pool.
            using pool_type = detail::dependent_t<Unused, pinned_pool>;
            pinned_pool_options opt;
            opt.upstream = std::make_shared<detail::dependent_t<Unused, numa_slab_source>>(
                node, numa_policy::preferred);
            std::size_t nodes = static_cast<std::size_t>(detail::numa_node_count());
            opt.max_pinned_bytes = std::max(detail::usable_memory_bytes() / 4 / nodes, 64_MiB);
            e = new detail::numa_pool_entry{detail::fork_stamp(), pool_type(std::move(opt))};
            slot.store(e, std::memory_order_release);
        }
    }
    if (e->stamp.inherited()) {
        throw usage_error("cudawait::numa_pinned_pool used in a child process after fork(); "
                          "CUDA state cannot be inherited: use CUDA in the child only if the "
                          "parent did not, or exec a new program");
    }
    return e->pool;
}

} // namespace cudawait
