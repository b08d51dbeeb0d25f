// SPDX-License-Identifier: Apache-2.0
#include <cudawait/detail/parallel_memcpy.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

#include <gtest/gtest.h>

namespace {

std::vector<std::uint8_t> random_bytes(std::size_t n, std::uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::vector<std::uint8_t> v(n);
    for (auto& b : v) {
        b = static_cast<std::uint8_t>(rng());
    }
    return v;
}

} // namespace

// Sizes that do not split evenly: with 5 parts of 5 MiB + 3 bytes, rounding each part down to
// n / parts left the last 3 bytes uncopied. Several thread counts, so the split is exercised
// whatever the machine's core count.
TEST(memcpy_workers, every_byte_arrives_for_any_split) {
    constexpr std::size_t MiB = std::size_t{1} << 20;
    for (unsigned threads : {1u, 2u, 3u, 5u, 8u}) {
        cudawait::detail::memcpy_workers workers(threads);
        for (std::size_t n : {std::size_t{1}, std::size_t{4099}, MiB, 2 * MiB + 1, 5 * MiB + 3,
                              7 * MiB + 4095, 8 * MiB, 9 * MiB + 17}) {
            SCOPED_TRACE(testing::Message() << threads << " threads, " << n << " bytes");
            auto src = random_bytes(n, n * 31 + threads);
            // Guard bytes on both sides catch a part that runs past the end.
            std::vector<std::uint8_t> dst(n + 2 * 4096, 0xa5);
            workers.copy(dst.data() + 4096, src.data(), n);
            for (std::size_t i = 0; i < 4096; ++i) {
                ASSERT_EQ(dst[i], 0xa5) << "written before the start at " << i;
                ASSERT_EQ(dst[4096 + n + i], 0xa5) << "written past the end at " << i;
            }
            ASSERT_TRUE(std::equal(src.begin(), src.end(), dst.begin() + 4096));
        }
    }
}

TEST(memcpy_workers, parts_cover_the_whole_copy) {
    using cudawait::detail::memcpy_workers;
    for (std::size_t parts = 2; parts <= 8; ++parts) {
        for (std::size_t n : {parts << 20, (parts << 20) + 1, (parts << 20) + parts - 1,
                              (std::size_t{5} << 20) + 3, std::size_t{1} << 30}) {
            std::size_t per = memcpy_workers::part_bytes(n, parts);
            EXPECT_GE(per * parts, n) << parts << " parts of " << n;
            EXPECT_LT(per * (parts - 1), n) << "the last part is empty: " << parts << ", " << n;
            EXPECT_EQ(per % 4096, 0u);
        }
    }
}
