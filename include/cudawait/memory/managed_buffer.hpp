// SPDX-License-Identifier: Apache-2.0
#pragma once

// Synopsis
//   managed_buffer<float> m(n);                   cudaMallocManaged: one address for host and GPUs
//   m[i] = x;  kernel<<<...>>>(m.data());         both sides touch it; the driver migrates pages
//   co_await prefetch(m, device_ref(0), s);       moves the pages to device 0 in `s`'s order
//   co_await prefetch_to_host(m, s);              ... back to host memory before the host reads
//   prefetch_async(r, dev, s);  prefetch_to_host_async(r, s);   enqueue only
//
// A prefetch (cudaMemPrefetchAsync) is a hint for speed, never needed for correctness; it takes
// any contiguous managed range. copy() and the pipeline take managed ranges as they are. The host
// may touch the memory only while no kernel that uses it runs, except on devices with
// concurrentManagedAccess. See docs/memory.md#buffers.

#include <cudawait/core/scheduler.hpp>
#include <cudawait/core/task.hpp>
#include <cudawait/memory/detail/typed_allocation.hpp>
#include <cudawait/memory/memory_kind.hpp>
#include <cudawait/runtime/device.hpp>
#include <cudawait/runtime/error.hpp>
#include <cudawait/runtime/stream.hpp>

#include <cstddef>
#include <ranges>
#include <source_location>
#include <span>
#include <string>
#include <type_traits>

#include <cuda_runtime_api.h>

namespace cudawait {

namespace detail {
/// How a managed_buffer frees its memory: cudaFree, which waits for the device to be idle.
struct managed_release {
    static constexpr const char* name = "managed_buffer";

    void operator()(void* data) const noexcept { detail::report(cudaFree(data), "cudaFree"); }
};
} // namespace detail

/// `count` uninitialised elements of managed (unified) memory, addressable from the host and
/// from every device.
///
/// data(), size(), span(), begin(), end(), operator[] and the moves: detail::typed_allocation.
template <class T>
class managed_buffer : public detail::typed_allocation<T, detail::managed_release> {
    static_assert(std::is_trivially_copyable_v<T>, "managed_buffer holds trivially copyable types");
    using base = detail::typed_allocation<T, detail::managed_release>;

public:
    /// Where the elements live (copy asks the type instead of the driver).
    static constexpr memory_kind memory = memory_kind::managed;

    managed_buffer() noexcept = default;

    /// Allocates with cudaMallocManaged(cudaMemAttachGlobal), so any stream of any device may
    /// use the memory.
    /// @throws usage_error for a zero count; cuda_error (cudaErrorMemoryAllocation when full,
    ///         cudaErrorNotSupported on a system without managed memory)
    explicit managed_buffer(std::size_t count,
                            std::source_location where = std::source_location::current()) {
        std::size_t bytes = base::checked_bytes(count);
        void* p = nullptr;
        check(cudaMallocManaged(&p, bytes, cudaMemAttachGlobal), "cudaMallocManaged", where);
        this->adopt(static_cast<T*>(p), count, detail::managed_release{});
    }

    /// Frees now (cudaFree waits until the device is idle first).
    using base::reset;
};

namespace detail {

/// A range's bytes for a prefetch, checked at the call.
struct prefetch_range {
    const void* data;
    std::size_t bytes;
};

template <class R>
concept prefetchable = std::ranges::contiguous_range<R> && std::ranges::sized_range<R>;

template <prefetchable R>
prefetch_range checked_prefetch_range(R&& r, const char* what) {
    using T = std::ranges::range_value_t<R>;
    std::size_t n = std::ranges::size(r);
    const void* p = static_cast<const void*>(std::ranges::data(r));
    if (n == 0 || p == nullptr) {
        throw usage_error(std::string(what) + ": empty range");
    }
    return {p, n * sizeof(T)};
}

/// cudaMemPrefetchAsync to `device`, or to host memory for a negative `device`. CUDA 13 takes a
/// cudaMemLocation and flags where CUDA 12 took a device ordinal (cudaCpuDeviceId for the host).
inline void enqueue_prefetch(prefetch_range r, int device, stream_ref s,
                             const std::source_location& where) {
#if CUDART_VERSION >= 13000
    cudaMemLocation loc{};
    if (device < 0) {
        loc.type = cudaMemLocationTypeHost;
        loc.id = 0;
    } else {
        loc.type = cudaMemLocationTypeDevice;
        loc.id = device;
    }
    check(cudaMemPrefetchAsync(r.data, r.bytes, loc, 0, s.get()), "cudaMemPrefetchAsync", where);
#else
    check(cudaMemPrefetchAsync(r.data, r.bytes, device < 0 ? cudaCpuDeviceId : device, s.get()),
          "cudaMemPrefetchAsync", where);
#endif
}

/// A template (called with its default) so that only a translation unit that prefetches
/// instantiates the coroutine and the scheduler's stream wait.
template <class Unused = void>
task<void> prefetch_task(prefetch_range r, int device, stream_ref s, std::source_location where) {
    enqueue_prefetch(r, device, s, where);
    co_await s;
}

} // namespace detail

/// Enqueues on `s` a migration of the managed range `r` to `dev`'s memory.
/// @throws usage_error for an empty range; cuda_error (cudaErrorInvalidValue for memory that is
///         not managed, on systems without pageable memory access)
template <detail::prefetchable R>
void prefetch_async(R&& r, device_ref dev, stream_ref s,
                    std::source_location where = std::source_location::current()) {
    detail::enqueue_prefetch(detail::checked_prefetch_range(r, "prefetch_async"), dev.get(), s,
                             where);
}

/// Enqueues on `s` a migration of the managed range `r` to host memory.
/// @throws as prefetch_async
template <detail::prefetchable R>
void prefetch_to_host_async(R&& r, stream_ref s,
                            std::source_location where = std::source_location::current()) {
    detail::enqueue_prefetch(detail::checked_prefetch_range(r, "prefetch_to_host_async"), -1, s,
                             where);
}

/// `co_await prefetch(r, dev, s)`: enqueues the migration of `r` to `dev` on `s` when awaited
/// and resumes once `s` reached it (with the work enqueued on `s` before). The range is checked
/// at the call; its memory must stay valid until the await completes.
/// @throws usage_error (at the call) for an empty range; cuda_error (from the await)
template <detail::prefetchable R>
[[nodiscard]] task<void> prefetch(R&& r, device_ref dev, stream_ref s,
                                  std::source_location where = std::source_location::current()) {
    return detail::prefetch_task(detail::checked_prefetch_range(r, "prefetch"), dev.get(), s,
                                 where);
}

/// `co_await prefetch_to_host(r, s)`: as prefetch, to host memory; after the await the host
/// reads the range without a page fault per page.
/// @throws as prefetch
template <detail::prefetchable R>
[[nodiscard]] task<void>
prefetch_to_host(R&& r, stream_ref s,
                 std::source_location where = std::source_location::current()) {
    return detail::prefetch_task(detail::checked_prefetch_range(r, "prefetch_to_host"), -1, s,
                                 where);
}

} // namespace cudawait
