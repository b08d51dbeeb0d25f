// SPDX-License-Identifier: Apache-2.0
#pragma once

// What every pipeline_bench run computes, and how its output is checked. Two kernels, both
// float -> float maps over a chunk, grid-stride:
//   light   out[i] = fma(in[i], a, b): memory-bound
//   heavy   K dependent FMAs per element, K calibrated at startup (cudaEvent timing, see
//           calibrate_heavy) so that the kernel on one chunk takes as long as the chunk's H2D
//           copy
// The input is random floats in pinned memory, with the host's reference results computed once
// (bit-exact: the device and the host both use fused multiply-adds). A run's output is
// poisoned where it will be checked, and a wrong value ends the program.
//
// Included by pipeline_bench.cu only: the kernels are defined here (nvcc ignores `inline` on a
// __global__ function).

#include <cudawait/cudawait.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include <cuda_runtime.h>

#include "bench_support.hpp"

namespace bench {

enum class work { light, heavy };

constexpr float kLightA = 1.5f;
constexpr float kLightB = 0.25f;
constexpr float kHeavyA = 0.999f; ///< v -> a v + b converges to 1: no overflow, no denormals
constexpr float kHeavyB = 0.001f;
constexpr int kCalibrationK = 256;  ///< FMAs per element of the first calibration launch
constexpr int kCalibrationReps = 7; ///< timed repetitions per calibration figure
constexpr unsigned kBlock = 256;
constexpr unsigned kBlocksPerSm = 8;

constexpr std::size_t kSampleTarget = std::size_t{1} << 20; ///< light: strided sample size
constexpr std::size_t kHeavySamples = std::size_t{1} << 16; ///< heavy: strided sample size
constexpr std::size_t kHeavyEdge = 4096; ///< heavy: first and last elements, also checked

/// Calibration of the heavy kernel, done once at startup.
struct calibration {
    int k = 0;           ///< FMAs per element
    double h2d_ms = 0;   ///< one pinned H2D copy of a chunk
    double d2h_ms = 0;   ///< one pinned D2H copy of a chunk
    double light_ms = 0; ///< the light kernel on one chunk
    double heavy_ms = 0; ///< the heavy kernel with `k` on one chunk
};
inline calibration g_cal;
inline int g_sm_count = 0;             ///< device 0's multiprocessors, set before any launch
inline std::size_t g_checked_runs = 0; ///< runs whose output was checked

// ---- kernels -----------------------------------------------------------------------------------

__global__ void light_kernel(const float* in, float* out, std::size_t n, float a, float b) {
    const std::size_t stride = std::size_t{gridDim.x} * blockDim.x;
    for (std::size_t i = std::size_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n; i += stride) {
        out[i] = __fmaf_rn(in[i], a, b);
    }
}

__global__ void heavy_kernel(const float* in, float* out, std::size_t n, float a, float b, int k) {
    const std::size_t stride = std::size_t{gridDim.x} * blockDim.x;
    for (std::size_t i = std::size_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n; i += stride) {
        float v = in[i];
        for (int j = 0; j < k; ++j) {
            v = __fmaf_rn(v, a, b);
        }
        out[i] = v;
    }
}

/// Enough blocks for a full device (kBlocksPerSm x kBlock threads per SM), fewer for small n.
inline unsigned grid_for(std::size_t n) {
    const std::size_t wanted = (n + kBlock - 1) / kBlock;
    const std::size_t full = static_cast<std::size_t>(g_sm_count) * kBlocksPerSm;
    return static_cast<unsigned>(std::max<std::size_t>(1, std::min(wanted, full)));
}

// cudaLaunchKernel returns the launch status directly (no cudaGetLastError round trip).
inline void launch_light(const float* in, float* out, std::size_t n, cudaStream_t s) {
    float a = kLightA;
    float b = kLightB;
    void* args[] = {&in, &out, &n, &a, &b};
    cudawait::check(cudaLaunchKernel(light_kernel, dim3(grid_for(n)), dim3(kBlock), args, 0, s),
                    "cudaLaunchKernel");
}

inline void launch_heavy(const float* in, float* out, std::size_t n, int k, cudaStream_t s) {
    float a = kHeavyA;
    float b = kHeavyB;
    void* args[] = {&in, &out, &n, &a, &b, &k};
    cudawait::check(cudaLaunchKernel(heavy_kernel, dim3(grid_for(n)), dim3(kBlock), args, 0, s),
                    "cudaLaunchKernel");
}

inline void launch_work(work w, const float* in, float* out, std::size_t n, cudaStream_t s) {
    if (w == work::light) {
        launch_light(in, out, n, s);
    } else {
        launch_heavy(in, out, n, g_cal.k, s);
    }
}

/// The pipeline's stage for the light kernel.
struct light_stage {
    void operator()(std::span<float> in, std::span<float> out, cudawait::stream_ref s) const {
        launch_light(in.data(), out.data(), in.size(), s.get());
    }
};

/// The pipeline's stage for the heavy kernel.
struct heavy_stage {
    int k;
    void operator()(std::span<float> in, std::span<float> out, cudawait::stream_ref s) const {
        launch_heavy(in.data(), out.data(), in.size(), k, s.get());
    }
};

/// The kernel of `w` as the hand-written variants (bench_raw_pipeline.hpp) launch it.
struct work_kernel {
    work w;
    void operator()(const float* in, float* out, std::size_t n, cudaStream_t s) const {
        launch_work(w, in, out, n, s);
    }
};

// ---- the input and the host's reference --------------------------------------------------------

/// Runs fn(args..., begin, end) over [0, n) split across the hardware's threads.
template <class Fn, class... Args>
void parallel_ranges(std::size_t n, Fn fn, Args... args) {
    const std::size_t parts = std::clamp<std::size_t>(std::thread::hardware_concurrency(), 1, 64);
    std::vector<std::jthread> threads; // joined when they go out of scope
    threads.reserve(parts);
    for (std::size_t p = 0; p < parts; ++p) {
        threads.emplace_back(fn, args..., n * p / parts, n * (p + 1) / parts);
    }
}

/// Uniform floats in [-1, 1) from splitmix64 of the element index (the same on every thread
/// split, so the input does not depend on the number of threads).
inline void fill_range(float* p, std::size_t begin, std::size_t end) {
    for (std::size_t i = begin; i < end; ++i) {
        std::uint64_t z = 0x243f6a8885a308d3ULL + (i + 1) * 0x9e3779b97f4a7c15ULL;
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
        z ^= z >> 31;
        p[i] = static_cast<float>(static_cast<std::int32_t>(z >> 32)) * 0x1p-31f;
    }
}

inline float light_reference(float x) { return std::fma(x, kLightA, kLightB); }

inline float heavy_reference(float x, int k) {
    for (int j = 0; j < k; ++j) {
        x = std::fma(x, kHeavyA, kHeavyB);
    }
    return x;
}

inline void light_reference_range(const float* in, float* ref, std::size_t begin, std::size_t end) {
    for (std::size_t i = begin; i < end; ++i) {
        ref[i] = light_reference(in[i]);
    }
}

inline void heavy_reference_range(const float* in, const std::size_t* at, float* ref, int k,
                                  std::size_t begin, std::size_t end) {
    for (std::size_t j = begin; j < end; ++j) {
        ref[j] = heavy_reference(in[at[j]], k);
    }
}

/// n random floats and room for the output, page-locked, with the reference results (the heavy
/// ones for g_cal.k, so the calibration comes first).
struct workload {
    cudawait::pinned_pool pool; // declared first: destroyed after the buffers
    cudawait::pinned_buffer<float> in;
    cudawait::pinned_buffer<float> out;
    std::vector<float> light_ref;      ///< the light kernel's result for every input element
    std::vector<std::size_t> heavy_at; ///< elements the heavy runs are checked at
    std::vector<float> heavy_ref;      ///< the heavy kernel's result there

    explicit workload(std::size_t n) {
        pool.reserve(2 * n * sizeof(float));
        in = cudawait::pinned_buffer<float>(n, pool);
        out = cudawait::pinned_buffer<float>(n, pool);
        parallel_ranges(n, fill_range, in.data());
        light_ref.resize(n);
        parallel_ranges(n, light_reference_range, static_cast<const float*>(in.data()),
                        light_ref.data());
        const std::size_t stride = n / kHeavySamples;
        for (std::size_t i = 0; i < kHeavyEdge; ++i) {
            heavy_at.push_back(i);
        }
        for (std::size_t j = 0; j < kHeavySamples; ++j) {
            heavy_at.push_back(sample_index(j, stride));
        }
        for (std::size_t i = n - kHeavyEdge; i < n; ++i) {
            heavy_at.push_back(i);
        }
        heavy_ref.resize(heavy_at.size());
        parallel_ranges(
            heavy_at.size(), heavy_reference_range, static_cast<const float*>(in.data()),
            static_cast<const std::size_t*>(heavy_at.data()), heavy_ref.data(), g_cal.k);
    }
    workload(const workload&) = delete;
    workload& operator=(const workload&) = delete;
};

// ---- checking ----------------------------------------------------------------------------------

/// The last chunk of a run of n elements in chunks of `chunk`: [n - tail, n).
inline std::size_t tail_of(std::size_t n, std::size_t chunk) {
    return n % chunk == 0 ? std::min(chunk, n) : n % chunk;
}

/// Calls f(begin, end) for every range a light run is checked at: the first and last chunk in
/// full, and a strided sample of about 1M single elements.
template <class F>
void for_light_checks(std::size_t n, std::size_t chunk, F&& f) {
    f(std::size_t{0}, std::min(chunk, n));
    f(n - tail_of(n, chunk), n);
    const std::size_t stride = std::max<std::size_t>(1, n / kSampleTarget);
    for (std::size_t j = 0; j < n / stride; ++j) {
        const std::size_t i = sample_index(j, stride);
        f(i, i + 1);
    }
}

/// Overwrites every element the check after a run of n elements in chunks of `chunk` looks at
/// (bench::poison).
inline void poison(const workload& wd, work w, float* out, std::size_t n, std::size_t chunk) {
    if (w == work::light) {
        for_light_checks(n, chunk, [&](std::size_t b, std::size_t e) { poison(out, b, e); });
    } else {
        for (std::size_t i : wd.heavy_at) {
            poison(out, i, i + 1);
        }
    }
}

/// Compares those elements with the host reference; the first wrong one ends the program.
inline void check_output(const workload& wd, work w, const float* out, std::size_t n,
                         std::size_t chunk, const std::string& what) {
    if (w == work::light) {
        const float* ref = wd.light_ref.data();
        for_light_checks(n, chunk,
                         [&](std::size_t b, std::size_t e) { expect_range(ref, out, b, e, what); });
    } else {
        for (std::size_t j = 0; j < wd.heavy_at.size(); ++j) {
            expect_at(out, wd.heavy_at[j], wd.heavy_ref[j], what);
        }
    }
    ++g_checked_runs;
}

// ---- calibration -------------------------------------------------------------------------------

/// Buffers for timing one chunk's operations with events.
struct calibration_buffers {
    std::size_t n;      ///< elements of the chunk
    cudawait::stream s; // before the device buffers, which are freed on it
    cudawait::pinned_buffer<float> host;
    cudawait::device_buffer<float> din;
    cudawait::device_buffer<float> dout;
    cudawait::event start;
    cudawait::event stop;

    explicit calibration_buffers(std::size_t chunk)
        : n(chunk), s(cudawait::device_ref(0), 0), host(chunk), din(chunk, s), dout(chunk, s),
          start(cudawait::device_ref(0), cudaEventDefault),
          stop(cudawait::device_ref(0), cudaEventDefault) {
        fill_range(host.data(), 0, n);
        cudawait::check(cudaMemcpyAsync(din.data(), host.data(), n * sizeof(float),
                                        cudaMemcpyHostToDevice, s.get()),
                        "cudaMemcpyAsync");
        s.sync();
    }
};

enum class calibration_op { h2d, d2h, light, heavy };

/// Median milliseconds of `op` on one chunk, by cudaEvent timing, after one untimed run.
inline double time_op_ms(calibration_buffers& b, calibration_op op, int k) {
    std::vector<double> ms;
    for (int rep = -1; rep < kCalibrationReps; ++rep) {
        b.start.record(b.s);
        switch (op) {
        case calibration_op::h2d:
            cudawait::check(cudaMemcpyAsync(b.din.data(), b.host.data(), b.n * sizeof(float),
                                            cudaMemcpyHostToDevice, b.s.get()),
                            "cudaMemcpyAsync");
            break;
        case calibration_op::d2h:
            cudawait::check(cudaMemcpyAsync(b.host.data(), b.dout.data(), b.n * sizeof(float),
                                            cudaMemcpyDeviceToHost, b.s.get()),
                            "cudaMemcpyAsync");
            break;
        case calibration_op::light:
            launch_light(b.din.data(), b.dout.data(), b.n, b.s.get());
            break;
        case calibration_op::heavy:
            launch_heavy(b.din.data(), b.dout.data(), b.n, k, b.s.get());
            break;
        }
        b.stop.record(b.s);
        b.stop.sync();
        float elapsed = 0;
        cudawait::check(cudaEventElapsedTime(&elapsed, b.start.get(), b.stop.get()),
                        "cudaEventElapsedTime");
        if (rep >= 0) {
            ms.push_back(static_cast<double>(elapsed));
        }
    }
    return median(ms);
}

/// Sets g_cal: picks K so that the heavy kernel on one chunk of `chunk` elements takes as long
/// as its H2D copy (a first launch with kCalibrationK scales K linearly, a second corrects it
/// once), and times the chunk's copies and kernels.
inline void calibrate_heavy(std::size_t chunk) {
    calibration_buffers b(chunk);
    calibration c;
    c.h2d_ms = time_op_ms(b, calibration_op::h2d, 0);
    c.d2h_ms = time_op_ms(b, calibration_op::d2h, 0);
    c.light_ms = time_op_ms(b, calibration_op::light, 0);
    int k = kCalibrationK;
    for (int pass = 0; pass < 2; ++pass) {
        const double ms = time_op_ms(b, calibration_op::heavy, k);
        k = std::max(1, static_cast<int>(std::lround(k * c.h2d_ms / ms)));
    }
    c.k = k;
    c.heavy_ms = time_op_ms(b, calibration_op::heavy, k);
    b.s.sync();
    g_cal = c;
    benchmark::AddCustomContext("heavy_K", std::to_string(c.k));
}

} // namespace bench
