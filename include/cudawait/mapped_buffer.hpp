// SPDX-License-Identifier: Apache-2.0
#pragma once

// Synopsis
//   mapped_buffer<int> flags(4);           zero-copy host memory every device can address
//   kernel<<<...>>>(flags.device_data());  the kernel reads and writes host memory directly
//   std::atomic_ref<int>(flags[0]).load(std::memory_order_acquire)   host side
//
// For flags, counters and control words: small data touched often by both sides. Each device
// access crosses the bus, so bulk data belongs in device memory and pinned_pool buffers.

#include <cudawait/error.hpp>
#include <cudawait/memory_kind.hpp>

#include <cstddef>
#include <cstring>
#include <source_location>
#include <span>
#include <type_traits>
#include <utility>

#include <cuda_runtime_api.h>

namespace cudawait {

/// `count` elements of mapped, portable, page-locked host memory, zero-initialised.
template <class T>
class mapped_buffer {
    static_assert(std::is_trivially_copyable_v<T>, "mapped_buffer holds trivially copyable types");

public:
    using value_type = T;
    /// Where the elements live (copy asks the type instead of the driver).
    static constexpr memory_kind memory = memory_kind::pinned;

    mapped_buffer() noexcept = default;

    /// @throws usage_error for a zero count; cuda_error
    explicit mapped_buffer(std::size_t count,
                           std::source_location where = std::source_location::current()) {
        if (count == 0) {
            throw usage_error("mapped_buffer: zero elements requested");
        }
        if (count > std::size_t(-1) / sizeof(T)) {
            throw usage_error("mapped_buffer: element count overflows the byte size");
        }
        void* p = nullptr;
        check(cudaHostAlloc(&p, count * sizeof(T), cudaHostAllocMapped | cudaHostAllocPortable),
              "cudaHostAlloc", where);
        void* d = nullptr;
        cudaError_t st = cudaHostGetDevicePointer(&d, p, 0);
        if (st != cudaSuccess) {
            detail::report(cudaFreeHost(p), "cudaFreeHost");
            check(st, "cudaHostGetDevicePointer", where);
        }
        std::memset(p, 0, count * sizeof(T));
        m_host = static_cast<T*>(p);
        m_device = static_cast<T*>(d);
        m_count = count;
    }

    mapped_buffer(mapped_buffer&& other) noexcept
        : m_host(std::exchange(other.m_host, nullptr)),
          m_device(std::exchange(other.m_device, nullptr)),
          m_count(std::exchange(other.m_count, 0)) {}
    mapped_buffer& operator=(mapped_buffer&& other) noexcept {
        if (this != &other) {
            reset();
            m_host = std::exchange(other.m_host, nullptr);
            m_device = std::exchange(other.m_device, nullptr);
            m_count = std::exchange(other.m_count, 0);
        }
        return *this;
    }
    mapped_buffer(const mapped_buffer&) = delete;
    mapped_buffer& operator=(const mapped_buffer&) = delete;
    ~mapped_buffer() { reset(); }

    /// Frees now. Kernels that still access the memory must have finished.
    void reset() noexcept {
        if (m_host != nullptr) {
            detail::report(cudaFreeHost(m_host), "cudaFreeHost");
            m_host = m_device = nullptr;
            m_count = 0;
        }
    }

    /// The host address. @throws usage_error on an empty buffer
    [[nodiscard]] T* data() const {
        if (m_host == nullptr) {
            throw usage_error("mapped_buffer: use of an empty or moved-from buffer");
        }
        return m_host;
    }
    /// The address kernels use. @throws usage_error on an empty buffer
    [[nodiscard]] T* device_data() const {
        if (m_device == nullptr) {
            throw usage_error("mapped_buffer: use of an empty or moved-from buffer");
        }
        return m_device;
    }
    [[nodiscard]] std::size_t size() const noexcept { return m_count; }
    [[nodiscard]] std::size_t size_bytes() const noexcept { return m_count * sizeof(T); }
    [[nodiscard]] bool empty() const noexcept { return m_count == 0; }
    [[nodiscard]] explicit operator bool() const noexcept { return m_host != nullptr; }

    [[nodiscard]] std::span<T> span() const { return {data(), m_count}; }
    [[nodiscard]] std::span<T> device_span() const { return {device_data(), m_count}; }
    [[nodiscard]] T* begin() const { return data(); }
    [[nodiscard]] T* end() const { return data() + m_count; }
    [[nodiscard]] T& operator[](std::size_t i) const { return m_host[i]; }

private:
    T* m_host = nullptr;
    T* m_device = nullptr;
    std::size_t m_count = 0;
};

} // namespace cudawait
