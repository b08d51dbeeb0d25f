// SPDX-License-Identifier: Apache-2.0
//
// data_parallel: the gradient all-reduce of a data-parallel training step, overlapped with the
// backward pass, on every visible GPU.
//
//   data_parallel [--layers L] [--mib M] [--steps S]   one process, one rank per visible GPU
//   data_parallel --spawn N [...]                      N processes, one rank each: makes the
//                                                      unique id and starts N copies of itself
//   data_parallel --ranks-from-env [...]               one rank: CUDAWAIT_NCCL_ID, CUDAWAIT_RANK,
//                                                      CUDAWAIT_NRANKS (device: rank % count)
//
// Each rank has L layers with a gradient of M MiB of floats. "Backward" of layer k is a kernel
// that writes layer k's gradient and runs about as long as one layer's all-reduce. Two ways to
// run a step:
//   serial:      every backward on the compute stream, then every all-reduce on the
//                communication stream;
//   overlapped:  layer k's all-reduce starts on the communication stream (ordered after its
//                backward by an event) while the backward of layer k-1 computes.
// A step is done when every rank's communication stream drained: one coroutine per GPU awaits
// it with nccl::wait under one scheduler. Printed, all from the same run (medians of S steps
// after a warm-up): serial and overlapped step times, the speedup, the all-reduces alone, and
// the fraction of the communication hidden = (serial - overlapped) / communication. The
// reduced gradients are checked element by element against the host's sum over the ranks (every
// rank writes different values).
//
// One thread drives every rank of this process, so each layer's all-reduces of all ranks are
// enqueued in one nccl::group, as NCCL requires. NCCL_NVLS_ENABLE is forced to 0 here and in
// the environment of the copies --spawn starts. Without a GPU the program exits with 2.

#include <cudawait/core.hpp>
#include <cudawait/nccl.hpp>
#include <cudawait/runtime.hpp>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <cuda_runtime.h>

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

extern char** environ;

namespace {

namespace nccl = cudawait::nccl;
using cudawait::check;
using cudawait::task;
using clock_type = std::chrono::steady_clock;

/// The value rank `rank` writes at element i of layer `layer`'s gradient: a small integer, so
/// that any summation order gives the same float.
__host__ __device__ inline float grad_value(std::size_t i, int layer, int rank) {
    return static_cast<float>(
        (i * 7u + static_cast<std::size_t>(layer) * 13u + static_cast<std::size_t>(rank) * 5u) %
        97u);
}

/// "Backward" of one layer: `work` dependent multiply-adds per element (the time it takes),
/// then the gradient. The accumulator stays near 1000, so the branch is never taken, but the
/// compiler cannot drop the loop.
__global__ void backward_kernel(float* grad, std::size_t n, int layer, int rank, int work) {
    for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
        float acc = static_cast<float>(i & 7u);
        for (int w = 0; w < work; ++w) {
            acc = acc * 0.999f + 1.0f;
        }
        grad[i] = grad_value(i, layer, rank) + (acc > 1e30f ? 1.0f : 0.0f);
    }
}

struct options {
    int layers = 8;
    std::size_t mib = 32;
    int steps = 7;
    int spawn = 0;
    bool from_env = false;
};

/// One rank of this process: its communicator, streams, per-layer gradients and results.
struct rank_state {
    nccl::communicator comm;
    int device = 0;
    std::optional<cudawait::stream> compute;
    std::optional<cudawait::stream> comm_stream;
    std::vector<float*> grad;
    std::vector<float*> reduced;
    std::vector<cudawait::event> computed; ///< per layer: its backward finished

    rank_state() = default;
    rank_state(const rank_state&) = delete;
    rank_state& operator=(const rank_state&) = delete;
    ~rank_state() {
        for (float* p : grad) {
            cudawait::detail::report(cudaFree(p), "cudaFree");
        }
        for (float* p : reduced) {
            cudawait::detail::report(cudaFree(p), "cudaFree");
        }
    }
};

class trainer {
public:
    trainer(std::vector<nccl::communicator> comms, const options& o)
        : m_layers(o.layers), m_count(o.mib * (std::size_t{1} << 20) / sizeof(float)) {
        for (auto& c : comms) {
            auto r = std::make_unique<rank_state>();
            r->device = c.device();
            r->comm = std::move(c);
            cudawait::device_guard guard{cudawait::device_ref(r->device)};
            r->compute.emplace(cudawait::device_ref(r->device));
            r->comm_stream.emplace(cudawait::device_ref(r->device));
            for (int k = 0; k < m_layers; ++k) {
                float* g = nullptr;
                float* out = nullptr;
                check(cudaMalloc(&g, m_count * sizeof(float)), "cudaMalloc");
                r->grad.push_back(g);
                check(cudaMalloc(&out, m_count * sizeof(float)), "cudaMalloc");
                r->reduced.push_back(out);
                r->computed.emplace_back(cudawait::device_ref(r->device));
            }
            m_ranks.push_back(std::move(r));
        }
    }

    [[nodiscard]] int nranks() const { return m_ranks.front()->comm.size(); }
    [[nodiscard]] std::size_t local_ranks() const { return m_ranks.size(); }

    /// Picks the backward's work so that one layer's backward takes about as long as one
    /// layer's all-reduce.
    void calibrate(cudawait::scheduler& s) {
        const double comm_ms = timed(s, [&] { enqueue_comm_only(); }) / m_layers;
        m_work = 64;
        const double bw_ms = timed(s, [&] { enqueue_backward_only(); }) / m_layers;
        if (bw_ms > 0 && comm_ms > 0) {
            m_work = std::clamp(static_cast<int>(m_work * comm_ms / bw_ms), 1, 1 << 16);
        }
        std::printf("calibration: one layer's all-reduce %.3f ms; backward work %d per element\n",
                    comm_ms, m_work);
    }

    /// Serial, overlapped and communication-only steps, interleaved; medians in ms.
    struct figures {
        double serial = 0;
        double overlapped = 0;
        double comm = 0;
    };
    figures measure(cudawait::scheduler& s, int steps) {
        std::vector<double> serial, overlapped, comm;
        for (int i = -1; i < steps; ++i) { // i == -1: warm-up
            const double a = timed(s, [&] { enqueue_serial(); });
            const double b = timed(s, [&] { enqueue_overlapped(); });
            const double c = timed(s, [&] { enqueue_comm_only(); });
            if (i >= 0) {
                serial.push_back(a);
                overlapped.push_back(b);
                comm.push_back(c);
            }
        }
        return {median(serial), median(overlapped), median(comm)};
    }

    /// Every element of every reduced gradient of every local rank against the host's sum.
    [[nodiscard]] bool check_gradients() const {
        std::vector<float> host(m_count);
        for (const auto& r : m_ranks) {
            cudawait::device_guard guard{cudawait::device_ref(r->device)};
            for (int k = 0; k < m_layers; ++k) {
                check(cudaMemcpy(host.data(), r->reduced[static_cast<std::size_t>(k)],
                                 m_count * sizeof(float), cudaMemcpyDeviceToHost),
                      "cudaMemcpy");
                for (std::size_t i = 0; i < m_count; ++i) {
                    float expected = 0.0f;
                    for (int q = 0; q < nranks(); ++q) {
                        expected += grad_value(i, k, q);
                    }
                    if (host[i] != expected) {
                        std::fprintf(stderr,
                                     "data_parallel: rank %d layer %d element %zu: %g, expected "
                                     "%g\n",
                                     r->comm.rank(), k, i, static_cast<double>(host[i]),
                                     static_cast<double>(expected));
                        return false;
                    }
                }
            }
        }
        return true;
    }

private:
    static double median(std::vector<double> v) {
        std::sort(v.begin(), v.end());
        return v[(v.size() - 1) / 2];
    }

    void poison() {
        for (const auto& r : m_ranks) {
            for (int k = 0; k < m_layers; ++k) {
                check(cudaMemsetAsync(r->reduced[static_cast<std::size_t>(k)], 0xff,
                                      m_count * sizeof(float), r->comm_stream->get()),
                      "cudaMemsetAsync");
            }
        }
    }

    void backward(rank_state& r, int k) {
        const int threads = 256;
        const int blocks = 132 * 8;
        backward_kernel<<<blocks, threads, 0, r.compute->get()>>>(
            r.grad[static_cast<std::size_t>(k)], m_count, k, r.comm.rank(), m_work);
        check(cudaGetLastError(), "backward_kernel<<<>>>");
        r.computed[static_cast<std::size_t>(k)].record(*r.compute);
    }

    /// Layer k's all-reduce on every local rank, in one group; each rank's communication
    /// stream first waits for that rank's backward of layer k when `after_backward`.
    void all_reduce_layer(int k, bool after_backward) {
        nccl::group g;
        for (const auto& r : m_ranks) {
            const auto uk = static_cast<std::size_t>(k);
            if (after_backward) {
                r->comm_stream->wait(r->computed[uk].get());
            }
            nccl::all_reduce_async<float>(std::span<const float>(r->grad[uk], m_count),
                                          std::span<float>(r->reduced[uk], m_count), ncclSum,
                                          r->comm, *r->comm_stream);
        }
        g.end();
    }

    void enqueue_serial() {
        for (const auto& r : m_ranks) {
            for (int k = m_layers - 1; k >= 0; --k) {
                backward(*r, k);
            }
            r->comm_stream->wait(r->computed[0].get()); // the last backward: all of them
        }
        for (int k = m_layers - 1; k >= 0; --k) {
            all_reduce_layer(k, false);
        }
    }

    void enqueue_overlapped() {
        for (int k = m_layers - 1; k >= 0; --k) {
            for (const auto& r : m_ranks) {
                backward(*r, k);
            }
            all_reduce_layer(k, true);
        }
    }

    void enqueue_comm_only() {
        for (int k = m_layers - 1; k >= 0; --k) {
            all_reduce_layer(k, false);
        }
    }

    void enqueue_backward_only() {
        for (const auto& r : m_ranks) {
            for (int k = m_layers - 1; k >= 0; --k) {
                backward(*r, k);
            }
            r->comm_stream->wait(r->computed[0].get());
        }
    }

    /// One coroutine per local GPU awaits its communication stream (which, by the events,
    /// also covers its compute stream), under one scheduler.
    task<void> await_step() {
        std::vector<task<void>> per_gpu;
        for (const auto& r : m_ranks) {
            per_gpu.push_back(
                nccl::wait(r->comm, *r->comm_stream, {.timeout = std::chrono::seconds(60)}));
        }
        co_await cudawait::when_all(std::move(per_gpu));
    }

    /// Milliseconds from the first enqueue to every rank's stream drained.
    template <class Enqueue>
    double timed(cudawait::scheduler& s, Enqueue enqueue) {
        // Idle before the clock starts (and the outputs poisoned, so a skipped all-reduce
        // cannot pass the check on an earlier step's values).
        poison();
        cudawait::sync_wait(s, await_step());
        const auto t0 = clock_type::now();
        enqueue();
        cudawait::sync_wait(s, await_step());
        return std::chrono::duration<double, std::milli>(clock_type::now() - t0).count();
    }

    int m_layers;
    std::size_t m_count;
    int m_work = 64;
    std::vector<std::unique_ptr<rank_state>> m_ranks;
};

int run(std::vector<nccl::communicator> comms, const options& o) {
    trainer t(std::move(comms), o);
    cudawait::scheduler s;
    std::printf("data_parallel: %d rank(s) in all, %zu in this process; %d layers x %zu MiB\n",
                t.nranks(), t.local_ranks(), o.layers, o.mib);
    t.calibrate(s);
    const auto f = t.measure(s, o.steps);
    // Every kind of step leaves the same reduced gradients (the all-reduces of what the
    // backward wrote), each after poisoning them: the last one is checked below.
    std::printf("serial step      %9.3f ms\n", f.serial);
    std::printf("overlapped step  %9.3f ms\n", f.overlapped);
    std::printf("speedup          %9.3f\n", f.serial / f.overlapped);
    std::printf("communication    %9.3f ms (the all-reduces alone)\n", f.comm);
    std::printf("fraction hidden  %9.3f (serial - overlapped) / communication\n",
                f.comm > 0 ? (f.serial - f.overlapped) / f.comm : 0.0);
    if (!t.check_gradients()) {
        return 1;
    }
    std::printf("gradients: every element of every layer equals the sum over the ranks\n");
    return 0;
}

int env_int(const char* name) {
    const char* v = std::getenv(name);
    if (v == nullptr) {
        throw std::runtime_error(std::string(name) + " is not set");
    }
    return std::stoi(v);
}

/// --spawn N: the id, then N copies of this program with --ranks-from-env.
int spawn(int n, int argc, char** argv) {
    const nccl::unique_id id = nccl::unique_id::create();
    if (n > cudawait::device_count()) {
        std::fprintf(stderr,
                     "data_parallel: %d ranks on %d device(s): NCCL needs one device per "
                     "rank\n",
                     n, cudawait::device_count());
        return 1;
    }
    std::vector<pid_t> pids;
    for (int rank = 0; rank < n; ++rank) {
        std::vector<std::string> env;
        for (char** e = environ; *e != nullptr; ++e) {
            const std::string_view kv(*e);
            if (!kv.starts_with("CUDAWAIT_NCCL_ID=") && !kv.starts_with("CUDAWAIT_RANK=") &&
                !kv.starts_with("CUDAWAIT_NRANKS=") && !kv.starts_with("NCCL_NVLS_ENABLE=")) {
                env.emplace_back(kv);
            }
        }
        env.push_back("CUDAWAIT_NCCL_ID=" + id.to_hex());
        env.push_back("CUDAWAIT_RANK=" + std::to_string(rank));
        env.push_back("CUDAWAIT_NRANKS=" + std::to_string(n));
        env.push_back("NCCL_NVLS_ENABLE=0");
        std::vector<char*> envp;
        for (auto& kv : env) {
            envp.push_back(kv.data());
        }
        envp.push_back(nullptr);
        // The same options, --spawn N replaced by --ranks-from-env.
        std::vector<std::string> args{"/proc/self/exe", "--ranks-from-env"};
        for (int i = 1; i < argc; ++i) {
            if (std::string_view(argv[i]) == "--spawn") {
                ++i;
                continue;
            }
            args.emplace_back(argv[i]);
        }
        std::vector<char*> cargs;
        for (auto& a : args) {
            cargs.push_back(a.data());
        }
        cargs.push_back(nullptr);
        pid_t pid = 0;
        if (int rc =
                ::posix_spawn(&pid, "/proc/self/exe", nullptr, nullptr, cargs.data(), envp.data());
            rc != 0) {
            std::fprintf(stderr, "data_parallel: posix_spawn failed: %s\n", std::strerror(rc));
            for (pid_t p : pids) {
                ::kill(p, SIGKILL);
                (void)::waitpid(p, nullptr, 0);
            }
            return 1;
        }
        pids.push_back(pid);
    }
    int worst = 0;
    for (pid_t p : pids) {
        int status = 0;
        if (::waitpid(p, &status, 0) != p || !WIFEXITED(status)) {
            worst = 1;
        } else {
            worst = std::max(worst, WEXITSTATUS(status));
        }
    }
    std::printf("data_parallel: %d process(es) finished, worst exit code %d\n", n, worst);
    return worst;
}

} // namespace

int main(int argc, char** argv) {
    // Before any NCCL call, here and (through spawn's environment) in the copies.
    ::setenv("NCCL_NVLS_ENABLE", "0", 1);
    options o;
    for (int i = 1; i < argc; ++i) {
        const std::string_view a = argv[i];
        auto next = [&]() -> const char* {
            if (i + 1 >= argc) {
                std::fprintf(stderr, "data_parallel: %s needs a value\n", argv[i]);
                std::exit(1);
            }
            return argv[++i];
        };
        if (a == "--layers") {
            o.layers = std::max(1, std::atoi(next()));
        } else if (a == "--mib") {
            o.mib = static_cast<std::size_t>(std::max(1, std::atoi(next())));
        } else if (a == "--steps") {
            o.steps = std::max(1, std::atoi(next()));
        } else if (a == "--spawn") {
            o.spawn = std::max(1, std::atoi(next()));
        } else if (a == "--ranks-from-env") {
            o.from_env = true;
        } else {
            std::fprintf(stderr, "usage: data_parallel [--layers L] [--mib M] [--steps S] "
                                 "[--spawn N | --ranks-from-env]\n");
            return 1;
        }
    }
    if (std::string why = cudawait::no_device_reason(); !why.empty()) {
        std::fprintf(stderr, "data_parallel: no CUDA device: %s\n", why.c_str());
        return 2;
    }
    try {
        if (o.spawn > 0) {
            return spawn(o.spawn, argc, argv);
        }
        if (o.from_env) {
            const int rank = env_int("CUDAWAIT_RANK");
            const int nranks = env_int("CUDAWAIT_NRANKS");
            const int device = rank % cudawait::device_count();
            std::vector<nccl::communicator> comms;
            comms.push_back(
                nccl::communicator::init_rank(nccl::unique_id::from_env(), nranks, rank, device));
            return run(std::move(comms), o);
        }
        return run(nccl::communicator::init_all(), o);
    } catch (const std::exception& e) {
        std::fprintf(stderr, "data_parallel: %s\n", e.what());
        return 1;
    }
}
