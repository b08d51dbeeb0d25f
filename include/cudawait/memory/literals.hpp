// SPDX-License-Identifier: Apache-2.0
#pragma once

// Synopsis
//   using namespace cudawait::literals;
//   std::size_t n = 64_MiB;              also _KiB and _GiB: byte counts as std::size_t

#include <cstddef>

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

} // namespace cudawait
