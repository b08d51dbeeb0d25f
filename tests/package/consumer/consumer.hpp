// SPDX-License-Identifier: Apache-2.0
#pragma once

// The one program every packaging test builds (tests/package/CMakeLists.txt): through
// find_package, through add_subdirectory and from a vendored copy of include/, each time once
// by the host C++ compiler (consumer.cpp) and once by nvcc (consumer.cu).
//
// It needs nothing but the public headers and libcudart, runs without a GPU (the GPU part is
// then skipped) and exits non-zero on any wrong result. Build it with
// -DCONSUMER_EXPECTED_VERSION="<major.minor.patch>": the version the build system believes it
// packaged, which the headers found must agree with.

#include <cudawait/cudawait.hpp>

#include <cstddef>
#include <cstdio>
#include <exception>
#include <string_view>
#include <vector>

#include <cuda_runtime_api.h>

#ifndef CONSUMER_EXPECTED_VERSION
#error "build the consumer with -DCONSUMER_EXPECTED_VERSION=\"<major.minor.patch>\""
#endif

namespace consumer {

inline cudawait::task<int> add(int a, int b) { co_return a + b; }

/// (1 + 2) + (20 + 22), the two inner sums computed by concurrent child tasks.
inline cudawait::task<int> sum_of_sums() {
    auto [a, b] = co_await cudawait::when_all(add(1, 2), add(20, 22));
    co_return a + b;
}

/// Extra device work a flavour adds on the filled buffer (the .cu launches a kernel).
using gpu_step = cudawait::task<bool> (*)(cudawait::stream&, unsigned char* device_bytes,
                                          std::size_t size);

inline constexpr unsigned char fill_byte = 0x5a;

/// Copies `size` bytes back from the device (awaiting the stream) and checks each is `want`.
inline cudawait::task<bool> device_bytes_equal(cudawait::stream& s, const unsigned char* bytes,
                                               std::size_t size, unsigned char want) {
    std::vector<unsigned char> host(size);
    cudawait::check(cudaMemcpyAsync(host.data(), bytes, size, cudaMemcpyDeviceToHost, s.get()),
                    "cudaMemcpyAsync");
    co_await s;
    for (unsigned char b : host) {
        if (b != want) {
            co_return false;
        }
    }
    co_return true;
}

/// Fills device memory asynchronously on `s`, awaits the stream, checks the bytes, then runs
/// `extra` (if any) on the same buffer.
inline cudawait::task<bool> gpu_roundtrip(cudawait::stream& s, gpu_step extra) {
    constexpr std::size_t size = std::size_t{1} << 16;
    void* raw = nullptr;
    cudawait::check(cudaMalloc(&raw, size), "cudaMalloc");
    struct device_buffer {
        void* p;
        ~device_buffer() { (void)cudaFree(p); }
    } owner{raw};
    auto* bytes = static_cast<unsigned char*>(raw);

    cudawait::check(cudaMemsetAsync(bytes, fill_byte, size, s.get()), "cudaMemsetAsync");
    co_await s;
    if (!co_await device_bytes_equal(s, bytes, size, fill_byte)) {
        std::fprintf(stderr, "device memory does not hold the bytes cudaMemsetAsync wrote\n");
        co_return false;
    }
    if (extra != nullptr) {
        co_return co_await extra(s, bytes, size);
    }
    co_return true;
}

/// The whole program; `flavour` names the build in the output.
inline int run(const char* flavour, gpu_step extra = nullptr) {
    try {
        if (std::string_view(cudawait::version_string) != CONSUMER_EXPECTED_VERSION) {
            std::fprintf(stderr, "[%s] headers say cudawait %s, the package says %s\n", flavour,
                         cudawait::version_string, CONSUMER_EXPECTED_VERSION);
            return 1;
        }
        cudawait::scheduler sched;
        const int sum = cudawait::sync_wait(sched, sum_of_sums());
        if (sum != 45) {
            std::fprintf(stderr, "[%s] when_all of two tasks gave %d, expected 45\n", flavour, sum);
            return 1;
        }
        std::printf("cudawait %s consumer ok [%s]\n", cudawait::version_string, flavour);

        if (cudawait::try_device_count() <= 0) {
            std::printf("[%s] no CUDA device or driver: GPU part skipped\n", flavour);
            return 0;
        }
        cudawait::stream s{cudawait::device_ref(0)};
        if (!cudawait::sync_wait(sched, gpu_roundtrip(s, extra))) {
            std::fprintf(stderr, "[%s] GPU part failed\n", flavour);
            return 1;
        }
        std::printf("[%s] GPU part ok\n", flavour);
        return 0;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "[%s] failed: %s\n", flavour, e.what());
        return 1;
    }
}

} // namespace consumer
