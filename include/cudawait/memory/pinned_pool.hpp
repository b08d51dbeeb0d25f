// SPDX-License-Identifier: Apache-2.0
#pragma once

// Synopsis
//   pinned_pool pool;                    page-locked host memory, grown rarely in large slabs
//                                        (requests of 8 MiB and more: in slabs of their own)
//   pool.reserve(1 << 30);               grow once, up front (slabs are pre-faulted on several
//                                        threads, then registered with cudaHostRegister)
//   void* p = pool.allocate(bytes);      O(1), no CUDA call and no syscall when memory is cached
//   cudaMemcpyAsync(dev, p, bytes, cudaMemcpyHostToDevice, s);
//   pool.record_use(p, s);               the library's own copies and pipelines do this for you
//   pool.deallocate(p);                  p is handed out again only once s has passed this point
//   pinned_pool::size_for(depth, in, out)  what reserve() needs for a pipeline's staging buffers
//   pinned_pool_resource r = pool.resource();  a copyable view of the pool as a cuda::mr resource
//                                        (CCCL 3.1's resource_ref and any_resource take only
//                                        copyable resources; the pool must outlive the view)
//
//   pool_exhausted      the cap on page-locked bytes was reached (derives std::bad_alloc)
//   slab_source         where slabs come from (registered_slab_source by default; replaceable)
//   use_tracker         how "the GPU is done with it" is observed (CUDA events by default)
//   default_pinned_pool()  the process-wide pool that copies stage through; in a child made by
//                          fork() after the parent used it, it throws usage_error
//
// The cap (pinned_pool_options::max_pinned_bytes) is by default a quarter of the memory the
// process may use: physical memory, or its cgroup's memory limit when that is lower (inside a
// container, the container's limit). At the cap a request waits up to cap_wait (1 s) for
// pending blocks (freed, their GPU work in flight), then gives free slabs back, then throws
// pool_exhausted, which states the requested, in-use, pending and cap bytes.
//
// The pool is a std::pmr::memory_resource and a libcu++ cuda::mr resource whose memory is both
// host- and device-accessible (cuda::mr::resource_ref<host_accessible, device_accessible>; with
// CCCL 3.1 and later, synchronous_resource_ref), and a stream-ordered one
// (async_resource_ref<host_accessible, device_accessible>; with CCCL 3.1 and later,
// resource_ref): pool.deallocate_async(p, n, a, s) (CCCL 3.1: deallocate(s, p, n, a)) is
// record_use(p, s) then deallocate(p), so the block is reused only after the GPU passed that
// point on `s`. Nothing needs defining for it, but with CCCL 3.0 (CUDA 13.0) a file that
// includes <cuda/memory_resource> itself must include cudawait first, or define
// LIBCUDACXX_ENABLE_EXPERIMENTAL_MEMORY_RESOURCE before every libcu++ header
// (CUDAWAIT_HAS_CUDA_MR tells; see device_resource.hpp).

#include <cudawait/memory/detail/block_heap.hpp>
#include <cudawait/memory/device_resource.hpp>
#include <cudawait/runtime/detail/fork_guard.hpp>
#include <cudawait/runtime/error.hpp>
#include <cudawait/runtime/event.hpp>
#include <cudawait/runtime/stream.hpp>

#include <algorithm>
#include <cassert>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <memory_resource>
#include <mutex>
#include <new>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>

#if defined(__unix__)
#include <sys/mman.h>
#include <unistd.h>
#endif

// CUDAWAIT_HAS_CUDA_MR and the cuda::mr switch (what a file including <cuda/memory_resource>
// itself must do) are in device_resource.hpp.

namespace cudawait {

/// Byte-size literals: `using namespace cudawait::literals;` then `64_MiB`.
inline namespace literals {
constexpr std::size_t operator""_KiB(unsigned long long n) {
    return static_cast<std::size_t>(n) << 10;
}
constexpr std::size_t operator""_MiB(unsigned long long n) {
    return static_cast<std::size_t>(n) << 20;
}
constexpr std::size_t operator""_GiB(unsigned long long n) {
    return static_cast<std::size_t>(n) << 30;
}
} // namespace literals

/// Thrown when a request would take the pool past its cap on page-locked bytes, after blocks
/// the GPU still used were waited for (up to pinned_pool_options::cap_wait) and cached free
/// slabs were given back.
class pool_exhausted : public std::bad_alloc {
public:
    pool_exhausted(std::size_t requested, std::size_t in_use, std::size_t pending, std::size_t cap)
        : m_requested(requested), m_in_use(in_use), m_pending(pending), m_cap(cap),
          m_what("cudawait::pinned_pool exhausted: requested " + std::to_string(requested) +
                 " bytes with " + std::to_string(in_use) + " bytes in use, " +
                 std::to_string(pending) + " bytes pending (freed, the GPU still using them) " +
                 "and a cap of " + std::to_string(cap) + " page-locked bytes") {}

    [[nodiscard]] const char* what() const noexcept override { return m_what.c_str(); }
    /// The bytes asked for.
    [[nodiscard]] std::size_t requested() const noexcept { return m_requested; }
    /// Bytes in blocks handed out and not freed.
    [[nodiscard]] std::size_t in_use() const noexcept { return m_in_use; }
    /// Bytes in freed blocks whose recorded GPU work had not completed.
    [[nodiscard]] std::size_t pending() const noexcept { return m_pending; }
    /// The pool's cap on page-locked bytes.
    [[nodiscard]] std::size_t cap() const noexcept { return m_cap; }

private:
    std::size_t m_requested;
    std::size_t m_in_use;
    std::size_t m_pending;
    std::size_t m_cap;
    std::string m_what;
};

/// A recorded point in a stream's work, as a use_tracker hands it out.
struct use_token {
    void* handle = nullptr;
    int device = 0;
};

/// Observes when the GPU finished with a block. The default records pooled CUDA events; tests
/// substitute a host-controlled one.
class use_tracker {
public:
    virtual ~use_tracker() = default;
    /// Marks the current end of `s`'s work. @throws cuda_error
    virtual use_token record(stream_ref s) = 0;
    /// True once the work up to the mark completed. @throws cuda_error
    virtual bool done(use_token t) = 0;
    /// Blocks until done(t). @throws cuda_error
    virtual void wait(use_token t) = 0;
    /// Gives the mark back.
    virtual void release(use_token t) noexcept = 0;
};

/// The default tracker: an event from the stream's device's event_pool per record.
class event_use_tracker final : public use_tracker {
public:
    use_token record(stream_ref s) override {
        int dev = s.device();
        event_pool& pool = event_pool::for_device(dev);
        cudaEvent_t ev = pool.acquire_raw();
        cudaError_t st = cudaEventRecord(ev, s.get());
        if (st != cudaSuccess) {
            pool.release_raw(ev);
            check(st, "cudaEventRecord");
        }
        return {ev, dev};
    }
    bool done(use_token t) override {
        return detail::event_ready(static_cast<cudaEvent_t>(t.handle),
                                   std::source_location::current());
    }
    void wait(use_token t) override {
        check(cudaEventSynchronize(static_cast<cudaEvent_t>(t.handle)), "cudaEventSynchronize");
    }
    void release(use_token t) noexcept override {
        event_pool::for_device(t.device).release_raw(static_cast<cudaEvent_t>(t.handle));
    }
};

#if defined(__unix__)
namespace detail {
/// An anonymous mapping of `bytes` that starts on an `alignment` boundary (a huge-page size):
/// `alignment` extra bytes are mapped and the ends trimmed; transparent huge pages requested.
/// @throws std::bad_alloc
[[nodiscard]] inline std::byte* map_huge_aligned(std::size_t bytes, std::size_t alignment) {
    std::size_t span = bytes + alignment;
    void* raw = ::mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) {
        throw std::bad_alloc();
    }
    auto addr = reinterpret_cast<std::uintptr_t>(raw);
    std::uintptr_t aligned = (addr + alignment - 1) / alignment * alignment;
    std::size_t head = aligned - addr;
    if (head != 0) {
        ::munmap(raw, head);
    }
    if (std::size_t tail = span - head - bytes; tail != 0) {
        ::munmap(reinterpret_cast<void*>(aligned + bytes), tail);
    }
    auto* p = reinterpret_cast<std::byte*>(aligned);
#if defined(MADV_HUGEPAGE)
    (void)::madvise(p, bytes, MADV_HUGEPAGE); // a hint; without it the slab still works
#endif
    return p;
}
} // namespace detail
#endif

/// Where a pool's slabs come from: page-locked, 2 MiB-aligned ranges whose size is a multiple
/// of 2 MiB.
class slab_source {
public:
    virtual ~slab_source() = default;
    /// @throws std::bad_alloc, cuda_error
    virtual void* allocate(std::size_t bytes) = 0;
    virtual void deallocate(void* p, std::size_t bytes) noexcept = 0;
};

namespace detail {

/// Everything registered_slab_source is, as a class template it derives from, so that only a
/// translation unit that makes one instantiates its map and its threads. `Unused` is always void.
template <class Unused = void>
class basic_registered_slab_source : public slab_source {
public:
    /// The largest range one cudaHostRegister call accepts here.
    static constexpr std::size_t max_slab_bytes = 64_GiB;
    static constexpr std::size_t alignment = 2_MiB;

    explicit basic_registered_slab_source(unsigned fault_threads = 0)
        : m_fault_threads(fault_threads) {}

    basic_registered_slab_source(const basic_registered_slab_source&) = delete;
    basic_registered_slab_source& operator=(const basic_registered_slab_source&) = delete;

    void* allocate(std::size_t bytes) override {
        if (bytes == 0 || bytes % alignment != 0 || bytes > max_slab_bytes) {
            throw usage_error("registered_slab_source: slab size must be a non-zero multiple of "
                              "2 MiB and at most 64 GiB");
        }
#if defined(__unix__)
        if (void* p = map_and_register(bytes)) {
            return p;
        }
#endif
        return host_alloc(bytes);
    }

    void deallocate(void* p, std::size_t bytes) noexcept override {
        void* base = nullptr;
        {
            std::lock_guard lock(m_mutex);
            auto it = m_host_alloc.find(p);
            if (it != m_host_alloc.end()) {
                base = it->second;
                m_host_alloc.erase(it);
            }
        }
        if (base != nullptr) {
            detail::report(cudaFreeHost(base), "cudaFreeHost");
            return;
        }
        detail::report(cudaHostUnregister(p), "cudaHostUnregister");
#if defined(__unix__)
        ::munmap(p, bytes);
#else
        (void)bytes;
#endif
    }

private:
#if defined(__unix__)
    void* map_and_register(std::size_t bytes) {
        std::byte* p = detail::map_huge_aligned(bytes, alignment);
        prefault(p, bytes);
        cudaError_t st = cudaHostRegister(p, bytes, cudaHostRegisterPortable);
        if (st == cudaSuccess) {
            return p;
        }
        (void)cudaGetLastError();
        ::munmap(p, bytes);
        if (st == cudaErrorInsufficientDriver || st == cudaErrorNoDevice) {
            check(st, "cudaHostRegister");
        }
        return nullptr;
    }

    // First touch of every page, split across threads: the kernel's page zeroing is the cost.
    void prefault(std::byte* p, std::size_t bytes) const {
        unsigned hw = std::max(1u, std::thread::hardware_concurrency());
        unsigned n = m_fault_threads != 0
                         ? m_fault_threads
                         : static_cast<unsigned>(std::clamp<std::size_t>(bytes / 64_MiB, 1, hw));
        std::size_t page = 4_KiB;
        std::size_t per = (bytes / n + page - 1) / page * page;
        auto touch = [p, bytes, page](std::size_t from, std::size_t to) {
            for (std::size_t off = from; off < to && off < bytes; off += page) {
                p[off] = std::byte{0};
            }
        };
        std::vector<std::thread> threads;
        threads.reserve(n > 0 ? n - 1 : 0);
        try {
            for (unsigned i = 1; i < n; ++i) {
                threads.emplace_back(touch, i * per, (i + 1) * per);
            }
        } catch (...) {
            // Fewer threads than hoped: the calling thread covers the rest below.
            touch(threads.size() * per + per, bytes);
        }
        touch(0, per);
        for (auto& t : threads) {
            t.join();
        }
    }
#endif

    void* host_alloc(std::size_t bytes) {
        void* base = nullptr;
        check(cudaHostAlloc(&base, bytes + alignment, cudaHostAllocPortable), "cudaHostAlloc");
        auto addr = reinterpret_cast<std::uintptr_t>(base);
        void* p = reinterpret_cast<void*>((addr + alignment - 1) / alignment * alignment);
        try {
            std::lock_guard lock(m_mutex);
            m_host_alloc.emplace(p, base);
        } catch (...) {
            detail::report(cudaFreeHost(base), "cudaFreeHost");
            throw;
        }
        return p;
    }

    unsigned m_fault_threads;
    std::mutex m_mutex;
    std::unordered_map<void*, void*> m_host_alloc; // aligned slab -> cudaHostAlloc's pointer
};
} // namespace detail

/// The default slab source. An anonymous mapping (transparent huge pages requested) is pre-faulted
/// by several threads at once and then registered with cudaHostRegister (portable, so that every
/// device can use it); that is about 10x faster than cudaHostAlloc on large slabs. Where
/// registration fails, the slab comes from cudaHostAlloc instead.
class registered_slab_source final : public detail::basic_registered_slab_source<> {
public:
    /// `fault_threads` = 0 picks one thread per 64 MiB, up to the hardware's threads.
    using detail::basic_registered_slab_source<>::basic_registered_slab_source;
};

/// How a pinned_pool behaves; every field has a default.
struct pinned_pool_options {
    /// Cap on page-locked bytes the pool holds. 0 means a quarter of the memory this process
    /// may use: physical memory, or its cgroup's memory limit when that is lower (a container's
    /// limit; see detail::cgroup_memory_limit).
    std::size_t max_pinned_bytes = 0;
    /// Growth step of the shared slabs, where requests below own_slab_bytes are placed. One
    /// larger than this grows the pool by its own size.
    std::size_t slab_bytes = 64_MiB;
    /// Requests of at least this many bytes start on a 2 MiB boundary.
    std::size_t large_block_bytes = 2_MiB;
    /// nullptr: a registered_slab_source.
    std::shared_ptr<slab_source> upstream;
    /// nullptr: an event_use_tracker.
    std::shared_ptr<use_tracker> tracker;
    /// At the cap, how long a request waits for pending blocks (freed, their GPU work still in
    /// flight) to come back before free slabs are given back and, failing that, pool_exhausted
    /// is thrown. The pool checks them with a back-off from 20 us to 1 ms, and another thread's
    /// free ends a wait at once. There is no wait when nothing is pending or when the bytes in
    /// use plus the request exceed the cap: no block would come back. Zero: never wait.
    std::chrono::nanoseconds cap_wait = std::chrono::seconds(1);
    /// Requests of at least this many bytes that find no room grow the pool by a slab of
    /// their own size (in 2 MiB steps), which smaller requests never use; a later request
    /// reuses room there only if it is at most a quarter (plus 2 MiB) larger than it. With the
    /// pool's rule that empty slabs go back before it grows past its peak (whatever this
    /// field), this keeps the page-locked bytes near the live bytes under churn of mixed sizes.
    /// 0: no own slabs, every growth is a shared slab. (Last among the fields, so that
    /// initialisers of the older ones stay valid.)
    std::size_t own_slab_bytes = 8_MiB;
};

/// What a pool has done so far.
struct pinned_pool_stats {
    std::size_t in_use_bytes = 0;    ///< sizes of blocks handed out (granule-rounded)
    std::size_t requested_bytes = 0; ///< sizes callers asked for, of blocks handed out
    std::size_t reserved_bytes = 0;  ///< page-locked bytes held from the upstream
    std::size_t peak_in_use_bytes = 0;
    std::size_t peak_requested_bytes = 0; ///< with peak_reserved_bytes: the pool's waste
    std::size_t peak_reserved_bytes = 0;
    std::size_t pending_bytes = 0; ///< freed, waiting for the GPU to finish with them
    std::size_t peak_pending_bytes = 0;
    /// The peak of in_use_bytes + pending_bytes: what the pool had to hold at once. Reserved
    /// bytes far above it mean the pool grew where it could have reused memory.
    std::size_t peak_in_use_and_pending_bytes = 0;
    std::size_t blocks_in_use = 0;
    std::uint64_t hits = 0;   ///< requests served without growing
    std::uint64_t misses = 0; ///< requests that grew the pool
    std::uint64_t growth_count = 0;
    std::chrono::nanoseconds growth_time{0};
};

namespace detail {
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

struct pool_block_extra {
    std::size_t requested = 0;
    std::vector<std::pair<cudaStream_t, use_token>> uses; ///< latest mark per stream
    bool pending = false;
    void* next_pending = nullptr;
};
} // namespace detail

class pinned_pool;
class pinned_pool_resource;
/// (Declared here for basic_pinned_pool's friendship; documented below.)
template <class Unused = void>
pinned_pool& default_pinned_pool();

namespace detail {

/// Everything `pinned_pool` is, as a class template that `pinned_pool` derives from: the
/// members of a template are instantiated only where they are used, so a translation unit that
/// includes this header and makes no pool does not instantiate the allocator, its containers and
/// its threads. `Unused` is always void.
template <class Unused = void>
class basic_pinned_pool : public std::pmr::memory_resource {
public:
    /// The smallest alignment and size step of a block.
    static constexpr std::size_t granule = 256;

    explicit basic_pinned_pool(pinned_pool_options options = {}) : m_options(std::move(options)) {
        if (!m_options.upstream) {
            m_options.upstream = std::make_shared<registered_slab_source>();
        }
        if (!m_options.tracker) {
            m_options.tracker = std::make_shared<event_use_tracker>();
        }
        if (m_options.max_pinned_bytes == 0) {
            m_options.max_pinned_bytes = detail::usable_memory_bytes() / 4;
        }
        if (m_options.slab_bytes == 0) {
            throw usage_error("pinned_pool: slab_bytes must be non-zero");
        }
        m_options.slab_bytes = heap::round_up(m_options.slab_bytes, slab_alignment);
        m_check_at_bytes = m_options.slab_bytes / 8;
    }

    basic_pinned_pool(const basic_pinned_pool&) = delete;
    basic_pinned_pool& operator=(const basic_pinned_pool&) = delete;

    /// Waits for blocks still pending reuse, reports (on stderr) blocks still handed out, and
    /// gives every slab without such blocks back. Slabs holding leaked blocks stay mapped, so a
    /// late access through a leaked pointer does not fault. In a child created by fork() after
    /// the pool was made it does nothing: no CUDA call, no lock (see detail/fork_guard.hpp).
    ~basic_pinned_pool() override {
        if (m_stamp.inherited()) {
            // A forked child: the slabs and marks may be the parent's CUDA state, and a lock
            // may be held by a thread that did not survive the fork. The process's memory goes
            // when it ends.
            return;
        }
        drain_pending();
        std::vector<std::pair<void*, std::size_t>> slabs;
        {
            std::lock_guard lock(m_mutex);
            if (m_used.size() != 0) {
                std::string sizes;
                int listed = 0;
                m_used.for_each([&](const void*, block* b) {
                    if (listed++ < 16) {
                        sizes += (sizes.empty() ? "" : ", ") + std::to_string(b->requested);
                    }
                });
                std::fprintf(stderr,
                             "cudawait: pinned_pool destroyed with %zu block(s) still handed out "
                             "(%zu bytes): sizes %s%s\n",
                             m_used.size(), m_in_use, sizes.c_str(),
                             m_used.size() > 16 ? ", ..." : "");
            }
            for (const auto& r : m_heap.regions()) {
                if (heap::region_unused(r.get())) {
                    slabs.emplace_back(r->base, r->bytes);
                }
            }
        }
        for (auto [p, n] : slabs) {
            m_options.upstream->deallocate(p, n);
        }
    }

    /// A block of at least `bytes`, aligned to `alignment` (a power of two up to 2 MiB; at
    /// least 256 is given). At the cap it first waits (up to pinned_pool_options::cap_wait) for
    /// pending blocks whose GPU work is still in flight, then gives free slabs back.
    /// @throws usage_error for zero bytes or a bad alignment; pool_exhausted when the request
    ///         still does not fit under the cap; cuda_error or std::bad_alloc when the upstream
    ///         fails
    [[nodiscard]] void* allocate(std::size_t bytes, std::size_t alignment = granule) {
        if (bytes == 0) {
            throw usage_error("pinned_pool::allocate: zero bytes requested");
        }
        if (alignment == 0 || (alignment & (alignment - 1)) != 0 || alignment > slab_alignment) {
            throw usage_error("pinned_pool::allocate: alignment must be a power of two, at most "
                              "2 MiB");
        }
        if (bytes > max_request) {
            auto s = stats();
            throw pool_exhausted(bytes, s.in_use_bytes, s.pending_bytes,
                                 m_options.max_pinned_bytes);
        }
        std::size_t size = heap::round_up(bytes, granule);
        std::size_t align = std::max(alignment, granule);
        if (size >= m_options.large_block_bytes) {
            align = slab_alignment;
        }
        {
            std::lock_guard lock(m_mutex);
            if (block* b = place(size, align)) {
                ++m_hits;
                return hand_out(b, bytes);
            }
        }
        return allocate_slow(bytes, size, align);
    }

    /// Gives a block back. Without recorded uses it is free at once; otherwise it waits, out of
    /// circulation, until the GPU passed every recorded point.
    /// @throws usage_error when `p` is not a block handed out by this pool
    void deallocate(void* p) {
        std::lock_guard lock(m_mutex);
        block* b = take_back(p);
        if (b->uses.empty()) {
            m_heap.free(b);
            notify_waiters();
            return;
        }
        b->pending = true;
        b->next_pending = nullptr;
        if (m_pending_tail != nullptr) {
            m_pending_tail->next_pending = b;
        } else {
            m_pending_head = b;
        }
        m_pending_tail = b;
        m_pending_bytes += b->size;
        ++m_pending_blocks;
        m_peak_pending = std::max(m_peak_pending, m_pending_bytes);
    }
    /// The cuda::mr / std::pmr form; size and alignment are not needed.
    void deallocate(void* p, std::size_t, std::size_t = granule) { deallocate(p); }

    /// Records that work enqueued on `s` so far may use the block holding `p` (an interior
    /// pointer is fine). Once freed, the block is reused only after that work completed. Now and
    /// then it also checks the pending blocks (see the class comment).
    /// @throws usage_error when `p` is not in a block handed out by this pool; cuda_error
    void record_use(const void* p, stream_ref s) {
        use_token t = m_options.tracker->record(s);
        use_token old{};
        bool replaced = false;
        {
            std::unique_lock lock(m_mutex);
            block* b = find_used(p);
            if (b == nullptr) {
                lock.unlock();
                m_options.tracker->release(t);
                throw usage_error("pinned_pool::record_use: pointer is not in a block handed out "
                                  "by this pool");
            }
            for (auto& [stream, token] : b->uses) {
                if (stream == s.get()) {
                    // Work on one stream completes in order: the newer mark covers the older.
                    old = std::exchange(token, t);
                    replaced = true;
                    break;
                }
            }
            if (!replaced) {
                b->uses.emplace_back(s.get(), t);
            }
            // Pending blocks have doubled since the last check: check them now, so that those
            // whose uses completed are reused before the pool runs out of free memory.
            if (!m_collecting &&
                (m_pending_bytes >= m_check_at_bytes || m_pending_blocks >= m_check_at_blocks)) {
                collect_pass(lock);
            }
        }
        if (replaced) {
            m_options.tracker->release(old);
        }
    }

    /// True when `p` lies in memory this pool holds.
    [[nodiscard]] bool owns(const void* p) const {
        std::lock_guard lock(m_mutex);
        return m_heap.region_of(p) != nullptr;
    }

    /// Grows the pool until it holds at least `bytes` page-locked bytes.
    /// @throws pool_exhausted past the cap; cuda_error or std::bad_alloc from the upstream
    void reserve(std::size_t bytes) {
        std::unique_lock lock(m_mutex);
        for (;;) {
            std::size_t held = m_reserved + m_growing;
            if (held >= bytes) {
                return;
            }
            std::size_t step = std::min(heap::round_up(bytes - held, slab_alignment),
                                        registered_slab_source::max_slab_bytes);
            if (held + step > m_options.max_pinned_bytes) {
                throw pool_exhausted(bytes - held, m_in_use, m_pending_bytes,
                                     m_options.max_pinned_bytes);
            }
            grow(lock, step, shared_arena);
        }
    }

    /// Moves blocks whose recorded uses completed back into circulation (this also happens on
    /// its own, see the class comment). Waits for a check another thread is making, then makes
    /// one. Returns the bytes made free by this call's check.
    std::size_t collect() {
        std::unique_lock lock(m_mutex);
        wait_while(lock, [this] { return m_collecting; });
        return collect_pass(lock);
    }

    /// Gives slabs with nothing handed out or pending back to the upstream. Returns the bytes.
    std::size_t release_unused() {
        collect();
        std::unique_lock lock(m_mutex);
        return release_unused(lock);
    }

    [[nodiscard]] pinned_pool_stats stats() const {
        std::lock_guard lock(m_mutex);
        pinned_pool_stats s;
        s.in_use_bytes = m_in_use;
        s.requested_bytes = m_requested;
        s.reserved_bytes = m_reserved;
        s.peak_in_use_bytes = m_peak_in_use;
        s.peak_requested_bytes = m_peak_requested;
        s.peak_reserved_bytes = m_peak_reserved;
        s.pending_bytes = m_pending_bytes;
        s.peak_pending_bytes = m_peak_pending;
        s.peak_in_use_and_pending_bytes = m_peak_held;
        s.blocks_in_use = m_used.size();
        s.hits = m_hits;
        s.misses = m_misses;
        s.growth_count = m_growth_count;
        s.growth_time = m_growth_time;
        return s;
    }

    /// The cap on page-locked bytes.
    [[nodiscard]] std::size_t max_pinned_bytes() const noexcept {
        return m_options.max_pinned_bytes;
    }

    /// The rule of thumb for a pipeline's staging buffers: `stages` x `max_batch_bytes` x 2.
    /// `stages` is the pipeline's depth (pipeline_options::depth, its slots), not the number of
    /// kernel stages; `max_batch_bytes` is the larger of a chunk's input and output bytes. While
    /// a pipeline stages pageable memory, streams, or replays graphs, each slot holds one pinned
    /// input and one pinned output chunk, for as long as the pipeline lives. The figure leaves
    /// out the pool's rounding (256 bytes) and placement (blocks of 2 MiB and more start on a
    /// 2 MiB boundary), so reserving it may fall short by a few MiB: for reserve(), use the
    /// three-argument form.
    [[nodiscard]] static constexpr std::size_t size_for(std::size_t stages,
                                                        std::size_t max_batch_bytes) noexcept {
        return stages * max_batch_bytes * 2;
    }

    /// What reserve() must hold, on a pool with nothing else in it, so that the staging buffers
    /// of a pipeline with `depth` slots, chunks of `input_chunk_bytes` in and
    /// `output_chunk_bytes` out, never grow it, whatever order the slots take them in: each
    /// buffer rounded to 256 bytes; one of `large_block_bytes` (the pool's option) or more
    /// rounded up to 2 MiB, or, when buffers below that size can sit between them, given
    /// 2 MiB - 256 bytes of room for its alignment instead.
    [[nodiscard]] static constexpr std::size_t
    size_for(std::size_t depth, std::size_t input_chunk_bytes, std::size_t output_chunk_bytes,
             std::size_t large_block_bytes = 2_MiB) noexcept {
        auto rounded = [](std::size_t n) { return heap::round_up(n, granule); };
        auto large = [&](std::size_t n) { return n != 0 && rounded(n) >= large_block_bytes; };
        auto small = [&](std::size_t n) { return n != 0 && !large(n); };
        bool mixed = (large(input_chunk_bytes) || large(output_chunk_bytes)) &&
                     (small(input_chunk_bytes) || small(output_chunk_bytes));
        auto footprint = [&](std::size_t n) {
            if (!large(n)) {
                return rounded(n);
            }
            return mixed ? rounded(n) + slab_alignment - granule
                         : heap::round_up(n, slab_alignment);
        };
        return depth * (footprint(input_chunk_bytes) + footprint(output_chunk_bytes));
    }

    /// The cuda::mr synchronous-resource spelling of allocate / deallocate (CCCL 3.1 and later).
    [[nodiscard]] void* allocate_sync(std::size_t bytes, std::size_t alignment = granule) {
        return allocate(bytes, alignment);
    }
    void deallocate_sync(void* p, std::size_t, std::size_t = granule) { deallocate(p); }

#if CUDAWAIT_HAS_CUDA_STREAM_REF
    /// The cuda::mr stream-ordered form (CCCL 3.0's async_resource): allocation needs no
    /// ordering (the block is free for the GPU now), so `s` is not used.
    /// @throws as allocate()
    [[nodiscard]] void* allocate_async(std::size_t bytes, std::size_t alignment,
                                       ::cuda::stream_ref) {
        return allocate(bytes, alignment);
    }
    /// Frees `p` once the work enqueued on `s` so far completed: record_use(p, s), then
    /// deallocate(p). The block is handed out again only after the GPU passed that point.
    /// @throws usage_error when `p` is not a block handed out by this pool; cuda_error
    void deallocate_async(void* p, std::size_t, std::size_t, ::cuda::stream_ref s) {
        record_use(p, stream_ref(s));
        deallocate(p);
    }
    /// The cuda::mr stream-ordered spelling of CCCL 3.1 and later (resource): allocate_async.
    [[nodiscard]] void* allocate(::cuda::stream_ref s, std::size_t bytes, std::size_t alignment) {
        return allocate_async(bytes, alignment, s);
    }
    /// The cuda::mr stream-ordered spelling of CCCL 3.1 and later (resource): deallocate_async.
    void deallocate(::cuda::stream_ref s, void* p, std::size_t bytes, std::size_t alignment) {
        deallocate_async(p, bytes, alignment, s);
    }
#endif

    friend bool operator==(const basic_pinned_pool& a, const basic_pinned_pool& b) noexcept {
        return &a == &b;
    }

    /// A copyable view of this pool as a cuda::mr resource (synchronous and stream-ordered, in
    /// both CCCL spellings), for what takes only copyable resources: CCCL 3.1's resource_ref
    /// and any_resource. The pool must outlive every copy.
    [[nodiscard]] pinned_pool_resource resource() noexcept;

private:
    // Dependent, so that the heap's class and the members the pool calls are instantiated with
    // the pool, not in every translation unit that includes this header (nvcc's front end
    // instantiates them where a template names them non-dependently).
    using heap = detail::block_heap<detail::dependent_t<Unused, detail::pool_block_extra>>;
    using block = typename heap::block;

    static constexpr std::size_t slab_alignment = 2_MiB;
    static constexpr std::size_t max_request = std::size_t{1} << 46;
    static constexpr unsigned shared_arena = 0; ///< slab_bytes slabs and reserve()'s
    static constexpr unsigned own_arena = 1;    ///< slabs sized to one request

    void* do_allocate(std::size_t bytes, std::size_t alignment) override {
        return allocate(bytes, alignment);
    }
    void do_deallocate(void* p, std::size_t, std::size_t) override { deallocate(p); }
    bool do_is_equal(const std::pmr::memory_resource& other) const noexcept override {
        return this == &other;
    }

    // Where a request is placed, under the lock: nullptr when nothing free holds it.
    //
    // Why own slabs: under churn (blocks of 1 KiB to 64 MiB freed in random order, live bytes
    // near steady) the holes large blocks leave in shared 64 MiB slabs are soon cut up by
    // smaller ones, and the next large request finds no hole that holds it: the pool grew to
    // 1.43x the live bytes, and best fit among the same slabs did no better than 1.37x. Blocks
    // of own_slab_bytes and more therefore live in slabs of their own (arena 1, sized to the
    // request) that small requests never cut up, and reuse a free block there only when it is
    // at most a quarter plus 2 MiB larger, so the room they hold stays close to what they use;
    // an empty own slab that is never reused is given back before the pool would grow past its
    // peak (allocate_slow). A large request also takes room in the shared slabs (arena 0): what
    // reserve() set aside serves it without growing.
    block* place(std::size_t size, std::size_t align) {
        if (own_slab(size)) {
            if (block* b =
                    m_heap.allocate(size, align, own_arena, size + size / 4 + slab_alignment)) {
                return b;
            }
        }
        return m_heap.allocate(size, align, shared_arena);
    }

    [[nodiscard]] bool own_slab(std::size_t size) const noexcept {
        return m_options.own_slab_bytes != 0 && size >= m_options.own_slab_bytes;
    }

    // Under the lock.
    void* hand_out(block* b, std::size_t requested) {
        b->requested = requested;
        m_used.insert(b->ptr, b);
        m_in_use += b->size;
        m_requested += requested;
        m_peak_in_use = std::max(m_peak_in_use, m_in_use);
        m_peak_requested = std::max(m_peak_requested, m_requested);
        m_peak_held = std::max(m_peak_held, m_in_use + m_pending_bytes);
        return b->ptr;
    }

    // Under the lock.
    block* take_back(void* p) {
        block** found = m_used.find(p);
        if (found == nullptr) {
            throw usage_error("pinned_pool::deallocate: pointer was not handed out by this pool "
                              "(or was freed already)");
        }
        block* b = *found;
        m_used.erase(p);
        m_in_use -= b->size;
        m_requested -= b->requested;
        return b;
    }

    // Under the lock: the handed-out block holding `p`.
    block* find_used(const void* p) {
        if (block** found = m_used.find(p)) {
            return *found;
        }
        block* b = m_heap.containing(p);
        if (b == nullptr || b->is_free || b->pending) {
            return nullptr;
        }
        return b;
    }

    // True when every recorded use of `b` completed. Never throws: a query that fails leaves
    // the block pending, except after a sticky error (the context is broken, the device
    // touches no memory any more, and the error resurfaces at the next CUDA call).
    bool all_done(block* b) noexcept {
        for (auto& u : b->uses) {
            try {
                if (!m_options.tracker->done(u.second)) {
                    return false;
                }
            } catch (const cuda_error& e) {
                if (!e.sticky()) {
                    return false;
                }
                std::fprintf(stderr, "cudawait: pinned_pool: %s\n", e.what());
            } catch (const std::exception& e) {
                std::fprintf(stderr, "cudawait: pinned_pool: use_tracker::done: %s\n", e.what());
                return false;
            }
        }
        return true;
    }

    // Waits on the pool's condition until `pred` is false. Under the lock.
    template <class Pred>
    void wait_while(std::unique_lock<std::mutex>& lock, Pred pred) {
        while (pred()) {
            ++m_waiters;
            m_cv.wait(lock);
            --m_waiters;
        }
    }

    // Under the lock. No system call unless a thread waits.
    void notify_waiters() noexcept {
        if (m_waiters != 0) {
            m_cv.notify_all();
        }
    }

    // One check of every pending block: those whose uses completed go back to the heap. Called
    // and returns with `lock` held and no other check running; the tracker is queried without
    // the lock. Meanwhile m_collecting tells other threads that the pending blocks are being
    // looked at, so that they wait for the outcome instead of taking the pool for exhausted.
    std::size_t collect_pass(std::unique_lock<std::mutex>& lock) noexcept {
        assert(!m_collecting);
        block* list = std::exchange(m_pending_head, nullptr);
        m_pending_tail = nullptr;
        if (list == nullptr) {
            return 0;
        }
        m_collecting = true;
        ++m_checks_started;
        lock.unlock();
        block* done = nullptr;
        block* waiting = nullptr;
        block* waiting_tail = nullptr;
        for (block* b = list; b != nullptr;) {
            auto* next = static_cast<block*>(b->next_pending);
            if (all_done(b)) {
                // Out of every list and owned by this check alone until it is freed below.
                for (auto& u : b->uses) {
                    m_options.tracker->release(u.second);
                }
                b->uses.clear();
                b->next_pending = done;
                done = b;
            } else {
                b->next_pending = nullptr;
                if (waiting_tail != nullptr) {
                    waiting_tail->next_pending = b;
                } else {
                    waiting = b;
                }
                waiting_tail = b;
            }
            b = next;
        }
        lock.lock();
        std::size_t freed = 0;
        for (block* b = done; b != nullptr;) {
            auto* next = static_cast<block*>(b->next_pending);
            b->pending = false;
            b->next_pending = nullptr;
            m_pending_bytes -= b->size;
            --m_pending_blocks;
            freed += b->size;
            m_heap.free(b);
            b = next;
        }
        // Still pending: back in front of anything freed meanwhile, in their old order.
        if (waiting != nullptr) {
            waiting_tail->next_pending = m_pending_head;
            if (m_pending_head == nullptr) {
                m_pending_tail = waiting_tail;
            }
            m_pending_head = waiting;
        }
        m_collecting = false;
        ++m_checks_finished;
        m_check_at_bytes = 2 * m_pending_bytes + m_options.slab_bytes / 8;
        m_check_at_blocks = 2 * m_pending_blocks + 32;
        notify_waiters();
        return freed;
    }

    void* allocate_slow(std::size_t bytes, std::size_t size, std::size_t align) {
        std::unique_lock lock(m_mutex);
        // A check numbered `first_check` or later sees every block pending now.
        const std::uint64_t first_check = m_checks_started + 1;
        const std::size_t need = heap::round_up(size, slab_alignment);
        const std::size_t cap = m_options.max_pinned_bytes;
        bool released = false;
        bool trimmed = false;
        bool waited = false;
        std::chrono::steady_clock::time_point deadline;
        std::chrono::microseconds poll(20);
        for (;;) {
            if (block* b = place(size, align)) {
                ++m_hits;
                return hand_out(b, bytes);
            }
            // Blocks whose uses completed, before anything else.
            if (m_checks_finished < first_check && (m_collecting || m_pending_head != nullptr)) {
                if (m_collecting) {
                    wait_while(lock, [this] { return m_collecting; });
                } else {
                    collect_pass(lock);
                }
                continue;
            }
            // Another thread is growing the pool: its slab may serve this request too.
            if (m_growing != 0) {
                wait_while(lock, [this] { return m_growing != 0; });
                continue;
            }
            // A growth that would take the pool past its peak gives empty slabs back first:
            // they hold nothing and are of no use to this request (too small, or an own slab
            // too large for it, or of the other arena), so keeping them only adds to the peak.
            const std::size_t want = own_slab(size) ? need : std::max(need, m_options.slab_bytes);
            if (!trimmed && m_reserved + want > m_peak_reserved) {
                trimmed = true;
                if (release_unused(lock) != 0) {
                    continue;
                }
            }
            if (m_reserved + need <= cap) {
                std::size_t step = std::min(want, cap - m_reserved);
                grow(lock, step / slab_alignment * slab_alignment,
                     own_slab(size) ? own_arena : shared_arena);
                if (block* b = place(size, align)) { // the new slab holds it
                    ++m_misses;
                    return hand_out(b, bytes);
                }
                continue;
            }
            // At the cap. Blocks the GPU still uses will come back: wait for them, a while.
            if (m_pending_bytes != 0 && m_in_use + size <= cap &&
                m_options.cap_wait > std::chrono::nanoseconds::zero()) {
                auto now = std::chrono::steady_clock::now();
                if (!waited) {
                    waited = true;
                    deadline = now + m_options.cap_wait;
                }
                if (now < deadline) {
                    if (m_collecting) {
                        wait_while(lock, [this] { return m_collecting; });
                    } else if (collect_pass(lock) == 0) {
                        // Nothing completed yet. Another thread's free also ends the sleep.
                        ++m_waiters;
                        m_cv.wait_for(lock,
                                      std::min<std::chrono::nanoseconds>(poll, deadline - now));
                        --m_waiters;
                        poll = std::min(poll * 2, std::chrono::microseconds(1000));
                    }
                    continue;
                }
            }
            // Hand cached slabs back, then try once more.
            if (!released) {
                released = true;
                release_unused(lock);
                continue;
            }
            throw pool_exhausted(bytes, m_in_use, m_pending_bytes, cap);
        }
    }

    // Adds a slab of `step` bytes. Called and returns with `lock` held; the upstream is called
    // without it, and m_growing tells other threads that memory is on its way.
    void grow(std::unique_lock<std::mutex>& lock, std::size_t step, unsigned arena) {
        m_growing += step;
        lock.unlock();
        auto start = std::chrono::steady_clock::now();
        void* p = nullptr;
        try {
            p = m_options.upstream->allocate(step);
        } catch (...) {
            lock.lock();
            m_growing -= step;
            notify_waiters();
            throw;
        }
        auto elapsed = std::chrono::steady_clock::now() - start;
        lock.lock();
        m_growing -= step;
        notify_waiters();
        try {
            m_heap.add_region(static_cast<std::byte*>(p), step, nullptr, arena);
        } catch (...) {
            lock.unlock();
            m_options.upstream->deallocate(p, step);
            lock.lock();
            throw;
        }
        m_reserved += step;
        m_peak_reserved = std::max(m_peak_reserved, m_reserved);
        ++m_growth_count;
        m_growth_time += std::chrono::duration_cast<std::chrono::nanoseconds>(elapsed);
    }

    // Gives unused slabs back to the upstream. Called and returns with `lock` held; the
    // upstream is called without it.
    std::size_t release_unused(std::unique_lock<std::mutex>& lock) {
        std::vector<std::pair<void*, std::size_t>> slabs;
        std::vector<typename heap::region*> unused;
        for (const auto& r : m_heap.regions()) {
            if (heap::region_unused(r.get())) {
                unused.push_back(r.get());
            }
        }
        slabs.reserve(unused.size());
        for (typename heap::region* r : unused) {
            slabs.emplace_back(r->base, r->bytes);
            m_reserved -= r->bytes;
            m_heap.remove_region(r);
        }
        if (slabs.empty()) {
            return 0;
        }
        lock.unlock();
        std::size_t bytes = 0;
        for (auto [p, n] : slabs) {
            m_options.upstream->deallocate(p, n);
            bytes += n;
        }
        lock.lock();
        return bytes;
    }

    void drain_pending() noexcept {
        block* list = nullptr;
        {
            std::lock_guard lock(m_mutex);
            list = m_pending_head;
            m_pending_head = m_pending_tail = nullptr;
        }
        for (block* b = list; b != nullptr;) {
            auto* next = static_cast<block*>(b->next_pending);
            for (auto& u : b->uses) {
                try {
                    m_options.tracker->wait(u.second);
                } catch (const std::exception& e) {
                    std::fprintf(stderr, "cudawait: pinned_pool: %s\n", e.what());
                }
                m_options.tracker->release(u.second);
            }
            std::lock_guard lock(m_mutex);
            b->uses.clear();
            b->pending = false;
            m_pending_bytes -= b->size;
            --m_pending_blocks;
            m_heap.free(b);
            b = next;
        }
    }

    template <class>
    friend pinned_pool& cudawait::default_pinned_pool();

    pinned_pool_options m_options;
    detail::fork_stamp m_stamp; ///< the process the pool was made in
    mutable std::mutex m_mutex;
    std::condition_variable m_cv; ///< a check or a growth finished, or a block was freed
    std::size_t m_waiters = 0;    ///< threads waiting on m_cv
    heap m_heap;
    detail::ptr_map<block*> m_used;
    block* m_pending_head = nullptr; ///< oldest first
    block* m_pending_tail = nullptr;
    std::size_t m_pending_blocks = 0;
    bool m_collecting = false; ///< a check is querying the pending blocks it took out
    std::uint64_t m_checks_started = 0;
    std::uint64_t m_checks_finished = 0;
    std::size_t m_check_at_bytes = 0; ///< record_use checks pending blocks from here on
    std::size_t m_check_at_blocks = 32;
    std::size_t m_in_use = 0;
    std::size_t m_requested = 0;
    std::size_t m_reserved = 0;
    std::size_t m_growing = 0;
    std::size_t m_peak_in_use = 0;
    std::size_t m_peak_requested = 0;
    std::size_t m_peak_reserved = 0;
    std::size_t m_pending_bytes = 0;
    std::size_t m_peak_pending = 0;
    std::size_t m_peak_held = 0; ///< of in use + pending
    std::uint64_t m_hits = 0;
    std::uint64_t m_misses = 0;
    std::uint64_t m_growth_count = 0;
    std::chrono::nanoseconds m_growth_time{0};
};

} // namespace detail

/// A pool of page-locked host memory with host-safe reuse.
///
/// Blocks come from large slabs (64 MiB by default; `reserve` grows by exactly what it is told)
/// and are sub-allocated by a two-level segregated fit with coalescing: O(1), blocks rounded to
/// 256 bytes only. Blocks of 2 MiB and more start on a 2 MiB boundary. Requests of
/// own_slab_bytes (8 MiB) and more that find no room grow slabs of their own size instead,
/// which smaller requests never cut up, and empty slabs go back before the pool grows past its
/// peak (see pinned_pool_options::own_slab_bytes): under churn of mixed sizes the pool then
/// holds about 1.2x the live bytes, not 1.4x.
///
/// A freed block on which record_use() was called is handed out again only once every stream
/// that used it passed the recorded point. Until then it is pending. Pending blocks are checked
/// (one query per recorded use) when a request finds no free block, and by record_use() once
/// they reach twice the bytes the last check left pending plus an eighth of a slab, or twice the
/// blocks plus 32: checks cost O(1) per block, and blocks whose uses completed do not pile up.
///
/// When a request finds no free block, the pool grows only after a check that saw every block
/// pending at that moment, and one thread grows it at a time: threads that miss together wait
/// for the check or the growth in progress and look again. Thread-safe; CUDA calls are made
/// outside the lock, and the hit path (free memory cached) takes one lock and makes no call.
///
/// (Its members are those of detail::basic_pinned_pool.)
class pinned_pool : public detail::basic_pinned_pool<> {
public:
    using detail::basic_pinned_pool<>::basic_pinned_pool;
};

#if CUDAWAIT_HAS_CUDA_MR
// The cuda::mr properties, found by argument-dependent lookup. Free functions rather than
// friends, so that the class reads the same in translation units without libcu++'s resources.
/// The pool's memory is host-accessible.
constexpr void get_property(const pinned_pool&, cuda::mr::host_accessible) noexcept {}
/// The pool's memory is device-accessible (page-locked and registered for every device).
constexpr void get_property(const pinned_pool&, cuda::mr::device_accessible) noexcept {}
#endif

namespace detail {
/// Everything `pinned_pool_resource` is, as a class template it derives from: its members call
/// the pool's allocation paths, which a non-template class would instantiate in every
/// translation unit. `Unused` is always void.
template <class Unused = void>
class basic_pinned_pool_resource {
public:
    explicit basic_pinned_pool_resource(pinned_pool& pool) noexcept : m_pool(&pool) {}

    [[nodiscard]] pinned_pool& pool() const noexcept { return *m_pool; }

    /// CCCL 3.0's synchronous spelling.
    [[nodiscard]] void* allocate(std::size_t bytes,
                                 std::size_t alignment = pinned_pool::granule) const {
        return m_pool->allocate(bytes, alignment);
    }
    void deallocate(void* p, std::size_t bytes,
                    std::size_t alignment = pinned_pool::granule) const {
        m_pool->deallocate(p, bytes, alignment);
    }
    /// CCCL 3.1's synchronous spelling.
    [[nodiscard]] void* allocate_sync(std::size_t bytes,
                                      std::size_t alignment = pinned_pool::granule) const {
        return m_pool->allocate_sync(bytes, alignment);
    }
    void deallocate_sync(void* p, std::size_t bytes,
                         std::size_t alignment = pinned_pool::granule) const {
        m_pool->deallocate_sync(p, bytes, alignment);
    }
#if CUDAWAIT_HAS_CUDA_STREAM_REF
    /// CCCL 3.0's stream-ordered spelling: freeing waits for the work enqueued on `s` so far.
    [[nodiscard]] void* allocate_async(std::size_t bytes, std::size_t alignment,
                                       ::cuda::stream_ref s) const {
        return m_pool->allocate_async(bytes, alignment, s);
    }
    void deallocate_async(void* p, std::size_t bytes, std::size_t alignment,
                          ::cuda::stream_ref s) const {
        m_pool->deallocate_async(p, bytes, alignment, s);
    }
    /// CCCL 3.1's stream-ordered spelling.
    [[nodiscard]] void* allocate(::cuda::stream_ref s, std::size_t bytes,
                                 std::size_t alignment) const {
        return m_pool->allocate(s, bytes, alignment);
    }
    void deallocate(::cuda::stream_ref s, void* p, std::size_t bytes, std::size_t alignment) const {
        m_pool->deallocate(s, p, bytes, alignment);
    }
#endif

    friend bool operator==(const basic_pinned_pool_resource& a,
                           const basic_pinned_pool_resource& b) noexcept {
        return a.m_pool == b.m_pool;
    }

private:
    pinned_pool* m_pool;
};
} // namespace detail

/// A pinned_pool seen as a cuda::mr resource, by pointer: copies view the same pool and compare
/// equal. Every call goes to the pool, so its errors are the pool's. Views of a destroyed pool
/// must not be used.
///
/// (Its members are those of detail::basic_pinned_pool_resource.)
class pinned_pool_resource : public detail::basic_pinned_pool_resource<> {
public:
    using detail::basic_pinned_pool_resource<>::basic_pinned_pool_resource;
};

template <class Unused>
pinned_pool_resource detail::basic_pinned_pool<Unused>::resource() noexcept {
    return pinned_pool_resource(static_cast<pinned_pool&>(*this));
}

#if CUDAWAIT_HAS_CUDA_MR
/// A view's memory is the pool's: host-accessible.
constexpr void get_property(const pinned_pool_resource&, cuda::mr::host_accessible) noexcept {}
/// A view's memory is the pool's: device-accessible.
constexpr void get_property(const pinned_pool_resource&, cuda::mr::device_accessible) noexcept {}
#endif

/// The process-wide pool that copies stage pageable memory through. It lives until the process
/// ends (it is never destroyed, so no static destruction order can free memory still in use).
/// @throws usage_error in a child process created by fork() after the pool was made: its
///         memory is registered with the parent's CUDA context, which a child cannot use
///
/// A function template (called as `default_pinned_pool()`) so that only a translation unit that
/// uses it makes a pool.
template <class Unused>
[[nodiscard]] pinned_pool& default_pinned_pool() {
    static pinned_pool* pool = new pinned_pool();
    if (pool->m_stamp.inherited()) {
        throw usage_error("cudawait::default_pinned_pool used in a child process after fork(); "
                          "CUDA state cannot be inherited: use CUDA in the child only if the "
                          "parent did not, or exec a new program");
    }
    return *pool;
}

} // namespace cudawait
