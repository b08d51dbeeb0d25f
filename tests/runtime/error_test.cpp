// SPDX-License-Identifier: Apache-2.0
#include <cudawait/runtime/error.hpp>

#include <chrono>
#include <cstring>
#include <source_location>
#include <stdexcept>
#include <string>
#include <type_traits>

#include <cuda_runtime.h>

#include <gtest/gtest.h>

namespace {

using cudawait::check;
using cudawait::cuda_error;
using cudawait::is_sticky;
using cudawait::timeout_error;
using cudawait::usage_error;

TEST(error, types_derive_from_standard_exceptions) {
    static_assert(std::is_base_of_v<std::runtime_error, cuda_error>);
    static_assert(std::is_base_of_v<std::runtime_error, timeout_error>);
    static_assert(std::is_base_of_v<std::logic_error, usage_error>);
}

TEST(error, check_passes_success_through) {
    EXPECT_NO_THROW(check(cudaSuccess, "cudaMemcpyAsync"));
}

TEST(error, check_throws_with_status_api_and_call_site) {
    const auto here = std::source_location::current();
    try {
        check(cudaErrorInvalidValue, "cudaMemcpyAsync");
        FAIL() << "check did not throw";
    } catch (const cuda_error& e) {
        EXPECT_EQ(e.status(), cudaErrorInvalidValue);
        EXPECT_STREQ(e.api(), "cudaMemcpyAsync");
        EXPECT_EQ(e.where().line(), here.line() + 2);
        EXPECT_STREQ(e.where().file_name(), here.file_name());
        EXPECT_FALSE(e.sticky());
        const std::string what = e.what();
        EXPECT_NE(what.find("cudaMemcpyAsync"), std::string::npos) << what;
        EXPECT_NE(what.find("cudaErrorInvalidValue"), std::string::npos) << what;
        EXPECT_NE(what.find("error_test.cpp"), std::string::npos) << what;
        EXPECT_EQ(what.find("sticky"), std::string::npos) << what;
    }
}

TEST(error, explicit_call_site_is_kept) {
    const auto site = std::source_location::current();
    cuda_error e(cudaErrorNotReady, "cudaEventQuery", site);
    EXPECT_EQ(e.where().line(), site.line());
    EXPECT_EQ(e.status(), cudaErrorNotReady);
}

TEST(error, sticky_statuses_are_classified) {
    for (cudaError_t st :
         {cudaErrorIllegalAddress, cudaErrorLaunchFailure, cudaErrorAssert,
          cudaErrorHardwareStackError, cudaErrorIllegalInstruction, cudaErrorMisalignedAddress,
          cudaErrorInvalidAddressSpace, cudaErrorInvalidPc, cudaErrorLaunchTimeout}) {
        EXPECT_TRUE(is_sticky(st)) << cudaGetErrorName(st);
        cuda_error e(st, "cudaEventQuery");
        EXPECT_TRUE(e.sticky());
        EXPECT_NE(std::string(e.what()).find("sticky"), std::string::npos);
    }
    for (cudaError_t st : {cudaSuccess, cudaErrorNotReady, cudaErrorInvalidValue,
                           cudaErrorMemoryAllocation, cudaErrorInvalidDevice, cudaErrorNoDevice,
                           cudaErrorInsufficientDriver, cudaErrorLaunchOutOfResources}) {
        EXPECT_FALSE(is_sticky(st)) << cudaGetErrorName(st);
    }
    static_assert(is_sticky(cudaErrorIllegalAddress), "usable in constant expressions");
}

TEST(error, null_api_name_is_tolerated) {
    cuda_error e(cudaErrorInvalidValue, nullptr);
    EXPECT_STREQ(e.api(), "CUDA call");
}

TEST(error, timeout_error_reports_its_duration) {
    timeout_error e(std::chrono::milliseconds(250));
    EXPECT_EQ(e.after(), std::chrono::milliseconds(250));
    EXPECT_NE(std::string(e.what()).find("250000000"), std::string::npos) << e.what();
}

TEST(error, check_clears_the_runtime_last_error) {
    // Provoke a non-sticky error in the runtime (works with or without a driver), then check it.
    void* p = nullptr;
    cudaError_t st = cudaMalloc(&p, static_cast<std::size_t>(-1));
    ASSERT_NE(st, cudaSuccess);
    EXPECT_THROW(check(st, "cudaMalloc"), cuda_error);
    if (st != cudaErrorInsufficientDriver && st != cudaErrorNoDevice) {
        // With a device, the failed allocation's error must not linger for the next caller.
        EXPECT_EQ(cudaGetLastError(), cudaSuccess);
    }
}

} // namespace
