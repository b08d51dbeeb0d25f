// SPDX-License-Identifier: Apache-2.0
#pragma once

// Synopsis
//   device_resource r;                  the default: cudaMallocAsync / cudaFreeAsync
//   device_resource r = my_resource;    any stream-ordered, device-accessible cuda::mr resource
//   device_resource r = ref;            or a reference to one (device_resource_ref)
//   void* p = r.allocate(bytes, s);     in `s`'s order
//   r.deallocate(p, bytes, s);          the memory is reused only after work enqueued on `s`
//
// A device_resource holds a resource by reference: the resource must outlive every buffer
// allocated from it. Without cuda::mr (CUDAWAIT_HAS_CUDA_MR 0) only the default can be made. See
// docs/memory.md#device-memory-resources.

#include <cudawait/runtime/error.hpp>
#include <cudawait/runtime/stream.hpp>

#include <cstddef>
#include <cstring>
#include <new>
#include <type_traits>

#include <cuda_runtime_api.h>

// libcu++'s memory resources (cuda::mr). CCCL 3.1 and later declare them unconditionally. CCCL
// 3.0 (CUDA 13.0) and 2.x declare them only if LIBCUDACXX_ENABLE_EXPERIMENTAL_MEMORY_RESOURCE
// is defined when <cuda/memory_resource> is first included; their include guards are set even
// when the switch skipped their contents, so defining it later changes nothing. This header
// therefore defines the switch itself when it is the first to include them. If they were
// included earlier without it, they declared nothing and nothing of cudawait is a cuda::mr
// resource, nor takes one, in that translation unit (CUDAWAIT_HAS_CUDA_MR is 0): include
// cudawait first there, or define the switch for the whole project.
#if __has_include(<cuda/memory_resource>) && __has_include(<cuda/version>)
#include <cuda/version>
#endif
#if defined(CCCL_VERSION) && CCCL_VERSION >= 3001000
#include <cuda/memory_resource>
#define CUDAWAIT_HAS_CUDA_MR 1
#elif defined(CCCL_VERSION)
#if !defined(LIBCUDACXX_ENABLE_EXPERIMENTAL_MEMORY_RESOURCE) && !defined(_CUDA_MEMORY_RESOURCE) && \
    !defined(_CUDA__MEMORY_RESOURCE_PROPERTIES_H)
#define LIBCUDACXX_ENABLE_EXPERIMENTAL_MEMORY_RESOURCE
#endif
#include <cuda/memory_resource>
#if defined(LIBCUDACXX_ENABLE_EXPERIMENTAL_MEMORY_RESOURCE)
#define CUDAWAIT_HAS_CUDA_MR 1
#else
#define CUDAWAIT_HAS_CUDA_MR 0
#endif
#else
#define CUDAWAIT_HAS_CUDA_MR 0
#endif

namespace cudawait {

#if CUDAWAIT_HAS_CUDA_MR
#if CCCL_VERSION >= 3001000
/// A reference to a stream-ordered resource whose memory the device can access.
using device_resource_ref = cuda::mr::resource_ref<cuda::mr::device_accessible>;
/// Whether `R` is a stream-ordered resource whose memory the device can access (CCCL 3.1's
/// references accept only copyable resources).
template <class R>
inline constexpr bool is_device_resource_v =
    cuda::mr::resource_with<R, cuda::mr::device_accessible>&& std::is_copy_constructible_v<R>;
#else
/// A reference to a stream-ordered resource whose memory the device can access.
using device_resource_ref = cuda::mr::async_resource_ref<cuda::mr::device_accessible>;
/// Whether `R` is a stream-ordered resource whose memory the device can access.
template <class R>
inline constexpr bool is_device_resource_v =
    cuda::mr::async_resource_with<R, cuda::mr::device_accessible>;
#endif
#endif

/// Where device memory comes from, in stream order: cudaMallocAsync / cudaFreeAsync by default,
/// or a cuda::mr resource (held by reference). Copyable; compares equal when both are the
/// default or refer to equal resources.
class device_resource {
public:
    /// Device memory is stream-ordered with an alignment of at least this (cudaMalloc's).
    static constexpr std::size_t alignment = 256;

    /// The default: cudaMallocAsync on the stream's device's current memory pool.
    device_resource() noexcept = default;
    /// The default, as for pointer-like options.
    device_resource(std::nullptr_t) noexcept {}

#if CUDAWAIT_HAS_CUDA_MR
    /// Allocates through `ref`; the resource it refers to must outlive everything allocated.
    device_resource(device_resource_ref ref) noexcept { hold(ref); }

    /// Allocates through `r`, which must outlive everything allocated from it.
    template <class R>
    requires(!std::is_same_v<std::remove_cvref_t<R>, device_resource> &&
             !std::is_same_v<std::remove_cvref_t<R>, device_resource_ref> &&
             is_device_resource_v<R>) device_resource(R& r)
    noexcept { hold(device_resource_ref(r)); }
#endif

    device_resource(const device_resource& other) noexcept { copy_from(other); }
    device_resource& operator=(const device_resource& other) noexcept {
        if (this != &other) {
            destroy();
            copy_from(other);
        }
        return *this;
    }
    ~device_resource() { destroy(); }

    /// True when this is the default (cudaMallocAsync).
    [[nodiscard]] bool is_default() const noexcept { return m_ops == nullptr; }

    /// `bytes` of device memory, ordered after the work enqueued on `s` (on `s`'s device when
    /// the default; a resource decides for itself).
    /// @throws cuda_error (cudaErrorMemoryAllocation when full), or what the resource throws
    [[nodiscard]] void* allocate(std::size_t bytes, stream_ref s) const {
        if (m_ops == nullptr) {
            void* p = nullptr;
            check(cudaMallocAsync(&p, bytes, s.get()), "cudaMallocAsync");
            return p;
        }
        return m_ops->allocate(m_storage, bytes, alignment, s.get());
    }

    /// Frees `p` (`bytes` long, from allocate()) in `s`'s order. Never throws: a failure is
    /// reported, as in a destructor.
    void deallocate(void* p, std::size_t bytes, stream_ref s) const noexcept {
        if (m_ops == nullptr) {
            detail::report(cudaFreeAsync(p, s.get()), "cudaFreeAsync");
            return;
        }
        m_ops->deallocate(m_storage, p, bytes, alignment, s.get());
    }

    friend bool operator==(const device_resource& a, const device_resource& b) noexcept {
        if (a.m_ops != b.m_ops) {
            return false;
        }
        return a.m_ops == nullptr || a.m_ops->equal(a.m_storage, b.m_storage);
    }

private:
    // The held reference's operations. A table of plain function pointers, so that the layout
    // of device_resource is the same with or without cuda::mr in a translation unit.
    struct ops {
        void* (*allocate)(const void* ref, std::size_t bytes, std::size_t alignment,
                          cudaStream_t s);
        void (*deallocate)(const void* ref, void* p, std::size_t bytes, std::size_t alignment,
                           cudaStream_t s) noexcept;
        void (*copy)(void* to, const void* from) noexcept;
        void (*destroy)(void* ref) noexcept;
        bool (*equal)(const void* a, const void* b) noexcept;
    };

    // Room for a resource reference: two pointers in CCCL 3.0, a few more in later versions.
    static constexpr std::size_t storage_bytes = 8 * sizeof(void*);

#if CUDAWAIT_HAS_CUDA_MR
    template <class Ref>
    static const ops* ops_for() noexcept {
        static constexpr ops table{
            [](const void* ref, std::size_t bytes, std::size_t align, cudaStream_t s) -> void* {
                Ref r = *static_cast<const Ref*>(ref);
#if CCCL_VERSION >= 3001000
                return r.allocate(::cuda::stream_ref(s), bytes, align);
#else
                return r.allocate_async(bytes, align, ::cuda::stream_ref(s));
#endif
            },
            [](const void* ref, void* p, std::size_t bytes, std::size_t align,
               cudaStream_t s) noexcept {
                Ref r = *static_cast<const Ref*>(ref);
                try {
#if CCCL_VERSION >= 3001000
                    r.deallocate(::cuda::stream_ref(s), p, bytes, align);
#else
                    r.deallocate_async(p, bytes, align, ::cuda::stream_ref(s));
#endif
                } catch (const cuda_error& e) {
                    detail::report(e.status(), "device_resource::deallocate");
                } catch (...) {
                    detail::report(cudaErrorUnknown, "device_resource::deallocate");
                }
            },
            [](void* to, const void* from) noexcept {
                ::new (to) Ref(*static_cast<const Ref*>(from));
            },
            [](void* ref) noexcept { static_cast<Ref*>(ref)->~Ref(); },
            [](const void* a, const void* b) noexcept {
                return *static_cast<const Ref*>(a) == *static_cast<const Ref*>(b);
            }};
        return &table;
    }

    void hold(const device_resource_ref& ref) noexcept {
        static_assert(sizeof(device_resource_ref) <= storage_bytes &&
                          alignof(device_resource_ref) <= alignof(std::max_align_t),
                      "device_resource: the resource reference does not fit");
        ::new (static_cast<void*>(m_storage)) device_resource_ref(ref);
        m_ops = ops_for<device_resource_ref>();
    }
#endif

    void copy_from(const device_resource& other) noexcept {
        if (other.m_ops != nullptr) {
            other.m_ops->copy(m_storage, other.m_storage);
        }
        m_ops = other.m_ops;
    }
    void destroy() noexcept {
        if (m_ops != nullptr) {
            m_ops->destroy(m_storage);
            m_ops = nullptr;
        }
    }

    alignas(std::max_align_t) unsigned char m_storage[storage_bytes]{};
    const ops* m_ops = nullptr; ///< null: the default
};

} // namespace cudawait
