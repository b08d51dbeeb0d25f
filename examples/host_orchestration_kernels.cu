// SPDX-License-Identifier: Apache-2.0
// The only device code of the host_orchestration example: a kernel behind a plain C++ function.

#include "host_orchestration_kernels.hpp"

namespace orchestration {

namespace {
__global__ void saxpy_kernel(float a, const float* x, float* y, std::size_t n) {
    for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
        y[i] = a * x[i] + y[i];
    }
}
} // namespace

cudaError_t launch_saxpy(float a, const float* x, float* y, std::size_t n, cudaStream_t s) {
    saxpy_kernel<<<256, 256, 0, s>>>(a, x, y, n);
    return cudaGetLastError();
}

} // namespace orchestration
