// SPDX-License-Identifier: Apache-2.0
#pragma once

// detail::doorbell: how a scheduler with poll_policy::sentinels() sleeps in deep idle, its thread
// blocked in the driver until a sentinel, a post or the backstop rings a word of mapped host
// memory. See docs/core.md#the-doorbell.

#include <cudawait/core/detail/idle_watch.hpp>
#include <cudawait/runtime/detail/chrono.hpp>
#include <cudawait/runtime/detail/fork_guard.hpp>
#include <cudawait/runtime/error.hpp>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <thread>
#include <vector>

#include <cuda.h>
#include <cuda_runtime_api.h>

namespace cudawait::detail {

/// Test hook: while true, a doorbell being set up finds no stream memory operations (as with a
/// driver that lacks the entry points), so its owner takes the host-function path.
inline std::atomic<bool> g_doorbell_hide_entry_points{false};

/// The host side of the doorbell protocol, without CUDA: the word's stores, the blocked flag
/// and the backstop thread. The word is the mapped one in a doorbell, a plain one in tests. A
/// class template (`Unused` is always void, see doorbell_gate) so that only a translation unit
/// that drives a scheduler instantiates its members.
template <class Unused = void>
class basic_doorbell_gate {
public:
    /// What block() did.
    enum class result {
        waited, ///< it called the wait function
        raced,  ///< remote work was flagged: it did not wait
        failed, ///< the backstop thread could not be started: it did not wait
    };

    basic_doorbell_gate() = default;
    basic_doorbell_gate(const basic_doorbell_gate&) = delete;
    basic_doorbell_gate& operator=(const basic_doorbell_gate&) = delete;
    ~basic_doorbell_gate() {
        if (m_stamp.inherited()) {
            // The parent's thread does not exist here, and its mutex may have been held at the
            // fork: leave both (the std::thread object is leaked: destroying it would terminate).
            m_thread = nullptr;
            return;
        }
        stop();
    }

    /// Sets the word (once, before the first block()).
    void attach(std::uint32_t* word) noexcept { m_word = word; }

    /// Step 1 of a round: the word to 0.
    void reset() noexcept { std::atomic_ref<std::uint32_t>(*m_word).store(0); }
    /// The word to 1: a stream waiting for it passes.
    void ring() noexcept { std::atomic_ref<std::uint32_t>(*m_word).store(1); }
    /// Any thread, after it flagged remote work (a sequentially consistent store): rings the
    /// word if the owner is blocked on it.
    void ring_if_blocked() noexcept {
        if (m_blocked.load()) {
            ring();
        }
    }
    [[nodiscard]] bool blocked() const noexcept { return m_blocked.load(); }

    /// Step 5: marks the owner blocked and calls `wait()` unless `remote` is set; the backstop
    /// rings the word if the wait lasts `backstop`.
    template <class Wait>
    result block(const std::atomic<bool>& remote, std::chrono::nanoseconds backstop,
                 Wait&& wait) noexcept {
        if (!arm_backstop(backstop)) {
            return result::failed;
        }
        m_blocked.store(true);
        if (remote.load()) {
            m_blocked.store(false);
            disarm_backstop();
            return result::raced;
        }
        wait();
        m_blocked.store(false);
        disarm_backstop();
        return result::waited;
    }

    /// Rings the backstop made so far (diagnostics and tests).
    [[nodiscard]] std::uint64_t backstop_rings() const noexcept { return m_backstop_rings.load(); }

    /// Stops and joins the backstop thread (the destructor does too).
    void stop() noexcept {
        if (!m_thread) {
            return;
        }
        {
            std::lock_guard lock(m_mutex);
            m_stop = true;
        }
        m_cv.notify_one();
        m_thread->join();
        delete m_thread;
        m_thread = nullptr;
    }

private:
    using clock = std::chrono::steady_clock;

    bool arm_backstop(std::chrono::nanoseconds period) noexcept {
        // No deadline past a day: clock::now() + nanoseconds::max() / 4 would overflow.
        period = std::clamp<std::chrono::nanoseconds>(period, std::chrono::nanoseconds(0),
                                                      std::chrono::hours(24));
        bool notify = false;
        try {
            std::lock_guard lock(m_mutex);
            if (!m_thread) {
                m_thread = new std::thread([this] { backstop_loop(); });
            }
            ++m_round;
            m_armed = true;
            m_deadline = clock::now() + period;
            // A thread waiting on an earlier deadline wakes by itself, sees the new round and
            // waits on. Only one waiting without a deadline must be woken.
            notify = m_untimed;
        } catch (...) {
            return false;
        }
        if (notify) {
            m_cv.notify_one();
        }
        return true;
    }
    void disarm_backstop() noexcept {
        std::lock_guard lock(m_mutex);
        m_armed = false;
    }
    void backstop_loop() noexcept {
        std::unique_lock lock(m_mutex);
        while (!m_stop) {
            if (!m_armed) {
                m_untimed = true;
                m_cv.wait(lock);
                m_untimed = false;
                continue;
            }
            const std::uint64_t round = m_round;
            const clock::time_point deadline = m_deadline;
            if (m_cv.wait_until(lock, deadline,
                                [&] { return m_stop || !m_armed || m_round != round; })) {
                continue;
            }
            // Blocked in the same round since `deadline`: end the wait, once.
            m_armed = false;
            m_backstop_rings.fetch_add(1, std::memory_order_relaxed);
            ring();
        }
    }

    std::uint32_t* m_word = nullptr;
    std::atomic<bool> m_blocked{false};
    std::atomic<std::uint64_t> m_backstop_rings{0};
    std::mutex m_mutex;
    std::condition_variable m_cv;
    /// The backstop, started by the first block(); owned (deleted by stop()). A plain pointer,
    /// not a std::unique_ptr: the scheduler's class holds this class, and nvcc's front end
    /// instantiates a std::unique_ptr member's class in every translation unit that includes
    /// the scheduler, at a cost of 2-3 MB of its memory each.
    std::thread* m_thread = nullptr;
    std::uint64_t m_round = 0;
    clock::time_point m_deadline{};
    bool m_armed = false;   ///< the owner is blocked (or about to be) in round m_round
    bool m_untimed = false; ///< the backstop waits without a deadline
    bool m_stop = false;
    fork_stamp m_stamp;
};

using doorbell_gate = basic_doorbell_gate<>;

/// Doorbell words: 32-bit words of mapped, portable page-locked memory, taken from slabs that are
/// never freed. So a doorbell's destructor makes no cudaFreeHost, which may wait for the whole
/// device (another scheduler's waker included, until that one is rung), and a word that a late
/// write might still reach stays mapped. A word is handed out again only once its streams
/// drained; a write that still lands there would only wake its next owner once, spuriously.
template <class Unused = void>
class doorbell_words {
public:
    static constexpr std::size_t per_slab = 1024; ///< 4 KiB of page-locked memory a slab

    /// The process's words (never destroyed, so a doorbell destroyed at exit still finds it).
    static doorbell_words& instance() {
        static doorbell_words* words = new doorbell_words;
        return *words;
    }

    /// A word, or null where no slab could be allocated (or in a forked child, where the
    /// parent's mutex and page-locked memory must not be touched).
    std::uint32_t* take() noexcept {
        if (m_stamp.inherited()) {
            return nullptr;
        }
        std::lock_guard lock(m_mutex);
        if (m_free.empty()) {
            try {
                m_free.reserve(per_slab);
            } catch (...) {
                return nullptr;
            }
            void* slab = nullptr;
            if (cudaError_t st = cudaHostAlloc(&slab, per_slab * sizeof(std::uint32_t),
                                               cudaHostAllocMapped | cudaHostAllocPortable);
                st != cudaSuccess) {
                (void)cudaGetLastError();
                return nullptr;
            }
            auto* words = static_cast<std::uint32_t*>(slab);
            for (std::size_t i = per_slab; i-- > 0;) {
                m_free.push_back(words + i);
            }
        }
        std::uint32_t* word = m_free.back();
        m_free.pop_back();
        return word;
    }
    /// Hands `word` back for another doorbell (leaks it where the list cannot grow).
    void give_back(std::uint32_t* word) noexcept {
        if (m_stamp.inherited()) {
            return;
        }
        std::lock_guard lock(m_mutex);
        try {
            m_free.push_back(word);
        } catch (...) {
        }
    }

private:
    doorbell_words() = default;

    std::mutex m_mutex;
    std::vector<std::uint32_t*> m_free;
    fork_stamp m_stamp;
};

/// The doorbell a scheduler blocks on in deep idle. Owner's thread only, except for
/// ring_if_blocked(). A class template for the same reason as basic_doorbell_gate.
template <class Unused = void>
class basic_doorbell {
public:
    /// Sentinel streams at most (each holds one armed sentinel at a time); past that the owner
    /// uses idle_watch, which has the same limit.
    static constexpr std::size_t max_streams = 64;

    /// What block() did.
    enum class outcome {
        woken,  ///< the loop blocked and was woken
        raced,  ///< remote work was flagged before it blocked
        failed, ///< the doorbell is unusable from now on
    };
    enum class state { unused, ready, unavailable };

    basic_doorbell() = default;
    basic_doorbell(const basic_doorbell&) = delete;
    basic_doorbell& operator=(const basic_doorbell&) = delete;
    ~basic_doorbell() {
        if (m_stamp.inherited()) {
            return; // the parent's context: touch nothing (the gate leaves its thread too)
        }
        m_gate.stop();
        if (m_word != nullptr) {
            m_gate.ring(); // a waker still waiting passes
        }
        // Every stream that may still read or write the word must have drained before the word
        // goes to another doorbell. The owner drained its waits, so a sentinel's event has
        // completed and only its write is left; should a stream not drain in time (a wait the
        // owner gave up on, a hung device), the word is never reused rather than the destructor
        // hanging.
        const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(2);
        bool drained = m_waker == nullptr || drain(m_waker, until);
        for (const sentinel_stream& s : m_streams) {
            drained = drain(s.stream, until) && drained;
        }
        if (m_waker != nullptr) {
            report(cudaStreamDestroy(m_waker), "cudaStreamDestroy");
        }
        for (const sentinel_stream& s : m_streams) {
            // Released by CUDA once its work is done, should it have any left.
            report(cudaStreamDestroy(s.stream), "cudaStreamDestroy");
        }
        if (m_wake_event != nullptr) {
            report(cudaEventDestroy(m_wake_event), "cudaEventDestroy");
        }
        if (m_word != nullptr) {
            if (drained) {
                doorbell_words<Unused>::instance().give_back(m_word);
            } else {
                std::fprintf(stderr, "cudawait: a doorbell stream did not drain; its word is "
                                     "not reused\n");
            }
        }
    }

    /// Step 1 of a round: sets the doorbell up on first use and stores 0 in the word. False
    /// where it cannot be used (see the top of this file): the owner polls or uses idle_watch.
    bool begin() noexcept {
        if (m_state == state::unavailable || m_stamp.inherited()) {
            return false;
        }
        if (m_state == state::unused && !set_up()) {
            m_state = state::unavailable;
            return false;
        }
        if (m_waker_armed) {
            // Left armed by a round that raced (and rang it): passed by now, most likely. If not,
            // this round is not a doorbell round: the word stays rung until the waker passed, so
            // that no sentinel is ever queued behind a waker's wait (they may share a hardware
            // queue, where the sentinel's write would then wait for the wait it should end).
            const cudaError_t st = cudaEventQuery(m_wake_event);
            if (st == cudaErrorNotReady) {
                return false;
            }
            if (st != cudaSuccess) {
                fail(st);
                return false;
            }
            m_waker_armed = false;
        }
        m_gate.reset();
        return true;
    }

    /// Step 3: arms a sentinel that rings the word once the work `ev` captured so far completed.
    /// `device`: the event's device (-1: the current device). Returns cudaSuccess,
    /// cudaErrorNotReady when max_streams sentinels are in flight, or the failing call's error
    /// (the doorbell is then unavailable); the owner then uses idle_watch.
    cudaError_t watch(cudaEvent_t ev, int device) noexcept {
        if (m_state != state::ready) {
            return cudaErrorNotPermitted;
        }
        if (device < 0) {
            if (cudaError_t st = cudaGetDevice(&device); st != cudaSuccess) {
                return fail(st);
            }
        }
        if (!supported(device)) {
            return cudaErrorNotSupported; // this wait only: other devices may have them
        }
        cudaStream_t s = nullptr;
        if (cudaError_t st = idle_stream(device, s); st != cudaSuccess) {
            return st == cudaErrorNotReady ? st : fail(st);
        }
        if (cudaError_t st = cudaStreamWaitEvent(s, ev, 0); st != cudaSuccess) {
            return fail(st);
        }
        if (CUresult r = m_write(s, m_device_word, 1, CU_STREAM_WRITE_VALUE_DEFAULT);
            r != CUDA_SUCCESS) {
            return fail(cudaErrorNotSupported);
        }
        return cudaSuccess;
    }

    /// Steps 4 and 5: arms the waker (begin() saw the last one pass) and blocks until the word
    /// is rung, unless `remote` is set first. `backstop`: rings the word after that long.
    outcome block(const std::atomic<bool>& remote, std::chrono::nanoseconds backstop) noexcept {
        if (m_state != state::ready) {
            return outcome::failed;
        }
        if (!m_waker_armed) {
            if (CUresult r = m_wait(m_waker, m_device_word, 1, CU_STREAM_WAIT_VALUE_GEQ);
                r != CUDA_SUCCESS) {
                fail(cudaErrorNotSupported);
                return outcome::failed;
            }
            if (cudaError_t st = cudaEventRecord(m_wake_event, m_waker); st != cudaSuccess) {
                fail(st); // the wait stays queued: the destructor rings it through
                return outcome::failed;
            }
            m_waker_armed = true;
        }
        cudaError_t st = cudaSuccess;
        using result = typename basic_doorbell_gate<Unused>::result;
        const result r =
            m_gate.block(remote, backstop, [&] { st = cudaEventSynchronize(m_wake_event); });
        if (r == result::raced) {
            // Rung, so that the waker does not hold its hardware queue while the owner is busy
            // or sleeps on its condition variable; the next round finds it passed.
            m_gate.ring();
            return outcome::raced;
        }
        if (r == result::failed || st != cudaSuccess) {
            fail(st);
            return outcome::failed;
        }
        m_waker_armed = false;
        ++m_rounds;
        return outcome::woken;
    }

    /// Ends a round begun with begin() without block() (a completion was caught, or a sentinel
    /// could not be armed): rings the word, so that a waker left armed does not hold its
    /// hardware queue while the owner works or sleeps elsewhere.
    void abandon() noexcept {
        if (m_state == state::ready) {
            m_gate.ring();
        }
    }

    /// Any thread, a CUDA host function included (no CUDA call): ends a block() in progress.
    /// The caller flagged its work before, with a sequentially consistent store.
    void ring_if_blocked() noexcept {
        if (!m_stamp.inherited()) {
            m_gate.ring_if_blocked();
        }
    }

    [[nodiscard]] state current_state() const noexcept { return m_state; }
    /// Rounds that blocked and were woken.
    [[nodiscard]] std::uint64_t rounds() const noexcept { return m_rounds; }
    /// Whether the owner is blocked on the doorbell now (any thread).
    [[nodiscard]] bool blocked() const noexcept { return m_gate.blocked(); }
    /// Sentinel streams made so far.
    [[nodiscard]] std::size_t stream_count() const noexcept { return m_streams.size(); }
    [[nodiscard]] std::uint64_t backstop_rings() const noexcept { return m_gate.backstop_rings(); }

private:
    using wait_value_fn = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
    using write_value_fn = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);

    struct sentinel_stream {
        int device = 0;
        cudaStream_t stream = nullptr;
    };

    /// The driver's entry point `name` (the CUDA 12.0 ABI), or null.
    static void* entry_point(const char* name) noexcept {
        void* fn = nullptr;
        cudaDriverEntryPointQueryResult found{};
#if CUDART_VERSION >= 12050
        const cudaError_t st =
            cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &found);
#else
        const cudaError_t st = cudaGetDriverEntryPoint(name, &fn, cudaEnableDefault, &found);
#endif
        if (st != cudaSuccess || found != cudaDriverEntryPointSuccess) {
            (void)cudaGetLastError();
            return nullptr;
        }
        return fn;
    }

    bool set_up() noexcept {
        if (g_doorbell_hide_entry_points.load()) {
            return false;
        }
        m_wait = reinterpret_cast<wait_value_fn>(entry_point("cuStreamWaitValue32"));
        m_write = reinterpret_cast<write_value_fn>(entry_point("cuStreamWriteValue32"));
        int device = 0;
        if (m_wait == nullptr || m_write == nullptr || cudaGetDevice(&device) != cudaSuccess ||
            !supported(device)) {
            (void)cudaGetLastError();
            return false;
        }
        m_word = doorbell_words<Unused>::instance().take();
        if (m_word == nullptr) {
            return false;
        }
        void* word = m_word;
        m_gate.attach(m_word);
        m_gate.ring(); // no wait is armed yet: nothing to hold
        void* on_device = nullptr;
        // Portable and, with unified addressing, one address in every context.
        if (cudaHostGetDevicePointer(&on_device, word, 0) != cudaSuccess ||
            cudaStreamCreateWithFlags(&m_waker, cudaStreamNonBlocking) != cudaSuccess ||
            cudaEventCreateWithFlags(&m_wake_event, cudaEventBlockingSync |
                                                        cudaEventDisableTiming) != cudaSuccess) {
            (void)cudaGetLastError(); // the destructor frees what was made
            return false;
        }
        m_device_word = reinterpret_cast<CUdeviceptr>(on_device);
        m_state = state::ready;
        return true;
    }

    /// Whether `device` can wait on and write the word (cached).
    bool supported(int device) noexcept {
        if (device < 0) {
            return false;
        }
        const auto d = static_cast<std::size_t>(device);
        try {
            if (d >= m_supported.size()) {
                m_supported.resize(d + 1, -1);
            }
        } catch (...) {
            return false;
        }
        if (m_supported[d] < 0) {
            m_supported[d] = query_support(device) ? 1 : 0;
        }
        return m_supported[d] == 1;
    }
    static bool query_support(int device) noexcept {
        auto attribute = [device](cudaDeviceAttr a) {
            int v = 0;
            if (cudaDeviceGetAttribute(&v, a, device) != cudaSuccess) {
                (void)cudaGetLastError();
                return false;
            }
            return v != 0;
        };
        if (!attribute(cudaDevAttrUnifiedAddressing) || !attribute(cudaDevAttrCanMapHostMemory)) {
            return false;
        }
        int driver = 0;
        if (cudaDriverGetVersion(&driver) != cudaSuccess) {
            (void)cudaGetLastError();
            return false;
        }
        // From CUDA 12.0 the 32-bit memory operations are always there; before, only where
        // CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1 (92) says so.
        return driver >= 12000 || attribute(static_cast<cudaDeviceAttr>(92));
    }

    /// A sentinel stream of `device` with nothing queued, made if none is; cudaErrorNotReady
    /// when max_streams are busy.
    cudaError_t idle_stream(int device, cudaStream_t& out) noexcept {
        for (const sentinel_stream& s : m_streams) {
            if (s.device != device) {
                continue;
            }
            const cudaError_t st = cudaStreamQuery(s.stream);
            if (st == cudaSuccess) {
                out = s.stream;
                return cudaSuccess;
            }
            if (st != cudaErrorNotReady) {
                return st;
            }
        }
        if (m_streams.size() >= max_streams) {
            return cudaErrorNotReady;
        }
        try {
            m_streams.reserve(m_streams.size() + 1); // no throw once the stream exists
        } catch (...) {
            return cudaErrorMemoryAllocation;
        }
        const cudaError_t st = make_sentinel_stream(device, out);
        if (st == cudaSuccess) {
            m_streams.push_back({device, out});
        }
        return st;
    }

    /// Waits until `s` has nothing queued, polling until `until`. True once it drained, or
    /// when the query fails (the context is gone: nothing of it runs any more).
    static bool drain(cudaStream_t s, std::chrono::steady_clock::time_point until) noexcept {
        for (;;) {
            const cudaError_t st = cudaStreamQuery(s);
            if (st != cudaErrorNotReady) {
                report(st, "cudaStreamQuery");
                return true;
            }
            if (std::chrono::steady_clock::now() >= until) {
                return false;
            }
            std::this_thread::sleep_for(std::chrono::microseconds(50));
        }
    }

    /// The doorbell is unavailable from now on; what it made is freed by the destructor.
    cudaError_t fail(cudaError_t st) noexcept {
        (void)cudaGetLastError(); // the owner's polling reports what matters
        if (m_word != nullptr) {
            m_gate.ring(); // a waker left queued passes
        }
        m_state = state::unavailable;
        return st == cudaSuccess ? cudaErrorUnknown : st;
    }

    basic_doorbell_gate<Unused> m_gate;
    state m_state = state::unused;
    wait_value_fn m_wait = nullptr;
    write_value_fn m_write = nullptr;
    std::uint32_t* m_word = nullptr; ///< from doorbell_words: mapped, portable, never freed
    CUdeviceptr m_device_word = 0;
    cudaStream_t m_waker = nullptr;
    cudaEvent_t m_wake_event = nullptr; ///< blocking sync, no timing: recorded after the wait
    bool m_waker_armed = false;         ///< the waker's wait and record are queued, not passed
    std::vector<sentinel_stream> m_streams;
    std::vector<signed char> m_supported; ///< by device: -1 not asked yet, 0 no, 1 yes
    std::uint64_t m_rounds = 0;
    fork_stamp m_stamp;
};

using doorbell = basic_doorbell<>;

} // namespace cudawait::detail
