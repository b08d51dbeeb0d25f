// SPDX-License-Identifier: Apache-2.0
#pragma once

// Synopsis
//   pinned_pool_options{.max_pinned_bytes = 4_GiB, .slab_bytes = 256_MiB}   how a pool behaves
//   pinned_pool_stats s = pool.stats();  what a pool has done so far: bytes, peaks, hits, growth
//   catch (const pool_exhausted& e)      the cap was reached: e.requested(), in_use(), pending(),
//                                        cap() (derives std::bad_alloc)
//
// The cap (max_pinned_bytes) is by default a quarter of the memory the process may use:
// physical memory, or its cgroup's limit when that is lower. See docs/memory.md#pinned-pool.

#include <cudawait/memory/literals.hpp>
#include <cudawait/memory/slab_source.hpp>
#include <cudawait/memory/use_tracker.hpp>
#include <cudawait/runtime/detail/chrono.hpp>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>
#include <string>

namespace cudawait {

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
} // namespace cudawait
