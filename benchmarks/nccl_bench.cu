// SPDX-License-Identifier: Apache-2.0
//
// nccl_bench: what awaiting an NCCL all-reduce through cudawait costs compared to the plain
// NCCL call and a stream synchronisation.
//
//   One rank per visible device, all in this process (ncclCommInitAll), one stream per rank.
//   Sizes 4 KiB .. 1 GiB of floats, x4 per step; per size, interleaved (bench::interleaved):
//     BM_nccl_awaited/<size>   every rank's co_await nccl::all_reduce (enqueued in one group),
//                              awaited with when_all under sync_wait on one scheduler
//     BM_nccl_raw/<size>       ncclAllReduce for every rank in one group, then
//                              cudaStreamSynchronize of every stream
//   Each sample is one all-reduce over all ranks, host wall clock from the first enqueue to the
//   last rank done. The result of the first awaited run of each size is checked element by
//   element (the program aborts if it is wrong).
//
// After the benchmarks main() prints the number of ranks and, per size, the medians and the
// ratio awaited / raw, with the target "<= 1.05 at >= 1 MiB". NCCL_NVLS_ENABLE is forced to 0.
// Without a CUDA device the program exits with 2.

#include <cudawait/cudawait.hpp>
#include <cudawait/nccl/nccl.hpp>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "bench_support.hpp"
#include <benchmark/benchmark.h>

namespace bench {

using cudawait::check;
using namespace cudawait::literals;
namespace nccl = cudawait::nccl;

constexpr std::size_t kMinBytes = 4_KiB;
constexpr std::size_t kMaxBytes = 1_GiB;
constexpr double kTargetRatio = 1.05;
constexpr std::size_t kTargetFrom = 1_MiB;

/// Rounds per size: many for the small sizes (noisy, cheap), few for the large ones.
std::int64_t rounds_for(std::size_t bytes) {
    if (bytes <= 1_MiB) {
        return 200;
    }
    if (bytes <= 64_MiB) {
        return 50;
    }
    return 15;
}

std::vector<std::size_t> sizes() {
    std::vector<std::size_t> out;
    for (std::size_t b = kMinBytes; b <= kMaxBytes; b *= 4) {
        out.push_back(b);
    }
    return out;
}

/// One rank: its communicator, stream and buffers of kMaxBytes.
struct rank_buffers {
    nccl::communicator comm;
    std::optional<cudawait::stream> st;
    float* send = nullptr;
    float* recv = nullptr;
    rank_buffers() = default;
    rank_buffers(const rank_buffers&) = delete;
    rank_buffers& operator=(const rank_buffers&) = delete;
    ~rank_buffers() {
        cudawait::detail::report(cudaFree(send), "cudaFree");
        cudawait::detail::report(cudaFree(recv), "cudaFree");
    }
};

struct world {
    std::vector<std::unique_ptr<rank_buffers>> ranks;
    std::unique_ptr<cudawait::scheduler> sched;
};
std::unique_ptr<world> g_world;
std::map<std::string, runs_by_variant> g_measured;
std::map<std::size_t, std::pair<double, double>> g_medians; // bytes -> (awaited, raw) seconds

/// The value rank r sends at element i: a small integer, so the sum is exact in any order.
float value(std::size_t i, std::size_t r) { return static_cast<float>((i * 3 + r * 11) % 61); }

void set_up() {
    create_context_and_async_pool();
    (void)add_device_context();
    g_world = std::make_unique<world>();
    world& w = *g_world;
    auto comms = nccl::communicator::init_all();
    const std::size_t count = kMaxBytes / sizeof(float);
    std::vector<float> host(count);
    for (auto& c : comms) {
        auto r = std::make_unique<rank_buffers>();
        const int dev = c.device();
        r->comm = std::move(c);
        cudawait::device_guard guard{cudawait::device_ref(dev)};
        r->st.emplace(cudawait::device_ref(dev));
        check(cudaMalloc(&r->send, kMaxBytes), "cudaMalloc");
        check(cudaMalloc(&r->recv, kMaxBytes), "cudaMalloc");
        const auto rank = static_cast<std::size_t>(r->comm.rank());
        for (std::size_t i = 0; i < count; ++i) {
            host[i] = value(i, rank);
        }
        check(cudaMemcpy(r->send, host.data(), kMaxBytes, cudaMemcpyHostToDevice), "cudaMemcpy");
        // The legacy stream's copy may still be landing; the ranks' streams do not wait for it.
        check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
        w.ranks.push_back(std::move(r));
    }
    w.sched = std::make_unique<cudawait::scheduler>();
    benchmark::AddCustomContext("nccl_ranks", std::to_string(w.ranks.size()));
    std::printf("nccl_bench: %zu rank(s), one per device, in this process\n", w.ranks.size());
}

double awaited_once(std::size_t count) {
    auto& ranks = g_world->ranks;
    const auto t0 = steady::now();
    auto body = [&]() -> cudawait::task<void> {
        std::vector<cudawait::task<void>> ts;
        {
            nccl::group g;
            for (auto& r : ranks) {
                ts.push_back(nccl::all_reduce<float>(std::span<const float>(r->send, count),
                                                     std::span<float>(r->recv, count), ncclSum,
                                                     r->comm, *r->st));
            }
            g.end();
        }
        co_await cudawait::when_all(std::move(ts));
    };
    cudawait::sync_wait(*g_world->sched, body());
    return seconds(steady::now() - t0);
}

double raw_once(std::size_t count) {
    auto& ranks = g_world->ranks;
    const auto t0 = steady::now();
    {
        nccl::detail::check(ncclGroupStart(), "ncclGroupStart");
        for (auto& r : ranks) {
            nccl::detail::check(ncclAllReduce(r->send, r->recv, count, ncclFloat32, ncclSum,
                                              r->comm.get(), r->st->get()),
                                "ncclAllReduce");
        }
        nccl::detail::check(ncclGroupEnd(), "ncclGroupEnd");
    }
    for (auto& r : ranks) {
        check(cudaStreamSynchronize(r->st->get()), "cudaStreamSynchronize");
    }
    return seconds(steady::now() - t0);
}

/// The first awaited run of a size, on poisoned outputs, checked element by element.
void check_once(std::size_t count) {
    for (auto& r : g_world->ranks) {
        // On the rank's device, settled before its (non-blocking) stream writes the output.
        cudawait::device_guard guard{cudawait::device_ref(r->comm.device())};
        check(cudaMemset(r->recv, 0xff, count * sizeof(float)), "cudaMemset");
        check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    }
    (void)awaited_once(count);
    const std::size_t n = g_world->ranks.size();
    std::vector<float> out(count);
    for (auto& r : g_world->ranks) {
        check(cudaMemcpy(out.data(), r->recv, count * sizeof(float), cudaMemcpyDeviceToHost),
              "cudaMemcpy");
        for (std::size_t i = 0; i < count; ++i) {
            float expected = 0.0f;
            for (std::size_t q = 0; q < n; ++q) {
                expected += value(i, q);
            }
            expect_at(out.data(), i, expected, "co_await nccl::all_reduce");
        }
    }
}

runs_by_variant measure(std::size_t bytes) {
    const std::size_t count = bytes / sizeof(float);
    check_once(count);
    const char* names[] = {"awaited", "raw"};
    return interleaved(rounds_for(bytes), names, [&](std::size_t i) {
        return i == 0 ? awaited_once(count) : raw_once(count);
    });
}

void BM_nccl(benchmark::State& state, std::size_t bytes, const char* variant) {
    guarded(state, [&] {
        const runs_by_variant runs =
            measured_once(g_measured, std::to_string(bytes), [&] { return measure(bytes); });
        const auto mine = samples_of(runs, variant);
        g_medians[bytes] = {median(samples_of(runs, "awaited")), median(samples_of(runs, "raw"))};
        replay(state, mine);
        state.counters["GBps_algo"] = benchmark::Counter(gbps(bytes, median(mine)));
    });
}

void register_benchmarks() {
    for (std::size_t bytes : sizes()) {
        for (const char* variant : {"awaited", "raw"}) {
            benchmark::RegisterBenchmark(
                ("BM_nccl_" + std::string(variant) + "/" + size_name(bytes)).c_str(),
                [bytes, variant](benchmark::State& s) { BM_nccl(s, bytes, variant); })
                ->UseManualTime()
                ->Iterations(rounds_for(bytes))
                ->Unit(benchmark::kMicrosecond);
        }
    }
}

void print_summary() {
    std::printf("\n==== nccl_bench summary ====\n");
    std::printf("\nAll-reduce of floats (sum), %zu rank(s), one per device, one process; median "
                "host wall time per all-reduce\n",
                g_world ? g_world->ranks.size() : 0);
    std::printf("  %-8s %12s %12s %8s\n", "size", "awaited us", "raw us", "ratio");
    bool met = true;
    bool any = false;
    for (std::size_t bytes : sizes()) {
        auto it = g_medians.find(bytes);
        std::optional<double> a;
        std::optional<double> r;
        if (it != g_medians.end()) {
            a = it->second.first * 1e6;
            r = it->second.second * 1e6;
        }
        const std::optional<double> q = ratio_of(a, r);
        print_row(size_name(bytes), 8, {{a, 12, 1}, {r, 12, 1}, {q, 8, 3}});
        if (bytes >= kTargetFrom && q) {
            any = true;
            met = met && *q <= kTargetRatio;
        }
    }
    std::printf("  target: awaited / raw <= %.2f at >= %s: %s\n", kTargetRatio,
                size_name(kTargetFrom).c_str(), any ? verdict(met) : "-");
    // The communicators go before the runtime unloads at exit.
    g_world.reset();
}

} // namespace bench

int main(int argc, char** argv) {
    // Before the first NCCL call.
    ::setenv("NCCL_NVLS_ENABLE", "0", 1);
    return bench::run_main(argc, argv, "nccl_bench",
                           "every benchmark here needs a GPU (NCCL runs on the devices)",
                           bench::set_up, bench::register_benchmarks, bench::print_summary);
}
