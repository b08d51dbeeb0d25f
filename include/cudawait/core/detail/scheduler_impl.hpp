// SPDX-License-Identifier: Apache-2.0
#pragma once

// detail::basic_scheduler: the loop behind cudawait::scheduler (scheduler.hpp includes this file
// at its end; under CUDAWAIT_SEPARATE_COMPILATION only the library's own translation unit,
// src/cudawait.cpp, does). See docs/core.md#the-scheduler.

#include <cudawait/core/detail/callback.hpp>
#include <cudawait/core/detail/idle_strategy.hpp>
#include <cudawait/core/detail/scheduler_access.hpp>
#include <cudawait/core/detail/timer_heap.hpp>
#include <cudawait/core/detail/wait_queues.hpp>
#include <cudawait/core/poll_policy.hpp>
#include <cudawait/runtime/detail/chrono.hpp>
#include <cudawait/runtime/error.hpp>
#include <cudawait/runtime/event.hpp>

#include <atomic>
#include <condition_variable>
#include <coroutine>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <mutex>
#include <stop_token>
#include <thread>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>

namespace cudawait {

namespace detail {

/// The loop behind a scheduler. A class template (`Unused` is always void): only a translation
/// unit that makes a scheduler (new_scheduler_core) compiles it and the standard containers it
/// uses.
template <class Unused>
class basic_scheduler final : public scheduler_core {
    using clock = std::chrono::steady_clock;
    template <class>
    friend struct scheduler_access_t;

public:
    explicit basic_scheduler(poll_policy policy) : m_policy(policy) {}

    /// Drives the loop until no GPU wait is pending and nothing is ready, so no recycled event
    /// is handed back while the GPU may still complete it. Coroutines still suspended on timers
    /// or on other schedulers are reported on stderr and not resumed.
    ~basic_scheduler() override {
        try {
            run_loop({}, [this] {
                return !m_waits.has_waits() && m_ready.empty() && m_stalled.empty() &&
                       m_children == 0 && !m_has_remote.load();
            });
        } catch (const std::exception& e) {
            std::fprintf(stderr, "cudawait: scheduler drain failed: %s\n", e.what());
        }
        if (m_timers.live() > 0 || m_detached.load() > 0) {
            std::fprintf(stderr,
                         "cudawait: scheduler destroyed with %zu pending timers and %zu detached "
                         "tasks still suspended; they will not be resumed\n",
                         m_timers.live(), m_detached.load());
        }
        // A thread that handed work over (post, wake, a finished detached task) does all it does
        // to this scheduler under m_remote_mutex: once this lock is had, none is still inside.
        { std::lock_guard lock(m_remote_mutex); }
        m_timers.clear();
        m_waits.release_events();
    }

    /// Runs `fn` on the loop thread (scheduler::post). Thread-safe.
    void post(callback fn) override {
        signal([this, &fn] { m_remote.push_back(std::move(fn)); });
    }
    void wake() noexcept override {
        signal([] {});
    }
    /// Counts a detached coroutine (scheduler::spawn) and posts its start, in one hand-off:
    /// when that throws, nothing is counted.
    void start_detached(std::coroutine_handle<> h) override {
        signal([this, h] {
            m_remote.push_back([h] { h.resume(); });
            m_detached.fetch_add(1, std::memory_order_relaxed);
        });
    }
    /// What a detached coroutine's sink calls last: keeps its exception for run() to rethrow.
    void finish_detached(std::exception_ptr error) override {
        if (error) {
            std::lock_guard lock(m_error_mutex);
            if (!m_detached_error) {
                m_detached_error = std::move(error);
            }
        }
        // The last thing the coroutine does to the scheduler, under its lock (see signal).
        signal([this] { m_detached.fetch_sub(1, std::memory_order_release); });
    }

    void run() override {
        run_loop({}, [this] { return idle(); });
        rethrow_detached_error();
    }
    void run(std::stop_token stop) override {
        std::stop_callback wake_on_stop(stop, [this] { wake(); });
        run_loop({}, [&stop] { return stop.stop_requested(); });
        rethrow_detached_error();
    }
    void run_from(std::coroutine_handle<> first, bool (*done)(void*), void* context) override {
        run_loop(first, [done, context] { return done(context); });
    }

    bool poll() override {
        loop_owner owner(*this);
        return step();
    }

    [[nodiscard]] scheduler_pending_counts pending() const override {
        return {m_waits.stream_waits(), m_waits.event_waits(), m_waits.streams(),
                m_timers.live(),        m_ready.size(),        m_detached.load()};
    }

    [[nodiscard]] const poll_policy& policy() const noexcept override { return m_policy; }
    void set_policy(const poll_policy& p) noexcept override { m_policy = p; }

private:
    // ---- used by the awaiters and the library's drivers (detail::scheduler_access) --------

    /// Drives the loop until `done()`, resuming `first` (if any) as its first piece of work.
    /// `first` is left untouched when the call throws usage_error.
    template <class Pred>
    void run_loop(std::coroutine_handle<> first, Pred&& done) {
        loop_owner owner(*this);
        if (first) {
            m_ready.push_back(first);
        }
        auto last_progress = clock::now();
        auto backoff = m_policy.sleep_min;
        while (!done()) {
            if (step()) {
                const auto now = clock::now();
                if (m_gpu_progress && now - last_progress > m_policy.spin) {
                    m_idle.record(now - last_progress); // a wait that outlasted the spin
                }
                last_progress = now;
                backoff = m_policy.sleep_min;
                continue;
            }
            if (done()) {
                break;
            }
            m_idle.wait(m_policy, m_waits, m_timers, {m_remote_mutex, m_remote_cv, m_has_remote},
                        last_progress, backoff);
        }
    }

    /// Queues `h` until the work enqueued on `s` so far finished: records a recycled event on `s`
    /// and appends it to the stream's FIFO. Returns false (with `status` and `api` set) when
    /// that failed and `h` must not suspend. Any thread.
    bool add_wait(cudaStream_t s, std::coroutine_handle<> h, cudaError_t& status,
                  const char*& api) noexcept override {
        if (!on_loop_thread()) {
            // Recorded here, on the awaiting thread: its current device and its per-thread
            // stream are what the handle names (the loop thread's may differ).
            return add_stream_wait_foreign(s, h, status, api);
        }
        try {
            return add_stream_wait_local(s, h, status, api);
        } catch (...) {
            return fail(status, api, cudaErrorMemoryAllocation, "stream wait bookkeeping");
        }
    }

    /// Queues `h` until the user's event `e` completes. Same contract as for a stream.
    bool add_wait(cudaEvent_t e, std::coroutine_handle<> h, cudaError_t& status,
                  const char*& api) noexcept override {
        if (!on_loop_thread()) {
            return post_add_wait(e, h, status, api);
        }
        try {
            detail::wait_node* n = m_waits.new_node();
            n->event = e;
            n->device = -1;
            n->waiter = h;
            n->status = &status;
            api = "cudaEventQuery";
            m_waits.push_event_wait(n);
        } catch (...) {
            return fail(status, api, cudaErrorMemoryAllocation, "event wait bookkeeping");
        }
        return true;
    }

    /// Resumes `h` at `deadline`. Any thread.
    void add_timer(clock::time_point deadline, std::coroutine_handle<> h) override {
        if (!on_loop_thread()) {
            post(callback([this, deadline, h] { add_timer(deadline, h); }));
            return;
        }
        m_timers.add(deadline, h);
    }
    /// Calls `fn` on the loop thread at `deadline` unless cancelled first. Loop thread only.
    timer_node* add_timer(clock::time_point deadline, callback fn) override {
        return m_timers.add(deadline, std::move(fn));
    }
    /// add_timer(deadline, fn) for a periodic check: the timer does not keep run() going nor
    /// the destructor waiting. Loop thread only.
    timer_node* add_daemon_timer(clock::time_point deadline, callback fn) override {
        return m_timers.add_daemon(deadline, std::move(fn));
    }
    /// Cancels a callback timer that has not fired yet. Loop thread only.
    void cancel_timer(timer_node* t) noexcept override { m_timers.cancel(t); }

    /// For a watchdog, loop thread only: GPU waits completed on `dev` so far.
    [[nodiscard]] std::uint64_t completed_on(int dev) const noexcept override {
        return m_waits.completed_on(dev);
    }
    /// For a watchdog, loop thread only: the devices with stream waits pending.
    void pending_devices(void (*each)(void*, int), void* context) const override {
        std::vector<int> devices;
        m_waits.pending_devices(devices);
        for (int dev : devices) {
            each(context, dev);
        }
    }
    /// For a watchdog, loop thread only: the streams of `dev` with awaits pending, and how many
    /// awaits are pending on `dev`.
    std::size_t pending_on(int dev, void (*each)(void*, cudaStream_t),
                           void* context) const override {
        std::vector<cudaStream_t> streams;
        const std::size_t waits = m_waits.pending_on(dev, streams);
        for (cudaStream_t s : streams) {
            each(context, s);
        }
        return waits;
    }
    /// What the await resume_stalled resumes now throws.
    [[nodiscard]] const stall_record& last_stall() const noexcept override { return m_stall; }
    /// Resumes `h` at the loop's next step. Loop thread only.
    void resume_soon(std::coroutine_handle<> h) override { m_ready.push_back(h); }
    /// signal(change) for a change named by a function and its argument.
    void signal(void (*change)(void*), void* context) override {
        signal([change, context] { change(context); });
    }

    /// For a watchdog (watchdog.hpp), loop thread only: fails every await of a stream of `dev`.
    /// Each coroutine resumes at the loop's next step, its await throwing stall_error; not
    /// resumed here, as the caller (a watchdog's timer) may be owned by one of them. Returns how
    /// many awaits it failed.
    std::size_t fail_waits_on(int dev, std::chrono::nanoseconds stalled_for) override {
        const std::size_t before = m_stalled.size();
        m_waits.fail_waits_on(dev, [&](std::coroutine_handle<> waiter) {
            m_stalled.push_back({waiter, {dev, stalled_for}});
        });
        return m_stalled.size() - before;
    }
    /// Library-internal detached coroutines (the work behind a with_timeout) are counted so
    /// that run() and the destructor wait for them. Loop thread only.
    void child_started() noexcept override { m_children.fetch_add(1, std::memory_order_relaxed); }
    void child_finished() noexcept override { m_children.fetch_sub(1, std::memory_order_relaxed); }

    [[nodiscard]] bool on_loop_thread() const noexcept override {
        return m_owner.load(std::memory_order_relaxed) == std::this_thread::get_id();
    }

    // ---- helpers ---------------------------------------------------------------------------

    /// Publishes a change that may let the loop finish (`change()`, run under m_remote_mutex) and
    /// wakes the loop, touching nothing of the scheduler after the lock is released: the loop
    /// may return and the scheduler be destroyed at once (its destructor takes the lock last).
    template <class Change>
    void signal(Change&& change) {
        std::lock_guard lock(m_remote_mutex);
        change();
        m_has_remote.store(true); // sequentially consistent: see doorbell_wait
        m_remote_cv.notify_one();
        m_idle.ring_if_blocked();
    }

    class loop_owner {
    public:
        explicit loop_owner(basic_scheduler& s) : m_s(s) {
            std::thread::id none{};
            if (!m_s.m_owner.compare_exchange_strong(none, std::this_thread::get_id())) {
                throw usage_error("cudawait::scheduler is already being driven (by another "
                                  "thread, or re-entered from one of its own coroutines)");
            }
        }
        loop_owner(const loop_owner&) = delete;
        loop_owner& operator=(const loop_owner&) = delete;
        ~loop_owner() { m_s.m_owner.store(std::thread::id{}); }

    private:
        basic_scheduler& m_s;
    };

    bool add_stream_wait_local(cudaStream_t s, std::coroutine_handle<> h, cudaError_t& status,
                               const char*& api) {
        detail::stream_fifo* f = nullptr;
        const char* what = nullptr;
        if (cudaError_t st = m_waits.fifo_for(s, f, what); st != cudaSuccess) {
            return fail(status, api, st, what);
        }
        detail::wait_node* n = m_waits.new_node();
        cudaEvent_t ev = nullptr;
        if (cudaError_t st = m_waits.event_for(f, ev); st != cudaSuccess) {
            m_waits.free_node(n);
            m_waits.drop_fifo_if_empty(f);
            return fail(status, api, st, "cudaEventCreateWithFlags");
        }
        if (cudaError_t st = cudaEventRecord(ev, s); st != cudaSuccess) {
            f->spare.push_back(ev);
            m_waits.free_node(n);
            m_waits.drop_fifo_if_empty(f);
            return fail(status, api, st, "cudaEventRecord");
        }
        n->event = ev;
        n->device = f->device;
        n->waiter = h;
        n->status = &status;
        api = "cudaEventQuery";
        m_waits.push(f, n);
        return true;
    }

    /// add_wait(stream) off the loop thread: the event is recorded here and only its
    /// bookkeeping is posted. It joins the user events' list (each queried on its own), not the
    /// stream's FIFO, whose order the loop thread's own records define.
    bool add_stream_wait_foreign(cudaStream_t s, std::coroutine_handle<> h, cudaError_t& status,
                                 const char*& api) noexcept {
        int dev = 0;
        const bool per_device = detail::wait_queues<Unused>::names_stream_per_device(s);
        if (cudaError_t st = per_device ? cudaGetDevice(&dev) : cudaStreamGetDevice(s, &dev);
            st != cudaSuccess) {
            return fail(status, api, st, per_device ? "cudaGetDevice" : "cudaStreamGetDevice");
        }
        cudaEvent_t ev = nullptr;
        try {
            ev = event_pool::for_device(dev).acquire_raw();
        } catch (const cuda_error& e) {
            return fail(status, api, e.status(), "cudaEventCreateWithFlags");
        } catch (...) {
            return fail(status, api, cudaErrorMemoryAllocation, "stream wait bookkeeping");
        }
        if (cudaError_t st = cudaEventRecord(ev, s); st != cudaSuccess) {
            event_pool::for_device(dev).release_raw(ev);
            return fail(status, api, st, "cudaEventRecord");
        }
        try {
            post(callback([this, ev, dev, h, &status, &api] {
                try {
                    detail::wait_node* n = m_waits.new_node();
                    n->event = ev;
                    n->device = dev;
                    n->waiter = h;
                    n->status = &status;
                    api = "cudaEventQuery";
                    m_waits.push_event_wait(n);
                } catch (...) {
                    // The event may still be pending: recorded again before anyone reuses it.
                    event_pool::for_device(dev).release_raw(ev);
                    (void)fail(status, api, cudaErrorMemoryAllocation, "stream wait bookkeeping");
                    m_ready.push_back(h);
                }
            }));
            return true;
        } catch (...) {
            event_pool::for_device(dev).release_raw(ev);
            return fail(status, api, cudaErrorMemoryAllocation, "scheduler::post");
        }
    }

    static bool fail(cudaError_t& status, const char*& api, cudaError_t st,
                     const char* what) noexcept {
        (void)cudaGetLastError();
        status = st;
        api = what;
        return false;
    }
    /// add_wait off the loop thread: the loop thread adds the wait instead, and resumes `h` at
    /// once (with `status` set) if that fails there.
    template <class Handle>
    bool post_add_wait(Handle handle, std::coroutine_handle<> h, cudaError_t& status,
                       const char*& api) noexcept {
        try {
            post(callback([this, handle, h, &status, &api] {
                if (!add_wait(handle, h, status, api)) {
                    m_ready.push_back(h);
                }
            }));
            return true;
        } catch (...) {
            return fail(status, api, cudaErrorMemoryAllocation, "scheduler::post");
        }
    }

    [[nodiscard]] bool idle() const noexcept {
        return !m_waits.has_waits() && m_ready.empty() && m_stalled.empty() &&
               m_timers.live() == 0 && m_children == 0 &&
               m_detached.load(std::memory_order_acquire) == 0 &&
               !m_has_remote.load(std::memory_order_acquire);
    }
    void rethrow_detached_error() {
        std::exception_ptr e;
        {
            std::lock_guard lock(m_error_mutex);
            e = std::exchange(m_detached_error, nullptr);
        }
        if (e) {
            std::rethrow_exception(e);
        }
    }

    // ---- the loop --------------------------------------------------------------------------

    bool step() {
        bool progress = take_remote();
        m_gpu_progress = poll_streams();
        m_gpu_progress |= m_waits.poll_events([this](detail::wait_node* n, cudaError_t st) {
            m_ready.push_back(m_waits.release(n, st));
        });
        progress |= m_gpu_progress;
        progress |= !m_timers.empty() && m_timers.fire(clock::now(), m_ready);
        progress |= resume_stalled(); // after the timer that failed them has returned
        progress |= run_ready();
        return progress;
    }

    bool take_remote() {
        if (!m_has_remote.load(std::memory_order_acquire)) {
            return false;
        }
        {
            std::lock_guard lock(m_remote_mutex);
            m_remote_batch.swap(m_remote);
            m_has_remote.store(false, std::memory_order_relaxed);
        }
        for (auto& fn : m_remote_batch) {
            if (fn) {
                try {
                    fn();
                } catch (...) {
                    std::lock_guard lock(m_error_mutex);
                    if (!m_detached_error) {
                        m_detached_error = std::current_exception();
                    }
                }
            }
        }
        m_remote_batch.clear();
        return true;
    }

    /// Resumes the awaits fail_waits_on failed, each reading its own record.
    bool resume_stalled() {
        if (m_stalled.empty()) {
            return false;
        }
        std::vector<stalled_wait> batch;
        batch.swap(m_stalled);
        for (const stalled_wait& w : batch) {
            m_stall = w.record;
            w.waiter.resume();
        }
        return true;
    }

    bool run_ready() {
        if (m_ready.empty()) {
            return false;
        }
        m_ready_batch.swap(m_ready);
        for (std::coroutine_handle<> h : m_ready_batch) {
            h.resume();
        }
        m_ready_batch.clear();
        return true;
    }

    bool poll_streams() {
        bool progress = false;
        const auto& active = m_waits.active();
        for (std::size_t i = 0; i < active.size();) {
            detail::stream_fifo* f = active[i];
            progress |= poll_fifo(f);
            // An emptied FIFO left the active list (finish_head), and another took its place:
            // poll that one next. (One made for a resumed coroutine's await may be skipped this
            // sweep: polled at the next.)
            if (i < active.size() && active[i] == f) {
                ++i;
            }
        }
        return progress;
    }

    /// Completes the done prefix of `f`'s FIFO, resuming each waiter right away: the resumed
    /// coroutine usually enqueues its next work on this stream, and the GPU gets it before the
    /// next query rather than a sweep later. The prefix is found in about 2 log2(k) + 2 queries
    /// for k done nodes (docs/core.md#polling).
    bool poll_fifo(detail::stream_fifo* f) {
        bool progress = false;
        while (detail::wait_node* head = f->head) {
            const cudaError_t st = cudaEventQuery(head->event);
            if (st == cudaErrorNotReady) {
                break;
            }
            progress = true;
            if (st != cudaSuccess) {
                finish_head(f, st);
                continue;
            }
            // A not-ready node right after the prefix ends this sweep of the FIFO, as a not-ready
            // head would.
            bool next_not_ready = false;
            const std::size_t proven =
                detail::wait_queues<Unused>::done_prefix(head, next_not_ready);
            // Resuming appends new nodes behind the prefix, never inside it, so the prefix is
            // always the first `proven` nodes of the FIFO.
            for (std::size_t k = 0; k < proven; ++k) {
                finish_head(f, cudaSuccess);
            }
            if (next_not_ready) {
                break;
            }
        }
        return progress;
    }

    /// Takes the head node off `f`, recycles its event on the stream and resumes its waiter.
    /// An emptied FIFO is forgotten before the waiter runs: it may destroy the stream, and a new
    /// stream (of any device) may get the same handle and must not find this FIFO.
    void finish_head(detail::stream_fifo* f, cudaError_t st) {
        std::coroutine_handle<> h = m_waits.release(m_waits.pop_head(f), st);
        if (m_ready.empty()) {
            h.resume(); // what run_ready would do, without the trip through m_ready
        } else {
            m_ready.push_back(h);
            run_ready();
        }
    }

    /// What a sentinel's host function calls (a CUDA-internal thread): ends the loop's sleep,
    /// or its block on the doorbell, as a post does, without allocating.
    static void sentinel_fired(void* self) noexcept {
        static_cast<basic_scheduler*>(self)->signal([] {});
    }

    poll_policy m_policy;

    // Loop-thread state.
    bool m_gpu_progress = false; ///< the last step() completed GPU waits
    std::vector<std::coroutine_handle<>> m_ready;
    std::vector<std::coroutine_handle<>> m_ready_batch;
    detail::wait_queues<Unused> m_waits;
    detail::timer_heap<Unused> m_timers;
    std::atomic<std::size_t> m_children{0};
    detail::stall_record m_stall; ///< what the await resume_stalled resumes now throws
    struct stalled_wait {
        std::coroutine_handle<> waiter;
        detail::stall_record record;
    };
    std::vector<stalled_wait> m_stalled; ///< failed by fail_waits_on, resumed at the next step

    // Shared with other threads.
    std::mutex m_remote_mutex;
    std::condition_variable m_remote_cv;
    std::vector<callback> m_remote;
    std::vector<callback> m_remote_batch;
    std::atomic<bool> m_has_remote{false};
    std::atomic<std::thread::id> m_owner{};
    std::atomic<std::size_t> m_detached{0};
    std::mutex m_error_mutex;
    std::exception_ptr m_detached_error;
    /// Last: its sentinels find the members above while it is destroyed (first), and none
    /// fires once it is gone; its doorbell is rung by posts.
    detail::idle_strategy<Unused> m_idle{&basic_scheduler::sentinel_fired, this};
};

template <class Unused>
scheduler_core* new_scheduler_core(const poll_policy& policy) {
    return new basic_scheduler<Unused>(policy);
}

} // namespace detail
} // namespace cudawait
