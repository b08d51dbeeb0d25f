// SPDX-License-Identifier: Apache-2.0
// hello_await: two coroutines, each on its own stream, await their kernels and copies without
// blocking a thread; when_all joins them.

#include <cudawait/core.hpp>
#include <cudawait/runtime.hpp>

#include <cstdio>
#include <string>
#include <vector>

namespace hello {

__global__ void square(const float* in, float* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        out[i] = in[i] * in[i];
    }
}

// Squares 0..n-1 on `s` and returns the sum, checked on the host.
cudawait::task<double> sum_of_squares(int n) {
    cudawait::stream s; // non-blocking, owned, synchronised before it is destroyed
    std::vector<float> host(n);
    for (int i = 0; i < n; ++i) {
        host[i] = static_cast<float>(i);
    }
    float* dev = nullptr;
    cudawait::check(cudaMallocAsync(&dev, 2 * n * sizeof(float), s.get()), "cudaMallocAsync");
    cudawait::check(
        cudaMemcpyAsync(dev, host.data(), n * sizeof(float), cudaMemcpyHostToDevice, s.get()),
        "cudaMemcpyAsync");
    square<<<(n + 255) / 256, 256, 0, s.get()>>>(dev, dev + n, n);
    cudawait::check(cudaGetLastError(), "square<<<>>>");
    cudawait::check(
        cudaMemcpyAsync(host.data(), dev + n, n * sizeof(float), cudaMemcpyDeviceToHost, s.get()),
        "cudaMemcpyAsync");
    cudawait::check(cudaFreeAsync(dev, s.get()), "cudaFreeAsync");
    co_await s; // the thread is free to run other coroutines until the GPU is done
    double sum = 0;
    for (float v : host) {
        sum += v;
    }
    co_return sum;
}

cudawait::task<int> hello_main() {
    auto [a, b] = co_await cudawait::when_all(sum_of_squares(1000), sum_of_squares(2000));
    const double expect_a = 999.0 * 1000 * 1999 / 6;
    const double expect_b = 1999.0 * 2000 * 3999 / 6;
    std::printf("sum of squares below 1000: %.0f (expected %.0f)\n", a, expect_a);
    std::printf("sum of squares below 2000: %.0f (expected %.0f)\n", b, expect_b);
    co_return (a == expect_a && b == expect_b) ? 0 : 1;
}

} // namespace hello

int main() {
    if (const std::string why = cudawait::no_device_reason(); !why.empty()) {
        std::fprintf(stderr, "hello_await: no CUDA device on this machine (%s); it needs a GPU.\n",
                     why.c_str());
        return 2;
    }
    try {
        cudawait::scheduler sched;
        return cudawait::sync_wait(sched, hello::hello_main());
    } catch (const cudawait::cuda_error& e) {
        std::fprintf(stderr, "hello_await: %s\n", e.what());
        return 1;
    }
}
