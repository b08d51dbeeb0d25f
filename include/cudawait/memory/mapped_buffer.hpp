// SPDX-License-Identifier: Apache-2.0
#pragma once

// Synopsis
//   mapped_buffer<int> flags(4);           zero-copy host memory every device can address
//   kernel<<<...>>>(flags.device_data());  the kernel reads and writes host memory directly
//   std::atomic_ref<int>(flags[0]).load(std::memory_order_acquire)   host side
//
// For flags, counters and control words: small data touched often by both sides. Each device
// access crosses the bus, so bulk data belongs in device memory and pinned_pool buffers.
// On an empty (default-constructed, moved-from or reset) buffer, data(), device_data(), the spans,
// begin(), end() and operator[] throw usage_error.

#include <cudawait/memory/detail/typed_allocation.hpp>
#include <cudawait/memory/memory_kind.hpp>
#include <cudawait/runtime/error.hpp>

#include <cstddef>
#include <cstring>
#include <source_location>
#include <span>
#include <type_traits>

#include <cuda_runtime_api.h>

namespace cudawait {

namespace detail {
/// How a mapped_buffer frees its memory (cudaFreeHost), and the address kernels use for it.
template <class T>
struct mapped_release {
    static constexpr const char* name = "mapped_buffer";
    T* device = nullptr;

    void operator()(void* host) const noexcept {
        detail::report(cudaFreeHost(host), "cudaFreeHost");
    }
};
} // namespace detail

/// `count` elements of mapped, portable, page-locked host memory, zero-initialised.
///
/// data() (the host address), size(), span(), begin(), end(), operator[] and the moves:
/// detail::typed_allocation.
template <class T>
class mapped_buffer : public detail::typed_allocation<T, detail::mapped_release<T>> {
    static_assert(std::is_trivially_copyable_v<T>, "mapped_buffer holds trivially copyable types");
    using base = detail::typed_allocation<T, detail::mapped_release<T>>;

public:
    /// Where the elements live (copy asks the type instead of the driver).
    static constexpr memory_kind memory = memory_kind::pinned;

    mapped_buffer() noexcept = default;

    /// @throws usage_error for a zero count; cuda_error
    explicit mapped_buffer(std::size_t count,
                           std::source_location where = std::source_location::current()) {
        std::size_t bytes = base::checked_bytes(count);
        void* p = nullptr;
        check(cudaHostAlloc(&p, bytes, cudaHostAllocMapped | cudaHostAllocPortable),
              "cudaHostAlloc", where);
        void* d = nullptr;
        cudaError_t st = cudaHostGetDevicePointer(&d, p, 0);
        if (st != cudaSuccess) {
            detail::report(cudaFreeHost(p), "cudaFreeHost");
            check(st, "cudaHostGetDevicePointer", where);
        }
        std::memset(p, 0, bytes);
        this->adopt(static_cast<T*>(p), count, detail::mapped_release<T>{static_cast<T*>(d)});
    }

    /// Frees now. Kernels that still access the memory must have finished.
    using base::reset;

    /// The address kernels use. @throws usage_error on an empty buffer
    [[nodiscard]] T* device_data() const {
        this->throw_if_empty();
        return this->release_fn().device;
    }
    /// @throws usage_error on an empty buffer
    [[nodiscard]] std::span<T> device_span() const { return {device_data(), this->size()}; }
};

} // namespace cudawait
