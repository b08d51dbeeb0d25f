// SPDX-License-Identifier: Apache-2.0
#pragma once

// Synopsis
//   device_buffer<float> d(n, stream);     cudaMallocAsync on `stream` (stream-ordered)
//   std::span<float> s = d.span();         device memory: hand it to kernels and copies
//   d.set_stream(other);                   free on `other` instead
//
// Move-only; freed with cudaFreeAsync on its stream, so the memory is reused only after work
// already enqueued on that stream. Work on other streams that uses the buffer must be ordered
// before the free (an event the freeing stream waits on), as with cudaFreeAsync itself.

#include <cudawait/device.hpp>
#include <cudawait/error.hpp>
#include <cudawait/memory_kind.hpp>
#include <cudawait/stream.hpp>

#include <cstddef>
#include <cstdio>
#include <source_location>
#include <span>
#include <type_traits>
#include <utility>

#include <cuda_runtime_api.h>

namespace cudawait {

/// `count` uninitialised elements of device memory, allocated and freed in stream order.
template <class T>
class device_buffer {
    static_assert(std::is_trivially_copyable_v<T>, "device_buffer holds trivially copyable types");

public:
    using value_type = T;
    /// Where the elements live (copy asks the type instead of the driver).
    static constexpr memory_kind memory = memory_kind::device;

    device_buffer() noexcept = default;

    /// Allocates on `s`'s device, ordered after the work enqueued on `s`.
    /// @throws usage_error for a zero count; cuda_error (cudaErrorMemoryAllocation when full)
    device_buffer(std::size_t count, stream_ref s,
                  std::source_location where = std::source_location::current())
        : m_stream(s) {
        if (count == 0) {
            throw usage_error("device_buffer: zero elements requested");
        }
        if (count > std::size_t(-1) / sizeof(T)) {
            throw usage_error("device_buffer: element count overflows the byte size");
        }
        device_guard guard(device_ref(s.device(where), where), where);
        void* p = nullptr;
        check(cudaMallocAsync(&p, count * sizeof(T), s.get()), "cudaMallocAsync", where);
        m_data = static_cast<T*>(p);
        m_count = count;
    }

    device_buffer(device_buffer&& other) noexcept
        : m_stream(other.m_stream), m_data(std::exchange(other.m_data, nullptr)),
          m_count(std::exchange(other.m_count, 0)) {}
    device_buffer& operator=(device_buffer&& other) noexcept {
        if (this != &other) {
            reset();
            m_stream = other.m_stream;
            m_data = std::exchange(other.m_data, nullptr);
            m_count = std::exchange(other.m_count, 0);
        }
        return *this;
    }
    device_buffer(const device_buffer&) = delete;
    device_buffer& operator=(const device_buffer&) = delete;
    ~device_buffer() { reset(); }

    /// Frees now, in the order of the buffer's stream; the buffer becomes empty.
    void reset() noexcept {
        if (m_data != nullptr) {
            detail::report(cudaFreeAsync(m_data, m_stream.get()), "cudaFreeAsync");
            m_data = nullptr;
            m_count = 0;
        }
    }

    /// The stream the memory is freed on.
    [[nodiscard]] stream_ref stream() const noexcept { return m_stream; }
    /// Frees on `s` from now on (it must be on the same device).
    void set_stream(stream_ref s) noexcept { m_stream = s; }

    /// @throws usage_error on an empty (moved-from) buffer
    [[nodiscard]] T* data() const {
        if (m_data == nullptr) {
            throw usage_error("device_buffer: use of an empty or moved-from buffer");
        }
        return m_data;
    }
    [[nodiscard]] std::size_t size() const noexcept { return m_count; }
    [[nodiscard]] std::size_t size_bytes() const noexcept { return m_count * sizeof(T); }
    [[nodiscard]] bool empty() const noexcept { return m_count == 0; }
    [[nodiscard]] explicit operator bool() const noexcept { return m_data != nullptr; }

    /// A span over device memory: for kernels and copies, not for host access.
    [[nodiscard]] std::span<T> span() const { return {data(), m_count}; }
    [[nodiscard]] T* begin() const { return data(); }
    [[nodiscard]] T* end() const { return data() + m_count; }

private:
    stream_ref m_stream{cudaStreamPerThread};
    T* m_data = nullptr;
    std::size_t m_count = 0;
};

} // namespace cudawait
