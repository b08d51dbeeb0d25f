// SPDX-License-Identifier: Apache-2.0
#include <cudawait/cudawait.hpp>

#include <algorithm>
#include <cstdio>
#include <numeric>
#include <string>

__global__ void square(float* x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n)
        x[i] *= x[i];
}

// Squares n copies of `value` on a stream of its own and returns their sum.
cudawait::task<double> sum_of_squares(int n, float value) {
    cudawait::stream s;                       // non-blocking; synchronised before it is destroyed
    cudawait::device_buffer<float> dev(n, s); // cudaMallocAsync on s, freed on s
    cudawait::pinned_buffer<float> host(n);   // page-locked, from a pool
    std::fill(host.begin(), host.end(), value);
    cudawait::copy_async(dev, host, s); // H2D, in s's order: the host does not wait
    square<<<(n + 255) / 256, 256, 0, s.get()>>>(dev.data(), n);
    co_await cudawait::copy(host, dev, s); // D2H; the thread runs other coroutines meanwhile
    co_return std::accumulate(host.begin(), host.end(), 0.0);
}

int main() {
    if (std::string why = cudawait::no_device_reason(); !why.empty()) {
        std::fprintf(stderr, "no CUDA device: %s\n", why.c_str());
        return 2;
    }
    cudawait::scheduler sched;
    auto [a, b] = cudawait::sync_wait(
        sched, cudawait::when_all(sum_of_squares(1 << 20, 3.0f), sum_of_squares(1 << 19, 2.0f)));
    std::printf("%.0f %.0f\n", a, b); // 9437184 2097152
    return a == 9.0 * (1 << 20) && b == 4.0 * (1 << 19) ? 0 : 1;
}
