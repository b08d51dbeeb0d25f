// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <cstddef>

#include <cuda_runtime_api.h>

namespace orchestration {

/// y = a * x + y on `s`; returns the launch status.
cudaError_t launch_saxpy(float a, const float* x, float* y, std::size_t n, cudaStream_t s);

} // namespace orchestration
