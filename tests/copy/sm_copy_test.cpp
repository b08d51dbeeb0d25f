// SPDX-License-Identifier: Apache-2.0
// detail/sm_copy.hpp without a GPU: the PTX text the small-copy kernel is loaded from names the
// oldest target the kernel needs (sm_50) and assembles with the toolkit's ptxas for every GPU
// target it knows; which failures turn SM copies off. (On a GPU, copy_lane_test runs the kernel,
// and makes its loading fail.)
#include <cudawait/copy/detail/sm_copy.hpp>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <string>

#include <gtest/gtest.h>

namespace {

using cudawait::detail::sm_copy_load_failure;

TEST(sm_copy, the_ptx_names_the_kernel_and_an_old_isa_and_target) {
    const std::string ptx = cudawait::detail::sm_copy_ptx;
    EXPECT_NE(ptx.find(std::string(".visible .entry ") + cudawait::detail::sm_copy_kernel_name),
              std::string::npos);
    EXPECT_NE(ptx.find(".version 7.0"), std::string::npos) << "drivers of CUDA 11 and later";
    // PTX for .target sm_XY compiles for sm_MN with MN >= XY only: the kernel uses nothing
    // newer than sm_50 (as the watchdog's heartbeat), so it loads on every GPU a supported
    // toolkit knows.
    EXPECT_NE(ptx.find(".target sm_50\n"), std::string::npos);
    EXPECT_STREQ(cudawait::detail::g_sm_copy_ptx.load(), cudawait::detail::sm_copy_ptx);
}

#ifdef CUDAWAIT_TEST_PTXAS
/// Every plain GPU target (sm_XY, no a/f suffix) that `ptxas --help` lists as allowed.
std::set<std::string> ptxas_targets(const std::string& ptxas, const std::filesystem::path& out) {
    const std::string cmd = ptxas + " --help > " + out.string();
    EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
    std::ifstream in(out);
    const std::string help((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    std::set<std::string> targets;
    const std::regex sm("'(sm_[0-9]+)'");
    for (auto it = std::sregex_iterator(help.begin(), help.end(), sm); it != std::sregex_iterator();
         ++it) {
        targets.insert((*it)[1]);
    }
    return targets;
}
#endif

TEST(sm_copy, the_ptx_assembles_for_every_target_of_the_toolkit) {
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
    // From the oldest the toolkit can emit (sm_50 with CUDA 12, sm_75 with CUDA 13) to the
    // newest.
    const std::set<std::string> targets = ptxas_targets(ptxas.string(), file.string() + ".help");
    EXPECT_TRUE(targets.count("sm_90")) << "ptxas --help lists no sm_90";
    EXPECT_GE(targets.size(), 5u);
    for (const std::string& arch : targets) {
        SCOPED_TRACE(arch);
        const std::string cmd = ptxas.string() + " -arch=" + arch + " " + file.string() + " -o " +
                                file.string() + ".cubin";
        EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
    }
    std::filesystem::remove(file);
    std::filesystem::remove(file.string() + ".cubin");
    std::filesystem::remove(file.string() + ".help");
#endif
}

TEST(sm_copy, only_failures_to_load_the_code_turn_sm_copies_off) {
    // What the driver returns for PTX too new for the device (cudaErrorInvalidPtx) or the driver
    // (cudaErrorUnsupportedPtxVersion), no code for the device, no JIT.
    static_assert(sm_copy_load_failure(cudaErrorNoKernelImageForDevice));
    static_assert(sm_copy_load_failure(cudaErrorInvalidKernelImage));
    static_assert(sm_copy_load_failure(cudaErrorInvalidPtx));
    static_assert(sm_copy_load_failure(cudaErrorUnsupportedPtxVersion));
    static_assert(sm_copy_load_failure(cudaErrorJitCompilerNotFound));
    static_assert(sm_copy_load_failure(cudaErrorJitCompilationDisabled));
    // Everything else surfaces: sticky errors, no device, a bad launch, a lost context.
    for (cudaError_t e :
         {cudaSuccess, cudaErrorIllegalAddress, cudaErrorLaunchFailure, cudaErrorNoDevice,
          cudaErrorInsufficientDriver, cudaErrorInvalidValue, cudaErrorInvalidDeviceFunction,
          cudaErrorMemoryAllocation, cudaErrorIllegalInstruction, cudaErrorDevicesUnavailable}) {
        EXPECT_FALSE(sm_copy_load_failure(e)) << cudaGetErrorName(e);
        EXPECT_TRUE(!cudawait::is_sticky(e) || !sm_copy_load_failure(e)) << cudaGetErrorName(e);
    }
}

} // namespace
