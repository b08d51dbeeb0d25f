// SPDX-License-Identifier: Apache-2.0
#include <cudawait/trace.hpp>

#include <type_traits>

#include <gtest/gtest.h>

namespace {

static_assert(!std::is_copy_constructible_v<cudawait::trace_range>);

// Without a profiler attached the ranges are no-ops; they must nest and unwind cleanly, on any
// thread, with or without NVTX compiled in.
TEST(trace_range, nests_and_unwinds) {
    int depth = 0;
    {
        cudawait::trace_range outer("outer", 1);
        ++depth;
        for (std::size_t i = 0; i < 1000; ++i) {
            cudawait::trace_range inner("inner", i);
            ++depth;
            --depth;
        }
        --depth;
    }
    EXPECT_EQ(depth, 0);
    EXPECT_EQ(CUDAWAIT_HAS_NVTX, 1) << "the toolkit's NVTX3 headers are on the include path";
}

} // namespace
