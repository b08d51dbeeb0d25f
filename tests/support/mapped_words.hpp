// SPDX-License-Identifier: Apache-2.0
#pragma once

// Mapped, page-locked words that kernels write and the host reads while the kernel may still run
// (the scheduler and timeout tests watch GPU work progress through them). They start poisoned.

#include <cudawait/runtime/error.hpp>

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

namespace cudawait::testing {

struct mapped_words {
    static constexpr std::uint32_t poison = 0xBADC0DEu;

    explicit mapped_words(std::size_t n) : count(n) {
        check(cudaHostAlloc(&host, n * sizeof(std::uint32_t), cudaHostAllocMapped),
              "cudaHostAlloc");
        check(cudaHostGetDevicePointer(&device, host, 0), "cudaHostGetDevicePointer");
        for (std::size_t i = 0; i < n; ++i) {
            host[i] = poison;
        }
    }
    mapped_words(const mapped_words&) = delete;
    mapped_words& operator=(const mapped_words&) = delete;
    ~mapped_words() { cudawait::detail::report(cudaFreeHost(host), "cudaFreeHost"); }

    /// Reads word `i` as the GPU left it (volatile: a kernel may write it while the host polls).
    [[nodiscard]] std::uint32_t read(std::size_t i) const {
        return reinterpret_cast<volatile std::uint32_t*>(host)[i];
    }
    /// Writes word `i` so that a kernel polling it sees the store.
    void write(std::size_t i, std::uint32_t v) {
        reinterpret_cast<volatile std::uint32_t*>(host)[i] = v;
    }

    std::uint32_t* host = nullptr;
    std::uint32_t* device = nullptr;
    std::size_t count;
};

} // namespace cudawait::testing
