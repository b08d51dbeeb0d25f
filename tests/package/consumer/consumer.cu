// SPDX-License-Identifier: Apache-2.0
// The packaging-test consumer, built by nvcc: the same program plus a kernel launched on a
// cudawait::stream and awaited.
#include "consumer.hpp"

#include <cstddef>

namespace {

__global__ void add_one(unsigned char* bytes, std::size_t size) {
    const std::size_t i = std::size_t{blockIdx.x} * blockDim.x + threadIdx.x;
    if (i < size) {
        bytes[i] = static_cast<unsigned char>(bytes[i] + 1);
    }
}

cudawait::task<bool> launch_add_one(cudawait::stream& s, unsigned char* bytes, std::size_t size) {
    constexpr unsigned threads = 256;
    const auto blocks = static_cast<unsigned>((size + threads - 1) / threads);
    add_one<<<blocks, threads, 0, s.get()>>>(bytes, size);
    cudawait::check(cudaGetLastError(), "add_one<<<>>>");
    co_await s;
    constexpr auto want = static_cast<unsigned char>(consumer::fill_byte + 1);
    if (!co_await consumer::device_bytes_equal(s, bytes, size, want)) {
        std::fprintf(stderr, "the add_one kernel's result is wrong\n");
        co_return false;
    }
    co_return true;
}

} // namespace

int main() { return consumer::run("nvcc", &launch_add_one); }
