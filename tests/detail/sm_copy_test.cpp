// SPDX-License-Identifier: Apache-2.0
// detail/sm_copy.hpp without a GPU: the PTX text the small-copy kernel is loaded from assembles
// with the toolkit's ptxas for the oldest target it names and for sm_90. (On a GPU,
// copy_lane_test runs the kernel.)
#include <cudawait/detail/sm_copy.hpp>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>

#include <gtest/gtest.h>

namespace {

TEST(sm_copy, the_ptx_names_the_kernel_and_an_old_isa) {
    const std::string ptx = cudawait::detail::sm_copy_ptx;
    EXPECT_NE(ptx.find(std::string(".visible .entry ") + cudawait::detail::sm_copy_kernel_name),
              std::string::npos);
    EXPECT_NE(ptx.find(".version 7.0"), std::string::npos) << "drivers of CUDA 11 and later";
    EXPECT_NE(ptx.find(".target sm_75"), std::string::npos);
}

TEST(sm_copy, the_ptx_assembles) {
#ifndef CUDAWAIT_TEST_PTXAS
    GTEST_SKIP() << "no ptxas path given to the build";
#else
    const std::filesystem::path ptxas = CUDAWAIT_TEST_PTXAS;
    if (!std::filesystem::exists(ptxas)) {
        GTEST_SKIP() << ptxas << " not found";
    }
    const auto file = std::filesystem::temp_directory_path() /
                      ("cudawait_sm_copy_" +
                       std::to_string(::testing::UnitTest::GetInstance()->random_seed()) + ".ptx");
    {
        std::ofstream out(file);
        out << cudawait::detail::sm_copy_ptx;
    }
    for (const char* arch : {"sm_75", "sm_90"}) {
        SCOPED_TRACE(arch);
        const std::string cmd = ptxas.string() + " -arch=" + arch + " " + file.string() + " -o " +
                                file.string() + ".cubin";
        EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
    }
    std::filesystem::remove(file);
    std::filesystem::remove(file.string() + ".cubin");
#endif
}

} // namespace
