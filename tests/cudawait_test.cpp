// SPDX-License-Identifier: Apache-2.0
// The umbrella header on its own: nothing but <cudawait/cudawait.hpp> (and GoogleTest) is
// included here, so the runtime's typed C++ overloads used below must come through it.
#include <cudawait/cudawait.hpp>

#include <cstddef>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

namespace {

TEST(cudawait, the_umbrella_brings_the_typed_runtime_api) {
    constexpr std::size_t n = 4099;
    float* device = nullptr;
    const cudaError_t st = cudaMalloc(&device, n * sizeof(float)); // the float** overload
    if (const std::string why = cudawait::no_device_reason(); !why.empty()) {
        EXPECT_NE(st, cudaSuccess);
        (void)cudaGetLastError();
        GTEST_SKIP() << why;
    }
    ASSERT_EQ(st, cudaSuccess);
    float* pinned = nullptr;
    ASSERT_EQ(cudaMallocHost(&pinned, n * sizeof(float)), cudaSuccess); // typed as well

    std::mt19937 rng(4099);
    std::uniform_real_distribution<float> dist(-1e6f, 1e6f);
    std::vector<float> want(n);
    for (float& v : want) {
        v = dist(rng);
    }
    for (std::size_t i = 0; i < n; ++i) {
        pinned[i] = want[i];
    }
    cudawait::stream s;
    cudawait::check(
        cudaMemcpyAsync(device, pinned, n * sizeof(float), cudaMemcpyHostToDevice, s.get()),
        "cudaMemcpyAsync");
    s.sync();
    for (std::size_t i = 0; i < n; ++i) {
        pinned[i] = -0.5f; // poison before the copy back
    }
    cudawait::check(
        cudaMemcpyAsync(pinned, device, n * sizeof(float), cudaMemcpyDeviceToHost, s.get()),
        "cudaMemcpyAsync");
    s.sync();
    std::size_t equal = 0;
    for (std::size_t i = 0; i < n; ++i) {
        equal += pinned[i] == want[i] ? 1 : 0;
    }
    EXPECT_EQ(equal, n);
    EXPECT_EQ(cudaFreeHost(pinned), cudaSuccess);
    EXPECT_EQ(cudaFree(device), cudaSuccess);
}

} // namespace
