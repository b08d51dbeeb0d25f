// SPDX-License-Identifier: Apache-2.0
#include "test_kernels.hpp"

namespace cudawait::testing {

namespace {

__device__ std::uint64_t global_ns() {
    std::uint64_t t = 0;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__global__ void mix_kernel(std::uint32_t* data, std::size_t n, std::uint32_t salt) {
    for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
        data[i] = data[i] * 3u + (salt ^ static_cast<std::uint32_t>(i));
    }
}

__global__ void spin_kernel(std::uint64_t ns, std::uint32_t* out, std::uint32_t value) {
    const std::uint64_t start = global_ns();
    while (global_ns() - start < ns) {
    }
    if (out != nullptr) {
        *out = value;
    }
}

__global__ void delayed_copy_kernel(std::uint64_t ns, std::uint32_t* dst, const std::uint32_t* src,
                                    std::size_t n) {
    const std::uint64_t start = global_ns();
    while (global_ns() - start < ns) {
    }
    __syncthreads();
    for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
        dst[i] = src[i];
    }
}

__global__ void transform_kernel(const std::uint32_t* in, std::uint32_t* out, std::size_t n,
                                 std::uint32_t salt, std::uint64_t spin_ns) {
    if (spin_ns != 0) {
        const std::uint64_t start = global_ns();
        while (global_ns() - start < spin_ns) {
        }
        __syncthreads();
    }
    for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
        out[i] = in[i] * 3u + (salt ^ static_cast<std::uint32_t>(i));
    }
}

__global__ void sum_kernel(const std::uint32_t* in, std::size_t n, std::uint32_t* out) {
    std::uint32_t acc = 0;
    for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
        acc += in[i];
    }
    atomicAdd(out, acc);
}

__global__ void wait_flag_kernel(const volatile std::uint32_t* flag, std::uint64_t timeout_ns) {
    const std::uint64_t start = global_ns();
    while (*flag == 0 && global_ns() - start < timeout_ns) {
    }
}

__global__ void fault_kernel(std::uint32_t* p) { *p = 42; }

__global__ void empty_kernel() {}

} // namespace

cudaError_t launch_mix(std::uint32_t* data, std::size_t n, std::uint32_t salt, cudaStream_t s) {
    const unsigned blocks = static_cast<unsigned>(n < 256 * 64 ? (n + 255) / 256 : 64);
    mix_kernel<<<blocks == 0 ? 1 : blocks, 256, 0, s>>>(data, n, salt);
    return cudaGetLastError();
}

cudaError_t launch_spin(std::uint64_t ns, std::uint32_t* out, std::uint32_t value, cudaStream_t s) {
    spin_kernel<<<1, 1, 0, s>>>(ns, out, value);
    return cudaGetLastError();
}

cudaError_t launch_delayed_copy(std::uint64_t ns, std::uint32_t* dst, const std::uint32_t* src,
                                std::size_t n, cudaStream_t s) {
    delayed_copy_kernel<<<32, 256, 0, s>>>(ns, dst, src, n);
    return cudaGetLastError();
}

cudaError_t launch_transform(const std::uint32_t* in, std::uint32_t* out, std::size_t n,
                             std::uint32_t salt, std::uint64_t spin_ns, cudaStream_t s) {
    const unsigned blocks = static_cast<unsigned>(n < 256 * 64 ? (n + 255) / 256 : 64);
    transform_kernel<<<blocks == 0 ? 1 : blocks, 256, 0, s>>>(in, out, n, salt, spin_ns);
    return cudaGetLastError();
}

cudaError_t launch_sum(const std::uint32_t* in, std::size_t n, std::uint32_t* out, cudaStream_t s) {
    cudaError_t st = cudaMemsetAsync(out, 0, sizeof(std::uint32_t), s);
    if (st != cudaSuccess) {
        return st;
    }
    sum_kernel<<<32, 256, 0, s>>>(in, n, out);
    return cudaGetLastError();
}

cudaError_t launch_bad_config(cudaStream_t s) {
    empty_kernel<<<0, 1, 0, s>>>();
    return cudaGetLastError();
}

cudaError_t launch_wait_flag(const volatile std::uint32_t* flag, std::uint64_t timeout_ns,
                             cudaStream_t s) {
    wait_flag_kernel<<<1, 1, 0, s>>>(flag, timeout_ns);
    return cudaGetLastError();
}

cudaError_t launch_fault(cudaStream_t s) {
    // An address far outside any allocation in the GPU's virtual address space.
    auto* bad = reinterpret_cast<std::uint32_t*>(std::uintptr_t{0xdead0000ull} << 16);
    fault_kernel<<<1, 1, 0, s>>>(bad);
    return cudaGetLastError();
}

cudaError_t launch_empty(cudaStream_t s) {
    empty_kernel<<<1, 1, 0, s>>>();
    return cudaGetLastError();
}

namespace {

__global__ void affine_kernel(const std::uint32_t* in, std::uint32_t* out, std::size_t n,
                              std::uint32_t a, std::uint32_t b) {
    for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
        out[i] = in[i] * a + b;
    }
}

__global__ void square_sub_kernel(const std::uint32_t* in, std::uint32_t* out, std::size_t n,
                                  std::uint32_t c) {
    for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
        out[i] = in[i] * in[i] - c;
    }
}

unsigned blocks_for(std::size_t n) {
    const unsigned blocks = static_cast<unsigned>(n < 256 * 64 ? (n + 255) / 256 : 64);
    return blocks == 0 ? 1 : blocks;
}

} // namespace

cudaError_t launch_affine(const std::uint32_t* in, std::uint32_t* out, std::size_t n,
                          std::uint32_t a, std::uint32_t b, cudaStream_t s) {
    affine_kernel<<<blocks_for(n), 256, 0, s>>>(in, out, n, a, b);
    return cudaGetLastError();
}

cudaError_t launch_square_sub(const std::uint32_t* in, std::uint32_t* out, std::size_t n,
                              std::uint32_t c, cudaStream_t s) {
    square_sub_kernel<<<blocks_for(n), 256, 0, s>>>(in, out, n, c);
    return cudaGetLastError();
}

} // namespace cudawait::testing

// ---- the pinned pool as a cuda::mr resource, under nvcc, without any switch defined here ----

#include <cudawait/memory/pinned_pool.hpp>

#include "cuda_mr_ref.hpp"

#if __has_include(<cuda/memory_resource>)
static_assert(CUDAWAIT_HAS_CUDA_MR == 1, "libcu++ is here, so the pool is a cuda::mr resource");
#endif

namespace cudawait::testing {

#if CUDAWAIT_HAS_CUDA_MR
bool cuda_mr_in_nvcc_unit() { return true; }
void* allocate_through_cuda_mr(pinned_pool& pool, std::size_t bytes) {
    return ref_allocate(pool_ref{pool}, bytes);
}
void deallocate_through_cuda_mr(pinned_pool& pool, void* p, std::size_t bytes) {
    ref_deallocate(pool_ref{pool}, p, bytes);
}
#else
bool cuda_mr_in_nvcc_unit() { return false; }
void* allocate_through_cuda_mr(pinned_pool&, std::size_t) { return nullptr; }
void deallocate_through_cuda_mr(pinned_pool&, void*, std::size_t) {}
#endif

} // namespace cudawait::testing
