// SPDX-License-Identifier: Apache-2.0
#pragma once

// The whole library (nccl.hpp aside, which needs NCCL), plus <cuda_runtime.h>. Each module's
// face (runtime.hpp, core.hpp, memory.hpp, observe.hpp, copy.hpp, pipeline.hpp) and each header
// can also be included on its own; the faces include only <cuda_runtime_api.h>, so a .cpp file
// that includes this header also has the runtime's typed C++ overloads (`cudaMalloc(&float_ptr,
// bytes)`). Manual: docs/README.md.

#include <cudawait/copy.hpp>
#include <cudawait/core.hpp>
#include <cudawait/memory.hpp>
#include <cudawait/observe.hpp>
#include <cudawait/pipeline.hpp>
#include <cudawait/runtime.hpp>
#include <cudawait/version.hpp>

#include <cuda_runtime.h>
