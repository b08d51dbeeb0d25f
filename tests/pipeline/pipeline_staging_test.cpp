// SPDX-License-Identifier: Apache-2.0
// detail/pipeline_staging.hpp without a GPU: the signal through which the stage workers hand
// finished copies to the loop thread.
#include <cudawait/pipeline/detail/staging.hpp>

#include <cstddef>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

namespace {

using cudawait::detail::staging_signal;

// A worker counts its copy finished only after it queued it for take(): for a moment no copy
// is outstanding while one is still to be taken. A staged batch that looked only at
// outstanding() then concluded that chunks on the GPU held every buffer and, with none in
// flight, stopped with a logic_error; unsettled() covers that moment.
TEST(staging_signal, a_finished_copy_stays_unsettled_until_it_is_taken) {
    staging_signal sig;
    EXPECT_FALSE(sig.unsettled());
    auto first = sig.expect(7);
    auto second = sig.expect(10);
    EXPECT_EQ(sig.outstanding(), 2u);
    EXPECT_TRUE(sig.unsettled());
    std::thread worker([&] { first(); });
    worker.join();
    EXPECT_EQ(sig.outstanding(), 1u);
    std::vector<staging_signal::finished> got;
    sig.take(got);
    ASSERT_EQ(got.size(), 1u);
    EXPECT_EQ(got[0].token, 7u);
    EXPECT_TRUE(sig.unsettled()) << "the second copy still runs";
    std::thread last([&] { second(); });
    last.join();
    EXPECT_EQ(sig.outstanding(), 0u);
    EXPECT_TRUE(sig.unsettled()) << "finished, and not taken yet";
    got.clear();
    sig.take(got);
    ASSERT_EQ(got.size(), 1u);
    EXPECT_EQ(got[0].token, 10u);
    EXPECT_FALSE(sig.unsettled());
}

} // namespace
