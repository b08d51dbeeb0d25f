// SPDX-License-Identifier: Apache-2.0
// A program of two files that include trace.hpp, this one with the NVTX3 headers and
// without_nvtx.cpp with CUDAWAIT_DISABLE_NVTX defined. Both use the ranges' inline constructors
// and destructors, so the linker keeps one file's copies for both. g++ builds it with -flto
// -Wodr -Werror (tests/CMakeLists.txt): the link fails where the switch changes a type. The
// tests check what it must not change at run time: the layout, and that every range the tool
// sees opened is closed by the matching call, whichever file opened or closed it.

// The recorder first: it defines NVTX's static-injection hook (see nvtx_recorder.hpp).
#include "nvtx_recorder.hpp"
// The rest.
#include <cudawait/observe/trace.hpp>

#include <memory>
#include <set>
#include <string>
#include <vector>

#include "both_files.hpp"
#include <gtest/gtest.h>

namespace cudawait::trace_odr {

layout layout_with_nvtx() {
    return {sizeof(trace_range), alignof(trace_range), sizeof(trace_async_range),
            alignof(trace_async_range), CUDAWAIT_HAS_NVTX != 0};
}

namespace {

using cudawait::testing::nvtx_range;
using cudawait::testing::nvtx_recorder;

std::multiset<std::string> messages(const std::vector<nvtx_range>& v) {
    std::multiset<std::string> m;
    for (const auto& r : v) {
        m.insert(r.message);
    }
    return m;
}

TEST(trace_odr, the_switch_leaves_the_ranges_layout_alone) {
    const layout on = layout_with_nvtx();
    const layout off = layout_without_nvtx();
    ASSERT_TRUE(on.has_nvtx) << "the toolkit's NVTX3 headers are on the include path";
    ASSERT_FALSE(off.has_nvtx);
    EXPECT_EQ(on.range_size, off.range_size);
    EXPECT_EQ(on.range_align, off.range_align);
    EXPECT_EQ(on.async_range_size, off.async_range_size);
    EXPECT_EQ(on.async_range_align, off.async_range_align);
}

class trace_odr_ranges : public ::testing::Test {
protected:
    void SetUp() override {
        { trace_range first("first", 0); } // NVTX initialises its tool on the first call
        if (!recorder().installed()) {
            GTEST_SKIP() << "another NVTX tool (a profiler's injection) took precedence";
        }
        recorder().clear();
    }
    void TearDown() override {
        if (IsSkipped()) {
            return;
        }
        EXPECT_EQ(recorder().errors(), std::vector<std::string>{});
        EXPECT_EQ(recorder().open_push_count(), 0u) << "push ranges left open";
        EXPECT_TRUE(recorder().open_starts().empty()) << "start ranges left open";
    }
    static nvtx_recorder& recorder() { return nvtx_recorder::instance(); }
};

// The program includes NVTX (this file), so the ranges of the file that compiled it out reach
// the tool as well, each closed by its own pop or end.
TEST_F(trace_odr_ranges, ranges_of_the_file_without_nvtx_are_traced_like_the_others) {
    {
        trace_range r("with nvtx", 1);
        ranges_without_nvtx(10);
        trace_async_range a("with nvtx async", 2);
    }
    auto closed = recorder().closed();
    EXPECT_EQ(messages(closed),
              (std::multiset<std::string>{"with nvtx", "with nvtx async", "without nvtx",
                                          "without nvtx async", "without nvtx heap"}));
    for (const nvtx_range& r : closed) {
        EXPECT_EQ(r.domain, "cudawait") << r.message;
        EXPECT_EQ(r.push_pop, r.message == "with nvtx" || r.message == "without nvtx") << r.message;
    }
}

TEST_F(trace_odr_ranges, a_range_started_in_one_file_ends_in_the_other) {
    auto here = std::make_unique<trace_async_range>("started with nvtx", 20);
    auto there = start_without_nvtx(21);
    end_without_nvtx(std::move(here));
    there.reset();
    auto closed = recorder().closed();
    ASSERT_EQ(closed.size(), 2u);
    EXPECT_EQ(closed[0].message, "started with nvtx");
    EXPECT_EQ(closed[0].payload, 20u);
    EXPECT_EQ(closed[1].message, "started without nvtx");
    EXPECT_EQ(closed[1].payload, 21u);
}

} // namespace
} // namespace cudawait::trace_odr
