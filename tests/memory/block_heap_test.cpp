// SPDX-License-Identifier: Apache-2.0
// detail/block_heap.hpp: the pinned pool's allocator and address map on their own, at fake
// addresses (the heap never touches the memory it manages), so they need no GPU.
#include <cudawait/memory/detail/block_heap.hpp>
#include <cudawait/memory/pinned_pool.hpp> // the _KiB, _MiB and _GiB literals

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <iterator>
#include <map>
#include <new>
#include <random>
#include <unordered_map>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

// The global operator new of this program, replaced so that a test can make the n-th allocation
// from now throw std::bad_alloc (0: none fails). Only the test thread allocates while armed.
namespace {
long g_fail_countdown = 0;

void* counted_allocation(std::size_t bytes) {
    if (g_fail_countdown > 0 && --g_fail_countdown == 0) {
        throw std::bad_alloc();
    }
    if (void* p = std::malloc(bytes == 0 ? 1 : bytes)) {
        return p;
    }
    throw std::bad_alloc();
}
} // namespace

void* operator new(std::size_t bytes) { return counted_allocation(bytes); }
void* operator new[](std::size_t bytes) { return counted_allocation(bytes); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }

namespace {

using namespace cudawait::literals;

// ---- block_heap -------------------------------------------------------------------------------

struct no_extra {};
using test_heap = cudawait::detail::block_heap<no_extra>;

TEST(block_heap, random_workload_keeps_blocks_disjoint_aligned_and_coalesces_fully) {
    test_heap heap;
    // Two regions at fake, 2 MiB-aligned addresses: the heap never touches the memory.
    auto* base1 = reinterpret_cast<std::byte*>(std::uintptr_t{1} << 40);
    auto* base2 =
        reinterpret_cast<std::byte*>((std::uintptr_t{1} << 40) + (std::uintptr_t{1} << 34));
    auto* r1 = heap.add_region(base1, 256_MiB);
    auto* r2 = heap.add_region(base2, 64_MiB);
    std::mt19937_64 rng(7);
    std::map<std::byte*, std::pair<std::size_t, test_heap::block*>> live;
    std::size_t live_bytes = 0;
    for (int step = 0; step < 20000; ++step) {
        if (live.empty() || rng() % 100 < 55) {
            std::size_t size = 1 + rng() % (rng() % 4 == 0 ? 8_MiB : 64_KiB);
            std::size_t align = std::size_t{256} << (rng() % 4 == 0 ? rng() % 14 : 0);
            test_heap::block* b = heap.allocate(size, align);
            if (b == nullptr) {
                continue;
            }
            ASSERT_GE(b->size, size);
            ASSERT_LT(b->size, size + 256 + 1) << "split to the rounded size, no class rounding";
            ASSERT_EQ(reinterpret_cast<std::uintptr_t>(b->ptr) % align, 0u);
            auto next = live.lower_bound(b->ptr);
            if (next != live.end()) {
                ASSERT_LE(b->ptr + b->size, next->first) << "overlaps the next live block";
            }
            if (next != live.begin()) {
                auto prev = std::prev(next);
                ASSERT_LE(prev->first + prev->second.first, b->ptr) << "overlaps the previous";
            }
            live.emplace(b->ptr, std::pair{b->size, b});
            live_bytes += b->size;
        } else {
            auto it = live.begin();
            std::advance(it, static_cast<long>(rng() % live.size()));
            live_bytes -= it->second.first;
            heap.free(it->second.second);
            live.erase(it);
        }
        ASSERT_EQ(heap.free_bytes() + live_bytes, 320_MiB);
    }
    for (auto& [p, v] : live) {
        EXPECT_EQ(heap.containing(p + v.first - 1), v.second);
        heap.free(v.second);
    }
    EXPECT_TRUE(test_heap::region_unused(r1));
    EXPECT_TRUE(test_heap::region_unused(r2));
    EXPECT_EQ(heap.largest_free(), 256_MiB);
    heap.remove_region(r2);
    EXPECT_EQ(heap.free_bytes(), 256_MiB);
    EXPECT_EQ(heap.region_of(base2), nullptr);
}

TEST(block_heap, finds_a_fit_in_every_size_class) {
    test_heap heap;
    auto* base = reinterpret_cast<std::byte*>(std::uintptr_t{1} << 40);
    heap.add_region(base, 1_GiB);
    // Exact-size requests across the whole range, each followed by a free, always fit.
    for (std::size_t size = 256; size <= 1_GiB; size = size * 3 / 2 + 256) {
        test_heap::block* b = heap.allocate(size, 256);
        ASSERT_NE(b, nullptr) << size;
        heap.free(b);
    }
    test_heap::block* all = heap.allocate(1_GiB, 2_MiB);
    ASSERT_NE(all, nullptr);
    EXPECT_EQ(heap.allocate(256, 256), nullptr);
    heap.free(all);
}

// The heap gives up on a request only when no free block can hold it at its alignment: checked
// against every free block after each failure, on a fragmenting workload of 2 MiB-aligned and
// small blocks such as the pool's churn makes.
TEST(block_heap, fails_an_aligned_request_only_when_no_free_block_holds_it) {
    test_heap heap;
    auto* base = reinterpret_cast<std::byte*>(std::uintptr_t{1} << 40);
    heap.add_region(base, 64_MiB);
    heap.add_region(base + 1_GiB, 64_MiB);
    std::mt19937_64 rng(31);
    std::vector<test_heap::block*> live;
    int failures = 0;
    for (int step = 0; step < 20000; ++step) {
        if (live.empty() || rng() % 100 < 52) {
            std::size_t size = 1_KiB + rng() % 4_MiB;
            std::size_t rounded = (size + 255) / 256 * 256;
            std::size_t align = rounded >= 2_MiB ? 2_MiB : std::size_t{256} << (rng() % 4);
            if (test_heap::block* b = heap.allocate(size, align)) {
                live.push_back(b);
                continue;
            }
            ++failures;
            for (const auto& r : heap.regions()) {
                for (test_heap::block* f = r->first; f != nullptr; f = f->next_phys) {
                    if (!f->is_free) {
                        continue;
                    }
                    auto addr = reinterpret_cast<std::uintptr_t>(f->ptr);
                    std::size_t pad = (align - addr % align) % align;
                    ASSERT_GT(pad + rounded, f->size)
                        << "a free block of " << f->size << " at offset " << pad
                        << " holds the failed request of " << rounded << " aligned to " << align;
                }
            }
        } else {
            std::size_t i = rng() % live.size();
            heap.free(live[i]);
            live[i] = live.back();
            live.pop_back();
        }
    }
    EXPECT_GT(failures, 100) << "the workload never filled the heap";
    for (test_heap::block* b : live) {
        heap.free(b);
    }
    EXPECT_EQ(heap.free_bytes(), 128_MiB);
}

TEST(block_heap, a_block_of_just_the_right_size_is_found) {
    test_heap heap;
    auto* base = reinterpret_cast<std::byte*>(std::uintptr_t{1} << 40);
    heap.add_region(base, 202_MiB);
    test_heap::block* b = heap.allocate(200_MiB + 256, 2_MiB);
    ASSERT_NE(b, nullptr) << "the only block fits, though its size class is below the request's";
    EXPECT_EQ(b->ptr, base);
    heap.free(b);
}

TEST(block_heap, an_aligned_request_finds_a_block_whose_class_the_padded_search_skips) {
    test_heap heap;
    auto* base = reinterpret_cast<std::byte*>(std::uintptr_t{1} << 40);
    heap.add_region(base, 64_MiB);
    test_heap::block* small = heap.allocate(300_KiB, 256);
    ASSERT_NE(small, nullptr);
    // The rest of the first region is unaligned; the second region is the only fit.
    heap.add_region(base + 1_GiB, 64_MiB);
    test_heap::block* b = heap.allocate(65956658, 2_MiB);
    ASSERT_NE(b, nullptr);
    EXPECT_EQ(b->ptr, base + 1_GiB);
    heap.free(b);
    heap.free(small);
}

// Every byte of every region is in exactly one block, the blocks of a region tile it in address
// order, no two free blocks are neighbours (freeing coalesces), and the free bytes add up.
void expect_heap_consistent(const test_heap& heap) {
    std::size_t free_bytes = 0;
    for (const auto& r : heap.regions()) {
        std::byte* at = r->base;
        const test_heap::block* prev = nullptr;
        for (const test_heap::block* b = r->first; b != nullptr; b = b->next_phys) {
            ASSERT_EQ(b->ptr, at) << "a gap or an overlap inside a region";
            ASSERT_EQ(b->owner, r.get());
            ASSERT_EQ(b->arena, r->arena);
            ASSERT_EQ(b->prev_phys, prev);
            ASSERT_GT(b->size, 0u);
            ASSERT_EQ(b->size % test_heap::granule, 0u);
            if (prev != nullptr) {
                ASSERT_FALSE(prev->is_free && b->is_free) << "two free neighbours not merged";
            }
            if (b->is_free) {
                free_bytes += b->size;
            }
            at += b->size;
            prev = b;
        }
        ASSERT_EQ(at, r->base + r->bytes) << "the blocks do not cover the region";
    }
    ASSERT_EQ(heap.free_bytes(), free_bytes);
}

TEST(block_heap, a_request_is_served_only_from_its_own_arenas_regions) {
    test_heap heap;
    auto* base = reinterpret_cast<std::byte*>(std::uintptr_t{1} << 40);
    test_heap::region* shared = heap.add_region(base, 4_MiB, nullptr, 0);
    test_heap::region* own = heap.add_region(base + 1_GiB, 64_MiB, nullptr, 1);
    EXPECT_EQ(own->arena, 1u);
    // The 64 MiB region is free, but in the other arena.
    EXPECT_EQ(heap.allocate(8_MiB, 256, 0), nullptr);
    test_heap::block* a = heap.allocate(1_MiB, 256, 0);
    ASSERT_NE(a, nullptr);
    EXPECT_EQ(a->owner, shared);
    test_heap::block* b = heap.allocate(8_MiB, 2_MiB, 1);
    ASSERT_NE(b, nullptr);
    EXPECT_EQ(b->owner, own);
    EXPECT_EQ(b->ptr, base + 1_GiB);
    // Arena 0 has 3 MiB left; its requests never spill into arena 1's 56 MiB.
    test_heap::block* c = heap.allocate(3_MiB, 256, 0);
    ASSERT_NE(c, nullptr);
    EXPECT_EQ(c->owner, shared);
    EXPECT_EQ(heap.allocate(256, 256, 0), nullptr);
    expect_heap_consistent(heap);
    heap.free(a);
    heap.free(b);
    heap.free(c);
    EXPECT_TRUE(test_heap::region_unused(shared));
    EXPECT_TRUE(test_heap::region_unused(own));
    expect_heap_consistent(heap);
}

TEST(block_heap, a_free_block_larger_than_max_block_is_not_cut) {
    test_heap heap;
    auto* base = reinterpret_cast<std::byte*>(std::uintptr_t{1} << 40);
    heap.add_region(base, 20_MiB, nullptr, 1);
    EXPECT_EQ(heap.allocate(12_MiB, 2_MiB, 1, 17_MiB), nullptr) << "20 MiB > 17 MiB";
    EXPECT_EQ(heap.free_bytes(), 20_MiB) << "a refused request changes nothing";
    test_heap::block* b = heap.allocate(12_MiB, 2_MiB, 1, 20_MiB);
    ASSERT_NE(b, nullptr);
    EXPECT_EQ(b->ptr, base);
    EXPECT_EQ(b->size, 12_MiB);
    // The 8 MiB left over is within bounds for a 7 MiB request.
    test_heap::block* c = heap.allocate(7_MiB, 2_MiB, 1, 7_MiB + 7_MiB / 4 + 2_MiB);
    ASSERT_NE(c, nullptr);
    EXPECT_EQ(c->ptr, base + 12_MiB);
    expect_heap_consistent(heap);
    heap.free(b);
    heap.free(c);
    EXPECT_EQ(heap.largest_free(), 20_MiB);
}

// Random allocate/free in two arenas, with random bounds on the block cut: after every step the
// regions are tiled exactly, blocks are aligned, disjoint and from their arena, and free
// neighbours are merged; at the end every region is one free block again.
TEST(block_heap, churn_in_two_arenas_keeps_every_invariant) {
    test_heap heap;
    auto* base = reinterpret_cast<std::byte*>(std::uintptr_t{1} << 40);
    std::size_t total = 0;
    for (unsigned i = 0; i < 6; ++i) {
        std::size_t bytes = (i % 2 == 0 ? 64_MiB : 2_MiB * (3 + 5 * i));
        heap.add_region(base + i * 1_GiB, bytes, nullptr, i % 2);
        total += bytes;
    }
    std::mt19937_64 rng(11);
    std::map<std::byte*, test_heap::block*> live;
    std::size_t live_bytes = 0;
    for (int step = 0; step < 6000; ++step) {
        if (live.empty() || rng() % 100 < 55) {
            unsigned arena = static_cast<unsigned>(rng() % 2);
            std::size_t size = arena == 0 ? 1 + rng() % 4_MiB : 8_MiB + rng() % 24_MiB;
            std::size_t align = size >= 2_MiB ? 2_MiB : std::size_t{256} << (rng() % 3);
            std::size_t max_block = rng() % 2 == 0 ? ~std::size_t{0} : size + size / 4 + 2_MiB;
            test_heap::block* b = heap.allocate(size, align, arena, max_block);
            if (b == nullptr) {
                continue;
            }
            ASSERT_EQ(b->arena, arena);
            ASSERT_EQ(b->owner->arena, arena);
            ASSERT_GE(b->size, size);
            ASSERT_LT(b->size, size + 256 + 1);
            ASSERT_EQ(reinterpret_cast<std::uintptr_t>(b->ptr) % align, 0u);
            auto next = live.lower_bound(b->ptr);
            if (next != live.end()) {
                ASSERT_LE(b->ptr + b->size, next->first);
            }
            if (next != live.begin()) {
                auto prev = std::prev(next);
                ASSERT_LE(prev->first + prev->second->size, b->ptr);
            }
            live.emplace(b->ptr, b);
            live_bytes += b->size;
        } else {
            auto it = live.begin();
            std::advance(it, static_cast<long>(rng() % live.size()));
            live_bytes -= it->second->size;
            heap.free(it->second);
            live.erase(it);
        }
        ASSERT_EQ(heap.free_bytes() + live_bytes, total);
        if (step % 16 == 0) {
            expect_heap_consistent(heap);
            if (::testing::Test::HasFatalFailure()) {
                return;
            }
        }
    }
    for (auto& [p, b] : live) {
        heap.free(b);
    }
    expect_heap_consistent(heap);
    for (const auto& r : heap.regions()) {
        EXPECT_TRUE(test_heap::region_unused(r.get()));
    }
}

// Every allocation the heap makes for its descriptors (a chunk of them, the growth of the list
// that owns the chunks) is made to throw in turn, at each point where the heap grows: the call
// throws and the heap is left as it was, so that later requests and frees work and every byte
// is accounted for. (The chunk's descriptors used to be linked into the spare list before the
// list of chunks took the chunk, so a throwing push_back freed the chunk under the spare list;
// and a cut that needed a descriptor came after the block had left the free lists.)
TEST(block_heap, a_growth_that_throws_leaves_the_heap_as_it_was) {
    test_heap heap;
    auto* base = reinterpret_cast<std::byte*>(std::uintptr_t{1} << 40);
    const std::size_t total = 1_GiB;
    heap.add_region(base, total);
    std::mt19937_64 rng(23);
    std::vector<test_heap::block*> live;
    std::size_t live_bytes = 0;
    std::vector<std::vector<std::byte>> scribbles; // reuse freed memory, overwriting it
    int failures_by_point[3] = {};
    for (int step = 0; step < 3000; ++step) {
        // Forty in a row (enough to use up a chunk of descriptors) then a random free or two,
        // with the allocations failing, in turn, at the first and second allocation made.
        if (step % 48 < 40 || live.empty()) {
            const std::size_t size = 1 + rng() % 64_KiB;
            const std::size_t align = std::size_t{256} << (rng() % 3);
            for (long point = 1; point <= 3; ++point) {
                test_heap::block* b = nullptr;
                const bool last = point == 3; // not armed: this one must succeed
                g_fail_countdown = last ? 0 : point;
                try {
                    b = heap.allocate(size, align);
                } catch (const std::bad_alloc&) {
                    g_fail_countdown = 0;
                    ++failures_by_point[point - 1];
                    scribbles.emplace_back(16_KiB, std::byte{0xFF});
                    ASSERT_EQ(heap.free_bytes() + live_bytes, total)
                        << "bytes lost at step " << step;
                    continue;
                }
                g_fail_countdown = 0;
                ASSERT_NE(b, nullptr);
                ASSERT_GE(b->size, size);
                ASSERT_EQ(reinterpret_cast<std::uintptr_t>(b->ptr) % align, 0u);
                live.push_back(b);
                live_bytes += b->size;
                break;
            }
        } else {
            const std::size_t i = rng() % live.size();
            live_bytes -= live[i]->size;
            heap.free(live[i]);
            live[i] = live.back();
            live.pop_back();
        }
        ASSERT_EQ(heap.free_bytes() + live_bytes, total) << "at step " << step;
        if (step % 64 == 0) {
            expect_heap_consistent(heap);
            if (::testing::Test::HasFatalFailure()) {
                return;
            }
        }
    }
    EXPECT_GT(failures_by_point[0], 0) << "no chunk of descriptors was made while armed";
    EXPECT_GT(failures_by_point[1], 0) << "the list of chunks never grew while armed";
    for (test_heap::block* b : live) {
        heap.free(b);
    }
    expect_heap_consistent(heap);
    EXPECT_TRUE(test_heap::region_unused(heap.regions().front().get()));
    test_heap::block* whole = heap.allocate(total, 256);
    ASSERT_NE(whole, nullptr);
    EXPECT_EQ(whole->size, total);
    heap.free(whole);
}

// ---- ptr_map ----------------------------------------------------------------------------------

TEST(ptr_map, matches_a_standard_map_under_random_inserts_and_erases) {
    cudawait::detail::ptr_map<int> m;
    std::unordered_map<const void*, int> ref;
    std::mt19937_64 rng(3);
    for (int i = 0; i < 200000; ++i) {
        auto* key = reinterpret_cast<const void*>((1 + rng() % 5000) * 256);
        if (rng() % 3 == 0) {
            EXPECT_EQ(m.erase(key), ref.erase(key) == 1);
        } else {
            int v = static_cast<int>(rng());
            m.insert(key, v);
            ref[key] = v;
        }
    }
    ASSERT_EQ(m.size(), ref.size());
    for (auto [k, v] : ref) {
        int* found = m.find(k);
        ASSERT_NE(found, nullptr);
        EXPECT_EQ(*found, v);
    }
    EXPECT_EQ(m.find(reinterpret_cast<const void*>(std::uintptr_t{77})), nullptr);
}

} // namespace
