// SPDX-License-Identifier: Apache-2.0
#pragma once

// The pinned pool through a cuda::mr resource reference, in whichever spelling the CCCL on the
// include path has: `synchronous_resource_ref` with allocate_sync (CCCL 3.1 and later) or
// `resource_ref` with allocate (CCCL 3.0). Included by a g++ unit and an nvcc unit, neither of
// which defines LIBCUDACXX_ENABLE_EXPERIMENTAL_MEMORY_RESOURCE.

#include <cudawait/memory/pinned_pool.hpp>

#include <cstddef>

#if CUDAWAIT_HAS_CUDA_MR
namespace cudawait::testing {
#if CCCL_VERSION >= 3001000
static_assert(cuda::mr::synchronous_resource_with<pinned_pool, cuda::mr::host_accessible,
                                                  cuda::mr::device_accessible>);
using pool_ref =
    cuda::mr::synchronous_resource_ref<cuda::mr::host_accessible, cuda::mr::device_accessible>;
inline void* ref_allocate(pool_ref r, std::size_t n) { return r.allocate_sync(n, 256); }
inline void ref_deallocate(pool_ref r, void* p, std::size_t n) { r.deallocate_sync(p, n, 256); }
#else
static_assert(
    cuda::mr::resource_with<pinned_pool, cuda::mr::host_accessible, cuda::mr::device_accessible>);
using pool_ref = cuda::mr::resource_ref<cuda::mr::host_accessible, cuda::mr::device_accessible>;
inline void* ref_allocate(pool_ref r, std::size_t n) { return r.allocate(n, 256); }
inline void ref_deallocate(pool_ref r, void* p, std::size_t n) { r.deallocate(p, n, 256); }
#endif

// The stream-ordered forms: `resource_ref` with allocate(stream, ...) (CCCL 3.1 and later) or
// `async_resource_ref` with allocate_async (CCCL 3.0), both made from the pool's copyable view
// (pinned_pool::resource(), which must outlive the reference).
#if CCCL_VERSION >= 3001000
static_assert(
    cuda::mr::resource_with<pinned_pool, cuda::mr::host_accessible, cuda::mr::device_accessible>);
// CCCL 3.1's references take only copyable resources, which the pool is not: its view is.
static_assert(cuda::mr::resource_with<pinned_pool_resource, cuda::mr::host_accessible,
                                      cuda::mr::device_accessible>);
using async_pool_ref =
    cuda::mr::resource_ref<cuda::mr::host_accessible, cuda::mr::device_accessible>;
inline void* ref_allocate_async(async_pool_ref r, std::size_t n, cudaStream_t s) {
    return r.allocate(::cuda::stream_ref(s), n, 256);
}
inline void ref_deallocate_async(async_pool_ref r, void* p, std::size_t n, cudaStream_t s) {
    r.deallocate(::cuda::stream_ref(s), p, n, 256);
}
#else
static_assert(cuda::mr::async_resource_with<pinned_pool, cuda::mr::host_accessible,
                                            cuda::mr::device_accessible>);
static_assert(cuda::mr::async_resource_with<pinned_pool_resource, cuda::mr::host_accessible,
                                            cuda::mr::device_accessible>);
using async_pool_ref =
    cuda::mr::async_resource_ref<cuda::mr::host_accessible, cuda::mr::device_accessible>;
inline void* ref_allocate_async(async_pool_ref r, std::size_t n, cudaStream_t s) {
    return r.allocate_async(n, 256, ::cuda::stream_ref(s));
}
inline void ref_deallocate_async(async_pool_ref r, void* p, std::size_t n, cudaStream_t s) {
    r.deallocate_async(p, n, 256, ::cuda::stream_ref(s));
}
#endif
} // namespace cudawait::testing
#endif
