// SPDX-License-Identifier: Apache-2.0
#pragma once

// Synopsis
//   struct poll_policy;   how an idle scheduler waits: spin, then yield, then sleep until a
//                         sentinel or the end its last idle periods predict wakes it (the
//                         default, balanced()); spinning(), yielding(), sleeping(), sentinels()
//   class scheduler;      the event loop that resumes coroutines when their GPU work finished
//   sleep_for(d)          inside a task: `co_await sleep_for(5ms);`
//   (with_timeout is in timeout.hpp)
//
// Inside a library coroutine (task, when_all child, scope or sync_wait root):
//   co_await stream;            resumes once all work enqueued on it before the await finished
//   co_await event;             resumes once the event's captured work finished
//   co_await sched.schedule();  continues on `sched`'s thread
//
// How it polls. An await on a stream records a recycled event on it and appends (event,
// coroutine) to that stream's FIFO. Events recorded on one stream complete in order, so each
// sweep queries only the head of every FIFO with pending work: O(streams), not O(awaits).
// Awaited user events are kept in a separate list and each is queried per sweep. No CUDA host
// callbacks are used on this path: they cost ~5x the latency of polling and may not call CUDA.
//
// Long waits (poll_policy). Once nothing has been ready for the policy's spin phase, the loop
// looks at how long its recent idle periods lasted before GPU work ended them: repeated work
// (most programs' steady state) is likely to take as long again, so the loop sleeps until shortly
// before that time and busy-polls around it (detail/wake_history.hpp), skipping the yield phase
// where that time is several sleeps away.
// Once its sleeps have backed off to `sleep_max` (at once, for a predicted end further away), it
// arms a sentinel per pending wait (the head of each stream's FIFO and each user event): a private
// stream that waits for the event and then runs a CUDA host function that wakes the loop, which
// sleeps on its condition variable until a sentinel, a post, a timer or the predicted end wakes it,
// polling every `sentinel_poll` (detail/idle_watch.hpp). With poll_policy::sentinels() (`doorbell`
// on) and no timer pending, a sentinel writes a doorbell word in mapped host memory instead, and
// the loop thread blocks in cudaEventSynchronize on a blocking-sync event that a waker stream
// records once the word is rung: the driver wakes the loop as directly as it wakes a blocking sync,
// but the waker's wait holds a hardware queue while the loop sleeps. Posts, stops and a backstop
// every `sentinel_poll` ring the word from the host (detail/doorbell.hpp). Either way: few
// wake-ups, and a resume soon after the GPU finishes, where the sleep back-off alone would take up
// to `sleep_max`.
//
// Threads. One thread at a time drives a scheduler (run / run_until / sync_wait); coroutines
// resume on it. post, spawn, wake and schedule() are safe from any thread, and a scheduler may be
// destroyed as soon as its loop returned, whatever other threads just handed it. `sched.wait(s)`
// from another thread records on that thread's stream: 0, cudaStreamLegacy and
// cudaStreamPerThread name the awaiting thread's stream of its current device.
//
// The public members are what a user calls. What only the library's awaiters and drivers need
// (queueing a wait or a timer, counting internal children, run_from) is private and reached
// through detail::scheduler_access.

#include <cudawait/core/detail/detached.hpp>
#include <cudawait/core/detail/doorbell.hpp>
#include <cudawait/core/detail/idle_watch.hpp>
#include <cudawait/core/detail/wake_history.hpp>
#include <cudawait/core/task.hpp>
#include <cudawait/runtime/device.hpp>
#include <cudawait/runtime/error.hpp>
#include <cudawait/runtime/event.hpp>
#include <cudawait/runtime/stream.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <coroutine>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <source_location>
#include <stop_token>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>

namespace cudawait {

/// How a scheduler waits while GPU work is pending and nothing is ready.
///
/// After the last progress it busy-polls for `spin`, then polls with `std::this_thread::yield()`
/// until `spin + yield` has passed, then sleeps between polls, starting at `sleep_min` and
/// doubling up to `sleep_max`. A post from another thread ends a sleep at once. With no GPU work
/// pending the scheduler blocks until a post or its next timer, whatever the policy.
///
/// With `predict` on, the loop remembers how long its last idle periods lasted before GPU work
/// ended them (detail/wake_history.hpp). Where one of them says the present wait is likely to
/// end, the loop busy-polls from shortly before that time until shortly after it, and sleeps
/// towards it: with the back-off as usual in the sleep phase, and from the end of `spin` on
/// (skipping the yield phase, the sentinels armed at once) where that end is at least
/// 4 x `sleep_max` away. Repeated long work (the usual case) is then seen complete about as soon
/// as a spinning loop would see it, at the CPU cost of one sleep. A prediction that misses costs
/// one short polling window; the sleep phase goes on as below.
///
/// With `sentinel` on, once the back-off has grown to `sleep_max` (or at once, where a predicted
/// end is at least 4 x `sleep_max` away) the loop arms a sentinel per pending wait: a private
/// stream that waits for the awaited event and then runs a CUDA host function that wakes the
/// loop, which sleeps on its condition variable meanwhile. With `doorbell` on too (and no timer
/// pending, and the driver's stream memory operations at hand) the sentinel writes a doorbell
/// word instead, and the loop thread blocks in the driver (cudaEventSynchronize) until it is
/// rung. While every pending wait has a sentinel, the loop sleeps until a sentinel, a post, a
/// timer or a predicted end wakes it, and polls only every `sentinel_poll`: that bounds the
/// latency where a sentinel cannot fire (a context a fault killed) or fires late (CUDA may run the
/// host functions of independent streams one at a time, so a user's long host function can hold
/// one up), and how long the doorbell's wait can hold a hardware queue that other streams share
/// (and a device-wide synchronisation on another thread, which waits for that wait too).
/// Where a sentinel cannot be armed (more than detail::idle_watch::max_armed waits, or a CUDA
/// error) the loop sleeps with the back-off as before.
struct poll_policy {
    std::chrono::nanoseconds spin = std::chrono::microseconds(200);
    std::chrono::nanoseconds yield = std::chrono::microseconds(800);
    std::chrono::nanoseconds sleep_min = std::chrono::microseconds(20);
    std::chrono::nanoseconds sleep_max = std::chrono::microseconds(1000);
    /// Sentinels wake the sleep phase when the GPU work completes (see above). On in balanced()
    /// (the default) and sentinels().
    bool sentinel = true;
    /// While sentinels watch every pending wait, the loop still polls this often.
    std::chrono::nanoseconds sentinel_poll = std::chrono::milliseconds(50);
    /// Sentinels ring a doorbell the loop blocks on in the driver (see above). Only sentinels().
    bool doorbell = false;
    /// Sleeps until shortly before the end its recent idle periods predict (see above).
    bool predict = true;

    /// Lowest latency, one core busy while anything is pending.
    [[nodiscard]] static constexpr poll_policy spinning() noexcept {
        return busy(std::chrono::nanoseconds::max() / 4, std::chrono::nanoseconds(0));
    }
    /// Polls between `std::this_thread::yield()` calls; gives the core away to other threads.
    [[nodiscard]] static constexpr poll_policy yielding() noexcept {
        return busy(std::chrono::nanoseconds(0), std::chrono::nanoseconds::max() / 4);
    }
    /// Sleeps between polls from the start, backing off from `min` to `max`: little CPU, a
    /// resume latency of up to `max` (less for repeated work, with `predict`). No sentinels:
    /// arming them would cost a few driver calls per wait, short ones included (set `sentinel`
    /// to have them).
    [[nodiscard]] static constexpr poll_policy
    sleeping(std::chrono::nanoseconds min = std::chrono::microseconds(50),
             std::chrono::nanoseconds max = std::chrono::microseconds(2000)) noexcept {
        poll_policy p;
        p.spin = p.yield = std::chrono::nanoseconds(0);
        p.sleep_min = min;
        p.sleep_max = max;
        p.sentinel = false;
        return p;
    }
    /// The default: spin 200 us, yield until 1 ms, then sleep, woken by host-function sentinels
    /// (polling every 50 ms; 20 us .. 1 ms back-off where none could be armed), and by the end
    /// that the last idle periods predict.
    [[nodiscard]] static constexpr poll_policy balanced() noexcept { return {}; }
    /// balanced(), but the sentinels ring a doorbell the loop thread blocks on in the driver
    /// (polling every 10 ms): a wake-up as prompt as a blocking sync's even for work never seen
    /// before, where no timer is pending. The doorbell's wait holds one of the device's hardware
    /// queues while the loop sleeps (up to 10 ms at a time): work other threads queue on streams
    /// that share it waits that long.
    [[nodiscard]] static constexpr poll_policy sentinels() noexcept {
        poll_policy p;
        p.doorbell = true;
        p.sentinel_poll = std::chrono::milliseconds(10);
        return p;
    }

private:
    // A policy that never sleeps while GPU work is pending: nothing to arm or predict.
    static constexpr poll_policy busy(std::chrono::nanoseconds spin,
                                      std::chrono::nanoseconds yield) noexcept {
        poll_policy p;
        p.spin = spin;
        p.yield = yield;
        p.sentinel = false;
        p.predict = false;
        return p;
    }
};

namespace detail {

/// One pending GPU wait: the event to poll and the coroutine to resume.
struct wait_node {
    wait_node* next = nullptr;
    cudaEvent_t event = nullptr;
    int device = -1; ///< >= 0: a recycled event of that device; -1: the user's event
    std::coroutine_handle<> waiter;
    cudaError_t* status = nullptr;
    bool watched = false; ///< a sentinel was armed on `event` (idle_watch)
    bool rung = false;    ///< a doorbell sentinel was armed on `event` (doorbell)
};

struct stream_fifo {
    cudaStream_t stream = nullptr;
    int device = 0;
    /// `stream` is 0, cudaStreamLegacy or cudaStreamPerThread: a handle that names a different
    /// stream on each device, kept apart by `device` (and not in the by-handle map).
    bool per_device = false;
    wait_node* head = nullptr;
    wait_node* tail = nullptr;
    /// Completed events of this stream, recorded on it again first: re-recording an event on
    /// the stream it last ran on is about twice as cheap in the driver as moving it.
    std::vector<cudaEvent_t> spare;
};

struct timer_node {
    std::chrono::steady_clock::time_point deadline;
    std::uint64_t seq = 0;
    std::coroutine_handle<> waiter;
    std::function<void()> callback;
    bool cancelled = false;
    /// Set by add_daemon_timer: not counted as pending work (run() and the destructor do not
    /// wait for it), for periodic checks such as a watchdog's.
    bool daemon = false;
};

/// Which device a watchdog found stalled and for how long: what a wait it failed throws.
struct stall_record {
    int device = -1;
    std::chrono::nanoseconds stalled_for{0};
};

inline void cpu_relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
}

template <class Handle>
class wait_awaiter;
class sleep_awaiter;
template <class Unused = void>
struct scheduler_access_t;
template <class Unused = void>
class basic_scheduler;

} // namespace detail

class scheduler;

namespace detail {

/// What scheduler::schedule() returns.
struct schedule_awaitable {
    scheduler* target;
};

/// Everything `scheduler` is, as a class template that `scheduler` derives from: the members of
/// a template are instantiated only where they are used, so a translation unit that includes
/// this header and drives no scheduler does not instantiate the loop and the standard containers
/// it uses. `Unused` is always void.
template <class Unused>
class basic_scheduler {
    using clock = std::chrono::steady_clock;
    template <class>
    friend struct scheduler_access_t;

public:
    explicit basic_scheduler(poll_policy policy = {}) : m_policy(policy) {}
    basic_scheduler(const basic_scheduler&) = delete;
    basic_scheduler& operator=(const basic_scheduler&) = delete;

    /// Drives the loop until no GPU wait is pending and nothing is ready, so no recycled event
    /// is handed back while the GPU may still complete it. Coroutines still suspended on timers
    /// or on other schedulers are reported on stderr and not resumed.
    ~basic_scheduler() {
        try {
            run_until([this] {
                return !has_gpu_waits() && m_ready.empty() && m_stalled.empty() &&
                       m_children == 0 && !m_has_remote.load();
            });
        } catch (const std::exception& e) {
            std::fprintf(stderr, "cudawait: scheduler drain failed: %s\n", e.what());
        }
        if (m_live_timers > 0 || m_detached.load() > 0) {
            std::fprintf(stderr,
                         "cudawait: scheduler destroyed with %zu pending timers and %zu detached "
                         "tasks still suspended; they will not be resumed\n",
                         m_live_timers, m_detached.load());
        }
        // A thread that handed work over (post, wake, a finished detached task) does all it does
        // to this scheduler under m_remote_mutex: once this lock is had, none is still inside.
        { std::lock_guard lock(m_remote_mutex); }
        for (detail::timer_node* t : m_timers) {
            delete t;
        }
        for (std::size_t d = 0; d < m_event_cache.size(); ++d) {
            for (cudaEvent_t e : m_event_cache[d]) {
                event_pool::for_device(static_cast<int>(d)).release_raw(e);
            }
        }
    }

    /// `co_await sched.schedule()` continues the awaiting coroutine on this scheduler's thread,
    /// and makes it the coroutine's scheduler from then on.
    [[nodiscard]] detail::schedule_awaitable schedule() noexcept;

    /// Resumes `h` on the scheduler's thread. Thread-safe.
    void post(std::coroutine_handle<> h) {
        post(std::function<void()>([h] { h.resume(); }));
    }
    /// Runs `fn` on the scheduler's thread. Thread-safe. An exception from `fn` is kept and
    /// rethrown by the next `run()`.
    void post(std::function<void()> fn) {
        signal([this, &fn] { m_remote.push_back(std::move(fn)); });
    }
    /// Makes a waiting loop re-check its stop condition. Thread-safe; allocates nothing.
    void wake() noexcept {
        signal([] {});
    }

    /// Starts `work` (a task or any awaitable) on this scheduler, detached. Its exception, if
    /// any, is rethrown by the next `run()`. Thread-safe.
    template <class A>
    void spawn(A&& work) {
        using R = detail::awaited_t<A>;
        auto d = detail::run_detached<R>(std::forward<A>(work), detached_sink{this});
        d.handle().promise().set_scheduler(self());
        // Counted as the post publishes it, so that a failed post (or frame allocation) leaves
        // no count behind that run() would wait for.
        try {
            signal([this, &d] {
                m_remote.push_back([h = std::coroutine_handle<>(d.handle())] { h.resume(); });
                m_detached.fetch_add(1, std::memory_order_relaxed);
            });
        } catch (...) {
            d.handle().destroy();
            throw;
        }
    }

    /// Drives the loop until no work is left: nothing ready, no GPU wait, no timer and no
    /// detached task. Rethrows the first exception of a detached task.
    /// @throws usage_error when another thread is driving this scheduler
    void run() {
        run_until([this] { return idle(); });
        rethrow_detached_error();
    }
    /// Drives the loop until `stop` is requested, waiting for posts when idle.
    void run(std::stop_token stop) {
        std::stop_callback wake_on_stop(stop, [this] { wake(); });
        run_until([&stop] { return stop.stop_requested(); });
        rethrow_detached_error();
    }

    /// Drives the loop on the calling thread until `done()` is true. `done` is checked after
    /// every step; whoever makes it true from another thread must call wake().
    /// @throws usage_error when another thread is driving this scheduler
    template <class Pred>
    void run_until(Pred&& done) {
        run_from({}, std::forward<Pred>(done));
    }

    /// One non-blocking turn of the loop. Returns whether anything happened.
    /// @throws usage_error when another thread is driving this scheduler
    bool poll() {
        loop_owner owner(*this);
        return step();
    }

    /// What is pending, for diagnostics and tests. Call from the driving thread or while idle.
    struct pending_counts {
        std::size_t stream_waits = 0;
        std::size_t event_waits = 0;
        std::size_t streams = 0;
        std::size_t timers = 0;
        std::size_t ready = 0;
        std::size_t detached = 0;
    };
    [[nodiscard]] pending_counts pending() const {
        return {m_stream_waits, m_event_waits.size(), m_active.size(),
                m_live_timers,  m_ready.size(),       m_detached.load()};
    }

    [[nodiscard]] const poll_policy& policy() const noexcept { return m_policy; }
    /// Call from the driving thread or while idle.
    void set_policy(const poll_policy& p) noexcept { m_policy = p; }

    /// For coroutines other than the library's: `co_await sched.wait(stream)`.
    [[nodiscard]] inline detail::wait_awaiter<cudaStream_t>
    wait(stream_ref s, std::source_location where = std::source_location::current());
    /// For coroutines other than the library's: `co_await sched.wait(event)`.
    [[nodiscard]] inline detail::wait_awaiter<cudaEvent_t>
    wait(event_ref e, std::source_location where = std::source_location::current());
    /// For coroutines other than the library's: `co_await sched.sleep_for(d)`.
    [[nodiscard]] inline detail::sleep_awaiter sleep_for(std::chrono::nanoseconds d);

private:
    // ---- used by the awaiters and the library's drivers (detail::scheduler_access) --------

    /// run_until, resuming `first` (if any) as the loop's first piece of work. `first` is left
    /// untouched when the call throws usage_error.
    template <class Pred>
    void run_from(std::coroutine_handle<> first, Pred&& done) {
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
                    m_wake_history.record(now - last_progress); // a wait that outlasted the spin
                }
                last_progress = now;
                backoff = m_policy.sleep_min;
                continue;
            }
            if (done()) {
                break;
            }
            wait_idle(last_progress, backoff);
        }
    }

    /// Queues `h` until the work enqueued on `s` so far finished: records a recycled event on `s`
    /// and appends it to the stream's FIFO. Returns false (with `status` and `api` set) when
    /// that failed and `h` must not suspend. Any thread.
    bool add_wait(cudaStream_t s, std::coroutine_handle<> h, cudaError_t& status,
                  const char*& api) noexcept {
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
                  const char*& api) noexcept {
        if (!on_loop_thread()) {
            return post_add_wait(e, h, status, api);
        }
        try {
            detail::wait_node* n = new_node();
            n->event = e;
            n->device = -1;
            n->waiter = h;
            n->status = &status;
            api = "cudaEventQuery";
            m_event_waits.push_back(n);
        } catch (...) {
            return fail(status, api, cudaErrorMemoryAllocation, "event wait bookkeeping");
        }
        return true;
    }

    /// Resumes `h` at `deadline`. Any thread.
    void add_timer(clock::time_point deadline, std::coroutine_handle<> h) {
        if (!on_loop_thread()) {
            post([this, deadline, h] { add_timer(deadline, h); });
            return;
        }
        auto* t = new detail::timer_node{deadline, m_timer_seq++, h, {}, false};
        push_timer(t);
    }
    /// Calls `fn` on the loop thread at `deadline` unless cancelled first. Loop thread only.
    detail::timer_node* add_timer(clock::time_point deadline, std::function<void()> fn) {
        auto* t = new detail::timer_node{deadline, m_timer_seq++, {}, std::move(fn), false};
        push_timer(t);
        return t;
    }
    /// add_timer(deadline, fn) for a periodic check: the timer does not keep run() going nor
    /// the destructor waiting. Loop thread only.
    detail::timer_node* add_daemon_timer(clock::time_point deadline, std::function<void()> fn) {
        auto* t = new detail::timer_node{deadline, m_timer_seq++, {}, std::move(fn), false};
        t->daemon = true;
        push_timer(t);
        return t;
    }
    /// Cancels a callback timer that has not fired yet. Loop thread only.
    void cancel_timer(detail::timer_node* t) noexcept {
        if (t != nullptr && !t->cancelled) {
            t->cancelled = true;
            t->callback = nullptr;
            m_live_timers -= t->daemon ? 0 : 1;
        }
    }

    // ---- for a watchdog (watchdog.hpp); loop thread only ------------------------------------

    /// Stream waits completed on `dev` so far: a watchdog sees progress as this count moving.
    [[nodiscard]] std::uint64_t completed_on(int dev) const noexcept {
        return static_cast<std::size_t>(dev) < m_completed.size()
                   ? m_completed[static_cast<std::size_t>(dev)]
                   : 0;
    }
    /// Devices with stream waits pending (awaits a watchdog failed no longer count).
    void pending_devices(std::vector<int>& out) const {
        out.clear();
        for (const detail::stream_fifo* f : m_active) {
            if (std::find(out.begin(), out.end(), f->device) == out.end() && live_waits(f) > 0) {
                out.push_back(f->device);
            }
        }
        for (const detail::wait_node* n : m_event_waits) {
            if (n->device >= 0 && n->status != &m_orphan_status &&
                std::find(out.begin(), out.end(), n->device) == out.end()) {
                out.push_back(n->device);
            }
        }
    }
    /// The streams of `dev` with pending awaits, and how many awaits are pending on them.
    std::size_t pending_on(int dev, std::vector<cudaStream_t>& streams) const {
        streams.clear();
        std::size_t waits = 0;
        for (const detail::stream_fifo* f : m_active) {
            if (f->device == dev) {
                if (std::size_t n = live_waits(f); n > 0) {
                    streams.push_back(f->stream);
                    waits += n;
                }
            }
        }
        for (const detail::wait_node* n : m_event_waits) {
            waits += n->device == dev && n->status != &m_orphan_status ? 1 : 0;
        }
        return waits;
    }
    /// Fails every await of a stream of `dev`: each coroutine resumes at the loop's next step,
    /// its await throwing stall_error. Not resumed here: the caller (a watchdog's timer) may be
    /// owned by one of them. The events stay queued until the GPU completes them (so nothing it
    /// may still touch is reused) and are then recycled without resuming anyone. Returns how many
    /// awaits it failed.
    std::size_t fail_waits_on(int dev, std::chrono::nanoseconds stalled_for) {
        const std::size_t before = m_stalled.size();
        auto fail_node = [&](detail::wait_node* n) {
            if (n->status != &m_orphan_status) {
                m_stalled.push_back({n->waiter, {dev, stalled_for}});
                // Never a completion's status: the polls keep NotReady nodes queued.
                *n->status = cudaErrorNotReady;
                n->status = &m_orphan_status;
                n->waiter = std::noop_coroutine();
            }
        };
        for (detail::stream_fifo* f : m_active) {
            if (f->device == dev) {
                for (detail::wait_node* n = f->head; n != nullptr; n = n->next) {
                    fail_node(n);
                }
            }
        }
        for (detail::wait_node* n : m_event_waits) {
            if (n->device == dev) { // a stream wait recorded off the loop thread
                fail_node(n);
            }
        }
        return m_stalled.size() - before;
    }
    /// What the last wait fail_waits_on resumed throws.
    [[nodiscard]] const detail::stall_record& last_stall() const noexcept { return m_stall; }
    /// Library-internal detached coroutines (the work behind a with_timeout) are counted so
    /// that run() and the destructor wait for them. Loop thread only.
    void child_started() noexcept { m_children.fetch_add(1, std::memory_order_relaxed); }
    void child_finished() noexcept { m_children.fetch_sub(1, std::memory_order_relaxed); }

    /// Queues `h` to run on this loop. Loop thread only.
    void resume_soon(std::coroutine_handle<> h) { m_ready.push_back(h); }

    [[nodiscard]] bool on_loop_thread() const noexcept {
        return m_owner.load(std::memory_order_relaxed) == std::this_thread::get_id();
    }

    // ---- helpers ---------------------------------------------------------------------------

    /// The scheduler this is the base of (`this` is dependent: the cast is checked where the
    /// member is instantiated, after `scheduler` is complete).
    [[nodiscard]] scheduler* self() noexcept { return static_cast<scheduler*>(this); }

    /// Publishes a change that may let the loop finish (`change()`, run under m_remote_mutex) and
    /// wakes the loop, touching nothing of the scheduler after the lock is released: the loop
    /// may return and the scheduler be destroyed at once (its destructor takes the lock last).
    template <class Change>
    void signal(Change&& change) {
        std::lock_guard lock(m_remote_mutex);
        change();
        m_has_remote.store(true); // sequentially consistent: see doorbell_wait
        m_remote_cv.notify_one();
        m_doorbell.ring_if_blocked();
    }

    struct detached_sink {
        basic_scheduler* self;
        template <class R>
        void complete(detail::result_slot<R>&& r) {
            if (r.has_exception()) {
                std::lock_guard lock(self->m_error_mutex);
                if (!self->m_detached_error) {
                    self->m_detached_error = r.exception();
                }
            }
            // The last thing this sink does to the scheduler, under its lock (see signal).
            self->signal([s = self] { s->m_detached.fetch_sub(1, std::memory_order_release); });
        }
    };

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

    [[nodiscard]] std::size_t live_waits(const detail::stream_fifo* f) const noexcept {
        std::size_t n = 0;
        for (const detail::wait_node* w = f->head; w != nullptr; w = w->next) {
            n += w->status != &m_orphan_status ? 1 : 0;
        }
        return n;
    }

    /// 0, cudaStreamLegacy and cudaStreamPerThread name the calling thread's stream of its
    /// current device: one handle, a different stream per device (and per thread).
    [[nodiscard]] static bool names_stream_per_device(cudaStream_t s) noexcept {
        return s == nullptr || s == cudaStreamLegacy || s == cudaStreamPerThread;
    }

    bool add_stream_wait_local(cudaStream_t s, std::coroutine_handle<> h, cudaError_t& status,
                               const char*& api) {
        detail::stream_fifo* f = nullptr;
        if (names_stream_per_device(s)) {
            int dev = 0;
            if (cudaError_t st = cudaGetDevice(&dev); st != cudaSuccess) {
                return fail(status, api, st, "cudaGetDevice");
            }
            for (detail::stream_fifo* a : m_active) {
                if (a->per_device && a->stream == s && a->device == dev) {
                    f = a;
                    break;
                }
            }
            if (f == nullptr) {
                f = new_fifo(s, dev, true);
            }
        } else if (m_last_fifo != nullptr && m_last_fifo->stream == s) {
            f = m_last_fifo;
        } else if (auto it = m_by_stream.find(s); it != m_by_stream.end()) {
            f = it->second;
        } else {
            int dev = 0;
            if (cudaError_t st = cudaStreamGetDevice(s, &dev); st != cudaSuccess) {
                return fail(status, api, st, "cudaStreamGetDevice");
            }
            f = new_fifo(s, dev, false);
        }
        m_last_fifo = f;
        detail::wait_node* n = new_node();
        cudaEvent_t ev = nullptr;
        if (!f->spare.empty()) {
            ev = f->spare.back();
            f->spare.pop_back();
        } else if (cudaError_t st = take_event(f->device, ev); st != cudaSuccess) {
            m_free_nodes.push_back(n);
            drop_fifo_if_empty(f);
            return fail(status, api, st, "cudaEventCreateWithFlags");
        }
        if (cudaError_t st = cudaEventRecord(ev, s); st != cudaSuccess) {
            f->spare.push_back(ev);
            m_free_nodes.push_back(n);
            drop_fifo_if_empty(f);
            return fail(status, api, st, "cudaEventRecord");
        }
        n->event = ev;
        n->device = f->device;
        n->waiter = h;
        n->status = &status;
        api = "cudaEventQuery";
        if (f->tail != nullptr) {
            f->tail->next = n;
        } else {
            f->head = n;
        }
        f->tail = n;
        ++m_stream_waits;
        return true;
    }

    /// add_wait(stream) off the loop thread: the event is recorded here and only its
    /// bookkeeping is posted. It joins the user events' list (each queried on its own), not the
    /// stream's FIFO, whose order the loop thread's own records define.
    bool add_stream_wait_foreign(cudaStream_t s, std::coroutine_handle<> h, cudaError_t& status,
                                 const char*& api) noexcept {
        int dev = 0;
        const bool per_device = names_stream_per_device(s);
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
            post(std::function<void()>([this, ev, dev, h, &status, &api] {
                try {
                    detail::wait_node* n = new_node();
                    n->event = ev;
                    n->device = dev;
                    n->waiter = h;
                    n->status = &status;
                    api = "cudaEventQuery";
                    m_event_waits.push_back(n);
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
            post(std::function<void()>([this, handle, h, &status, &api] {
                if (!add_wait(handle, h, status, api)) {
                    m_ready.push_back(h);
                }
            }));
            return true;
        } catch (...) {
            return fail(status, api, cudaErrorMemoryAllocation, "scheduler::post");
        }
    }

    [[nodiscard]] bool has_gpu_waits() const noexcept {
        return m_stream_waits > 0 || !m_event_waits.empty();
    }
    [[nodiscard]] bool idle() const noexcept {
        return !has_gpu_waits() && m_ready.empty() && m_stalled.empty() && m_live_timers == 0 &&
               m_children == 0 && m_detached.load(std::memory_order_acquire) == 0 &&
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
        m_gpu_progress |= poll_events();
        progress |= m_gpu_progress;
        progress |= fire_timers();
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
        for (std::size_t i = 0; i < m_active.size();) {
            detail::stream_fifo* f = m_active[i];
            progress |= poll_fifo(f);
            // An emptied FIFO left m_active (finish_head), and another took its place: poll
            // that one next. (One made for a resumed coroutine's await may be skipped this
            // sweep: polled at the next.)
            if (i < m_active.size() && m_active[i] == f) {
                ++i;
            }
        }
        return progress;
    }

    /// Completes the done prefix of `f`'s FIFO, resuming each waiter right away: the resumed
    /// coroutine usually enqueues its next work on this stream, and the GPU gets it before the
    /// next query rather than a sweep later.
    ///
    /// Events of one stream complete in order, so a node found done proves every node before it
    /// done. Once the head is done, the nodes 1, 2, 4, 8, ... places further on are probed, the
    /// end of the done prefix is bisected between the last done probe and the first not-ready
    /// one, and the whole prefix completes without a query per node: k done nodes cost about
    /// 2 log2(k) + 2 queries instead of the k + 1 of querying head after head (at most one more
    /// for a few k below 6, far fewer above). A success proves the earlier events succeeded too:
    /// event queries fail only for a context-wide (sticky) error, which a later event of the
    /// context would report as well.
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
            // Gallop: probe the nodes 1, 2, 4, ... places after the head until one is not done.
            std::size_t lo = 0; // the last place known done
            const detail::wait_node* lo_node = head;
            std::size_t hi = 0; // the first place known not ready; 0: none found
            const detail::wait_node* probe = head;
            std::size_t at = 0; // probe's place
            for (std::size_t target = 1; probe->next != nullptr; target *= 2) {
                while (at < target && probe->next != nullptr) {
                    probe = probe->next;
                    ++at;
                }
                const cudaError_t pst = cudaEventQuery(probe->event);
                if (pst == cudaSuccess) {
                    lo = at;
                    lo_node = probe;
                    continue;
                }
                // An error stops the search at `lo`; the new head's own query reports it.
                hi = pst == cudaErrorNotReady ? at : 0;
                break;
            }
            // Bisect between the last done place and the first not-ready one: the prefix ends
            // exactly where the first not-ready node starts.
            while (hi != 0 && hi - lo > 1) {
                const std::size_t mid = lo + (hi - lo) / 2;
                const detail::wait_node* m = lo_node;
                for (std::size_t place = lo; place < mid; ++place) {
                    m = m->next;
                }
                const cudaError_t mst = cudaEventQuery(m->event);
                if (mst == cudaSuccess) {
                    lo = mid;
                    lo_node = m;
                } else {
                    hi = mst == cudaErrorNotReady ? mid : 0;
                }
            }
            const std::size_t proven = lo + 1; // the nodes from the head on known to be done
            // A not-ready node right after the prefix ends this sweep of the FIFO, as a not-ready
            // head would.
            const bool next_not_ready = hi == proven;
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
    void finish_head(detail::stream_fifo* f, cudaError_t st) {
        detail::wait_node* n = f->head;
        f->head = n->next;
        --m_stream_waits;
        ++m_completed[static_cast<std::size_t>(f->device)];
        f->spare.push_back(n->event);
        if (f->head == nullptr) {
            // Forgotten before the waiter runs: it may destroy the stream, and a new stream (of
            // any device) may get the same handle and must not find this FIFO.
            f->tail = nullptr;
            drop_fifo_if_empty(f);
        }
        std::coroutine_handle<> h = release_node(n, st);
        if (m_ready.empty()) {
            h.resume(); // what run_ready would do, without the trip through m_ready
        } else {
            m_ready.push_back(h);
            run_ready();
        }
    }

    bool poll_events() {
        bool progress = false;
        for (std::size_t i = 0; i < m_event_waits.size();) {
            detail::wait_node* n = m_event_waits[i];
            cudaError_t st = cudaEventQuery(n->event);
            if (st == cudaErrorNotReady) {
                ++i;
                continue;
            }
            m_event_waits[i] = m_event_waits.back();
            m_event_waits.pop_back();
            if (n->device >= 0) { // a stream wait recorded off the loop thread: a pooled event
                const auto dev = static_cast<std::size_t>(n->device);
                if (dev >= m_completed.size()) {
                    m_completed.resize(dev + 1, 0);
                }
                ++m_completed[dev];
                if (dev >= m_event_cache.size()) {
                    m_event_cache.resize(dev + 1);
                }
                give_event(n->device, n->event);
            }
            complete(n, st);
            progress = true;
        }
        return progress;
    }

    void complete(detail::wait_node* n, cudaError_t st) { m_ready.push_back(release_node(n, st)); }

    /// Stores the wait's outcome, recycles its node and returns the coroutine to resume.
    std::coroutine_handle<> release_node(detail::wait_node* n, cudaError_t st) {
        if (st != cudaSuccess) {
            (void)cudaGetLastError();
        }
        *n->status = st;
        std::coroutine_handle<> h = n->waiter;
        *n = detail::wait_node{};
        m_free_nodes.push_back(n);
        return h;
    }

    bool fire_timers() {
        if (m_timers.empty()) {
            return false;
        }
        bool progress = false;
        auto now = clock::now();
        while (!m_timers.empty() && m_timers.front()->deadline <= now) {
            std::pop_heap(m_timers.begin(), m_timers.end(), timer_later{});
            std::unique_ptr<dependent_t<Unused, detail::timer_node>> t(m_timers.back());
            m_timers.pop_back();
            if (t->cancelled) {
                continue;
            }
            m_live_timers -= t->daemon ? 0 : 1;
            progress |= !t->daemon; // a periodic check is not progress of the loop
            if (t->waiter) {
                m_ready.push_back(t->waiter);
            } else if (t->callback) {
                t->callback();
            }
        }
        return progress;
    }

    void wait_idle(clock::time_point last_progress, std::chrono::nanoseconds& backoff) {
        drop_cancelled_timers();
        const bool gpu = has_gpu_waits();
        const bool timers = !m_timers.empty();
        auto now = clock::now();
        bool watched = false;
        std::optional<clock::time_point> wake_at; // shortly before a predicted end
        if (gpu) {
            auto idle_for = now - last_progress;
            if (idle_for < m_policy.spin) {
                detail::cpu_relax();
                return;
            }
            const bool yield_phase = idle_for - m_policy.spin < m_policy.yield;
            bool far = false; // a predicted end at least kSentinelLead sleeps away
            if (m_policy.predict) {
                if (const auto d = m_wake_history.predict(idle_for)) {
                    const auto lead = detail::wake_history::lead(*d);
                    if (idle_for >= *d - lead) {
                        detail::cpu_relax(); // within the window around the predicted end
                        return;
                    }
                    // In the yield phase only an end far ahead is slept towards: nearer ones,
                    // and whatever else may complete before them, are left to its polling.
                    far = *d - lead - idle_for >= kSentinelLead * m_policy.sleep_max;
                    if (!yield_phase || far) {
                        wake_at = last_progress + (*d - lead);
                    }
                }
            }
            if (!wake_at && yield_phase) {
                std::this_thread::yield();
                return;
            }
            // Sentinels cost driver calls to arm and a host function (or a doorbell round) to
            // fire: they are armed once the back-off has grown to sleep_max, or at once where the
            // predicted end is further away than a few of the longest sleeps.
            const bool long_wait = backoff >= m_policy.sleep_max || (wake_at && far);
            if (m_policy.sentinel && long_wait) {
                if (m_policy.doorbell && !timers && doorbell_wait(wake_at)) {
                    return;
                }
                watched = watch_pending();
                now = clock::now();
            }
        }
        std::unique_lock lock(m_remote_mutex);
        if (m_has_remote.load(std::memory_order_relaxed)) {
            return;
        }
        if (gpu) {
            auto until = now + (watched ? m_policy.sentinel_poll : backoff);
            if (wake_at) {
                until = std::min(until, *wake_at);
            }
            if (timers) {
                until = std::min(until, m_timers.front()->deadline);
            }
            m_remote_cv.wait_until(lock, until);
            if (!watched) {
                backoff = std::min(backoff * 2, m_policy.sleep_max);
            }
        } else if (timers) {
            m_remote_cv.wait_until(lock, m_timers.front()->deadline);
        } else {
            m_remote_cv.wait(lock);
        }
    }

    /// Arms a sentinel on every pending wait that has none. Returns whether every pending wait
    /// is watched now (false: the loop must keep polling with its back-off).
    bool watch_pending() noexcept {
        bool all = true;
        auto watch = [this, &all](detail::wait_node* n) noexcept {
            if (!n->watched && all) {
                if (m_idle_watch.arm(n->event, n->device) == cudaSuccess) {
                    n->watched = true;
                } else {
                    all = false; // the rest keep polling; retried at the next sleep
                }
            }
        };
        for (detail::stream_fifo* f : m_active) {
            if (f->head != nullptr) {
                watch(f->head);
            }
        }
        for (detail::wait_node* n : m_event_waits) {
            watch(n);
        }
        return all;
    }

    /// Deep idle with no timer pending: blocks in the driver until a doorbell sentinel, a post
    /// or the backstop rings (detail/doorbell.hpp, steps 1-5). False where the doorbell cannot
    /// be used this round: the caller arms host-function sentinels and sleeps instead. A post
    /// stores m_has_remote, then reads whether the loop is blocked; block() stores that, then
    /// reads m_has_remote: either the post rings or the loop does not block.
    bool doorbell_wait(std::optional<clock::time_point> wake_at) noexcept {
        if (!m_doorbell.begin()) {
            return false;
        }
        bool done = false;
        bool armed = true;
        auto watch = [this, &done, &armed](detail::wait_node* n) noexcept {
            if (done || !armed) {
                return;
            }
            // A completion from before the doorbell was cleared rang nothing: caught here.
            if (cudaEventQuery(n->event) != cudaErrorNotReady) {
                done = true; // the next step completes it (or reports its error)
            } else if (!n->watched && !n->rung) { // a host-function sentinel rings too
                armed = m_doorbell.watch(n->event, n->device) == cudaSuccess;
                n->rung = armed;
            }
        };
        for (detail::stream_fifo* f : m_active) {
            if (f->head != nullptr) {
                watch(f->head);
            }
        }
        for (detail::wait_node* n : m_event_waits) {
            watch(n);
        }
        if (done || !armed) {
            m_doorbell.abandon();
            return done;
        }
        auto backstop = m_policy.sentinel_poll;
        if (wake_at) {
            backstop = std::min<std::chrono::nanoseconds>(
                backstop, std::max<std::chrono::nanoseconds>(*wake_at - clock::now(), {}));
        }
        return m_doorbell.block(m_has_remote, backstop) != detail::doorbell::outcome::failed;
    }

    /// What a sentinel's host function calls (a CUDA-internal thread): ends the loop's sleep,
    /// or its block on the doorbell, as a post does, without allocating.
    static void sentinel_fired(void* self) noexcept {
        static_cast<basic_scheduler*>(self)->signal([] {});
    }

    // ---- bookkeeping -----------------------------------------------------------------------

    struct timer_later {
        bool operator()(const detail::timer_node* a, const detail::timer_node* b) const noexcept {
            return a->deadline != b->deadline ? a->deadline > b->deadline : a->seq > b->seq;
        }
    };
    void push_timer(detail::timer_node* t) {
        m_timers.push_back(t);
        std::push_heap(m_timers.begin(), m_timers.end(), timer_later{});
        m_live_timers += t->daemon ? 0 : 1;
    }
    void drop_cancelled_timers() {
        while (!m_timers.empty() && m_timers.front()->cancelled) {
            std::pop_heap(m_timers.begin(), m_timers.end(), timer_later{});
            delete m_timers.back();
            m_timers.pop_back();
        }
    }

    detail::wait_node* new_node() {
        if (m_free_nodes.empty()) {
            m_node_storage.emplace_back();
            return &m_node_storage.back();
        }
        detail::wait_node* n = m_free_nodes.back();
        m_free_nodes.pop_back();
        return n;
    }

    detail::stream_fifo* new_fifo(cudaStream_t s, int dev, bool per_device) {
        detail::stream_fifo* f = nullptr;
        if (m_free_fifos.empty()) {
            m_fifo_storage.emplace_back();
            f = &m_fifo_storage.back();
        } else {
            f = m_free_fifos.back();
            m_free_fifos.pop_back();
        }
        if (static_cast<std::size_t>(dev) >= m_completed.size()) {
            m_completed.resize(static_cast<std::size_t>(dev) + 1, 0);
        }
        f->stream = s;
        f->device = dev;
        f->per_device = per_device;
        f->head = nullptr;
        f->tail = nullptr;
        if (!per_device) {
            m_by_stream.emplace(s, f);
        }
        m_active.push_back(f);
        return f;
    }
    void drop_fifo_if_empty(detail::stream_fifo* f) {
        if (f->head != nullptr) {
            return;
        }
        release_fifo(f);
        auto it = std::find(m_active.begin(), m_active.end(), f);
        *it = m_active.back();
        m_active.pop_back();
    }
    /// Forgets an empty FIFO: its stream may be destroyed and its handle reused from now on.
    void release_fifo(detail::stream_fifo* f) {
        for (cudaEvent_t e : f->spare) {
            give_event(f->device, e);
        }
        f->spare.clear();
        if (!f->per_device) {
            m_by_stream.erase(f->stream);
        }
        if (m_last_fifo == f) {
            m_last_fifo = nullptr;
        }
        m_free_fifos.push_back(f);
    }

    cudaError_t take_event(int dev, cudaEvent_t& ev) noexcept {
        if (static_cast<std::size_t>(dev) < m_event_cache.size() &&
            !m_event_cache[static_cast<std::size_t>(dev)].empty()) {
            ev = m_event_cache[static_cast<std::size_t>(dev)].back();
            m_event_cache[static_cast<std::size_t>(dev)].pop_back();
            return cudaSuccess;
        }
        try {
            if (static_cast<std::size_t>(dev) >= m_event_cache.size()) {
                m_event_cache.resize(static_cast<std::size_t>(dev) + 1);
            }
            ev = event_pool::for_device(dev).acquire_raw();
            return cudaSuccess;
        } catch (const cuda_error& e) {
            return e.status();
        } catch (...) {
            return cudaErrorMemoryAllocation;
        }
    }
    void give_event(int dev, cudaEvent_t ev) {
        m_event_cache[static_cast<std::size_t>(dev)].push_back(ev);
    }

    /// A predicted end this many sleep_max away, or more, arms the sentinels at once.
    static constexpr int kSentinelLead = 4;

    poll_policy m_policy;

    // Loop-thread state.
    detail::wake_history m_wake_history; ///< long idle periods GPU work ended (predict)
    bool m_gpu_progress = false;         ///< the last step() completed GPU waits
    std::vector<std::coroutine_handle<>> m_ready;
    std::vector<std::coroutine_handle<>> m_ready_batch;
    std::unordered_map<cudaStream_t, detail::stream_fifo*> m_by_stream;
    detail::stream_fifo* m_last_fifo = nullptr;
    std::vector<detail::stream_fifo*> m_active;
    std::vector<detail::stream_fifo*> m_free_fifos;
    std::deque<detail::stream_fifo> m_fifo_storage;
    std::size_t m_stream_waits = 0;
    std::vector<detail::wait_node*> m_event_waits;
    std::vector<detail::wait_node*> m_free_nodes;
    std::deque<detail::wait_node> m_node_storage;
    std::vector<std::vector<cudaEvent_t>> m_event_cache;
    std::vector<detail::timer_node*> m_timers;
    std::size_t m_live_timers = 0;
    std::uint64_t m_timer_seq = 0;
    std::atomic<std::size_t> m_children{0};
    std::vector<std::uint64_t> m_completed;    ///< stream waits completed, by device
    cudaError_t m_orphan_status = cudaSuccess; ///< where failed awaits' completions go
    detail::stall_record m_stall;              ///< what the await resume_stalled resumes now throws
    struct stalled_wait {
        std::coroutine_handle<> waiter;
        detail::stall_record record;
    };
    std::vector<stalled_wait> m_stalled; ///< failed by fail_waits_on, resumed at the next step

    // Shared with other threads.
    std::mutex m_remote_mutex;
    std::condition_variable m_remote_cv;
    std::vector<std::function<void()>> m_remote;
    std::vector<std::function<void()>> m_remote_batch;
    std::atomic<bool> m_has_remote{false};
    std::atomic<std::thread::id> m_owner{};
    std::atomic<std::size_t> m_detached{0};
    std::mutex m_error_mutex;
    std::exception_ptr m_detached_error;
    /// Rung by posts and by host-function sentinels; destroyed after m_idle_watch.
    detail::doorbell m_doorbell;
    /// Last: destroyed first, so a sentinel firing during the destructor still finds the
    /// members above (it takes m_remote_mutex), and none fires once it is gone.
    detail::idle_watch m_idle_watch{&basic_scheduler::sentinel_fired, this};
};

} // namespace detail

/// The event loop. Resumes coroutines when the GPU work they await finished, when their timers
/// expire, or when other threads post them. (Its members are those of detail::basic_scheduler.)
class scheduler : public detail::basic_scheduler<> {
public:
    using detail::basic_scheduler<>::basic_scheduler;
};

namespace detail {

/// The scheduler's internals that the library's awaiters and drivers use: sync_wait, the
/// awaiters below, with_timeout and tests that check the loop itself. Not part of the API.
///
/// A class template (scheduler_access is its one specialization) so that a call instantiates
/// only the scheduler members it reaches.
template <class Unused>
struct scheduler_access_t {
    using clock = std::chrono::steady_clock;

    static bool add_wait(basic_scheduler<Unused>& s, cudaStream_t stream, std::coroutine_handle<> h,
                         cudaError_t& status, const char*& api) noexcept {
        return s.add_wait(stream, h, status, api);
    }
    static bool add_wait(basic_scheduler<Unused>& s, cudaEvent_t event, std::coroutine_handle<> h,
                         cudaError_t& status, const char*& api) noexcept {
        return s.add_wait(event, h, status, api);
    }
    static void add_timer(basic_scheduler<Unused>& s, clock::time_point deadline,
                          std::coroutine_handle<> h) {
        s.add_timer(deadline, h);
    }
    static timer_node* add_timer(basic_scheduler<Unused>& s, clock::time_point deadline,
                                 std::function<void()> fn) {
        return s.add_timer(deadline, std::move(fn));
    }
    static timer_node* add_daemon_timer(basic_scheduler<Unused>& s, clock::time_point deadline,
                                        std::function<void()> fn) {
        return s.add_daemon_timer(deadline, std::move(fn));
    }
    static void cancel_timer(basic_scheduler<Unused>& s, timer_node* t) noexcept {
        s.cancel_timer(t);
    }
    [[nodiscard]] static std::uint64_t completed_on(const basic_scheduler<Unused>& s,
                                                    int dev) noexcept {
        return s.completed_on(dev);
    }
    static void pending_devices(const basic_scheduler<Unused>& s, std::vector<int>& out) {
        s.pending_devices(out);
    }
    static std::size_t pending_on(const basic_scheduler<Unused>& s, int dev,
                                  std::vector<cudaStream_t>& out) {
        return s.pending_on(dev, out);
    }
    static std::size_t fail_waits_on(basic_scheduler<Unused>& s, int dev,
                                     std::chrono::nanoseconds d) {
        return s.fail_waits_on(dev, d);
    }
    [[nodiscard]] static const stall_record& last_stall(const basic_scheduler<Unused>& s) noexcept {
        return s.last_stall();
    }
    /// Runs `change` under the scheduler's hand-off lock and wakes its loop; nothing of `s` is
    /// touched once the lock is released, so the loop may finish and `s` go at once.
    template <class Change>
    static void signal(basic_scheduler<Unused>& s, Change&& change) {
        s.signal(std::forward<Change>(change));
    }
    static void child_started(basic_scheduler<Unused>& s) noexcept { s.child_started(); }
    static void child_finished(basic_scheduler<Unused>& s) noexcept { s.child_finished(); }
    static void resume_soon(basic_scheduler<Unused>& s, std::coroutine_handle<> h) {
        s.resume_soon(h);
    }
    [[nodiscard]] static bool on_loop_thread(const basic_scheduler<Unused>& s) noexcept {
        return s.on_loop_thread();
    }
    /// Private streams the scheduler's sentinels made so far (0: none was ever armed).
    [[nodiscard]] static std::size_t sentinel_streams(const basic_scheduler<Unused>& s) noexcept {
        return s.m_idle_watch.stream_count();
    }
    /// The doorbell the loop blocks on in deep idle, for tests and benchmarks.
    [[nodiscard]] static const doorbell& idle_doorbell(const basic_scheduler<Unused>& s) noexcept {
        return s.m_doorbell;
    }
    template <class Pred>
    static void run_from(basic_scheduler<Unused>& s, std::coroutine_handle<> first, Pred&& done) {
        s.run_from(first, std::forward<Pred>(done));
    }
};

/// How the library names the scheduler's internals (see scheduler_access_t).
using scheduler_access = scheduler_access_t<>;

/// `co_await stream` or `co_await event` (Handle: cudaStream_t or cudaEvent_t): resumes once the
/// work the stream held at the await, or the work the event captured, finished.
template <class Handle>
class wait_awaiter {
public:
    wait_awaiter(scheduler& s, Handle handle, std::source_location where) noexcept
        : m_scheduler(&s), m_handle(handle), m_where(where) {}
    bool await_ready() const noexcept { return false; }
    bool await_suspend(std::coroutine_handle<> h) noexcept {
        return scheduler_access::add_wait(*m_scheduler, m_handle, h, m_status, m_api);
    }
    /// @throws cuda_error carrying the status the poll observed and this await's call site
    /// @throws stall_error when a watchdog gave up on the await (its device made no progress)
    void await_resume() const {
        if (m_status == cudaErrorNotReady) [[unlikely]] {
            const stall_record& r = scheduler_access::last_stall(*m_scheduler);
            throw stall_error(r.device, r.stalled_for);
        }
        if (m_status != cudaSuccess) {
            throw cuda_error(m_status, m_api, m_where);
        }
    }

private:
    scheduler* m_scheduler;
    Handle m_handle;
    std::source_location m_where;
    cudaError_t m_status = cudaSuccess;
    const char* m_api = nullptr;
};

class sleep_awaiter {
public:
    sleep_awaiter(scheduler& s, std::chrono::nanoseconds d) noexcept : m_scheduler(&s), m_for(d) {}
    bool await_ready() const noexcept { return m_for <= std::chrono::nanoseconds::zero(); }
    /// A template, as schedule_awaiter's: only a coroutine that awaits it instantiates the
    /// scheduler's timer and post paths.
    template <class P>
    void await_suspend(std::coroutine_handle<P> h) {
        scheduler_access::add_timer(*m_scheduler, std::chrono::steady_clock::now() + m_for,
                                    std::coroutine_handle<>(h));
    }
    void await_resume() const noexcept {}

private:
    scheduler* m_scheduler;
    std::chrono::nanoseconds m_for;
};

class schedule_awaiter {
public:
    explicit schedule_awaiter(scheduler& s) noexcept : m_scheduler(&s) {}
    bool await_ready() const noexcept { return false; }
    template <class P>
    void await_suspend(std::coroutine_handle<P> h) {
        m_scheduler->post(std::coroutine_handle<>(h));
    }
    void await_resume() const noexcept {}

private:
    scheduler* m_scheduler;
};

/// `co_await sleep_for(d)` before it is bound to a scheduler.
struct sleep_request {
    std::chrono::nanoseconds duration;
};

inline wait_awaiter<cudaStream_t> await_on(promise_base& p, stream_ref s,
                                           std::source_location where) {
    return {p.require_scheduler(), s.get(), where};
}
inline wait_awaiter<cudaEvent_t> await_on(promise_base& p, event_ref e,
                                          std::source_location where) {
    return {p.require_scheduler(), e.get(), where};
}
inline sleep_awaiter await_on(promise_base& p, sleep_request r, std::source_location) {
    return sleep_awaiter(p.require_scheduler(), r.duration);
}
inline schedule_awaiter await_on(promise_base& p, schedule_awaitable a, std::source_location) {
    p.set_scheduler(a.target);
    return schedule_awaiter(*a.target);
}

template <class Unused>
schedule_awaitable basic_scheduler<Unused>::schedule() noexcept {
    // Not `return {self()};`: nvcc 13.0's host pass rejects that aggregate initialisation in a
    // member template ("could not convert"), as g++ on its own does not.
    schedule_awaitable a;
    a.target = self();
    return a;
}
template <class Unused>
wait_awaiter<cudaStream_t> basic_scheduler<Unused>::wait(stream_ref s, std::source_location where) {
    return {*self(), s.get(), where};
}
template <class Unused>
wait_awaiter<cudaEvent_t> basic_scheduler<Unused>::wait(event_ref e, std::source_location where) {
    return {*self(), e.get(), where};
}
template <class Unused>
sleep_awaiter basic_scheduler<Unused>::sleep_for(std::chrono::nanoseconds d) {
    return sleep_awaiter(*self(), d);
}

} // namespace detail

/// Inside a library coroutine: `co_await sleep_for(10ms)` resumes after at least `d`, without
/// blocking the scheduler's thread.
[[nodiscard]] inline detail::sleep_request sleep_for(std::chrono::nanoseconds d) noexcept {
    return {d};
}

} // namespace cudawait
