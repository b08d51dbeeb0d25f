// SPDX-License-Identifier: Apache-2.0
#pragma once

// Synopsis
//   struct stall_info;        a stalled device, its streams with pending awaits, how long
//   struct watchdog_options;  window, heartbeat, fail_awaits, on_stall
//   class watchdog;           `watchdog wd(sched, {.window = 2s, .on_stall = report});`
//
// Reports a device whose pending awaits made no progress for a whole window. Construct, use and
// destroy a watchdog on the scheduler's thread or while nobody drives it. See
// docs/observe.md#watchdog.

#include <cudawait/core/scheduler.hpp>
#include <cudawait/core/task.hpp>
#include <cudawait/runtime/detail/chrono.hpp>
#include <cudawait/runtime/error.hpp>
#include <cudawait/runtime/event.hpp>
#include <cudawait/runtime/stream.hpp>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

#include <cuda.h>
#include <cuda_runtime_api.h>

namespace cudawait {

/// What a watchdog passes to its on_stall callback.
struct stall_info {
    int device = -1;                         ///< the device that made no progress
    std::vector<cudaStream_t> streams;       ///< its streams with pending awaits
    std::size_t pending_awaits = 0;          ///< awaits pending on those streams
    std::chrono::nanoseconds stalled_for{0}; ///< time since its last progress
};

/// How a watchdog decides and what it does.
struct watchdog_options {
    /// No progress for this long while awaits are pending is a stall.
    std::chrono::nanoseconds window = std::chrono::seconds(2);
    /// Tell a long kernel that leaves SMs free from a stalled context (see the synopsis).
    bool heartbeat = true;
    /// On a stall, resume the device's awaits with stall_error.
    bool fail_awaits = false;
    /// Called on the scheduler's thread, once per stall, before any await is failed. Must not
    /// throw (an exception is reported on stderr and dropped) nor destroy the watchdog.
    std::function<void(const stall_info&)> on_stall;
};

namespace detail {

// One thread atomically increments the 64-bit counter it is given. Hand-written PTX for an ISA
// every driver of CUDA 11 or newer JIT-compiles for its GPU.
inline constexpr char heartbeat_ptx[] = R"(
.version 7.0
.target sm_50
.address_size 64
.visible .entry cudawait_heartbeat(.param .u64 counter)
{
    .reg .b64 %rd<4>;
    ld.param.u64 %rd1, [counter];
    cvta.to.global.u64 %rd2, %rd1;
    atom.global.add.u64 %rd3, [%rd2], 1;
    ret;
}
)";

/// Per device, for the process's life: the heartbeat kernel and the mapped counter that every
/// heartbeat on that device increments (any advance proves the context alive, whichever
/// watchdog launched it). Thread-safe. A class template (`Unused` is always void; use
/// heartbeat_kernel) so that only a translation unit that runs a watchdog instantiates it.
template <class Unused = void>
class basic_heartbeat_kernel {
public:
    /// @throws cuda_error when the runtime, the driver or the JIT fails
    [[nodiscard]] static basic_heartbeat_kernel& for_device(int dev) {
        static std::mutex mutex;
        static std::vector<std::unique_ptr<basic_heartbeat_kernel>> kernels;
        std::lock_guard lock(mutex);
        if (static_cast<std::size_t>(dev) >= kernels.size()) {
            kernels.resize(static_cast<std::size_t>(dev) + 1);
        }
        auto& k = kernels[static_cast<std::size_t>(dev)];
        if (!k) {
            k.reset(new basic_heartbeat_kernel(dev));
        }
        return *k;
    }
    basic_heartbeat_kernel(const basic_heartbeat_kernel&) = delete;
    basic_heartbeat_kernel& operator=(const basic_heartbeat_kernel&) = delete;
    // The module stays loaded: the primary context goes with the process.
    ~basic_heartbeat_kernel() { report(cudaFreeHost(m_host), "cudaFreeHost"); }

    /// Heartbeats that ran on this device so far.
    [[nodiscard]] std::uint64_t beats() const noexcept {
        return std::atomic_ref<std::uint64_t>(*m_host).load(std::memory_order_relaxed);
    }
    /// Enqueues one heartbeat on `s` (a stream of this device). Loop thread.
    [[nodiscard]] cudaError_t launch(cudaStream_t s) const noexcept {
        void* counter = m_device;
        void* args[] = {&counter};
        // Runtime and driver codes agree for every error a launch reports.
        return static_cast<cudaError_t>(
            m_launch(m_function, 1, 1, 1, 1, 1, 1, 0, static_cast<CUstream>(s), args, nullptr));
    }

private:
    using load_fn = CUresult(CUDAAPI*)(CUmodule*, const void*);
    using get_function_fn = CUresult(CUDAAPI*)(CUfunction*, CUmodule, const char*);
    using launch_fn = CUresult(CUDAAPI*)(CUfunction, unsigned, unsigned, unsigned, unsigned,
                                         unsigned, unsigned, unsigned, CUstream, void**, void**);

    template <class Fn>
    static Fn entry(const char* name) {
        void* fn = nullptr;
        cudaDriverEntryPointQueryResult found{};
        check(cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &found),
              "cudaGetDriverEntryPointByVersion");
        if (found != cudaDriverEntryPointSuccess || fn == nullptr) {
            throw cuda_error(cudaErrorSymbolNotFound, "cudaGetDriverEntryPointByVersion");
        }
        return reinterpret_cast<Fn>(fn);
    }

    explicit basic_heartbeat_kernel(int dev) {
        device_guard guard{device_ref(dev)};
        // Allocating first also makes the device's primary context current for the driver.
        check(cudaHostAlloc(reinterpret_cast<void**>(&m_host), sizeof(std::uint64_t),
                            cudaHostAllocMapped | cudaHostAllocPortable),
              "cudaHostAlloc");
        *m_host = 0;
        try {
            check(cudaHostGetDevicePointer(&m_device, m_host, 0), "cudaHostGetDevicePointer");
            CUmodule module = nullptr;
            check(static_cast<cudaError_t>(
                      entry<load_fn>("cuModuleLoadData")(&module, heartbeat_ptx)),
                  "cuModuleLoadData");
            check(static_cast<cudaError_t>(entry<get_function_fn>("cuModuleGetFunction")(
                      &m_function, module, "cudawait_heartbeat")),
                  "cuModuleGetFunction");
            m_launch = entry<launch_fn>("cuLaunchKernel");
        } catch (...) {
            report(cudaFreeHost(m_host), "cudaFreeHost");
            throw;
        }
    }

    std::uint64_t* m_host = nullptr;
    void* m_device = nullptr;
    CUfunction m_function = nullptr;
    launch_fn m_launch = nullptr;
};

using heartbeat_kernel = basic_heartbeat_kernel<>;

} // namespace detail

namespace detail {

/// Everything `watchdog` is, as a class template that `watchdog` derives from: the members of a
/// template are instantiated only where they are used, so a translation unit that includes
/// this header and makes no watchdog does not instantiate them. `Unused` is always void.
template <class Unused = void>
class basic_watchdog {
    using clock = std::chrono::steady_clock;

public:
    /// Starts watching at once; makes no CUDA call until a device has awaits pending.
    /// @throws usage_error when `options.window` is not positive
    explicit basic_watchdog(scheduler& sched, watchdog_options options = {})
        : m_sched(&sched), m_options(std::move(options)),
          m_tick(std::max<std::chrono::nanoseconds>(m_options.window / 32,
                                                    std::chrono::microseconds(100))) {
        if (m_options.window <= std::chrono::nanoseconds::zero()) {
            throw usage_error("cudawait::watchdog: the window must be positive");
        }
        arm(clock::now());
    }
    basic_watchdog(const basic_watchdog&) = delete;
    basic_watchdog& operator=(const basic_watchdog&) = delete;

    /// Stops watching. A heartbeat still in flight keeps its stream and event: a task on the
    /// scheduler releases them once it finished (run() and the scheduler's destructor wait).
    ~basic_watchdog() {
        detail::scheduler_access::cancel_timer(*m_sched, m_timer);
        for (auto& d : m_devices) {
            if (d && d->in_flight) {
                retire(std::move(d));
            }
        }
    }

    /// Stalls reported so far.
    [[nodiscard]] std::size_t stalls() const noexcept { return m_stalls; }
    [[nodiscard]] const watchdog_options& options() const noexcept { return m_options; }

private:
    struct device_state {
        int device = 0;
        bool pending = false;  ///< awaits were pending at the last tick
        bool reported = false; ///< this stall was reported
        clock::time_point last_progress{};
        std::uint64_t completed = 0;
        std::uint64_t beats = 0;
        // The heartbeat, set up on first use.
        bool heartbeat_failed = false;
        bool in_flight = false;
        detail::heartbeat_kernel* kernel = nullptr;
        std::optional<stream> beat_stream;
        std::optional<pooled_event> beat_done;
    };

    void arm(clock::time_point now) {
        m_timer = detail::scheduler_access::add_daemon_timer(*m_sched, now + m_tick,
                                                             [this] { on_tick(); });
    }

    void on_tick() {
        m_timer = nullptr; // fired: the scheduler deletes it
        const auto now = clock::now();
        try {
            check_devices(now);
        } catch (const std::exception& e) {
            std::fprintf(stderr, "cudawait: watchdog check failed: %s\n", e.what());
        }
        arm(now);
    }

    void check_devices(clock::time_point now) {
        detail::scheduler_access::pending_devices(*m_sched, m_busy);
        for (auto& d : m_devices) {
            if (d && std::find(m_busy.begin(), m_busy.end(), d->device) == m_busy.end()) {
                d->pending = false; // nothing to watch: re-armed, no heartbeat launched
                d->reported = false;
            }
        }
        for (int dev : m_busy) {
            device_state& d = state(dev);
            bool progress = !d.pending; // awaits just started: the window counts from now
            d.pending = true;
            if (auto c = detail::scheduler_access::completed_on(*m_sched, dev); c != d.completed) {
                d.completed = c;
                progress = true;
            }
            if (m_options.heartbeat && !progress) {
                // Only while no completion shows the device alive: a kernel launch changes the
                // driver's state for everyone's event records and queries, so a busy device is
                // never sent one.
                progress = beat(d);
            }
            if (progress) {
                d.last_progress = now;
                d.reported = false;
                continue;
            }
            const auto stalled = now - d.last_progress;
            if (!d.reported && stalled >= m_options.window) {
                d.reported = true;
                report(dev, std::chrono::duration_cast<std::chrono::nanoseconds>(stalled));
            }
        }
    }

    device_state& state(int dev) {
        if (static_cast<std::size_t>(dev) >= m_devices.size()) {
            m_devices.resize(static_cast<std::size_t>(dev) + 1);
        }
        auto& d = m_devices[static_cast<std::size_t>(dev)];
        if (!d) {
            d = std::make_unique<device_state>();
            d->device = dev;
        }
        return *d;
    }

    /// Whether the device's heartbeat counter advanced since the last look; launches the next
    /// heartbeat once the last one finished. A device whose heartbeat cannot be set up or
    /// launched is reported on stderr and watched through completions alone.
    bool beat(device_state& d) {
        if (d.heartbeat_failed) {
            return false;
        }
        try {
            if (d.kernel == nullptr) {
                device_ref dev(d.device);
                d.beat_stream.emplace(dev, priority_low(dev));
                d.beat_done.emplace(event_pool::for_device(d.device).acquire());
                d.kernel = &detail::heartbeat_kernel::for_device(d.device);
                d.beats = d.kernel->beats();
            }
            bool progress = false;
            if (auto b = d.kernel->beats(); b != d.beats) {
                d.beats = b;
                progress = true;
            }
            if (d.in_flight) {
                const cudaError_t st = cudaEventQuery(d.beat_done->get());
                if (st == cudaErrorNotReady) {
                    return progress;
                }
                check(st, "cudaEventQuery");
                d.in_flight = false;
            }
            {
                // A launch fails on a stream of a device that is not current, and the loop
                // thread's current device is whatever the code it runs last chose.
                device_guard on{device_ref(d.device)};
                check(d.kernel->launch(d.beat_stream->get()), "cuLaunchKernel");
                check(cudaEventRecord(d.beat_done->get(), d.beat_stream->get()), "cudaEventRecord");
            }
            d.in_flight = true;
            return progress;
        } catch (const std::exception& e) {
            std::fprintf(stderr, "cudawait: watchdog heartbeat on device %d disabled: %s\n",
                         d.device, e.what());
            d.heartbeat_failed = true;
            return false;
        }
    }

    void report(int dev, std::chrono::nanoseconds stalled) {
        ++m_stalls;
        if (m_options.on_stall) {
            stall_info info;
            info.device = dev;
            info.pending_awaits = detail::scheduler_access::pending_on(*m_sched, dev, info.streams);
            info.stalled_for = stalled;
            try {
                m_options.on_stall(info);
            } catch (const std::exception& e) {
                std::fprintf(stderr, "cudawait: watchdog on_stall threw: %s\n", e.what());
            } catch (...) {
                std::fprintf(stderr, "cudawait: watchdog on_stall threw\n");
            }
        }
        if (m_options.fail_awaits) {
            (void)detail::scheduler_access::fail_waits_on(*m_sched, dev, stalled);
        }
    }

    /// Keeps a heartbeat's stream and event until its kernel finished, in a task on the
    /// scheduler; waits here if even that cannot be started.
    void retire(std::unique_ptr<device_state> d) noexcept {
        try {
            m_sched->spawn(wait_then_release(std::move(d)));
        } catch (...) {
            if (d) {
                detail::report(cudaEventSynchronize(d->beat_done->get()), "cudaEventSynchronize");
            }
        }
    }
    static task<void> wait_then_release(std::unique_ptr<device_state> d) {
        co_await event_ref(d->beat_done->get());
    }

    scheduler* m_sched;
    watchdog_options m_options;
    std::chrono::nanoseconds m_tick;
    detail::timer_node* m_timer = nullptr;
    std::vector<std::unique_ptr<device_state>> m_devices; ///< by device id
    std::vector<int> m_busy;
    std::size_t m_stalls = 0;
};

} // namespace detail

/// Watches the devices a scheduler awaits, and reports (and optionally fails the awaits of) one
/// that stopped making progress. Not copyable nor movable: the scheduler's timer points to it.
///
/// (Its members are those of detail::basic_watchdog.)
class watchdog : public detail::basic_watchdog<> {
public:
    using detail::basic_watchdog<>::basic_watchdog;
};

} // namespace cudawait
