// SPDX-License-Identifier: Apache-2.0
#pragma once

// NUMA placement of host memory without libnuma (the mbind and get_mempolicy system calls,
// a few sysfs files): node counts, a device's node, binding and first touch. `root` is empty for
// the real files; tests point it at a fake tree.

#include <cudawait/runtime/device.hpp>
#include <cudawait/runtime/error.hpp>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <vector>

#include <cuda_runtime_api.h>

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(__unix__)
#include <dirent.h> // not <filesystem>: every TU that includes the umbrella would parse it
#endif

namespace cudawait::detail {

// numa_node_count(root)          nodes under /sys/devices/system/node (1 when unknown)
// numa_node_exists(node, root)   whether a node id names a node of this machine
// pci_numa_node(bus_id, root)    a PCI device's node from sysfs, -1 when unknown
// device_numa_node(dev)          the host node nearest a CUDA device, -1 when unknown
// bind_to_node(p, bytes, node, mode)   mbind: pages faulted in later land on `node`
// page_numa_node(p)              the node holding the (faulted) page at p: get_mempolicy
// fault_in(p, bytes)             first touch of every page, on several threads
// The functions are templates (called with their default argument) so that only a translation
// unit that calls them instantiates the containers, threads and parsing they use.

/// mbind / get_mempolicy modes and flags, as in the kernel's uapi/linux/mempolicy.h (defined
/// here because <numaif.h> comes with libnuma's headers, which the library must not need).
inline constexpr int mpol_preferred = 1;
inline constexpr int mpol_bind = 2;
inline constexpr unsigned long mpol_f_node = 1UL << 0;
inline constexpr unsigned long mpol_f_addr = 1UL << 1;

/// The number in a sysfs entry named `prefix` + decimal digits ("node3" -> 3), or -1.
[[nodiscard]] inline int numbered_entry(std::string_view name, std::string_view prefix) noexcept {
    if (name.size() <= prefix.size() || name.substr(0, prefix.size()) != prefix) {
        return -1;
    }
    std::string_view digits = name.substr(prefix.size());
    int n = -1;
    auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), n);
    if (ec != std::errc() || end != digits.data() + digits.size() || n < 0) {
        return -1;
    }
    return n;
}

/// The node ids listed under `root`/sys/devices/system/node (node0, node1, ...), ascending;
/// empty where the directory is missing or unreadable (not Linux, or sysfs hidden).
template <class Unused = void>
[[nodiscard]] std::vector<int> numa_node_ids(const std::string& root = {}) {
    std::vector<int> ids;
#if defined(__unix__)
    DIR* dir = ::opendir((root + "/sys/devices/system/node").c_str());
    if (dir == nullptr) {
        return ids;
    }
    struct dir_closer {
        DIR* d;
        ~dir_closer() { ::closedir(d); }
    } closer{dir};
    // "." and ".." are no "node<n>" entries; a read error ends the listing, as it did before.
    while (const dirent* entry = ::readdir(dir)) {
        int id = numbered_entry(entry->d_name, "node");
        if (id >= 0) {
            ids.push_back(id);
        }
    }
#else
    static_cast<void>(root);
#endif
    std::sort(ids.begin(), ids.end());
    return ids;
}

/// The number of NUMA nodes; 1 where sysfs does not tell (every machine has one node at least).
template <class Unused = void>
[[nodiscard]] int numa_node_count(const std::string& root = {}) noexcept {
    try {
        return std::max<int>(1, static_cast<int>(numa_node_ids(root).size()));
    } catch (const std::exception&) {
        return 1;
    }
}

/// True when `node` is a node of this machine; where sysfs does not tell, only node 0 is.
template <class Unused = void>
[[nodiscard]] bool numa_node_exists(int node, const std::string& root = {}) noexcept {
    if (node < 0) {
        return false;
    }
    try {
        std::vector<int> ids = numa_node_ids(root);
        if (ids.empty()) {
            return node == 0;
        }
        return std::binary_search(ids.begin(), ids.end(), node);
    } catch (const std::exception&) {
        return node == 0;
    }
}

/// The node sysfs gives for a PCI device, from its bus id as cudaDeviceGetPCIBusId writes it
/// ("0000:3B:00.0"; an 8-digit domain is accepted too). sysfs names devices in lower case with
/// a 4-digit domain. -1 when the file is missing or holds no node (sysfs itself writes -1 on a
/// machine without NUMA).
template <class Unused = void>
[[nodiscard]] int pci_numa_node(std::string_view bus_id, const std::string& root = {}) {
    std::size_t colon = bus_id.find(':');
    if (colon == std::string_view::npos || colon == 0) {
        return -1;
    }
    unsigned long domain = 0;
    auto [end, ec] = std::from_chars(bus_id.data(), bus_id.data() + colon, domain, 16);
    if (ec != std::errc() || end != bus_id.data() + colon || domain > 0xffffffffUL) {
        return -1;
    }
    char head[16];
    std::snprintf(head, sizeof head, "%04lx", domain);
    std::string name = head;
    for (char c : bus_id.substr(colon)) {
        name.push_back(c >= 'A' && c <= 'F' ? static_cast<char>(c - 'A' + 'a') : c);
    }
    std::string path = root + "/sys/bus/pci/devices/" + name + "/numa_node";
    std::FILE* f = std::fopen(path.c_str(), "r");
    if (f == nullptr) {
        return -1;
    }
    char buf[32] = {};
    std::size_t n = std::fread(buf, 1, sizeof buf - 1, f);
    std::fclose(f);
    std::string_view text(buf, n);
    while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) {
        text.remove_suffix(1);
    }
    int node = -1;
    auto [tail, err] = std::from_chars(text.data(), text.data() + text.size(), node);
    if (err != std::errc() || tail != text.data() + text.size() || node < -1) {
        return -1;
    }
    return node;
}

/// The host NUMA node nearest device `dev`, or -1 when unknown. The driver's answer
/// (cudaDevAttrHostNumaId, CUDA 12.2 and later) comes first; where it has none (-1, or a driver
/// too old for the attribute) the PCI device's numa_node file in sysfs is read. (Not
/// cudaDevAttrNumaId: that is the node of the GPU's own memory, set only where the GPU is a
/// NUMA node, as on Grace Hopper, and -1 for a PCIe or SXM GPU in an x86 host.)
/// @throws cuda_error (cudaErrorInvalidDevice for a bad id; no driver, no device)
template <class Unused = void>
[[nodiscard]] int device_numa_node(int dev) {
    device_ref d(dev);
#if CUDART_VERSION >= 12020
    int node = -1;
    cudaError_t st = cudaDeviceGetAttribute(&node, cudaDevAttrHostNumaId, d.get());
    if (st == cudaSuccess && node >= 0) {
        return node;
    }
    if (st == cudaErrorInvalidValue) {
        (void)cudaGetLastError(); // a driver older than this toolkit: it knows no such attribute
    } else {
        check(st, "cudaDeviceGetAttribute(cudaDevAttrHostNumaId)");
    }
#endif
    char bus[64] = {};
    check(cudaDeviceGetPCIBusId(bus, static_cast<int>(sizeof bus), d.get()),
          "cudaDeviceGetPCIBusId");
    return pci_numa_node(bus);
}

/// Applies the NUMA policy `mode` (mpol_bind or mpol_preferred) for `node` to [p, p + bytes),
/// page-aligned memory mapped by the caller: pages faulted in afterwards come from that node
/// (mpol_bind: only from it; mpol_preferred: from it while it has free memory).
/// @throws std::system_error with the errno of mbind (EPERM where a container's seccomp
///         profile forbids it, EINVAL for a node without memory, ENOSYS where there is no mbind)
template <class Unused = void>
void bind_to_node(void* p, std::size_t bytes, int node, int mode) {
#if defined(__linux__) && defined(SYS_mbind)
    constexpr std::size_t bits = sizeof(unsigned long) * 8;
    std::vector<unsigned long> mask(static_cast<std::size_t>(node) / bits + 1, 0UL);
    mask[static_cast<std::size_t>(node) / bits] |= 1UL << (static_cast<std::size_t>(node) % bits);
    // The kernel reads maxnode - 1 bits, hence the + 1.
    unsigned long maxnode = static_cast<unsigned long>(mask.size() * bits + 1);
    if (::syscall(SYS_mbind, p, static_cast<unsigned long>(bytes), mode, mask.data(), maxnode,
                  0U) != 0) {
        throw std::system_error(errno, std::generic_category(),
                                "mbind to NUMA node " + std::to_string(node));
    }
#else
    (void)p;
    (void)bytes;
    (void)mode;
    throw std::system_error(ENOSYS, std::generic_category(),
                            "mbind to NUMA node " + std::to_string(node));
#endif
}

/// The node that holds the page at `p` (faulted in), from get_mempolicy(MPOL_F_NODE |
/// MPOL_F_ADDR).
/// @throws std::system_error with the errno of get_mempolicy (EPERM where a seccomp profile
///         forbids it, ENOSYS where there is none)
template <class Unused = void>
[[nodiscard]] int page_numa_node(const void* p) {
#if defined(__linux__) && defined(SYS_get_mempolicy)
    int node = -1;
    if (::syscall(SYS_get_mempolicy, &node, nullptr, 0UL, const_cast<void*>(p),
                  mpol_f_node | mpol_f_addr) != 0) {
        throw std::system_error(errno, std::generic_category(), "get_mempolicy");
    }
    return node;
#else
    (void)p;
    throw std::system_error(ENOSYS, std::generic_category(), "get_mempolicy");
#endif
}

/// Writes one byte of every 4 KiB page of [p, p + bytes), on one thread per 64 MiB up to the
/// hardware's threads: the kernel's page zeroing is the cost, and it runs in parallel. The pages
/// are placed by the range's NUMA policy, not by the threads that touch them.
template <class Unused = void>
void fault_in(std::byte* p, std::size_t bytes) {
    constexpr std::size_t page = 4096;
    unsigned hw = std::max(1u, std::thread::hardware_concurrency());
    auto n = static_cast<unsigned>(std::clamp<std::size_t>(bytes >> 26, 1, hw));
    std::size_t per = (bytes / n + page - 1) / page * page;
    auto touch = [p, bytes](std::size_t from, std::size_t to) {
        for (std::size_t off = from; off < to && off < bytes; off += page) {
            p[off] = std::byte{0};
        }
    };
    std::vector<std::thread> threads;
    std::size_t covered = per; // the calling thread's share, [0, per)
    try {
        for (unsigned i = 1; i < n; ++i) {
            threads.emplace_back(touch, i * per, (i + 1) * per);
            covered = (i + 1) * per;
        }
    } catch (...) {
        // Fewer threads than hoped: the calling thread covers the rest below.
    }
    touch(0, per);
    touch(covered, bytes);
    for (auto& t : threads) {
        t.join();
    }
}

} // namespace cudawait::detail
