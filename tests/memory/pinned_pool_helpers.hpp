// SPDX-License-Identifier: Apache-2.0
// Byte checks the pinned_pool tests share (pinned_pool_test.cpp, pinned_pool_churn_test.cpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace cudawait::testing {

inline void fill(void* p, std::size_t n, std::uint8_t v) { std::memset(p, v, n); }
inline std::size_t heap_round(std::size_t n, std::size_t a) { return (n + a - 1) / a * a; }
// Every byte is v: the first is, and each equals the next (memcmp is fast in debug builds too).
inline bool all_equal(const void* p, std::size_t n, std::uint8_t v) {
    auto* b = static_cast<const std::uint8_t*>(p);
    return n == 0 || (b[0] == v && std::memcmp(b, b + 1, n - 1) == 0);
}

} // namespace cudawait::testing
