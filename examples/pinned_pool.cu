// SPDX-License-Identifier: Apache-2.0
// pinned_pool: page-locked memory from a pool grown once, buffers that give their block back
// only when the GPU is done with it, and a copy from ordinary (pageable) memory that is staged
// and overlapped instead of silently running at pageable speed.

#include <cudawait/copy.hpp>
#include <cudawait/core.hpp>
#include <cudawait/memory.hpp>
#include <cudawait/runtime.hpp>

#include <chrono>
#include <cstdio>
#include <numeric>
#include <string>
#include <vector>

namespace demo {

using namespace cudawait::literals;

__global__ void scale(float* data, std::size_t n, float by) {
    for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
        data[i] *= by;
    }
}

// Round trip through the GPU from pinned memory, then from a plain std::vector.
cudawait::task<int> run(cudawait::pinned_pool& pool) {
    cudawait::stream s;
    const std::size_t n = 64_MiB / sizeof(float);
    cudawait::device_buffer<float> dev(n, s);

    // Pinned: a buffer from the pool; copies record their use, so freeing it early is safe.
    cudawait::pinned_buffer<float> pinned(n, pool);
    std::iota(pinned.begin(), pinned.end(), 0.0f);
    co_await cudawait::copy(dev, pinned, s);
    scale<<<256, 256, 0, s.get()>>>(dev.data(), n, 2.0f);
    cudawait::check(cudaGetLastError(), "scale<<<>>>");
    co_await cudawait::copy(pinned, dev, s);
    int bad = 0;
    for (std::size_t i = 0; i < n; ++i) {
        bad += pinned[i] != 2.0f * static_cast<float>(i);
    }

    // Pageable: a std::vector, staged through pinned chunks with the host copy overlapped. The
    // first staged copy grows the default pool and starts the copy threads; time the second.
    std::vector<float> plain(n);
    std::iota(plain.begin(), plain.end(), 1.0f);
    co_await cudawait::copy(dev, plain, s);
    auto t0 = std::chrono::steady_clock::now();
    co_await cudawait::copy(dev, plain, s);
    auto t1 = std::chrono::steady_clock::now();
    scale<<<256, 256, 0, s.get()>>>(dev.data(), n, 0.5f);
    cudawait::check(cudaGetLastError(), "scale<<<>>>");
    co_await cudawait::copy(plain, dev, s);
    for (std::size_t i = 0; i < n; ++i) {
        bad += plain[i] != 0.5f * static_cast<float>(i + 1);
    }
    double secs = std::chrono::duration<double>(t1 - t0).count();
    std::printf("staged copy of 64 MiB from a std::vector: %.1f GB/s\n", 64_MiB / secs / 1e9);
    std::printf("%s\n", bad == 0 ? "every element checked: ok" : "MISMATCH");
    co_return bad == 0 ? 0 : 1;
}

} // namespace demo

int main() {
    using namespace cudawait::literals;
    if (const std::string why = cudawait::no_device_reason(); !why.empty()) {
        std::fprintf(stderr, "pinned_pool: no CUDA device on this machine (%s); it needs a GPU.\n",
                     why.c_str());
        return 2;
    }
    try {
        // Sized for this demo: one slot staging 64 MiB in and 64 MiB out.
        cudawait::pinned_pool pool;
        pool.reserve(cudawait::pinned_pool::size_for(1, 64_MiB, 64_MiB));
        cudawait::scheduler sched;
        int rc = cudawait::sync_wait(sched, demo::run(pool));
        auto st = pool.stats();
        std::printf("pool: reserved %zu MiB in %llu growth(s) taking %.1f ms; peak in use %zu MiB; "
                    "%llu hits, %llu misses\n",
                    st.reserved_bytes >> 20, static_cast<unsigned long long>(st.growth_count),
                    std::chrono::duration<double, std::milli>(st.growth_time).count(),
                    st.peak_in_use_bytes >> 20, static_cast<unsigned long long>(st.hits),
                    static_cast<unsigned long long>(st.misses));
        return rc;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "pinned_pool: %s\n", e.what());
        return 1;
    }
}
