// SPDX-License-Identifier: Apache-2.0
// host_orchestration: the coroutines live in a .cpp built by the host compiler (no nvcc); the
// kernel is in host_orchestration_kernels.cu. Eight chunks are processed on four streams by
// detached coroutines in a scope; each copies in, runs saxpy, copies out and awaits its stream.

#include <cudawait/core.hpp>
#include <cudawait/runtime.hpp>

#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "host_orchestration_kernels.hpp"

namespace {

constexpr std::size_t chunk = 1 << 20;
constexpr int chunks = 8;
constexpr float a = 2.5f;

cudawait::task<> process(cudawait::stream& s, const float* x, float* y, std::size_t n) {
    float* dx = nullptr;
    float* dy = nullptr;
    cudawait::check(cudaMallocAsync(&dx, n * sizeof(float), s.get()), "cudaMallocAsync");
    cudawait::check(cudaMallocAsync(&dy, n * sizeof(float), s.get()), "cudaMallocAsync");
    cudawait::check(cudaMemcpyAsync(dx, x, n * sizeof(float), cudaMemcpyHostToDevice, s.get()),
                    "cudaMemcpyAsync");
    cudawait::check(cudaMemcpyAsync(dy, y, n * sizeof(float), cudaMemcpyHostToDevice, s.get()),
                    "cudaMemcpyAsync");
    cudawait::check(orchestration::launch_saxpy(a, dx, dy, n, s.get()), "launch_saxpy");
    cudawait::check(cudaMemcpyAsync(y, dy, n * sizeof(float), cudaMemcpyDeviceToHost, s.get()),
                    "cudaMemcpyAsync");
    cudawait::check(cudaFreeAsync(dx, s.get()), "cudaFreeAsync");
    cudawait::check(cudaFreeAsync(dy, s.get()), "cudaFreeAsync");
    co_await s;
}

cudawait::task<> run_all(cudawait::scheduler& sched, std::vector<cudawait::stream>& streams,
                         const float* x, float* y) {
    cudawait::async_scope scope(sched);
    for (int c = 0; c < chunks; ++c) {
        scope.spawn(process(streams[c % streams.size()], x + c * chunk, y + c * chunk, chunk));
    }
    co_await scope.join();
}

} // namespace

int main() {
    if (const std::string why = cudawait::no_device_reason(); !why.empty()) {
        std::fprintf(stderr,
                     "host_orchestration: no CUDA device on this machine (%s); it needs a GPU.\n",
                     why.c_str());
        return 2;
    }
    try {
        float* x = nullptr;
        float* y = nullptr;
        const std::size_t n = chunk * chunks;
        cudawait::check(cudaMallocHost(&x, n * sizeof(float)), "cudaMallocHost");
        cudawait::check(cudaMallocHost(&y, n * sizeof(float)), "cudaMallocHost");
        std::mt19937 rng(7);
        std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
        std::vector<float> expect(n);
        for (std::size_t i = 0; i < n; ++i) {
            x[i] = dist(rng);
            y[i] = dist(rng);
            expect[i] = a * x[i] + y[i];
        }
        std::size_t wrong = 0;
        {
            std::vector<cudawait::stream> streams(4);
            cudawait::scheduler sched;
            cudawait::sync_wait(sched, run_all(sched, streams, x, y));
        }
        for (std::size_t i = 0; i < n; ++i) {
            wrong += std::fabs(y[i] - expect[i]) > 1e-6f;
        }
        std::printf("saxpy over %d chunks on 4 streams: %zu of %zu elements wrong\n", chunks, wrong,
                    n);
        cudawait::check(cudaFreeHost(x), "cudaFreeHost");
        cudawait::check(cudaFreeHost(y), "cudaFreeHost");
        return wrong == 0 ? 0 : 1;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "host_orchestration: %s\n", e.what());
        return 1;
    }
}
