// SPDX-License-Identifier: Apache-2.0
#pragma once

// Bookkeeping behind pinned_pool, free of CUDA so that it is tested without a GPU: block_heap
// (a two-level segregated-fit allocator over address ranges) and ptr_map (address -> value).

#include <bit>
#include <cassert>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

namespace cudawait::detail {

/// A map from non-null addresses to V with linear probing and backward-shift deletion.
/// No allocation once it has grown to the working set, so the pool's hit path makes no syscall.
template <class V>
class ptr_map {
public:
    ptr_map() { m_slots.resize(64); }

    [[nodiscard]] std::size_t size() const noexcept { return m_size; }

    /// Inserts or overwrites.
    void insert(const void* key, V value) {
        assert(key != nullptr);
        if ((m_size + 1) * 2 > m_slots.size()) {
            grow();
        }
        std::size_t i = home(key);
        while (m_slots[i].key != nullptr && m_slots[i].key != key) {
            i = (i + 1) & mask();
        }
        if (m_slots[i].key == nullptr) {
            ++m_size;
        }
        m_slots[i] = {key, value};
    }

    /// The value for `key`, or nullptr.
    [[nodiscard]] V* find(const void* key) noexcept {
        std::size_t i = home(key);
        while (m_slots[i].key != nullptr) {
            if (m_slots[i].key == key) {
                return &m_slots[i].value;
            }
            i = (i + 1) & mask();
        }
        return nullptr;
    }

    /// Removes `key`; false when it was absent.
    bool erase(const void* key) noexcept {
        std::size_t i = home(key);
        while (m_slots[i].key != key) {
            if (m_slots[i].key == nullptr) {
                return false;
            }
            i = (i + 1) & mask();
        }
        // Shift later members of the probe run back so that no lookup stops early at the hole.
        std::size_t j = i;
        for (;;) {
            j = (j + 1) & mask();
            if (m_slots[j].key == nullptr) {
                break;
            }
            std::size_t k = home(m_slots[j].key);
            bool stays = (i <= j) ? (i < k && k <= j) : (i < k || k <= j);
            if (!stays) {
                m_slots[i] = m_slots[j];
                i = j;
            }
        }
        m_slots[i] = {};
        --m_size;
        return true;
    }

    template <class F>
    void for_each(F&& f) const {
        for (const slot& s : m_slots) {
            if (s.key != nullptr) {
                f(s.key, s.value);
            }
        }
    }

private:
    struct slot {
        const void* key = nullptr;
        V value{};
    };

    [[nodiscard]] std::size_t mask() const noexcept { return m_slots.size() - 1; }
    [[nodiscard]] std::size_t home(const void* key) const noexcept {
        auto x = static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(key));
        x ^= x >> 33;
        x *= 0xff51afd7ed558ccdULL;
        x ^= x >> 33;
        return static_cast<std::size_t>(x) & mask();
    }
    void grow() {
        std::vector<slot> old(m_slots.size() * 2);
        old.swap(m_slots);
        m_size = 0;
        for (const slot& s : old) {
            if (s.key != nullptr) {
                insert(s.key, s.value);
            }
        }
    }

    std::vector<slot> m_slots;
    std::size_t m_size = 0;
};

/// Two-level segregated fit over caller-supplied address ranges.
///
/// O(1) allocate and free, immediate coalescing with both neighbours, blocks split to the
/// request's size (256-byte granules, no power-of-two rounding); regions belong to one of
/// arena_count arenas, each with its own free lists, so that an owner can keep kinds of blocks
/// apart. The heap never touches the memory it manages: descriptors live beside it, so the GPU
/// can write any byte of a block without corrupting the allocator.
///
/// `Extra` is per-block state the owner keeps beside the heap's own (requested size, pending
/// uses); it is value-initialised whenever a descriptor is reused.
template <class Extra>
class block_heap {
public:
    /// Every block's size and address are multiples of this.
    static constexpr std::size_t granule = 256;
    /// Regions are kept apart in this many arenas: a request is served from one arena only.
    static constexpr unsigned arena_count = 2;

    struct region;

    struct block : Extra {
        std::byte* ptr = nullptr;
        std::size_t size = 0;
        block* prev_phys = nullptr; ///< neighbours in address order within the region
        block* next_phys = nullptr;
        block* prev_free = nullptr; ///< links of the size class's free list
        block* next_free = nullptr;
        region* owner = nullptr;
        unsigned arena = 0; ///< owner->arena, kept here to spare the free lists a load
        bool is_free = false;
    };

    struct region {
        std::byte* base = nullptr;
        std::size_t bytes = 0;
        block* first = nullptr;
        void* tag = nullptr; ///< the owner's handle for the range (for instance the upstream's)
        unsigned arena = 0;  ///< which free lists its free blocks are in
    };

    block_heap() = default;
    block_heap(const block_heap&) = delete;
    block_heap& operator=(const block_heap&) = delete;

    /// Adds [base, base + bytes) as one free block of `arena`'s free lists. `base` and `bytes`
    /// must be granule multiples.
    region* add_region(std::byte* base, std::size_t bytes, void* tag = nullptr,
                       unsigned arena = 0) {
        assert(arena < arena_count);
        assert(reinterpret_cast<std::uintptr_t>(base) % granule == 0 && bytes % granule == 0);
        auto r = std::make_unique<region>();
        r->base = base;
        r->bytes = bytes;
        r->tag = tag;
        r->arena = arena;
        block* b = new_block();
        b->ptr = base;
        b->size = bytes;
        b->owner = r.get();
        b->arena = arena;
        r->first = b;
        region* raw = r.get();
        // Kept sorted by address: lookups of interior pointers binary-search it.
        auto pos = m_regions.begin();
        while (pos != m_regions.end() && (*pos)->base < base) {
            ++pos;
        }
        try {
            m_regions.insert(pos, std::move(r));
        } catch (...) {
            recycle(b);
            throw;
        }
        insert_free(b);
        return raw;
    }

    /// True when the region is one free block (nothing handed out, nothing pending).
    [[nodiscard]] static bool region_unused(const region* r) noexcept {
        return r->first->is_free && r->first->size == r->bytes;
    }

    /// Drops an unused region; its range is the caller's again.
    void remove_region(region* r) {
        assert(region_unused(r));
        remove_free(r->first);
        recycle(r->first);
        for (auto it = m_regions.begin(); it != m_regions.end(); ++it) {
            if (it->get() == r) {
                m_regions.erase(it);
                return;
            }
        }
    }

    [[nodiscard]] const std::vector<std::unique_ptr<region>>& regions() const noexcept {
        return m_regions;
    }

    /// A used block of at least `bytes` (rounded to granules) starting at a multiple of `align`
    /// (a power of two, at least `granule`), cut from a free block of `arena`'s regions of at
    /// most `max_block` bytes, or nullptr when no such block fits. The search is good fit: the
    /// smallest size class that holds the request, so `max_block` costs no extra search.
    [[nodiscard]] block* allocate(std::size_t bytes, std::size_t align, unsigned arena = 0,
                                  std::size_t max_block = ~std::size_t{0}) {
        assert(arena < arena_count);
        if (m_lists[arena].fl_bitmap == 0) {
            return nullptr; // an arena with nothing free: a bitmap test, not three searches
        }
        bytes = round_up(bytes, granule);
        block* b = find_fit(arena, bytes);
        if (b != nullptr && padding(b, align) + bytes > b->size) {
            b = nullptr;
        }
        if (b == nullptr && align > granule) {
            b = find_fit(arena, bytes + align - granule);
        }
        if (b != nullptr && b->size > max_block) {
            b = nullptr;
        }
        if (b == nullptr) {
            // The segregated search only looks at classes whose every block fits; a block in a
            // class it skipped may fit too (a fresh slab of just the right size).
            b = scan_classes(arena, bytes, align);
        }
        if (b == nullptr || b->size > max_block) {
            return nullptr;
        }
        // The cuts below take up to two descriptors: made sure of before any list changes, so
        // that a growth that throws (bad_alloc) leaves the heap as it was.
        if (m_spare == nullptr || m_spare->next_free == nullptr) {
            grow_spare();
        }
        remove_free(b);
        if (std::size_t gap = padding(b, align); gap != 0) {
            // The gap in front stays free; its left neighbour is in use (free neighbours are
            // always merged), so it needs no merging either.
            block* rest = split(b, gap);
            insert_free(b);
            b = rest;
        }
        if (b->size - bytes >= granule) {
            block* tail = split(b, bytes);
            insert_free(tail);
        }
        b->is_free = false;
        return b;
    }

    /// Returns a used block, merging it with free neighbours.
    void free(block* b) noexcept {
        assert(!b->is_free);
        if (block* prev = b->prev_phys; prev != nullptr && prev->is_free) {
            remove_free(prev);
            prev->size += b->size;
            unlink_phys(b);
            recycle(b);
            b = prev;
        }
        if (block* next = b->next_phys; next != nullptr && next->is_free) {
            remove_free(next);
            b->size += next->size;
            unlink_phys(next);
            recycle(next);
        }
        insert_free(b);
    }

    /// The region whose range holds `p`, or nullptr.
    [[nodiscard]] region* region_of(const void* p) const noexcept {
        auto* q = static_cast<const std::byte*>(p);
        std::size_t lo = 0;
        std::size_t hi = m_regions.size();
        while (lo < hi) {
            std::size_t mid = (lo + hi) / 2;
            if (m_regions[mid]->base + m_regions[mid]->bytes <= q) {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        if (lo == m_regions.size() || q < m_regions[lo]->base) {
            return nullptr;
        }
        return m_regions[lo].get();
    }

    /// The block whose range holds `p`, or nullptr when `p` lies in no region. Walks the
    /// region's blocks: for the rare interior-pointer lookup, not for hot paths.
    [[nodiscard]] block* containing(const void* p) const noexcept {
        region* r = region_of(p);
        if (r == nullptr) {
            return nullptr;
        }
        auto* q = static_cast<const std::byte*>(p);
        for (block* b = r->first; b != nullptr; b = b->next_phys) {
            if (q < b->ptr + b->size) {
                return b;
            }
        }
        return nullptr;
    }

    /// Bytes in free blocks.
    [[nodiscard]] std::size_t free_bytes() const noexcept { return m_free_bytes; }
    /// The largest free block, in bytes (0 when none).
    [[nodiscard]] std::size_t largest_free() const noexcept {
        std::size_t best = 0;
        for (const auto& r : m_regions) {
            for (block* b = r->first; b != nullptr; b = b->next_phys) {
                if (b->is_free && b->size > best) {
                    best = b->size;
                }
            }
        }
        return best;
    }

    [[nodiscard]] static constexpr std::size_t round_up(std::size_t n, std::size_t a) noexcept {
        return (n + a - 1) / a * a;
    }

private:
    static constexpr unsigned sl_bits = 5;
    static constexpr unsigned sl_count = 1u << sl_bits;
    static constexpr unsigned fl_count = 48;

    struct index {
        unsigned fl;
        unsigned sl;
    };

    // Sizes below sl_count granules map one class per granule; above, each power of two is cut
    // into sl_count classes, so a class spans at most 1/32 of its sizes.
    static index map(std::size_t bytes) noexcept {
        std::size_t u = bytes / granule;
        if (u < sl_count) {
            return {0, static_cast<unsigned>(u)};
        }
        auto msb = static_cast<unsigned>(std::bit_width(u) - 1);
        return {msb - sl_bits + 1, static_cast<unsigned>((u >> (msb - sl_bits)) - sl_count)};
    }

    // The first class all of whose blocks hold `bytes`.
    static index map_search(std::size_t bytes) noexcept {
        std::size_t u = bytes / granule;
        if (u >= sl_count) {
            auto msb = static_cast<unsigned>(std::bit_width(u) - 1);
            u += (std::size_t{1} << (msb - sl_bits)) - 1;
        }
        return map(u * granule);
    }

    block* find_fit(unsigned arena, std::size_t bytes) noexcept {
        lists& a = m_lists[arena];
        index i = map_search(bytes);
        if (i.fl >= fl_count) {
            return nullptr;
        }
        std::uint32_t sl_map = a.sl_bitmap[i.fl] & (~std::uint32_t{0} << i.sl);
        if (sl_map == 0) {
            std::uint64_t fl_map =
                i.fl + 1 >= 64 ? 0 : (a.fl_bitmap & (~std::uint64_t{0} << (i.fl + 1)));
            if (fl_map == 0) {
                return nullptr;
            }
            i.fl = static_cast<unsigned>(std::countr_zero(fl_map));
            sl_map = a.sl_bitmap[i.fl];
        }
        i.sl = static_cast<unsigned>(std::countr_zero(sl_map));
        return a.heads[i.fl][i.sl];
    }

    // Every class that may hold a block of at least `bytes` the rounded searches skipped:
    // from the request's own class up to the class of the request plus its worst padding.
    block* scan_classes(unsigned arena, std::size_t bytes, std::size_t align) const noexcept {
        index lo = map(bytes);
        index hi = map(bytes + align - granule);
        const lists& a = m_lists[arena];
        for (unsigned fl = lo.fl; fl <= hi.fl && fl < fl_count; ++fl) {
            if (a.sl_bitmap[fl] == 0) {
                continue; // the usual case on the hit path: nothing to walk
            }
            unsigned first = fl == lo.fl ? lo.sl : 0;
            unsigned last = fl == hi.fl ? hi.sl : sl_count - 1;
            for (unsigned sl = first; sl <= last; ++sl) {
                for (block* b = a.heads[fl][sl]; b != nullptr; b = b->next_free) {
                    if (padding(b, align) + bytes <= b->size) {
                        return b;
                    }
                }
            }
        }
        return nullptr;
    }

    static std::size_t padding(const block* b, std::size_t align) noexcept {
        auto addr = reinterpret_cast<std::uintptr_t>(b->ptr);
        return static_cast<std::size_t>((align - addr % align) % align);
    }

    void insert_free(block* b) noexcept {
        lists& a = m_lists[b->arena];
        index i = map(b->size);
        b->is_free = true;
        b->prev_free = nullptr;
        b->next_free = a.heads[i.fl][i.sl];
        if (b->next_free != nullptr) {
            b->next_free->prev_free = b;
        }
        a.heads[i.fl][i.sl] = b;
        a.sl_bitmap[i.fl] |= std::uint32_t{1} << i.sl;
        a.fl_bitmap |= std::uint64_t{1} << i.fl;
        m_free_bytes += b->size;
    }

    void remove_free(block* b) noexcept {
        lists& a = m_lists[b->arena];
        index i = map(b->size);
        if (b->prev_free != nullptr) {
            b->prev_free->next_free = b->next_free;
        } else {
            a.heads[i.fl][i.sl] = b->next_free;
        }
        if (b->next_free != nullptr) {
            b->next_free->prev_free = b->prev_free;
        }
        if (a.heads[i.fl][i.sl] == nullptr) {
            a.sl_bitmap[i.fl] &= ~(std::uint32_t{1} << i.sl);
            if (a.sl_bitmap[i.fl] == 0) {
                a.fl_bitmap &= ~(std::uint64_t{1} << i.fl);
            }
        }
        b->is_free = false;
        b->prev_free = b->next_free = nullptr;
        m_free_bytes -= b->size;
    }

    // Cuts `b` at `at` bytes; returns the right part, linked after `b`. Neither is in a list.
    block* split(block* b, std::size_t at) {
        block* r = new_block();
        r->ptr = b->ptr + at;
        r->size = b->size - at;
        r->owner = b->owner;
        r->arena = b->arena;
        r->prev_phys = b;
        r->next_phys = b->next_phys;
        if (b->next_phys != nullptr) {
            b->next_phys->prev_phys = r;
        }
        b->next_phys = r;
        b->size = at;
        return r;
    }

    static void unlink_phys(block* b) noexcept {
        if (b->prev_phys != nullptr) {
            b->prev_phys->next_phys = b->next_phys;
        }
        if (b->next_phys != nullptr) {
            b->next_phys->prev_phys = b->prev_phys;
        }
        if (b->owner->first == b) {
            b->owner->first = b->next_phys;
        }
    }

    // Descriptors come from chunks and are recycled through a free list, so a split on the hit
    // path allocates nothing once the heap has warmed up.
    block* new_block() {
        if (m_spare == nullptr) {
            grow_spare();
        }
        block* b = m_spare;
        m_spare = b->next_free;
        *b = block{};
        return b;
    }
    // The chunk is in m_chunks before any of its descriptors is linked into m_spare: when the
    // push_back throws, the chunk is freed with nothing pointing into it.
    void grow_spare() {
        m_chunks.push_back(std::make_unique<block[]>(chunk_blocks));
        block* chunk = m_chunks.back().get();
        for (std::size_t i = 0; i < chunk_blocks; ++i) {
            chunk[i].next_free = m_spare;
            m_spare = &chunk[i];
        }
    }
    void recycle(block* b) noexcept {
        b->next_free = m_spare;
        m_spare = b;
    }

    static constexpr std::size_t chunk_blocks = 256;

    // One set of segregated free lists per arena.
    struct lists {
        std::uint64_t fl_bitmap = 0;
        std::uint32_t sl_bitmap[fl_count] = {};
        block* heads[fl_count][sl_count] = {};
    };

    lists m_lists[arena_count];
    std::size_t m_free_bytes = 0;
    std::vector<std::unique_ptr<region>> m_regions;
    std::vector<std::unique_ptr<block[]>> m_chunks;
    block* m_spare = nullptr;
};

} // namespace cudawait::detail
