// SPDX-License-Identifier: Apache-2.0
#pragma once

// Synopsis
//   pinned_pool pool;                    page-locked host memory, grown rarely in large slabs
//   pool.reserve(1 << 30);               grow once, up front
//   void* p = pool.allocate(bytes);      O(1), no CUDA call and no syscall when memory is cached
//   pool.record_use(p, s);               the library's own copies and pipelines do this for you
//   pool.deallocate(p);                  p is handed out again only once s has passed this point
//   pinned_pool::size_for(depth, in, out)  what reserve() needs for a pipeline's staging buffers
//   pinned_pool_resource r = pool.resource();  a copyable cuda::mr view (the pool outlives it)
//   default_pinned_pool()                the process-wide pool that copies stage through
//
// At the cap (a quarter of the memory the process may use, by default) a request waits a while
// for pending blocks, gives free slabs back, then throws pool_exhausted (pinned_pool_options.hpp).
// See docs/memory.md#pinned-pool.

#include <cudawait/memory/detail/block_heap.hpp>
#include <cudawait/memory/detail/memory_limit.hpp>
#include <cudawait/memory/detail/pending_blocks.hpp>
#include <cudawait/memory/device_resource.hpp>
#include <cudawait/memory/literals.hpp>
#include <cudawait/memory/pinned_pool_options.hpp>
#include <cudawait/memory/slab_source.hpp>
#include <cudawait/memory/use_tracker.hpp>
#include <cudawait/runtime/detail/chrono.hpp>
#include <cudawait/runtime/detail/fork_guard.hpp>
#include <cudawait/runtime/error.hpp>
#include <cudawait/runtime/stream.hpp>

#include <algorithm>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <memory_resource>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>

namespace cudawait {

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
        m_pending.start(m_options.slab_bytes);
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
        m_pending.drain(m_mutex, *m_options.tracker, [this](block* b) { m_heap.free(b); });
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
                             m_used.size(), m_stats.in_use_bytes, sizes.c_str(),
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
                ++m_stats.hits;
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
        m_pending.push(b);
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
            if (m_pending.check_due()) {
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
            std::size_t held = m_stats.reserved_bytes + m_growing;
            if (held >= bytes) {
                return;
            }
            std::size_t step = std::min(heap::round_up(bytes - held, slab_alignment),
                                        registered_slab_source::max_slab_bytes);
            if (held + step > m_options.max_pinned_bytes) {
                throw pool_exhausted(bytes - held, m_stats.in_use_bytes, m_pending.bytes(),
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
        wait_while(lock, [this] { return m_pending.collecting(); });
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
        pinned_pool_stats s = m_stats;
        s.pending_bytes = m_pending.bytes();
        s.peak_pending_bytes = m_pending.peak_bytes();
        s.blocks_in_use = m_used.size();
        return s;
    }

    /// The cap on page-locked bytes.
    [[nodiscard]] std::size_t max_pinned_bytes() const noexcept {
        return m_options.max_pinned_bytes;
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
        pinned_pool_stats& st = m_stats;
        st.in_use_bytes += b->size;
        st.requested_bytes += requested;
        st.peak_in_use_bytes = std::max(st.peak_in_use_bytes, st.in_use_bytes);
        st.peak_requested_bytes = std::max(st.peak_requested_bytes, st.requested_bytes);
        st.peak_in_use_and_pending_bytes =
            std::max(st.peak_in_use_and_pending_bytes, st.in_use_bytes + m_pending.bytes());
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
        m_stats.in_use_bytes -= b->size;
        m_stats.requested_bytes -= b->requested;
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

    // One check of every pending block (see detail::pending_blocks::check). Under the lock.
    std::size_t collect_pass(std::unique_lock<std::mutex>& lock) noexcept {
        const std::uint64_t finished = m_pending.checks_finished();
        std::size_t freed =
            m_pending.check(lock, *m_options.tracker, [this](block* b) { m_heap.free(b); });
        if (m_pending.checks_finished() != finished) {
            notify_waiters();
        }
        return freed;
    }

    void* allocate_slow(std::size_t bytes, std::size_t size, std::size_t align) {
        std::unique_lock lock(m_mutex);
        // A check numbered `first_check` or later sees every block pending now.
        const std::uint64_t first_check = m_pending.checks_started() + 1;
        const std::size_t need = heap::round_up(size, slab_alignment);
        const std::size_t cap = m_options.max_pinned_bytes;
        bool released = false;
        bool trimmed = false;
        bool waited = false;
        std::chrono::steady_clock::time_point deadline;
        std::chrono::microseconds poll(20);
        for (;;) {
            if (block* b = place(size, align)) {
                ++m_stats.hits;
                return hand_out(b, bytes);
            }
            // Blocks whose uses completed, before anything else.
            if (m_pending.checks_finished() < first_check &&
                (m_pending.collecting() || !m_pending.empty())) {
                if (m_pending.collecting()) {
                    wait_while(lock, [this] { return m_pending.collecting(); });
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
            if (!trimmed && m_stats.reserved_bytes + want > m_stats.peak_reserved_bytes) {
                trimmed = true;
                if (release_unused(lock) != 0) {
                    continue;
                }
            }
            if (m_stats.reserved_bytes + need <= cap) {
                std::size_t step = std::min(want, cap - m_stats.reserved_bytes);
                grow(lock, step / slab_alignment * slab_alignment,
                     own_slab(size) ? own_arena : shared_arena);
                if (block* b = place(size, align)) { // the new slab holds it
                    ++m_stats.misses;
                    return hand_out(b, bytes);
                }
                continue;
            }
            // At the cap. Blocks the GPU still uses will come back: wait for them, a while.
            if (m_pending.bytes() != 0 && m_stats.in_use_bytes + size <= cap &&
                m_options.cap_wait > std::chrono::nanoseconds::zero()) {
                auto now = std::chrono::steady_clock::now();
                if (!waited) {
                    waited = true;
                    deadline = now + m_options.cap_wait;
                }
                if (now < deadline) {
                    if (m_pending.collecting()) {
                        wait_while(lock, [this] { return m_pending.collecting(); });
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
            throw pool_exhausted(bytes, m_stats.in_use_bytes, m_pending.bytes(), cap);
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
        m_stats.reserved_bytes += step;
        m_stats.peak_reserved_bytes = std::max(m_stats.peak_reserved_bytes, m_stats.reserved_bytes);
        ++m_stats.growth_count;
        m_stats.growth_time += std::chrono::duration_cast<std::chrono::nanoseconds>(elapsed);
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
            m_stats.reserved_bytes -= r->bytes;
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

    template <class>
    friend pinned_pool& cudawait::default_pinned_pool();

    pinned_pool_options m_options;
    detail::fork_stamp m_stamp; ///< the process the pool was made in
    mutable std::mutex m_mutex;
    std::condition_variable m_cv; ///< a check or a growth finished, or a block was freed
    std::size_t m_waiters = 0;    ///< threads waiting on m_cv
    heap m_heap;
    detail::ptr_map<block*> m_used;
    detail::pending_blocks<block> m_pending; ///< freed, their recorded GPU uses maybe in flight
    pinned_pool_stats m_stats; ///< the counters; pending and blocks_in_use are filled by stats()
    std::size_t m_growing = 0; ///< bytes an upstream call in progress will add
};

} // namespace detail

/// A pool of page-locked host memory with host-safe reuse: a freed block on which record_use()
/// was called is handed out again only once every stream that used it passed the recorded
/// point. Thread-safe; the hit path takes one lock and makes no CUDA call. How blocks are placed,
/// checked and grown: docs/memory.md#how-the-pool-works.
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
