// SPDX-License-Identifier: Apache-2.0
#pragma once

// The memory this process may use: physical memory, or its cgroup's limit when lower
// (cgroup v1 and v2), read from /proc and /sys. pinned_pool's default cap is a quarter of it.

#include <cudawait/memory/literals.hpp>

#include <cstddef>
#include <cstdio>
#include <exception>
#include <string>

#if defined(__unix__)
#include <unistd.h>
#endif

namespace cudawait::detail {

inline std::size_t physical_memory_bytes() noexcept {
#if defined(__unix__)
    long pages = ::sysconf(_SC_PHYS_PAGES);
    long page = ::sysconf(_SC_PAGESIZE);
    if (pages > 0 && page > 0) {
        return static_cast<std::size_t>(pages) * static_cast<std::size_t>(page);
    }
#endif
    return 16_GiB;
}

// The whole of a small file (a /proc or cgroup file); false when it cannot be opened.
inline bool read_small_file(const std::string& path, std::string& text) {
    std::FILE* f = std::fopen(path.c_str(), "r");
    if (f == nullptr) {
        return false;
    }
    text.clear();
    char buf[512];
    std::size_t n = 0;
    while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) {
        text.append(buf, n);
    }
    std::fclose(f);
    return true;
}

// A cgroup limit file's value in bytes; 0 for none: "max", empty or not a number.
inline std::size_t parse_memory_limit(const std::string& text) noexcept {
    std::size_t bytes = 0;
    std::size_t i = 0;
    while (i < text.size() && text[i] >= '0' && text[i] <= '9') {
        auto digit = static_cast<std::size_t>(text[i] - '0');
        if (bytes > (~std::size_t{0} - digit) / 10) {
            return 0;
        }
        bytes = bytes * 10 + digit;
        ++i;
    }
    bool rest_blank = text.find_first_not_of(" \t\n", i) == std::string::npos;
    return i > 0 && rest_blank ? bytes : 0;
}

// The lowest limit `file` holds for the cgroup at `path` below `mount` and for the cgroups
// above it (a parent's limit binds its children too); 0 when none has one. The walk ends at the
// mount's root, which is the process's own cgroup when the mount does not show its path (inside
// a container, /proc/self/cgroup may name the host's path).
inline std::size_t lowest_memory_limit(const std::string& mount, std::string path,
                                       const char* file) {
    std::size_t lowest = 0;
    for (;;) {
        std::string text;
        std::string dir = path == "/" ? mount : mount + path;
        if (read_small_file(dir + "/" + file, text)) {
            std::size_t limit = parse_memory_limit(text);
            if (limit != 0 && (lowest == 0 || limit < lowest)) {
                lowest = limit;
            }
        }
        if (path.empty() || path == "/") {
            return lowest;
        }
        std::size_t slash = path.rfind('/');
        path = slash == 0 || slash == std::string::npos ? "/" : path.substr(0, slash);
    }
}

/// The memory limit of the cgroup this process runs in, in bytes; 0 when there is none or it
/// cannot be read. The cgroup comes from `root`/proc/self/cgroup. Under cgroup v1 the limit is
/// memory.limit_in_bytes below `root`/sys/fs/cgroup/memory; under cgroup v2 (or where v1 sets
/// none) it is memory.max below `root`/sys/fs/cgroup ("max": none). The lowest limit of the
/// cgroup and the ones above it wins. `root` is empty for the real files; tests point it at a
/// fake tree.
inline std::size_t cgroup_memory_limit(const std::string& root = {}) noexcept {
    try {
        std::string text;
        if (!read_small_file(root + "/proc/self/cgroup", text)) {
            return 0;
        }
        // Lines "hierarchy-id:controllers:path"; cgroup v2's is "0::path".
        std::string v1_path;
        std::string v2_path;
        std::size_t start = 0;
        while (start < text.size()) {
            std::size_t end = text.find('\n', start);
            if (end == std::string::npos) {
                end = text.size();
            }
            std::string line = text.substr(start, end - start);
            start = end + 1;
            std::size_t c1 = line.find(':');
            std::size_t c2 = c1 == std::string::npos ? c1 : line.find(':', c1 + 1);
            if (c2 == std::string::npos) {
                continue;
            }
            std::string controllers(1, ','); // ",memory," is then found in any position
            controllers.append(line, c1 + 1, c2 - c1 - 1).push_back(',');
            std::string path = line.substr(c2 + 1);
            if (line.compare(0, c2 + 1, "0::") == 0) {
                v2_path = path;
            } else if (controllers.find(",memory,") != std::string::npos) {
                v1_path = path;
            }
        }
        std::size_t limit = 0;
        if (!v1_path.empty()) {
            limit = lowest_memory_limit(root + "/sys/fs/cgroup/memory", v1_path,
                                        "memory.limit_in_bytes");
        }
        if (limit == 0 && !v2_path.empty()) {
            limit = lowest_memory_limit(root + "/sys/fs/cgroup", v2_path, "memory.max");
        }
        return limit;
    } catch (const std::exception&) {
        return 0;
    }
}

/// The memory this process may use: physical memory, or its cgroup's memory limit when that is
/// lower. `root` as for cgroup_memory_limit.
inline std::size_t usable_memory_bytes(const std::string& root = {}) noexcept {
    std::size_t physical = physical_memory_bytes();
    std::size_t limit = cgroup_memory_limit(root);
    return limit != 0 && limit < physical ? limit : physical;
}

} // namespace cudawait::detail
