// SPDX-License-Identifier: Apache-2.0
// torch_stage: PyTorch ops from C++ inside cudawait, on cudawait's streams and memory.
//
// 1. A pipeline stage runs torch ops over tensors that wrap the slot's device memory
//    (torch::from_blob, no copy), on the stage's stream: c10::cuda::getStreamFromExternal turns
//    the cudaStream_t into a CUDAStream and a CUDAStreamGuard makes it current, so every op of
//    the stage (and the caching allocator's temporaries) is ordered on that stream.
// 2. A coroutine wraps pinned pool memory in host tensors, lets torch copy it to the GPU with
//    non_blocking=true on a cudawait stream, and frees the pinned block at once: record_use does
//    for the pool what Tensor::record_stream does for torch's caching allocator, so the block is
//    handed out again only after the stream passed the copy. It then awaits torch's CUDAStream
//    itself: any type with .stream() returning a cudaStream_t can be awaited.
// Both results are checked, element by element, against the same ops run by torch on the CPU.
//
// Built where CMake finds Torch (pass its prefix: python3 -c "import torch;
// print(torch.utils.cmake_prefix_path)"). Exit status: 0 when every element matches, 1 on a
// mismatch or an error, 2 without a GPU.

#include <cudawait/cudawait.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <random>
#include <span>
#include <string>
#include <vector>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/torch.h>

namespace {

torch::TensorOptions cuda_floats(int device) {
    return torch::TensorOptions()
        .dtype(torch::kFloat32)
        .device(torch::kCUDA, static_cast<c10::DeviceIndex>(device));
}

torch::Tensor wrap(std::span<float> s, const torch::TensorOptions& o) {
    return torch::from_blob(s.data(), {static_cast<std::int64_t>(s.size())}, o);
}

// The ops the stage runs, on whichever device `x` lives: x * sigmoid(x) + 0.5 (SiLU, shifted).
torch::Tensor stage_ops(const torch::Tensor& x) { return x * torch::sigmoid(x) + 0.5f; }

// A pipeline stage: torch ops over the slot's device memory, on the stage's stream.
struct silu_stage {
    void operator()(std::span<float> in, std::span<float> out,
                    const cudawait::stage_context& ctx) const {
        c10::cuda::CUDAStreamGuard guard(c10::cuda::getStreamFromExternal(
            ctx.stream.get(), static_cast<c10::DeviceIndex>(ctx.device)));
        const auto o = cuda_floats(ctx.device);
        wrap(out, o).copy_(stage_ops(wrap(in, o)));
    }
};

// Host tensors over pinned pool memory, copied by torch on a cudawait stream; the pinned input
// is given back to the pool right after the copy is enqueued. Returns tanh(x) * 3 on the host.
cudawait::task<std::vector<float>> torch_on_pool_memory(const std::vector<float>& x, int device) {
    const auto n = static_cast<std::int64_t>(x.size());
    cudawait::stream s{cudawait::device_ref(device)};
    const c10::cuda::CUDAStream ts =
        c10::cuda::getStreamFromExternal(s.get(), static_cast<c10::DeviceIndex>(device));
    c10::cuda::CUDAStreamGuard guard(ts);

    torch::Tensor dev = torch::empty({n}, cuda_floats(device));
    {
        cudawait::pinned_buffer<float> host_in(x.size()); // from default_pinned_pool()
        std::copy(x.begin(), x.end(), host_in.begin());
        dev.copy_(wrap(host_in.span(), torch::kFloat32), /*non_blocking=*/true); // H2D on ts
        host_in.record_use(s); // as Tensor::record_stream: reused only after s passed the copy
    } // the block goes back to the pool now, with the copy possibly still running

    cudawait::pinned_buffer<float> host_out(x.size());
    torch::Tensor result = torch::tanh(dev) * 3.0f;
    wrap(host_out.span(), torch::kFloat32).copy_(result, /*non_blocking=*/true); // D2H on ts
    co_await ts; // c10::cuda::CUDAStream awaited directly: it has .stream()
    co_return std::vector<float>(host_out.begin(), host_out.end());
}

// Every element of `got` against `want`, within a float tolerance (the GPU's sigmoid and tanh
// may differ from the CPU's in the last bits). Returns the number of mismatches.
std::size_t mismatches(const char* what, std::span<const float> got, std::span<const float> want) {
    std::size_t bad = 0;
    for (std::size_t i = 0; i < got.size(); ++i) {
        const float tol = 1e-5f + 1e-5f * std::abs(want[i]);
        if (!(std::abs(got[i] - want[i]) <= tol)) {
            if (bad++ < 5) {
                std::fprintf(stderr, "torch_stage: %s element %zu is %.8g, expected %.8g\n", what,
                             i, static_cast<double>(got[i]), static_cast<double>(want[i]));
            }
        }
    }
    return bad;
}

} // namespace

int main() {
    if (std::string why = cudawait::no_device_reason(); !why.empty()) {
        std::fprintf(stderr, "torch_stage: no CUDA device: %s\n", why.c_str());
        return 2;
    }
    try {
        const std::size_t chunk = std::size_t{1} << 20;
        const std::size_t n = chunk * 8 + 4'321; // 8 full chunks and a short one
        std::vector<float> in(n);
        std::mt19937 rng(11);
        std::uniform_real_distribution<float> dist(-6.0f, 6.0f);
        for (float& v : in) {
            v = dist(rng);
        }
        std::vector<float> out(n, -12345.0f); // poison

        cudawait::pipeline_options o;
        o.chunk_elements = chunk;
        o.depth = 3;
        cudawait::pipeline<float> pipe(o, {silu_stage{}});
        cudawait::scheduler sched;
        cudawait::sync_wait(sched, pipe.run(in, out));

        // The same ops on the CPU, over the same input.
        const torch::Tensor cpu_in = wrap(std::span<float>(in), torch::kFloat32);
        const torch::Tensor want_stage = stage_ops(cpu_in).contiguous();
        std::size_t bad =
            mismatches("pipeline", out, std::span<const float>(want_stage.data_ptr<float>(), n));

        const std::vector<float> got_pool = cudawait::sync_wait(sched, torch_on_pool_memory(in, 0));
        const torch::Tensor want_pool = (torch::tanh(cpu_in) * 3.0f).contiguous();
        bad += mismatches("pool tensor", got_pool,
                          std::span<const float>(want_pool.data_ptr<float>(), n));
        if (bad != 0) {
            std::fprintf(stderr, "torch_stage: %zu elements differ\n", bad);
            return 1;
        }
        std::printf("torch_stage: %zu elements through %zu chunks of torch ops on the stages' "
                    "streams, and %zu through pool memory on a cudawait stream; all match the "
                    "CPU\n",
                    n, pipe.stats().chunks, n);
        return 0;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "torch_stage: %s\n", e.what());
        return 1;
    }
}
