// SPDX-License-Identifier: Apache-2.0
//
// pool_waste_host: the pinned pool's placement figures without a GPU. memory_bench's waste
// workloads (waste_workload.hpp: the same seed, sizes and operations) and its hit-path loop run
// on a pinned_pool whose slabs come from plain anonymous mappings instead of registered
// page-locked memory. The slabs have the registered source's shape (2 MiB-aligned, sizes in
// 2 MiB steps, the pool's default 64 MiB growth step) and are never touched, so the placement,
// and with it every waste figure, is the one memory_bench measures on a GPU machine.
//
//   pool_waste_host            prints the two waste ratios and the hit-path ns per pair
//   pool_waste_host --check    also exits with 1 when a waste ratio misses its target
//
// The hit path: allocate + deallocate of one size on a warm pool (4 KiB, 1 MiB, 64 MiB), the
// median of 200 batches of 1000 pairs, as memory_bench's BM_pool_alloc_free measures it.

#include <cudawait/memory/pinned_pool.hpp>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <memory>
#include <new>
#include <stdexcept>
#include <vector>

#include "waste_workload.hpp"
#include <sys/mman.h>

namespace {

using namespace cudawait::literals;

/// Slabs from anonymous mappings, 2 MiB-aligned like registered_slab_source's, never touched
/// (MAP_NORESERVE): the pool never writes to its memory, so a 4 GiB pool costs no RAM here.
class mapped_slab_source final : public cudawait::slab_source {
public:
    void* allocate(std::size_t bytes) override {
        if (bytes == 0 || bytes % alignment != 0) {
            throw std::logic_error("slab size must be a non-zero multiple of 2 MiB");
        }
        const std::size_t span = bytes + alignment;
        void* raw = ::mmap(nullptr, span, PROT_READ | PROT_WRITE,
                           MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (raw == MAP_FAILED) {
            throw std::bad_alloc();
        }
        const auto addr = reinterpret_cast<std::uintptr_t>(raw);
        const std::uintptr_t aligned = (addr + alignment - 1) / alignment * alignment;
        const std::size_t head = aligned - addr;
        if (head != 0) {
            ::munmap(raw, head);
        }
        if (const std::size_t tail = span - head - bytes; tail != 0) {
            ::munmap(reinterpret_cast<void*>(aligned + bytes), tail);
        }
        return reinterpret_cast<void*>(aligned);
    }
    void deallocate(void* p, std::size_t bytes) noexcept override { ::munmap(p, bytes); }

private:
    static constexpr std::size_t alignment = 2_MiB;
};

/// No block here is ever used by a stream.
class no_use_tracker final : public cudawait::use_tracker {
public:
    cudawait::use_token record(cudawait::stream_ref) override {
        throw std::logic_error("pool_waste_host records no uses");
    }
    bool done(cudawait::use_token) override { return true; }
    void wait(cudawait::use_token) override {}
    void release(cudawait::use_token) noexcept override {}
};

cudawait::pinned_pool_options host_options(cudawait::pinned_pool_options o) {
    o.upstream = std::make_shared<mapped_slab_source>();
    o.tracker = std::make_shared<no_use_tracker>();
    return o;
}

/// Keeps the pointers' loads and stores in the timed loop.
void* volatile g_sink = nullptr;

struct hit_path {
    double median_ns;
    double fastest_ns; ///< the fastest batch: what a busy machine disturbs least
};

/// Median ns per allocate + free pair on a warm pool, as memory_bench measures it.
hit_path hit_path_ns(std::size_t bytes) {
    constexpr int batches = 200;
    constexpr int pairs = 1000;
    cudawait::pinned_pool pool(host_options({}));
    pool.reserve(std::max(2 * bytes, 64_MiB));
    for (int i = 0; i < pairs; ++i) {
        void* p = pool.allocate(bytes);
        g_sink = p;
        pool.deallocate(p);
    }
    const cudawait::pinned_pool_stats before = pool.stats();
    std::vector<double> per_pair;
    for (int b = 0; b < batches; ++b) {
        const auto t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < pairs; ++i) {
            void* p = pool.allocate(bytes);
            g_sink = p;
            pool.deallocate(p);
        }
        const auto t1 = std::chrono::steady_clock::now();
        per_pair.push_back(std::chrono::duration<double, std::nano>(t1 - t0).count() / pairs);
    }
    if (pool.stats().growth_count != before.growth_count) {
        throw std::runtime_error("the pool grew during the hit-path loop");
    }
    std::sort(per_pair.begin(), per_pair.end());
    return {per_pair[(per_pair.size() - 1) / 2], per_pair.front()};
}

bool report(const char* name, const bench::waste_result& r, double target) {
    const double ratio = r.ratio();
    std::printf("%-8s peak reserved %.3f GiB / peak requested %.3f GiB = %.3f   target <= %.2f: "
                "%s\n",
                name, static_cast<double>(r.peak_reserved) / 0x1p30,
                static_cast<double>(r.peak_live) / 0x1p30, ratio, target,
                ratio <= target ? "ok" : "MISSED");
    std::printf("         peak in use / peak requested %.3f; %zu allocations, %zu frees, "
                "%llu growth steps\n",
                static_cast<double>(r.peak_in_use) / static_cast<double>(r.peak_live),
                r.allocations, r.frees, static_cast<unsigned long long>(r.growth_count));
    return ratio <= target;
}

} // namespace

int main(int argc, char** argv) {
    const bool check = argc > 1 && std::strcmp(argv[1], "--check") == 0;
    try {
        bool met = true;
        std::printf("pinned_pool placement on host slabs (memory_bench's waste workloads)\n");
        {
            cudawait::pinned_pool pool(host_options(bench::waste_pool_options()));
            met &= report("batches", bench::run_waste_workload(pool, true), bench::kWasteTarget);
        }
        {
            cudawait::pinned_pool pool(host_options(bench::waste_pool_options()));
            met &=
                report("churn", bench::run_waste_workload(pool, false), bench::kWasteChurnTarget);
        }
        std::printf("hit path (allocate + free, warm pool; ns per pair, median of 200 batches of "
                    "1000 pairs, fastest batch in brackets):\n");
        for (std::size_t bytes : {4_KiB, 1_MiB, 64_MiB}) {
            const hit_path h = hit_path_ns(bytes);
            std::printf("  %zu KiB %.1f (%.1f)", bytes >> 10, h.median_ns, h.fastest_ns);
        }
        std::printf("\n");
        return check && !met ? 1 : 0;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "pool_waste_host: %s\n", e.what());
        return 1;
    }
}
