// SPDX-License-Identifier: Apache-2.0
#pragma once

// Synopsis
//   class my_source : public slab_source { ... };   allocate(bytes) / deallocate(p, bytes)
//   registered_slab_source src(fault_threads);       the default: mmap, pre-fault, register
//   pinned_pool pool(pinned_pool_options{.upstream = std::make_shared<my_source>()});
//
// Where a pinned_pool's slabs come from: page-locked ranges of whole 2 MiB pages, 2 MiB-aligned.
// See docs/memory.md#slab-sources-and-use-trackers.

#include <cudawait/memory/literals.hpp>
#include <cudawait/runtime/error.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <new>
#include <thread>
#include <unordered_map>
#include <vector>

#include <cuda_runtime_api.h>

#if defined(__unix__)
#include <sys/mman.h>
#include <unistd.h>
#endif

namespace cudawait {

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

} // namespace cudawait
