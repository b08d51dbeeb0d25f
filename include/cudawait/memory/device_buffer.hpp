// SPDX-License-Identifier: Apache-2.0
#pragma once

// Synopsis
//   device_buffer<float> d(n, stream);     cudaMallocAsync on `stream` (stream-ordered)
//   device_buffer<float> d(n, stream, r);  from device_resource r (device_resource.hpp)
//   std::span<float> s = d.span();         device memory: hand it to kernels and copies
//   d.set_stream(other);                   free on `other` instead
//
// Move-only; freed on its stream, so work on other streams that uses the buffer must be ordered
// before the free, as with cudaFreeAsync. See docs/memory.md#buffers.

#include <cudawait/memory/detail/typed_allocation.hpp>
#include <cudawait/memory/device_resource.hpp>
#include <cudawait/memory/memory_kind.hpp>
#include <cudawait/runtime/device.hpp>
#include <cudawait/runtime/error.hpp>
#include <cudawait/runtime/stream.hpp>

#include <cstddef>
#include <source_location>
#include <span>
#include <type_traits>

#include <cuda_runtime_api.h>

namespace cudawait {

namespace detail {
/// How a device_buffer frees its memory: through its resource, in its stream's order.
struct stream_ordered_free {
    static constexpr const char* name = "device_buffer";
    stream_ref stream{cudaStreamPerThread};
    device_resource resource{};
    std::size_t bytes = 0;

    void operator()(void* data) const noexcept { resource.deallocate(data, bytes, stream); }
};
} // namespace detail

/// `count` uninitialised elements of device memory, allocated and freed in stream order.
///
/// data(), size(), span(), begin(), end() and the moves: detail::typed_allocation.
template <class T>
class device_buffer : public detail::typed_allocation<T, detail::stream_ordered_free> {
    static_assert(std::is_trivially_copyable_v<T>, "device_buffer holds trivially copyable types");
    using base = detail::typed_allocation<T, detail::stream_ordered_free>;

public:
    /// Where the elements live (copy asks the type instead of the driver).
    static constexpr memory_kind memory = memory_kind::device;

    device_buffer() noexcept = default;

    /// Allocates on `s`'s device, ordered after the work enqueued on `s`, from `resource`
    /// (cudaMallocAsync by default).
    /// @throws usage_error for a zero count; cuda_error (cudaErrorMemoryAllocation when full), or
    ///         what the resource throws
    device_buffer(std::size_t count, stream_ref s, const device_resource& resource = {},
                  std::source_location where = std::source_location::current()) {
        std::size_t bytes = base::checked_bytes(count);
        device_guard guard(device_ref(s.device(where), where), where);
        void* p = nullptr;
        if (resource.is_default()) {
            check(cudaMallocAsync(&p, bytes, s.get()), "cudaMallocAsync", where);
        } else {
            p = resource.allocate(bytes, s);
        }
        this->adopt(static_cast<T*>(p), count, detail::stream_ordered_free{s, resource, bytes});
    }

    /// Allocates on `s`'s device, ordered after the work enqueued on `s`.
    /// @throws usage_error for a zero count; cuda_error (cudaErrorMemoryAllocation when full)
    device_buffer(std::size_t count, stream_ref s, std::source_location where)
        : device_buffer(count, s, device_resource{}, where) {}

    /// The resource the memory came from (and goes back to).
    [[nodiscard]] const device_resource& resource() const noexcept {
        return this->release_fn().resource;
    }

    /// Frees now, in the order of the buffer's stream; the buffer becomes empty.
    using base::reset;

    /// The stream the memory is freed on.
    [[nodiscard]] stream_ref stream() const noexcept { return this->release_fn().stream; }
    /// Frees on `s` from now on (it must be on the same device).
    void set_stream(stream_ref s) noexcept { this->release_fn().stream = s; }

    /// A span over device memory: for kernels and copies, not for host access.
    /// @throws usage_error on an empty buffer
    using base::span;

    /// Not provided: the host cannot read or write device memory, so there is nothing to index.
    T& operator[](std::size_t) const = delete;
};

} // namespace cudawait
