// SPDX-License-Identifier: Apache-2.0
#include <cudawait/copy/detail/parallel_memcpy.hpp>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "random_words.hpp"
#include <gtest/gtest.h>

using cudawait::testing::random_bytes;

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

// copy_async: every byte arrives, done() runs once per copy (on a worker, or on the caller
// without workers), and several copies queued at once each complete.
TEST(memcpy_workers, copy_async_copies_every_byte_and_calls_done_once) {
    constexpr std::size_t MiB = std::size_t{1} << 20;
    for (unsigned threads : {1u, 2u, 5u, 9u}) {
        cudawait::detail::memcpy_workers workers(threads);
        const std::vector<std::size_t> sizes = {1, 4099, MiB, 3 * MiB + 5, 8 * MiB + 4095};
        std::vector<std::vector<std::uint8_t>> srcs;
        std::vector<std::vector<std::uint8_t>> dsts;
        for (std::size_t n : sizes) {
            srcs.push_back(random_bytes(n, n * 7 + threads));
            dsts.emplace_back(n + 2 * 4096, 0xa5);
        }
        std::mutex m;
        std::condition_variable cv;
        std::vector<int> calls(sizes.size(), 0);
        std::size_t finished = 0;
        for (std::size_t k = 0; k < sizes.size(); ++k) {
            workers.copy_async(dsts[k].data() + 4096, srcs[k].data(), sizes[k], [&, k] {
                std::lock_guard lock(m);
                ++calls[k];
                ++finished;
                cv.notify_all();
            });
        }
        {
            std::unique_lock lock(m);
            ASSERT_TRUE(cv.wait_for(lock, std::chrono::seconds(30), [&] {
                return finished == sizes.size();
            })) << "copies never completed";
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(5)); // a second call would show
        for (std::size_t k = 0; k < sizes.size(); ++k) {
            SCOPED_TRACE(testing::Message() << threads << " threads, " << sizes[k] << " bytes");
            EXPECT_EQ(calls[k], 1);
            for (std::size_t i = 0; i < 4096; ++i) {
                ASSERT_EQ(dsts[k][i], 0xa5) << "written before the start at " << i;
                ASSERT_EQ(dsts[k][4096 + sizes[k] + i], 0xa5) << "written past the end at " << i;
            }
            ASSERT_TRUE(std::equal(srcs[k].begin(), srcs[k].end(), dsts[k].begin() + 4096));
        }
    }
}

TEST(memcpy_workers, stage_sets_have_threads_of_their_own) {
    using cudawait::detail::memcpy_workers;
    memcpy_workers& in = memcpy_workers::stage_in_workers();
    memcpy_workers& out = memcpy_workers::stage_out_workers();
    EXPECT_NE(&in, &out);
    EXPECT_NE(&in, &memcpy_workers::instance());
    EXPECT_EQ(&in, &memcpy_workers::stage_in_workers());
    EXPECT_GE(memcpy_workers::stage_threads(), 1u);
    EXPECT_LE(memcpy_workers::stage_threads(), 16u);
    EXPECT_LE(in.workers(), memcpy_workers::stage_threads());
    EXPECT_LE(out.workers(), memcpy_workers::stage_threads());
}
