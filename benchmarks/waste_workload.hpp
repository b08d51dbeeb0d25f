// SPDX-License-Identifier: Apache-2.0
#pragma once

// The pinned pool's waste workloads, shared by memory_bench (on the registered, page-locked
// slab source) and pool_waste_host (on a host slab source, no GPU). The placement is host logic
// and the sequence is fixed by the seed, so both programs see the same figures.
//
//   batches  kWasteRounds rounds: allocate until kWasteLiveTarget bytes are live, then free them
//            all in random order
//   churn    kWasteOps random allocate/free operations with the live bytes held near
//            kWasteLiveTarget (an allocation with probability kWasteAllocProbability while
//            below it, a free of a random live block otherwise)
//
// Sizes are log-uniform in [kWasteMinBytes, kWasteMaxBytes]. The figure is
// peak_reserved_bytes / peak_requested_bytes of the pool.

#include <cudawait/memory/pinned_pool.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

namespace bench {

using namespace cudawait::literals;

constexpr int kWasteOps = 20000; ///< churn: allocate/free operations
constexpr int kWasteRounds = 30; ///< batches: rounds
constexpr std::uint64_t kWasteSeed = 0x6d656d6f7279ULL;
constexpr std::size_t kWasteLiveTarget = 2_GiB; ///< live requested bytes per batch / churn
constexpr double kWasteAllocProbability = 0.55;
constexpr std::size_t kWasteMinBytes = 1_KiB;
constexpr std::size_t kWasteMaxBytes = 64_MiB;
/// Safety cap on the waste pools (default options otherwise): twice the live target, so a waste
/// ratio far above the target fails with pool_exhausted instead of pinning the machine's memory.
constexpr std::size_t kWasteCap = 4_GiB;
constexpr double kWasteTarget = 1.15;      ///< batches: peak reserved / peak live at most
constexpr double kWasteChurnTarget = 1.25; ///< churn: peak reserved / peak live at most

struct waste_result {
    std::size_t peak_reserved = 0;
    std::size_t peak_in_use = 0; ///< peak of block sizes handed out (rounded, aligned)
    std::size_t peak_live = 0;   ///< peak of the sum of live requested sizes
    std::uint64_t hits = 0;
    std::uint64_t misses = 0;
    std::uint64_t growth_count = 0;
    std::size_t allocations = 0;
    std::size_t frees = 0;
    double growth_ms = 0.0;

    /// peak_reserved / peak_live.
    [[nodiscard]] double ratio() const {
        return static_cast<double>(peak_reserved) / static_cast<double>(peak_live);
    }
};

/// The options the waste pools are made with: the defaults, but for the safety cap.
inline cudawait::pinned_pool_options waste_pool_options() {
    cudawait::pinned_pool_options options;
    options.max_pinned_bytes = kWasteCap;
    return options;
}

/// Uniform in [0, 1) from the top 53 bits, the same on every standard library.
inline double unit(std::mt19937_64& rng) {
    return std::ldexp(static_cast<double>(rng() >> 11), -53);
}

/// Log-uniform in [kWasteMinBytes, kWasteMaxBytes].
inline std::size_t log_uniform_size(std::mt19937_64& rng) {
    const double lo = std::log(static_cast<double>(kWasteMinBytes));
    const double hi = std::log(static_cast<double>(kWasteMaxBytes));
    const auto n = static_cast<std::size_t>(std::exp(lo + (hi - lo) * unit(rng)));
    return std::clamp(n, kWasteMinBytes, kWasteMaxBytes);
}

/// Runs the batches (`batches`) or the churn workload on `pool`, a fresh pinned_pool made with
/// waste_pool_options() (plus, off the GPU, a host upstream and tracker). Every block is given
/// back at the end. Other seeds than kWasteSeed show how much the figures owe to one sequence.
/// @throws std::runtime_error when the pool hits the safety cap or its statistics disagree
///         with the workload's
inline waste_result run_waste_workload(cudawait::pinned_pool& pool, bool batches,
                                       std::uint64_t seed = kWasteSeed) {
    struct live_block {
        void* ptr;
        std::size_t bytes;
    };
    std::mt19937_64 rng(seed);
    std::vector<live_block> live;
    std::size_t live_bytes = 0;
    waste_result r;
    auto allocate = [&] {
        const std::size_t n = log_uniform_size(rng);
        live.push_back({pool.allocate(n), n});
        live_bytes += n;
        r.peak_live = std::max(r.peak_live, live_bytes);
        ++r.allocations;
    };
    auto free_one = [&](std::size_t i) {
        pool.deallocate(live[i].ptr);
        live_bytes -= live[i].bytes;
        live[i] = live.back();
        live.pop_back();
        ++r.frees;
    };
    try {
        if (batches) {
            for (int round = 0; round < kWasteRounds; ++round) {
                while (live_bytes < kWasteLiveTarget) {
                    allocate();
                }
                while (!live.empty()) {
                    free_one(static_cast<std::size_t>(rng() % live.size()));
                }
            }
        } else {
            for (int op = 0; op < kWasteOps; ++op) {
                if (live.empty() ||
                    (live_bytes < kWasteLiveTarget && unit(rng) < kWasteAllocProbability)) {
                    allocate();
                } else {
                    free_one(static_cast<std::size_t>(rng() % live.size()));
                }
            }
        }
    } catch (const cudawait::pool_exhausted& e) {
        for (const live_block& b : live) {
            pool.deallocate(b.ptr);
        }
        throw std::runtime_error("waste workload hit the " + std::to_string(kWasteCap >> 30) +
                                 " GiB safety cap with " + std::to_string(live_bytes) +
                                 " live requested bytes (peak " + std::to_string(r.peak_live) +
                                 "): " + e.what());
    }
    for (const live_block& b : live) {
        pool.deallocate(b.ptr);
    }
    const cudawait::pinned_pool_stats s = pool.stats();
    if (s.peak_requested_bytes != r.peak_live) {
        throw std::runtime_error("pool's peak_requested_bytes disagrees with the workload's peak");
    }
    r.peak_reserved = s.peak_reserved_bytes;
    r.peak_in_use = s.peak_in_use_bytes;
    r.hits = s.hits;
    r.misses = s.misses;
    r.growth_count = s.growth_count;
    r.growth_ms = std::chrono::duration<double, std::milli>(s.growth_time).count();
    return r;
}

} // namespace bench
