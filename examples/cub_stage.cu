// SPDX-License-Identifier: Apache-2.0
// cub_stage: a pipeline stage that calls a library. Each chunk's inclusive prefix sum comes from
// cub::DeviceScan::InclusiveSum, launched on the stage's stream with the slot's scratch as CUB's
// temp storage. The temp size is asked for once, up front, and becomes scratch_bytes: every slot
// gets that much device memory at construction, so no chunk allocates. (thrust::cuda::par.on(s)
// would cudaMalloc and cudaFree its temporaries on every call, and both synchronise the device.)
//
// Exit status: 0 when every element matches the host's scan, 1 on a mismatch or an error, 2
// without a GPU.

#include <cudawait/core.hpp>
#include <cudawait/pipeline.hpp>
#include <cudawait/runtime.hpp>

#include <cstdint>
#include <cstdio>
#include <exception>
#include <random>
#include <span>
#include <string>
#include <vector>

#include <cub/device/device_scan.cuh>

using u32 = std::uint32_t;

// One chunk: out[i] = in[0] + ... + in[i] (modulo 2^32), on ctx.stream, in ctx.scratch.
void scan_stage(std::span<u32> in, std::span<u32> out, const cudawait::stage_context& ctx) {
    std::size_t temp_bytes = ctx.scratch.size(); // CUB checks that it is enough
    cudawait::check(cub::DeviceScan::InclusiveSum(ctx.scratch.data(), temp_bytes, in.data(),
                                                  out.data(), in.size(), ctx.stream.get()),
                    "cub::DeviceScan::InclusiveSum");
}

int main() {
    if (std::string why = cudawait::no_device_reason(); !why.empty()) {
        std::fprintf(stderr, "cub_stage: no CUDA device: %s\n", why.c_str());
        return 2;
    }
    try {
        const std::size_t chunk = std::size_t{1} << 20;
        const std::size_t n = chunk * 16 + 12'345; // 16 full chunks and a short one

        // How much temp storage a full chunk's scan needs (a shorter one needs no more). The
        // element count has the stage's type (std::size_t): CUB sizes its offsets by it.
        std::size_t temp_bytes = 0;
        cudawait::check(cub::DeviceScan::InclusiveSum(nullptr, temp_bytes,
                                                      static_cast<const u32*>(nullptr),
                                                      static_cast<u32*>(nullptr), chunk),
                        "cub::DeviceScan::InclusiveSum (size query)");

        cudawait::pipeline_options o;
        o.chunk_elements = chunk;
        o.depth = 3;
        o.memory.scratch_bytes = temp_bytes; // per slot, allocated once
        cudawait::pipeline<u32> pipe(o, {scan_stage});

        std::vector<u32> in(n);
        std::mt19937 rng(7);
        for (u32& x : in) {
            x = rng();
        }
        std::vector<u32> out(n, 0xdeadbeefu);
        cudawait::scheduler sched;
        cudawait::sync_wait(sched, pipe.run(in, out));

        // Each chunk is scanned on its own: the running sum restarts at every chunk.
        u32 sum = 0;
        for (std::size_t i = 0; i < n; ++i) {
            sum = (i % chunk == 0 ? 0u : sum) + in[i];
            if (out[i] != sum) {
                std::fprintf(stderr, "cub_stage: element %zu is %u, expected %u\n", i, out[i], sum);
                return 1;
            }
        }
        std::printf("cub_stage: %zu elements in %zu chunks scanned by CUB, %zu bytes of scratch "
                    "per slot; all match\n",
                    n, pipe.stats().chunks, temp_bytes);
        return 0;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "cub_stage: %s\n", e.what());
        return 1;
    }
}
