// SPDX-License-Identifier: Apache-2.0
//
// await_bench: what `co_await stream` costs compared to waiting for CUDA work by hand.
//
//   1. Round-trip latency, empty kernel launch -> waiter running again (p50 of 20000 samples per
//      variant; the six variants are measured together, in 20 interleaved rounds):
//        BM_roundtrip_stream_sync         cudaStreamSynchronize
//        BM_roundtrip_event_query_spin    cudaEventRecord + spin on cudaEventQuery
//        BM_roundtrip_host_func           cudaLaunchHostFunc sets an atomic, host spins on it
//        BM_roundtrip_host_func_resume    coroutine resumption driven by cudaLaunchHostFunc: the
//                                         host function posts the coroutine to its scheduler
//        BM_roundtrip_co_await            cudawait, poll_policy::spinning()
//        BM_roundtrip_co_await_balanced   cudawait, poll_policy::balanced() (the default)
//   2. Completion throughput, 10000 waiters x 50 awaits over 64 streams, one thread (the runs of
//      the four variants are interleaved and measured together):
//        BM_completions_co_await_spin / _balanced   cudawait tasks started with when_all
//        BM_completions_co_await_spin_watchdog      _spin with a watchdog (heartbeat on) attached
//        BM_completions_raw                         hand-written event record/query loop
//   3. CPU used by the driving thread (and by the whole process) while one ~200 ms GPU wait is
//      pending, and how late the waiter runs again:
//        BM_idle_cpu_spinning / _yielding / _sleeping / _balanced / _sentinels   cudawait, each
//                                     poll_policy (sentinels: balanced, its sleep phase woken by
//                                     sentinels; with no timer pending the loop blocks in the
//                                     driver on the doorbell that they write)
//        BM_idle_cpu_balanced_unpredicted  balanced with `predict` off: what a wait unlike
//                                     the loop's recent ones gets (for information; balanced
//                                     itself sleeps until shortly before the end its last waits
//                                     predict, and the warm-up's and earlier rounds' waits are
//                                     what it learns from)
//        BM_idle_cpu_sentinels_host_func   sentinels with the doorbell hidden (as where the
//                                     driver lacks stream memory operations, or a timer is
//                                     pending): host-function sentinels and a condition variable
//        BM_idle_cpu_blocking_sync    the reference: cudaEventSynchronize on a
//                                     cudaEventBlockingSync | cudaEventDisableTiming event
//        BM_idle_post_wake            a post from another thread to a loop waiting idle on one
//                                     long GPU wait: wall time until the posted function runs
//                                     (median of 20), the loop blocked on the doorbell
//                                     (sentinels) and sleeping on its condition variable
//                                     (balanced); printed for information
//      The summary quotes the overshoot of balanced (the default), sentinels and
//      sentinels_host_func against blocking_sync's, and their process CPU fractions (which count
//      the CUDA thread that runs host functions and the doorbell's backstop thread).
//
// All comparisons run in one process, on the same device, the same stream type (cudawait::stream,
// non-blocking) and the same kernels. After the benchmarks main() prints a summary table with
// the ratios. See docs/benchmarks.md#await_bench.
//
// Every coroutine here is a free function in namespace `bench` and takes its state through
// parameters: lambdas kept in a coroutine frame (or coroutines in an anonymous namespace) make
// g++ raise -Wsubobject-linkage in nvcc's host pass.

#include <cudawait/cudawait.hpp>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <coroutine>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <iterator>
#include <map>
#include <stdexcept>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include <cuda_runtime.h>

#include "bench_support.hpp"
#include <benchmark/benchmark.h>
#include <time.h>

namespace bench {

using cudawait::check;

// ---- parameters ------------------------------------------------------------------------------

constexpr std::size_t kWarmupSamples = 1000; ///< round trips discarded before sampling
constexpr std::int64_t kSamples = 20000;     ///< round trips sampled per latency benchmark
constexpr std::size_t kStreams = 64;         ///< streams in the throughput benchmarks
constexpr std::size_t kWaiters = 10000;      ///< concurrent waiters (coroutines or events)
constexpr int kAwaitsPerWaiter = 50;         ///< awaits each waiter performs
constexpr std::uint64_t kCompletions = std::uint64_t{kWaiters} * kAwaitsPerWaiter; // 500k
constexpr std::int64_t kThroughputRuns = 5;         ///< timed runs per throughput benchmark
constexpr std::chrono::milliseconds kIdleWait{200}; ///< GPU time of the idle benchmark's kernel
constexpr std::int64_t kIdleRuns = 5;               ///< timed waits per idle benchmark

// ---- results shared with the summary printed by main() ---------------------------------------

std::map<std::string, double> g_p50_us;       ///< latency variant -> p50 in microseconds
std::map<std::string, double> g_rate;         ///< throughput variant -> completions per second
std::map<std::string, double> g_cpu_fraction; ///< idle policy -> CPU seconds / wall seconds
std::map<std::string, double> g_overshoot_us; ///< idle policy -> median wall time - 200 ms
std::map<std::string, double> g_process_cpu;  ///< idle policy -> process CPU seconds / wall
std::map<std::string, double> g_post_us;      ///< idle loop kind -> median post-to-run time
std::uint64_t g_doorbell_rounds = 0;          ///< sentinels' rounds blocked on the doorbell

// ---- kernels -----------------------------------------------------------------------------------

/// The work whose completion every latency variant waits for: nothing at all.
__global__ void empty_kernel() {}

__device__ __forceinline__ unsigned long long globaltimer_ns() {
    unsigned long long t = 0;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

/// Keeps one thread busy for `ns` nanoseconds of GPU time, so the host has a long wait.
__global__ void spin_kernel(unsigned long long ns) {
    const unsigned long long start = globaltimer_ns();
    while (globaltimer_ns() - start < ns) {
    }
}

// cudaLaunchKernel returns the launch status directly (no cudaGetLastError round trip), and it is
// the same call every variant makes.
void launch_empty(cudaStream_t s) {
    check(cudaLaunchKernel(empty_kernel, dim3(1), dim3(1), nullptr, 0, s), "cudaLaunchKernel");
}

void launch_spin(cudaStream_t s, unsigned long long ns) {
    void* args[] = {&ns};
    check(cudaLaunchKernel(spin_kernel, dim3(1), dim3(1), args, 0, s), "cudaLaunchKernel");
}

// ---- helpers -----------------------------------------------------------------------------------

double cpu_seconds(clockid_t clock) {
    timespec ts{};
    if (clock_gettime(clock, &ts) != 0) {
        throw std::system_error(errno, std::generic_category(), "clock_gettime");
    }
    return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}
double thread_cpu_seconds() { return cpu_seconds(CLOCK_THREAD_CPUTIME_ID); }
/// Every thread of the process: the CUDA threads that run host functions included.
double process_cpu_seconds() { return cpu_seconds(CLOCK_PROCESS_CPUTIME_ID); }

/// Nearest-rank percentile (`p` in [0, 1]) of `sorted`, which must be sorted and non-empty.
double percentile(const std::vector<double>& sorted, double p) {
    const auto rank = std::clamp<std::size_t>(
        static_cast<std::size_t>(std::ceil(p * static_cast<double>(sorted.size()))), 1,
        sorted.size());
    return sorted[rank - 1];
}

// ---- 1. round-trip latency ----------------------------------------------------------------------
//
// The six variants are measured together, the first time any of their benchmarks runs, in
// kLatencyRounds rounds of kLatencyBlock round trips per variant; the order of the variants
// rotates from round to round, and each benchmark then publishes its own pooled samples. Measured
// one benchmark after the other, the raw baselines' p50 drifted by more than 1 us between
// neighbouring benchmarks of one process on an H200 (7.9 to 9.4 us), enough to move a ratio by
// 15%; side by side, every variant sees the same drift.

constexpr std::size_t kLatencyRounds = 20;                       ///< rounds of every variant
constexpr std::size_t kLatencyBlock = kSamples / kLatencyRounds; ///< samples per variant per round
constexpr std::size_t kBlockWarmup = 50; ///< round trips discarded at the start of every block

/// What the latency variants share: one stream, one event, one flag, one scheduler per policy.
/// The flag is declared first and the schedulers last: the stream's destructor synchronises, so
/// the last host function has returned before the flag goes, and each scheduler drains before
/// the stream goes.
struct latency_context {
    std::atomic<bool> flag{false};
    cudawait::stream stream;
    cudawait::event done; // cudaEventDisableTiming, like the scheduler's recycled events
    cudawait::scheduler spinning{cudawait::poll_policy::spinning()};
    cudawait::scheduler balanced{cudawait::poll_policy::balanced()};
    cudawait::scheduler host_func_sched{}; // the default policy, as a user would have it
};

/// Appends the round trips after the first `warmup` of `warmup + n` to `out`.
template <class RoundTrip>
void sample_round_trips(std::size_t warmup, std::size_t n, std::vector<double>& out,
                        RoundTrip&& round_trip) {
    for (std::size_t i = 0; i < warmup + n; ++i) {
        const auto t0 = steady::now();
        round_trip();
        const auto t1 = steady::now();
        if (i >= warmup) {
            out.push_back(seconds(t1 - t0));
        }
    }
}

void block_stream_sync(latency_context& c, std::size_t warmup, std::size_t n,
                       std::vector<double>& out) {
    const cudaStream_t s = c.stream.get();
    sample_round_trips(warmup, n, out, [&] {
        launch_empty(s);
        check(cudaStreamSynchronize(s), "cudaStreamSynchronize");
    });
}

void block_event_query_spin(latency_context& c, std::size_t warmup, std::size_t n,
                            std::vector<double>& out) {
    const cudaStream_t s = c.stream.get();
    const cudaEvent_t ev = c.done.get();
    sample_round_trips(warmup, n, out, [&] {
        launch_empty(s);
        check(cudaEventRecord(ev, s), "cudaEventRecord");
        cudaError_t st = cudaSuccess;
        while ((st = cudaEventQuery(ev)) == cudaErrorNotReady) {
        }
        check(st, "cudaEventQuery");
    });
}

/// Host function enqueued behind the kernel; runs on a CUDA-internal thread.
void CUDART_CB set_flag(void* flag) {
    static_cast<std::atomic<bool>*>(flag)->store(true, std::memory_order_release);
}

void block_host_func(latency_context& c, std::size_t warmup, std::size_t n,
                     std::vector<double>& out) {
    const cudaStream_t s = c.stream.get();
    sample_round_trips(warmup, n, out, [&] {
        c.flag.store(false, std::memory_order_relaxed);
        launch_empty(s);
        check(cudaLaunchHostFunc(s, set_flag, &c.flag), "cudaLaunchHostFunc");
        while (!c.flag.load(std::memory_order_acquire)) {
        }
    });
    // The last host function has returned before the next block touches the flag.
    check(cudaStreamSynchronize(s), "cudaStreamSynchronize");
}

/// Host-function-based resumption, the design the scheduler's polling replaces: the awaiting
/// coroutine enqueues a host function behind the work; the function (on a CUDA-internal thread,
/// where CUDA may not be called) posts the coroutine to its scheduler, which sleeps until then.
struct host_func_resume {
    cudawait::scheduler* sched;
    cudaStream_t stream;
    std::coroutine_handle<> waiter;

    static void CUDART_CB fire(void* self) {
        auto* me = static_cast<host_func_resume*>(self);
        me->sched->post(me->waiter);
    }
    bool await_ready() const noexcept { return false; }
    void await_suspend(std::coroutine_handle<> h) {
        waiter = h;
        check(cudaLaunchHostFunc(stream, &host_func_resume::fire, this), "cudaLaunchHostFunc");
    }
    void await_resume() const noexcept {}
};

cudawait::task<void> host_func_resume_loop(cudawait::scheduler* sched, cudaStream_t s,
                                           std::size_t warmup, std::size_t n,
                                           std::vector<double>* samples) {
    for (std::size_t i = 0; i < warmup + n; ++i) {
        const auto t0 = steady::now();
        launch_empty(s);
        co_await host_func_resume{sched, s, {}};
        const auto t1 = steady::now();
        if (i >= warmup) {
            samples->push_back(seconds(t1 - t0));
        }
    }
}

void block_host_func_resume(latency_context& c, std::size_t warmup, std::size_t n,
                            std::vector<double>& out) {
    cudawait::sync_wait(c.host_func_sched,
                        host_func_resume_loop(&c.host_func_sched, c.stream.get(), warmup, n, &out));
    c.stream.sync();
}

/// The coroutine side of the co_await variants: `warmup + n` round trips, timed from just
/// before the launch to just after the coroutine resumed. Runs inside one sync_wait, so the
/// scheduler's first-use costs are outside every sample.
cudawait::task<void> roundtrip_loop(cudawait::stream_ref s, std::size_t warmup, std::size_t n,
                                    std::vector<double>* samples) {
    for (std::size_t i = 0; i < warmup + n; ++i) {
        const auto t0 = steady::now();
        launch_empty(s);
        co_await s;
        const auto t1 = steady::now();
        if (i >= warmup) {
            samples->push_back(seconds(t1 - t0));
        }
    }
}

void block_co_await(latency_context& c, std::size_t warmup, std::size_t n,
                    std::vector<double>& out) {
    cudawait::sync_wait(c.spinning, roundtrip_loop(c.stream, warmup, n, &out));
}

void block_co_await_balanced(latency_context& c, std::size_t warmup, std::size_t n,
                             std::vector<double>& out) {
    cudawait::sync_wait(c.balanced, roundtrip_loop(c.stream, warmup, n, &out));
}

using latency_block = void (*)(latency_context&, std::size_t, std::size_t, std::vector<double>&);

/// The variants, in the order of the first round.
constexpr std::pair<const char*, latency_block> kLatencyVariants[] = {
    {"stream_sync", &block_stream_sync}, {"event_query_spin", &block_event_query_spin},
    {"host_func", &block_host_func},     {"host_func_resume", &block_host_func_resume},
    {"co_await", &block_co_await},       {"co_await_balanced", &block_co_await_balanced},
};

struct latency_runs {
    std::map<std::string, std::vector<double>> samples;   ///< variant -> round trips (seconds)
    std::map<std::string, std::vector<double>> round_p50; ///< variant -> p50 of each round
};

latency_runs measure_latency() {
    latency_context c;
    std::vector<std::string> names;
    for (const auto& [name, block] : kLatencyVariants) { // warm-up: a longer block of each
        std::vector<double> discarded;
        block(c, kWarmupSamples, 0, discarded);
        names.emplace_back(name);
    }
    latency_runs runs;
    runs.samples = interleaved(
        static_cast<std::int64_t>(kLatencyRounds), names,
        [&](std::size_t v) {
            std::vector<double> block;
            block.reserve(kLatencyBlock);
            kLatencyVariants[v].second(c, kBlockWarmup, kLatencyBlock, block);
            runs.round_p50[names[v]].push_back(median(block));
            return block;
        },
        0);
    return runs;
}

/// Measured once per process, by whichever latency benchmark runs first. A failed measurement
/// is not cached: the next benchmark tries again and reports its own error.
const latency_runs& latency() {
    static const latency_runs runs = measure_latency();
    return runs;
}

/// Feeds the pooled per-round-trip times (seconds) of `key` to Google Benchmark as manual
/// iteration times, publishes the percentiles as counters and keeps the p50 for the summary.
void publish_latency(benchmark::State& state, const char* key) {
    const std::vector<double> samples = samples_of(latency().samples, key);
    replay(state, samples);
    std::vector<double> sorted = samples;
    std::sort(sorted.begin(), sorted.end());
    const double p50 = percentile(sorted, 0.50) * 1e6;
    state.counters["p50_us"] = p50;
    state.counters["p90_us"] = percentile(sorted, 0.90) * 1e6;
    state.counters["p99_us"] = percentile(sorted, 0.99) * 1e6;
    state.counters["min_us"] = sorted.front() * 1e6;
    state.counters["max_us"] = sorted.back() * 1e6;
    g_p50_us[key] = p50;
}

void BM_roundtrip_stream_sync(benchmark::State& state) {
    guarded(state, [&] { publish_latency(state, "stream_sync"); });
}
void BM_roundtrip_event_query_spin(benchmark::State& state) {
    guarded(state, [&] { publish_latency(state, "event_query_spin"); });
}
void BM_roundtrip_host_func(benchmark::State& state) {
    guarded(state, [&] { publish_latency(state, "host_func"); });
}
void BM_roundtrip_host_func_resume(benchmark::State& state) {
    guarded(state, [&] { publish_latency(state, "host_func_resume"); });
}
void BM_roundtrip_co_await(benchmark::State& state) {
    guarded(state, [&] { publish_latency(state, "co_await"); });
}
void BM_roundtrip_co_await_balanced(benchmark::State& state) {
    guarded(state, [&] { publish_latency(state, "co_await_balanced"); });
}

// ---- 2. completion throughput -------------------------------------------------------------------
//
// The four variants' timed runs are interleaved (one run of each per round, the order rotating
// from round to round) and measured together the first time any of the four benchmarks runs;
// each benchmark then publishes its own runs. Measured one benchmark after the other, the same
// code moved by 20% and more between neighbouring benchmarks on an H200, and the absolute rate
// depended several-fold on what the process had done before (docs/benchmarks.md#await_bench),
// so only runs taken side by side give a ratio worth quoting.

std::vector<cudawait::stream> make_streams() {
    std::vector<cudawait::stream> streams;
    streams.reserve(kStreams);
    for (std::size_t i = 0; i < kStreams; ++i) {
        streams.emplace_back();
    }
    return streams;
}

/// One waiter: `awaits` back-to-back awaits of its stream. Each await records an event on the
/// stream, which is the only stream-ordered work there is.
cudawait::task<void> completion_worker(cudawait::stream_ref s, int awaits,
                                       std::uint64_t* completed) {
    for (int i = 0; i < awaits; ++i) {
        co_await s;
        ++*completed;
    }
}

/// Starts `kWaiters` workers over `streams` with when_all and drives them to the end on `sched`.
/// Returns the seconds spent in sync_wait (building the task vector is not timed).
double run_completion_workers(cudawait::scheduler& sched,
                              const std::vector<cudawait::stream>& streams, int awaits) {
    std::uint64_t completed = 0;
    std::vector<cudawait::task<void>> workers;
    workers.reserve(kWaiters);
    for (std::size_t w = 0; w < kWaiters; ++w) {
        workers.push_back(completion_worker(streams[w % kStreams], awaits, &completed));
    }
    const auto t0 = steady::now();
    cudawait::sync_wait(sched, cudawait::when_all(std::move(workers)));
    const auto t1 = steady::now();
    benchmark::DoNotOptimize(completed);
    const std::uint64_t expected = std::uint64_t{kWaiters} * static_cast<std::uint64_t>(awaits);
    if (completed != expected) {
        throw std::runtime_error("co_await workers completed " + std::to_string(completed) +
                                 " awaits, expected " + std::to_string(expected));
    }
    return seconds(t1 - t0);
}

/// A fixed-capacity FIFO of waiter indices: the pending events of one stream, oldest first.
class index_ring {
public:
    explicit index_ring(std::size_t capacity) : m_slots(capacity) {}
    [[nodiscard]] bool empty() const noexcept { return m_size == 0; }
    [[nodiscard]] std::uint32_t front() const noexcept { return m_slots[m_head]; }
    void push(std::uint32_t w) noexcept {
        std::size_t at = m_head + m_size;
        if (at >= m_slots.size()) {
            at -= m_slots.size();
        }
        m_slots[at] = w;
        ++m_size;
    }
    void pop() noexcept {
        if (++m_head == m_slots.size()) {
            m_head = 0;
        }
        --m_size;
    }
    void clear() noexcept {
        m_head = 0;
        m_size = 0;
    }

private:
    std::vector<std::uint32_t> m_slots;
    std::size_t m_head = 0;
    std::size_t m_size = 0;
};

/// State of the hand-written loop, allocated once outside the timed region.
struct raw_waiters {
    std::vector<cudaStream_t> streams;
    std::vector<cudawait::event> owned_events; // RAII: destroyed with this struct
    std::vector<cudaEvent_t> events;           // raw handles for the hot loop
    std::vector<int> remaining;
    std::vector<index_ring> rings;

    explicit raw_waiters(const std::vector<cudawait::stream>& on) {
        for (const cudawait::stream& s : on) {
            streams.push_back(s.get());
        }
        owned_events.reserve(kWaiters);
        events.reserve(kWaiters);
        for (std::size_t w = 0; w < kWaiters; ++w) {
            owned_events.emplace_back(); // cudaEventDisableTiming
            events.push_back(owned_events.back().get());
        }
        remaining.assign(kWaiters, 0);
        for (std::size_t s = 0; s < streams.size(); ++s) {
            // Waiter w lives on stream w % streams: at most this many per stream.
            rings.emplace_back((kWaiters + streams.size() - 1) / streams.size());
        }
    }
};

/// The record/query cycle written as well as it can be by hand: record every waiter's event,
/// then sweep the streams, querying only each FIFO's head (events recorded on one stream
/// complete in order) and re-recording a completed waiter right away. Returns the seconds it
/// took, initial records included (the co_await variant's first awaits record too).
double run_raw(raw_waiters& r, int awaits) {
    const std::size_t waiters = r.events.size();
    const std::size_t nstreams = r.streams.size();
    for (index_ring& ring : r.rings) {
        ring.clear();
    }
    const auto t0 = steady::now();
    for (std::size_t w = 0; w < waiters; ++w) {
        r.remaining[w] = awaits;
        check(cudaEventRecord(r.events[w], r.streams[w % nstreams]), "cudaEventRecord");
        r.rings[w % nstreams].push(static_cast<std::uint32_t>(w));
    }
    const std::uint64_t target = std::uint64_t{waiters} * static_cast<std::uint64_t>(awaits);
    std::uint64_t completed = 0;
    while (completed < target) {
        for (std::size_t s = 0; s < nstreams; ++s) {
            index_ring& ring = r.rings[s];
            while (!ring.empty()) {
                const std::uint32_t w = ring.front();
                const cudaError_t st = cudaEventQuery(r.events[w]);
                if (st == cudaErrorNotReady) {
                    break;
                }
                check(st, "cudaEventQuery");
                ring.pop();
                ++completed;
                if (--r.remaining[w] > 0) {
                    check(cudaEventRecord(r.events[w], r.streams[s]), "cudaEventRecord");
                    ring.push(w);
                }
            }
        }
    }
    const auto t1 = steady::now();
    benchmark::DoNotOptimize(completed);
    return seconds(t1 - t0);
}

/// The throughput variants, in the order of the first round.
constexpr const char* kThroughputVariants[] = {"co_await_spin", "co_await_balanced", "raw",
                                               "co_await_spin_watchdog"};

/// The watchdog variant's window: short, so that it checks (and beats) every ~3 ms of a run.
constexpr auto kWatchdogWindow = std::chrono::milliseconds(100);

/// run_completion_workers with a watchdog (heartbeat on) watching `sched` for the run. The
/// watchdog goes when the run is done, and its last heartbeat is drained before returning.
double run_completion_workers_watched(cudawait::scheduler& sched,
                                      const std::vector<cudawait::stream>& streams, int awaits) {
    double secs = 0.0;
    {
        cudawait::watchdog_options o;
        o.window = kWatchdogWindow;
        o.on_stall = [](const cudawait::stall_info& info) {
            std::fprintf(stderr, "await_bench: watchdog reported device %d stalled\n", info.device);
        };
        cudawait::watchdog wd(sched, o);
        secs = run_completion_workers(sched, streams, awaits);
    }
    sched.run();
    return secs;
}

/// Runs all four variants, interleaved, on the same 64 streams. The co_await variants share one
/// scheduler (and so one event cache); its policy is switched between runs, while it is idle.
runs_by_variant measure_throughput() {
    const std::vector<cudawait::stream> streams = make_streams();
    raw_waiters raw(streams);
    cudawait::scheduler sched; // destroyed first: drains before the streams go

    // Warm-up: fills the scheduler's event cache (kWaiters events) and node storage, and runs
    // the hand-written loop's code and events once.
    (void)run_completion_workers(sched, streams, 2);
    (void)run_completion_workers_watched(sched, streams, 2); // loads the heartbeat kernel
    (void)run_raw(raw, 2);

    return interleaved(
        kThroughputRuns, kThroughputVariants,
        [&](std::size_t v) {
            if (v == 2) {
                return run_raw(raw, kAwaitsPerWaiter);
            }
            sched.set_policy(v == 1 ? cudawait::poll_policy::balanced()
                                    : cudawait::poll_policy::spinning());
            if (v == 3) {
                return run_completion_workers_watched(sched, streams, kAwaitsPerWaiter);
            }
            return run_completion_workers(sched, streams, kAwaitsPerWaiter);
        },
        0); // warmed up above
}

/// Measured once per process, by whichever throughput benchmark runs first. A failed measurement
/// is not cached: the next benchmark tries again and reports its own error.
const runs_by_variant& throughput() {
    static const runs_by_variant runs = measure_throughput();
    return runs;
}

/// Feeds one variant's run times to Google Benchmark and publishes the median rate.
void publish_throughput(benchmark::State& state, const char* key) {
    const std::vector<double> run_seconds = samples_of(throughput(), key);
    replay(state, run_seconds);
    std::vector<double> rates;
    for (double secs : run_seconds) {
        rates.push_back(static_cast<double>(kCompletions) / secs);
    }
    const double rate = median(rates);
    state.counters["completions_per_s"] = rate;
    g_rate[key] = rate;
}

void BM_completions_co_await_spin(benchmark::State& state) {
    guarded(state, [&] { publish_throughput(state, "co_await_spin"); });
}
void BM_completions_co_await_balanced(benchmark::State& state) {
    guarded(state, [&] { publish_throughput(state, "co_await_balanced"); });
}
void BM_completions_raw(benchmark::State& state) {
    guarded(state, [&] { publish_throughput(state, "raw"); });
}
void BM_completions_co_await_spin_watchdog(benchmark::State& state) {
    guarded(state, [&] { publish_throughput(state, "co_await_spin_watchdog"); });
}

// ---- 3. idle CPU cost ---------------------------------------------------------------------------

/// One long GPU wait: the spin kernel, then `co_await` its stream.
cudawait::task<void> idle_wait(cudawait::stream_ref s, unsigned long long ns) {
    launch_spin(s, ns);
    co_await s;
}

/// Times `wait_once(ns)` (one wait for an `ns` GPU kernel, driven on this thread) once per
/// iteration and publishes its CPU fractions and median overshoot under `key`.
template <class Wait>
void measure_idle(benchmark::State& state, const char* key, Wait&& wait_once) {
    const auto ns = static_cast<unsigned long long>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(kIdleWait).count());
    double cpu_total = 0.0;
    double process_total = 0.0;
    double wall_total = 0.0;
    std::vector<double> overshoots_us;
    for (auto _ : state) {
        // The wait is driven on this thread, so this thread's CPU time is the loop's.
        const double p0 = process_cpu_seconds();
        const double c0 = thread_cpu_seconds();
        const auto t0 = steady::now();
        wait_once(ns);
        const auto t1 = steady::now();
        const double c1 = thread_cpu_seconds();
        const double p1 = process_cpu_seconds();
        const double wall = seconds(t1 - t0);
        state.SetIterationTime(wall);
        cpu_total += c1 - c0;
        process_total += p1 - p0;
        wall_total += wall;
        overshoots_us.push_back((wall - seconds(kIdleWait)) * 1e6);
    }
    const double fraction = cpu_total / wall_total;
    const double overshoot = median(overshoots_us);
    state.counters["cpu_fraction"] = fraction;
    state.counters["process_cpu_fraction"] = process_total / wall_total;
    state.counters["overshoot_us"] = overshoot;
    g_cpu_fraction[key] = fraction;
    g_process_cpu[key] = process_total / wall_total;
    g_overshoot_us[key] = overshoot;
}

void idle_cpu(benchmark::State& state, const cudawait::poll_policy& policy, const char* key) {
    cudawait::stream stream;
    cudawait::scheduler sched(policy);
    // Warm-up: the kernel's first launch, the scheduler's first event and FIFO; for sentinels
    // also a wait long enough to arm one, so its private stream (and the doorbell) exists before
    // timing.
    cudawait::sync_wait(sched, idle_wait(stream, 0));
    cudawait::sync_wait(sched, idle_wait(stream, 20'000'000));
    const std::uint64_t rounds0 = cudawait::detail::scheduler_access::idle_doorbell(sched).rounds();
    measure_idle(state, key,
                 [&](unsigned long long ns) { cudawait::sync_wait(sched, idle_wait(stream, ns)); });
    if (std::string(key) == "sentinels") {
        g_doorbell_rounds =
            cudawait::detail::scheduler_access::idle_doorbell(sched).rounds() - rounds0;
    }
}

/// While alive, new doorbells find no stream memory operations (the library's test hook): the
/// sentinels are host functions.
struct doorbell_hidden {
    doorbell_hidden() { cudawait::detail::g_doorbell_hide_entry_points.store(true); }
    ~doorbell_hidden() { cudawait::detail::g_doorbell_hide_entry_points.store(false); }
    doorbell_hidden(const doorbell_hidden&) = delete;
    doorbell_hidden& operator=(const doorbell_hidden&) = delete;
};

// ---- 3b. post latency to an idle loop -----------------------------------------------------------

constexpr int kPostSamples = 20;
constexpr auto kPostGap = std::chrono::milliseconds(10); ///< past spin + yield: the loop is idle

/// Median microseconds from post() on this thread to the posted function running on `policy`'s
/// loop, driven by another thread while one long GPU wait is pending. `doorbell`: each post waits
/// until the loop is blocked on the doorbell first.
double post_wake_us(const cudawait::poll_policy& policy, bool doorbell) {
    using cudawait::detail::scheduler_access;
    /// What one posted function records; outlives the scheduler, which may run it late.
    struct sample {
        std::atomic<bool> ran{false};
        steady::time_point ran_at{};
        std::thread::id ran_on;
    };
    std::vector<sample> samples(kPostSamples);
    cudawait::stream stream;
    cudawait::scheduler sched(policy);
    cudawait::sync_wait(sched, idle_wait(stream, 20'000'000)); // warm-up, as idle_cpu's
    // Long enough for every sample: the loop must stay waiting for the GPU throughout.
    sched.spawn(idle_wait(stream, 1'000'000'000ull));
    std::stop_source stop;
    std::thread::id loop_thread;
    std::thread driver([&] {
        loop_thread = std::this_thread::get_id();
        sched.run(stop.get_token());
    });
    std::vector<double> us;
    std::string failure;
    for (int i = 0; i < kPostSamples && failure.empty(); ++i) {
        std::this_thread::sleep_for(kPostGap);
        const auto until = steady::now() + std::chrono::seconds(1);
        while (doorbell && !scheduler_access::idle_doorbell(sched).blocked() &&
               steady::now() < until) {
            std::this_thread::sleep_for(std::chrono::microseconds(50));
        }
        if (doorbell && !scheduler_access::idle_doorbell(sched).blocked()) {
            failure = "the loop did not block on the doorbell";
            break;
        }
        sample& x = samples[static_cast<std::size_t>(i)];
        const auto t0 = steady::now();
        sched.post([&x] {
            x.ran_at = steady::now();
            x.ran_on = std::this_thread::get_id();
            x.ran.store(true, std::memory_order_release);
        });
        while (!x.ran.load(std::memory_order_acquire)) {
            if (steady::now() - t0 > std::chrono::seconds(5)) {
                failure = "a post did not run within 5 s";
                break;
            }
        }
        if (failure.empty() && x.ran_on != loop_thread) {
            failure = "a post ran off the loop thread";
        }
        if (failure.empty()) { // else it may still run and write x
            us.push_back(seconds(x.ran_at - t0) * 1e6);
        }
    }
    stop.request_stop();
    driver.join();
    if (!failure.empty()) {
        throw std::runtime_error(failure); // the destructor runs what is still posted
    }
    if (us.size() != static_cast<std::size_t>(kPostSamples)) {
        throw std::runtime_error("post_wake: samples missing");
    }
    return median(us); // the destructor drains the rest of the GPU wait
}

void BM_idle_post_wake(benchmark::State& state) {
    guarded(state, [&] {
        for (auto _ : state) {
            const auto t0 = steady::now();
            g_post_us["sentinels"] = post_wake_us(cudawait::poll_policy::sentinels(), true);
            g_post_us["balanced"] = post_wake_us(cudawait::poll_policy::balanced(), false);
            state.SetIterationTime(seconds(steady::now() - t0));
        }
        state.counters["sentinels_us"] = g_post_us["sentinels"];
        state.counters["balanced_us"] = g_post_us["balanced"];
    });
}

/// The driver's own blocking wait, which a long idle wait is measured against.
void idle_blocking_sync(benchmark::State& state) {
    cudawait::stream stream;
    cudawait::event done(cudawait::current_device(),
                         cudaEventBlockingSync | cudaEventDisableTiming);
    auto wait_once = [&](unsigned long long ns) {
        launch_spin(stream.get(), ns);
        check(cudaEventRecord(done.get(), stream.get()), "cudaEventRecord");
        check(cudaEventSynchronize(done.get()), "cudaEventSynchronize");
    };
    wait_once(0); // warm-up
    wait_once(20'000'000);
    measure_idle(state, "blocking_sync", wait_once);
}

void BM_idle_cpu_spinning(benchmark::State& state) {
    guarded(state, [&] { idle_cpu(state, cudawait::poll_policy::spinning(), "spinning"); });
}
void BM_idle_cpu_yielding(benchmark::State& state) {
    guarded(state, [&] { idle_cpu(state, cudawait::poll_policy::yielding(), "yielding"); });
}
void BM_idle_cpu_sleeping(benchmark::State& state) {
    guarded(state, [&] { idle_cpu(state, cudawait::poll_policy::sleeping(), "sleeping"); });
}
void BM_idle_cpu_balanced(benchmark::State& state) {
    guarded(state, [&] { idle_cpu(state, cudawait::poll_policy::balanced(), "balanced"); });
}
void BM_idle_cpu_balanced_unpredicted(benchmark::State& state) {
    guarded(state, [&] {
        cudawait::poll_policy p = cudawait::poll_policy::balanced();
        p.predict = false;
        idle_cpu(state, p, "balanced_unpredicted");
    });
}
void BM_idle_cpu_sentinels(benchmark::State& state) {
    guarded(state, [&] { idle_cpu(state, cudawait::poll_policy::sentinels(), "sentinels"); });
}
void BM_idle_cpu_sentinels_host_func(benchmark::State& state) {
    guarded(state, [&] {
        doorbell_hidden hidden;
        idle_cpu(state, cudawait::poll_policy::sentinels(), "sentinels_host_func");
    });
}
void BM_idle_cpu_blocking_sync(benchmark::State& state) {
    guarded(state, [&] { idle_blocking_sync(state); });
}

// ---- setup and summary --------------------------------------------------------------------------

/// Creates the context and loads both kernels (lazy module loading loads each on its first
/// launch), so no benchmark pays for that. It also matters for the throughput benchmarks: on an
/// H200, event record/query ran about 4x faster in a process that had never launched a kernel,
/// a state no real program is in.
void warm_up_device() {
    check(cudaSetDevice(0), "cudaSetDevice");
    cudawait::stream s;
    launch_empty(s.get());
    launch_spin(s.get(), 0);
    check(cudaStreamSynchronize(s.get()), "cudaStreamSynchronize");

    add_device_context();
}

void register_benchmarks() {
    using benchmark::RegisterBenchmark;
    // Latency: kSamples manual-time iterations, each fed one measured round trip.
    for (auto [name, fn] :
         {std::pair{"BM_roundtrip_stream_sync", &BM_roundtrip_stream_sync},
          std::pair{"BM_roundtrip_event_query_spin", &BM_roundtrip_event_query_spin},
          std::pair{"BM_roundtrip_host_func", &BM_roundtrip_host_func},
          std::pair{"BM_roundtrip_host_func_resume", &BM_roundtrip_host_func_resume},
          std::pair{"BM_roundtrip_co_await", &BM_roundtrip_co_await},
          std::pair{"BM_roundtrip_co_await_balanced", &BM_roundtrip_co_await_balanced}}) {
        RegisterBenchmark(name, fn)->UseManualTime()->Iterations(kSamples)->Unit(
            benchmark::kMicrosecond);
    }
    // Throughput: each iteration is one full run of kCompletions completions, measured (for all
    // four at once) by the first of them that runs.
    for (auto [name, fn] :
         {std::pair{"BM_completions_co_await_spin", &BM_completions_co_await_spin},
          std::pair{"BM_completions_co_await_balanced", &BM_completions_co_await_balanced},
          std::pair{"BM_completions_raw", &BM_completions_raw},
          std::pair{"BM_completions_co_await_spin_watchdog",
                    &BM_completions_co_await_spin_watchdog}}) {
        RegisterBenchmark(name, fn)
            ->UseManualTime()
            ->Iterations(kThroughputRuns)
            ->Unit(benchmark::kMillisecond);
    }
    // Idle CPU: each iteration is one ~200 ms GPU wait.
    for (auto [name, fn] :
         {std::pair{"BM_idle_cpu_spinning", &BM_idle_cpu_spinning},
          std::pair{"BM_idle_cpu_yielding", &BM_idle_cpu_yielding},
          std::pair{"BM_idle_cpu_sleeping", &BM_idle_cpu_sleeping},
          std::pair{"BM_idle_cpu_balanced", &BM_idle_cpu_balanced},
          std::pair{"BM_idle_cpu_balanced_unpredicted", &BM_idle_cpu_balanced_unpredicted},
          std::pair{"BM_idle_cpu_sentinels", &BM_idle_cpu_sentinels},
          std::pair{"BM_idle_cpu_sentinels_host_func", &BM_idle_cpu_sentinels_host_func},
          std::pair{"BM_idle_cpu_blocking_sync", &BM_idle_cpu_blocking_sync}}) {
        RegisterBenchmark(name, fn)->UseManualTime()->Iterations(kIdleRuns)->Unit(
            benchmark::kMillisecond);
    }
    // Post latency: one iteration measures both loops.
    RegisterBenchmark("BM_idle_post_wake", &BM_idle_post_wake)
        ->UseManualTime()
        ->Iterations(1)
        ->Unit(benchmark::kMillisecond);
}

/// "a / b" when both were measured in this run, "-" otherwise.
std::string ratio(const std::map<std::string, double>& m, const char* a, const char* b) {
    auto ia = m.find(a);
    auto ib = m.find(b);
    if (ia == m.end() || ib == m.end() || ib->second == 0.0) {
        return "-";
    }
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.2f", ia->second / ib->second);
    return buf;
}

/// "   (rounds: median M, min .. max)" of the per-round ratios of the p50s of `a` and `b`, when
/// both were measured; empty otherwise.
std::string round_spread(const char* a, const char* b) {
    if (!g_p50_us.contains(a) || !g_p50_us.contains(b)) {
        return "";
    }
    const std::vector<double>& pa = latency().round_p50.at(a);
    const std::vector<double>& pb = latency().round_p50.at(b);
    std::vector<double> r;
    for (std::size_t i = 0; i < pa.size() && i < pb.size(); ++i) {
        r.push_back(pa[i] / pb[i]);
    }
    if (r.empty()) {
        return "";
    }
    const auto [lo, hi] = std::minmax_element(r.begin(), r.end());
    char buf[96];
    std::snprintf(buf, sizeof buf, "   (rounds: median %.2f, %.2f .. %.2f)", median(r), *lo, *hi);
    return buf;
}

void print_summary() {
    std::printf("\n==== await_bench summary ====\n");
    if (!g_p50_us.empty()) {
        std::printf("\nRound trip, empty kernel launch -> waiter resumed (p50 of %zu samples per "
                    "variant, in %zu interleaved rounds)\n",
                    kLatencyRounds * kLatencyBlock, kLatencyRounds);
        for (const char* k : {"stream_sync", "event_query_spin", "host_func", "host_func_resume",
                              "co_await", "co_await_balanced"}) {
            if (auto it = g_p50_us.find(k); it != g_p50_us.end()) {
                std::printf("  %-20s %9.2f us\n", k, it->second);
            }
        }
        for (auto [a, b] :
             {std::pair{"co_await", "event_query_spin"},
              std::pair{"co_await_balanced", "event_query_spin"},
              std::pair{"host_func", "co_await"}, std::pair{"host_func_resume", "co_await"},
              std::pair{"host_func_resume", "co_await_balanced"}}) {
            const std::string label = std::string(a) + " / " + b;
            std::printf("  %-38s %s%s\n", label.c_str(), ratio(g_p50_us, a, b).c_str(),
                        round_spread(a, b).c_str());
        }
    }
    if (!g_rate.empty()) {
        std::printf("\nCompletions, %zu waiters x %d awaits over %zu streams, one thread "
                    "(median of %lld interleaved runs)\n",
                    kWaiters, kAwaitsPerWaiter, kStreams, static_cast<long long>(kThroughputRuns));
        for (const char* k :
             {"co_await_spin", "co_await_balanced", "raw", "co_await_spin_watchdog"}) {
            if (auto it = g_rate.find(k); it != g_rate.end()) {
                std::printf("  %-22s %12.0f completions/s\n", k, it->second);
            }
        }
        std::printf("  co_await_spin / raw                   %s\n",
                    ratio(g_rate, "co_await_spin", "raw").c_str());
        std::printf("  co_await_balanced / raw               %s\n",
                    ratio(g_rate, "co_await_balanced", "raw").c_str());
        std::printf("  co_await_spin_watchdog / co_await_spin %s   (target >= 0.98)\n",
                    ratio(g_rate, "co_await_spin_watchdog", "co_await_spin").c_str());
        std::printf("  completions: co_await_spin / raw: %s (target >= 1.0)\n",
                    ratio(g_rate, "co_await_spin", "raw").c_str());
    }
    if (!g_cpu_fraction.empty()) {
        // The spinning policy's overshoot is the floor (launch, kernel start, any difference in
        // rate between %globaltimer and the host clock), so the other policies are also shown
        // relative to it: that difference is the wake-up latency the policy adds.
        std::printf("\nIdle: one %lld ms GPU wait; cpu_fraction = driving thread's CPU time / "
                    "wall time; overshoot = wall time - %lld ms (median)\n",
                    static_cast<long long>(kIdleWait.count()),
                    static_cast<long long>(kIdleWait.count()));
        const auto floor = g_overshoot_us.find("spinning");
        for (const char* k :
             {"spinning", "yielding", "sleeping", "balanced", "balanced_unpredicted", "sentinels",
              "sentinels_host_func", "blocking_sync"}) {
            if (auto it = g_cpu_fraction.find(k); it != g_cpu_fraction.end()) {
                const double overshoot = g_overshoot_us[k];
                std::printf("  %-20s cpu_fraction %6.3f   overshoot %9.1f us", k, it->second,
                            overshoot);
                if (floor != g_overshoot_us.end()) {
                    std::printf("   (%+.1f us vs spinning)", overshoot - floor->second);
                }
                std::printf("   process_cpu %6.3f\n", g_process_cpu[k]);
            }
        }
        if (g_cpu_fraction.contains("sentinels")) {
            // Zero means the doorbell was unavailable and sentinels took the host-function path.
            std::printf("  sentinels blocked on the doorbell %llu times in %lld waits\n",
                        static_cast<unsigned long long>(g_doorbell_rounds),
                        static_cast<long long>(kIdleRuns));
        }
        for (const char* k :
             {"balanced", "balanced_unpredicted", "sentinels", "sentinels_host_func"}) {
            std::printf("  idle wake-up: %s overshoot / blocking-sync overshoot: %s (target <= "
                        "1.0)\n",
                        k, ratio(g_overshoot_us, k, "blocking_sync").c_str());
            if (auto it = g_process_cpu.find(k); it != g_process_cpu.end()) {
                // The whole process: host functions run on a CUDA thread, the doorbell's
                // backstop on one of its own.
                std::printf("  idle CPU %s: %.4f (target <= 0.01)\n", k, it->second);
            }
        }
    }
    if (!g_post_us.empty()) {
        std::printf("\nPost from another thread to an idle loop (one long GPU wait pending), wall "
                    "time until the posted function runs (median of %d; for information)\n",
                    kPostSamples);
        for (auto [k, what] : {std::pair{"sentinels", "blocked on the doorbell"},
                               std::pair{"balanced", "sleeping on its condition variable"}}) {
            if (auto it = g_post_us.find(k); it != g_post_us.end()) {
                std::printf("  %-10s %9.1f us   (%s)\n", k, it->second, what);
            }
        }
        std::printf("  post wake-up: sentinels / balanced: %s\n",
                    ratio(g_post_us, "sentinels", "balanced").c_str());
    }
    std::fflush(stdout);
}

} // namespace bench

int main(int argc, char** argv) {
    return bench::run_main(argc, argv, "await_bench", "every benchmark here waits for a GPU",
                           bench::warm_up_device, bench::register_benchmarks, bench::print_summary);
}
