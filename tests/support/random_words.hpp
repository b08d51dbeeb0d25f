// SPDX-License-Identifier: Apache-2.0
#pragma once

// Random test data: n 32-bit words, or n bytes, from a seeded generator, the same for a seed on
// every run.

#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

namespace cudawait::testing {

inline std::vector<std::uint32_t> random_words(std::size_t n, std::uint64_t seed) {
    std::vector<std::uint32_t> v(n);
    std::mt19937_64 rng(seed);
    for (auto& x : v) {
        x = static_cast<std::uint32_t>(rng());
    }
    return v;
}

inline std::vector<std::uint8_t> random_bytes(std::size_t n, std::uint64_t seed) {
    std::vector<std::uint8_t> v(n);
    std::mt19937_64 rng(seed);
    for (auto& b : v) {
        b = static_cast<std::uint8_t>(rng());
    }
    return v;
}

} // namespace cudawait::testing
