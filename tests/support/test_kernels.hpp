// SPDX-License-Identifier: Apache-2.0
#pragma once

// Host entry points for the kernels the GPU tests launch (defined in test_kernels.cu), so that
// the tests themselves are plain C++ compiled by the host compiler. Each returns the launch's
// status (cudaGetLastError after the launch).

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

namespace cudawait::testing {

/// data[i] = data[i] * 3 + (salt ^ i), unsigned arithmetic modulo 2^32.
cudaError_t launch_mix(std::uint32_t* data, std::size_t n, std::uint32_t salt, cudaStream_t s);

/// The host reference of launch_mix.
inline void mix_on_host(std::uint32_t* data, std::size_t n, std::uint32_t salt) {
    for (std::size_t i = 0; i < n; ++i) {
        data[i] = data[i] * 3u + (salt ^ static_cast<std::uint32_t>(i));
    }
}

/// Spins on the GPU's global timer for `ns` nanoseconds, then writes `value` to *out (if
/// non-null).
cudaError_t launch_spin(std::uint64_t ns, std::uint32_t* out, std::uint32_t value, cudaStream_t s);

/// Spins for `ns` nanoseconds, then copies n words from src to dst. `src` may be page-locked
/// host memory: the kernel then reads the host's bytes over the bus, late.
cudaError_t launch_delayed_copy(std::uint64_t ns, std::uint32_t* dst, const std::uint32_t* src,
                                std::size_t n, cudaStream_t s);

/// out[i] = in[i] * 3 + (salt ^ i) for i < n, after spinning `spin_ns` nanoseconds (0: none).
cudaError_t launch_transform(const std::uint32_t* in, std::uint32_t* out, std::size_t n,
                             std::uint32_t salt, std::uint64_t spin_ns, cudaStream_t s);

/// The host reference of launch_transform.
inline void transform_on_host(const std::uint32_t* in, std::uint32_t* out, std::size_t n,
                              std::uint32_t salt) {
    for (std::size_t i = 0; i < n; ++i) {
        out[i] = in[i] * 3u + (salt ^ static_cast<std::uint32_t>(i));
    }
}

/// *out = the sum of in[0..n) modulo 2^32 (zeroes *out first, in stream order).
cudaError_t launch_sum(const std::uint32_t* in, std::size_t n, std::uint32_t* out, cudaStream_t s);

/// A launch with zero blocks: a launch error (cudaErrorInvalidValue on CUDA 13) that is not
/// sticky.
cudaError_t launch_bad_config(cudaStream_t s);

/// Spins until *flag (host-mapped memory) becomes non-zero or `timeout_ns` passed.
cudaError_t launch_wait_flag(const volatile std::uint32_t* flag, std::uint64_t timeout_ns,
                             cudaStream_t s);

/// Stores through a pointer no allocation covers: an illegal-address fault (sticky).
cudaError_t launch_fault(cudaStream_t s);

/// An empty kernel.
cudaError_t launch_empty(cudaStream_t s);

/// out[i] = in[i] * a + b for i < n (unsigned, modulo 2^32); in and out may be the same.
cudaError_t launch_affine(const std::uint32_t* in, std::uint32_t* out, std::size_t n,
                          std::uint32_t a, std::uint32_t b, cudaStream_t s);

/// The host reference of launch_affine.
inline void affine_on_host(const std::uint32_t* in, std::uint32_t* out, std::size_t n,
                           std::uint32_t a, std::uint32_t b) {
    for (std::size_t i = 0; i < n; ++i) {
        out[i] = in[i] * a + b;
    }
}

/// out[i] = in[i] * in[i] - c for i < n (unsigned, modulo 2^32); in and out may be the same.
cudaError_t launch_square_sub(const std::uint32_t* in, std::uint32_t* out, std::size_t n,
                              std::uint32_t c, cudaStream_t s);

/// The host reference of launch_square_sub.
inline void square_sub_on_host(const std::uint32_t* in, std::uint32_t* out, std::size_t n,
                               std::uint32_t c) {
    for (std::size_t i = 0; i < n; ++i) {
        out[i] = in[i] * in[i] - c;
    }
}

} // namespace cudawait::testing

// The pinned pool as a libcu++ cuda::mr resource, reached from a translation unit that nvcc
// compiles (test_kernels.cu) and that defines no switch for libcu++'s memory resources.
namespace cudawait {
class pinned_pool;
} // namespace cudawait

namespace cudawait::testing {

/// CUDAWAIT_HAS_CUDA_MR as test_kernels.cu sees it.
bool cuda_mr_in_nvcc_unit();

/// `bytes` from `pool` through a host- and device-accessible cuda::mr resource reference made
/// in test_kernels.cu; nullptr where libcu++ has no memory resources.
void* allocate_through_cuda_mr(pinned_pool& pool, std::size_t bytes);

/// Gives `p` back through such a reference.
void deallocate_through_cuda_mr(pinned_pool& pool, void* p, std::size_t bytes);

} // namespace cudawait::testing
