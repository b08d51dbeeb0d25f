// SPDX-License-Identifier: Apache-2.0
#pragma once

// A stream-ordered, device-accessible cuda::mr resource over cudaMallocAsync that counts what it
// hands out and takes back, so that tests can see every device allocation a component makes.
// Copyable (CCCL 3.1's references take only copyable resources): copies share one set of counts.
// It has both spellings: allocate_async (CCCL 3.0) and allocate(stream, ...) (CCCL 3.1 and later).

#include <cudawait/memory/device_resource.hpp>
#include <cudawait/runtime/error.hpp>

#include <atomic>
#include <cstddef>

#include <cuda_runtime.h>

#if CUDAWAIT_HAS_CUDA_MR
namespace cudawait::testing {

struct device_resource_counts {
    std::atomic<long> allocations{0};
    std::atomic<long> deallocations{0};
    std::atomic<std::size_t> bytes_allocated{0};
    std::atomic<std::size_t> bytes_freed{0};
};

class counting_device_resource {
public:
    explicit counting_device_resource(device_resource_counts& c) noexcept : m_counts(&c) {}

    void* allocate_async(std::size_t bytes, std::size_t, ::cuda::stream_ref s) {
        void* p = nullptr;
        check(cudaMallocAsync(&p, bytes, s.get()), "cudaMallocAsync");
        ++m_counts->allocations;
        m_counts->bytes_allocated += bytes;
        return p;
    }
    void deallocate_async(void* p, std::size_t bytes, std::size_t, ::cuda::stream_ref s) noexcept {
        ++m_counts->deallocations;
        m_counts->bytes_freed += bytes;
        detail::report(cudaFreeAsync(p, s.get()), "cudaFreeAsync");
    }
    void* allocate(::cuda::stream_ref s, std::size_t bytes, std::size_t alignment) {
        return allocate_async(bytes, alignment, s);
    }
    void deallocate(::cuda::stream_ref s, void* p, std::size_t bytes,
                    std::size_t alignment) noexcept {
        deallocate_async(p, bytes, alignment, s);
    }

    // The synchronous forms both concepts also require.
    void* allocate(std::size_t bytes, std::size_t alignment) {
        void* p = allocate_async(bytes, alignment, ::cuda::stream_ref(cudaStreamPerThread));
        check(cudaStreamSynchronize(cudaStreamPerThread), "cudaStreamSynchronize");
        return p;
    }
    void deallocate(void* p, std::size_t bytes, std::size_t alignment) noexcept {
        deallocate_async(p, bytes, alignment, ::cuda::stream_ref(cudaStreamPerThread));
    }
    void* allocate_sync(std::size_t bytes, std::size_t alignment) {
        return allocate(bytes, alignment);
    }
    void deallocate_sync(void* p, std::size_t bytes, std::size_t alignment) noexcept {
        deallocate(p, bytes, alignment);
    }

    bool operator==(const counting_device_resource&) const = default;
    friend void get_property(const counting_device_resource&,
                             ::cuda::mr::device_accessible) noexcept {}

private:
    device_resource_counts* m_counts;
};

static_assert(is_device_resource_v<counting_device_resource>);

} // namespace cudawait::testing
#endif
