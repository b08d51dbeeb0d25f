// SPDX-License-Identifier: Apache-2.0
// pipeline: 1 GiB through H2D -> kernel -> D2H in 64 MiB chunks, first one chunk at a time, then
// with cudawait::pipeline (three slots, copies both ways and the kernel overlapped), and the
// pipeline's own account of what it achieved; then one more run with a timeline attached, written
// as pipeline_trace.json (chrome://tracing, ui.perfetto.dev) and pipeline_timeline.svg (any
// browser) into the working directory: the copies and the kernel overlapping, chunk by chunk.

#include <cudawait/copy.hpp>
#include <cudawait/core.hpp>
#include <cudawait/memory.hpp>
#include <cudawait/observe.hpp>
#include <cudawait/pipeline.hpp>
#include <cudawait/runtime.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <span>
#include <string>
#include <utility>

namespace demo {

using namespace cudawait::literals;
using clock = std::chrono::steady_clock;

__global__ void saxpy(const float* x, float* y, std::size_t n, float a) {
    for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
        y[i] = a * x[i] + 1.0f;
    }
}

void launch_saxpy(std::span<float> in, std::span<float> out, cudawait::stream_ref s) {
    saxpy<<<1024, 256, 0, s.get()>>>(in.data(), out.data(), in.size(), 2.0f);
}

// The plain way: one stream, each chunk copied in, computed and copied out before the next.
double serial(std::span<const float> in, std::span<float> out, std::size_t chunk) {
    cudawait::stream s;
    cudawait::device_buffer<float> din(chunk, s);
    cudawait::device_buffer<float> dout(chunk, s);
    auto t0 = clock::now();
    for (std::size_t off = 0; off < in.size(); off += chunk) {
        std::size_t n = std::min(chunk, in.size() - off);
        cudawait::copy_async(din.span().first(n), in.subspan(off, n), s);
        launch_saxpy(din.span().first(n), dout.span().first(n), s);
        cudawait::check(cudaGetLastError(), "saxpy");
        cudawait::copy_async(out.subspan(off, n), dout.span().first(n), s);
        s.sync();
    }
    return std::chrono::duration<double>(clock::now() - t0).count();
}

bool check_output(std::span<const float> in, std::span<const float> out) {
    for (std::size_t i = 0; i < in.size(); i += 4099) {
        if (out[i] != 2.0f * in[i] + 1.0f) {
            std::printf("wrong output at %zu: %f\n", i, static_cast<double>(out[i]));
            return false;
        }
    }
    return out.back() == 2.0f * in.back() + 1.0f;
}

} // namespace demo

int main() {
    using namespace cudawait::literals;
    if (const std::string why = cudawait::no_device_reason(); !why.empty()) {
        std::fprintf(stderr, "pipeline: no CUDA device on this machine (%s); it needs a GPU.\n",
                     why.c_str());
        return 2;
    }
    try {
        const std::size_t total = 1_GiB / sizeof(float);
        const std::size_t chunk = 64_MiB / sizeof(float);
        cudawait::pinned_buffer<float> in(total);
        cudawait::pinned_buffer<float> out(total);
        for (std::size_t i = 0; i < total; ++i) {
            in[i] = static_cast<float>(i % 1000);
        }

        double serial_s = demo::serial(in.span(), out.span(), chunk);
        bool ok = demo::check_output(in.span(), out.span());

        cudawait::pipeline_options opt;
        opt.chunk_elements = chunk;
        opt.depth = 3;
        opt.monitoring.timing = true;
        bool link_described = false; // an alert is read against the link: print it once
        opt.monitoring.on_alert = [&](const cudawait::pipeline_alert& a) {
            std::printf("  alert (%s, %s): %.1f GB/s, peak %.1f GB/s\n",
                        std::string(cudawait::to_string(a.kind)).c_str(), a.direction,
                        a.achieved_gbps, a.peak_gbps);
            if (!std::exchange(link_described, true)) {
                std::printf("  %s\n", cudawait::to_string(cudawait::describe_link(0)).c_str());
            }
        };
        cudawait::pipeline<float> pipe(opt, {demo::launch_saxpy});
        cudawait::scheduler sched;
        cudawait::sync_wait(sched, pipe.run(in.span(), out.span())); // warm-up
        std::fill(out.begin(), out.end(), 0.0f);
        auto t0 = demo::clock::now();
        cudawait::sync_wait(sched, pipe.run(in.span(), out.span()));
        double piped_s = std::chrono::duration<double>(demo::clock::now() - t0).count();
        ok = ok && demo::check_output(in.span(), out.span());

        double gb = static_cast<double>(total * sizeof(float)) / 1e9;
        auto st = pipe.stats();
        std::printf("1 GiB, 64 MiB chunks, H2D -> saxpy -> D2H\n");
        std::printf("  serial (one stream, sync per chunk): %6.1f GB/s\n", gb / serial_s);
        std::printf("  cudawait::pipeline, depth 3:         %6.1f GB/s  (%.2fx)\n", gb / piped_s,
                    serial_s / piped_s);
        std::printf("pipeline stats: H2D %.1f GB/s, D2H %.1f GB/s (link peak %.1f GB/s one way); "
                    "compute:transfer %.2f; overlap efficiency %.2f; suggested chunk %zu MiB\n",
                    st.h2d_gbps, st.d2h_gbps, st.link_peak_gbps, st.compute_to_transfer,
                    st.overlap_efficiency, pipe.suggest_chunk_size() * sizeof(float) >> 20);

        // What ran where: the same run with a timeline attached (a pipeline of its own, since
        // the options are fixed at construction; the timeline outlives it).
        cudawait::timeline tl;
        opt.monitoring.timeline = &tl;
        {
            cudawait::pipeline<float> traced(opt, {demo::launch_saxpy});
            std::fill(out.begin(), out.end(), 0.0f);
            cudawait::sync_wait(sched, traced.run(in.span(), out.span()));
            ok = ok && demo::check_output(in.span(), out.span());
        }
        tl.write_chrome_trace("pipeline_trace.json");
        tl.write_svg("pipeline_timeline.svg");
        const std::string dir = std::filesystem::current_path().string();
        std::printf("timeline of a traced run: %s/pipeline_trace.json (open in ui.perfetto.dev "
                    "or chrome://tracing) and %s/pipeline_timeline.svg (any browser)\n",
                    dir.c_str(), dir.c_str());
        std::printf("%s\n", ok ? "outputs checked: ok" : "OUTPUT MISMATCH");
        return ok ? 0 : 1;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "pipeline: %s\n", e.what());
        return 1;
    }
}
