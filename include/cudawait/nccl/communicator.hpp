// SPDX-License-Identifier: Apache-2.0
#pragma once

// Synopsis (namespace cudawait::nccl; link the CMake target cudawait::nccl)
//   auto comms = communicator::init_all(devices);     one per device, driven by one thread
//   communicator c = communicator::init_rank(id, n, rank, device);   blocks until all joined
//   communicator c = co_await communicator::init_rank_async(id, n, rank, device, opts);
//   c.get(), c.rank(), c.size(), c.device(), c.blocking(), c.abort(), c.release()
//   wait_options{.timeout = 5s, .poll = 1ms}          how long an await may take, how often it
//                                                     looks at the async error
//
// RAII over ncclComm_t, move-only; empty once moved from, aborted or released. One thread at a
// time per communicator, as NCCL requires. A communicator made by init_rank_async is
// non-blocking (ncclConfig_t::blocking = 0). See docs/nccl.md#communicators.

#include <cudawait/core/scheduler.hpp>
#include <cudawait/core/task.hpp>
#include <cudawait/core/timeout.hpp>
#include <cudawait/nccl/error.hpp>
#include <cudawait/nccl/unique_id.hpp>
#include <cudawait/runtime/detail/chrono.hpp>
#include <cudawait/runtime/device.hpp>
#include <cudawait/runtime/error.hpp>

#include <algorithm>
#include <cstddef>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <thread>
#include <utility>
#include <vector>

#include <nccl.h>

namespace cudawait::nccl {

namespace detail {

/// The thread's open groups and the non-blocking communicators enqueued in them, whose state
/// group::end() waits out when ncclGroupEnd reports ncclInProgress.
struct group_registry {
    int depth = 0;
    std::vector<ncclComm_t> nonblocking;
};
inline group_registry& this_thread_groups() noexcept {
    thread_local group_registry registry;
    return registry;
}

/// Spins until a non-blocking communicator's last call is no longer in progress; gives up
/// after `limit` (0: never). Returns the final state (ncclInProgress: gave up).
inline ncclResult_t settle(ncclComm_t comm,
                           std::chrono::nanoseconds limit = std::chrono::nanoseconds::zero()) {
    const auto t0 = std::chrono::steady_clock::now();
    for (;;) {
        ncclResult_t state = ncclInProgress;
        const ncclResult_t q = ncclCommGetAsyncError(comm, &state);
        if (q != ncclSuccess) {
            return q;
        }
        if (state != ncclInProgress) {
            return state;
        }
        if (limit > std::chrono::nanoseconds::zero() &&
            std::chrono::steady_clock::now() - t0 >= limit) {
            return ncclInProgress;
        }
        std::this_thread::yield();
    }
}

/// What a communicator and every await on it share: the handle while it may be used, and why it
/// was aborted. The awaits poll the handle, and abort it, under the mutex only, so that none
/// calls NCCL with it once an abort started (ncclCommAbort frees it) and no two call NCCL on it
/// at once.
struct comm_state {
    std::mutex mutex;
    ncclComm_t comm = nullptr; ///< null once aborted, destroyed or released
    bool aborted = false;      ///< by an await (why), or by the communicator's abort() or end
    std::optional<error> why;

    /// Marks the handle gone for the awaits; `e`: the error an await aborted it for. Under the
    /// mutex. Does not throw: an error that cannot be kept is replaced at rethrow().
    void mark_aborted(const error* e) noexcept {
        aborted = true;
        comm = nullptr;
        if (e != nullptr) {
            try {
                why.emplace(*e);
            } catch (...) {
                // No memory for a copy: rethrow() makes a plainer error.
            }
        }
    }

    /// What an await throws once the handle was aborted. Under the mutex.
    /// @throws error, always
    [[noreturn]] void rethrow() const {
        if (why) {
            throw *why;
        }
        throw error(ncclInvalidUsage, "cudawait::nccl::communicator",
                    "aborted or destroyed while an await on it ran");
    }
};

struct comm_access;

} // namespace detail

/// How long an await may take and how often it looks at the communicator's async error.
struct wait_options {
    /// Zero: no limit.
    std::chrono::nanoseconds timeout{0};
    /// Between two ncclCommGetAsyncError calls.
    std::chrono::nanoseconds poll = std::chrono::milliseconds(1);
};

/// An NCCL communicator: one rank on one device. Move-only; destroyed with ncclCommDestroy,
/// or not at all once abort() ran. Empty when default-constructed, moved from, aborted or
/// released.
class communicator {
public:
    communicator() noexcept = default;
    communicator(const communicator&) = delete;
    communicator& operator=(const communicator&) = delete;
    communicator(communicator&& o) noexcept
        : m_comm(std::exchange(o.m_comm, nullptr)), m_shared(std::move(o.m_shared)),
          m_rank(o.m_rank), m_size(o.m_size), m_device(o.m_device), m_blocking(o.m_blocking) {}
    communicator& operator=(communicator&& o) noexcept {
        if (this != &o) {
            destroy();
            m_comm = std::exchange(o.m_comm, nullptr);
            m_shared = std::move(o.m_shared);
            m_rank = o.m_rank;
            m_size = o.m_size;
            m_device = o.m_device;
            m_blocking = o.m_blocking;
        }
        return *this;
    }
    /// ncclCommDestroy; a failure is reported on stderr.
    ~communicator() { destroy(); }

    /// One communicator per device, all in one clique, rank i on devices[i] (ncclCommInitAll).
    /// @throws usage_error for no devices; error
    [[nodiscard]] static std::vector<communicator> init_all(std::span<const int> devices) {
        if (devices.empty()) {
            throw usage_error("cudawait::nccl::communicator::init_all: no devices");
        }
        std::vector<ncclComm_t> raw(devices.size(), nullptr);
        std::vector<communicator> out;
        out.reserve(devices.size());
        std::vector<std::shared_ptr<detail::comm_state>> shared;
        for (std::size_t i = 0; i < devices.size(); ++i) {
            shared.push_back(std::make_shared<detail::comm_state>());
        }
        detail::check(ncclCommInitAll(raw.data(), static_cast<int>(devices.size()), devices.data()),
                      "ncclCommInitAll");
        for (std::size_t i = 0; i < raw.size(); ++i) {
            // Owned from here: destroyed on a throw.
            out.push_back(communicator(raw[i], true, std::move(shared[i])));
        }
        for (communicator& c : out) {
            c.describe();
        }
        return out;
    }

    /// init_all over every visible device, 0 .. device_count() - 1.
    /// @throws cuda_error when there is no device; error
    [[nodiscard]] static std::vector<communicator> init_all() {
        std::vector<int> devices(static_cast<std::size_t>(device_count()));
        for (std::size_t i = 0; i < devices.size(); ++i) {
            devices[i] = static_cast<int>(i);
        }
        return init_all(devices);
    }

    /// Rank `rank` of `nranks` on `device`; blocks until every rank joined (ncclCommInitRank).
    /// @throws cuda_error for a bad device; error
    [[nodiscard]] static communicator init_rank(const unique_id& id, int nranks, int rank,
                                                int device) {
        device_guard guard{device_ref(device)};
        auto shared = std::make_shared<detail::comm_state>();
        ncclComm_t raw = nullptr;
        detail::check(ncclCommInitRank(&raw, nranks, id.value, rank), "ncclCommInitRank");
        communicator c(raw, true, std::move(shared));
        c.describe();
        return c;
    }

    /// Rank `rank` of `nranks` on `device`, initialised without blocking (ncclConfig_t
    /// blocking = 0) while the awaiting coroutine's scheduler polls its state every
    /// `opts.poll`. Starts at the co_await. When `opts.timeout` passes first (other ranks
    /// missing), the half-made communicator is aborted on a thread of its own and the await
    /// throws error with timed_out().
    /// @throws (at the co_await) error; cuda_error for a bad device
    [[nodiscard]] static task<communicator>
    init_rank_async(const unique_id& id, int nranks, int rank, int device, wait_options opts = {});

    /// Takes ownership of `comm`; `blocking`: whether it was made with blocking = 1 (the
    /// default of every NCCL init but a config's).
    /// @throws error when NCCL cannot describe it, std::bad_alloc (then it is not destroyed)
    [[nodiscard]] static communicator from_native_handle(ncclComm_t comm, bool blocking = true) {
        communicator c(comm, blocking, std::make_shared<detail::comm_state>());
        try {
            c.describe();
        } catch (...) {
            (void)c.release();
            throw;
        }
        return c;
    }

    /// Gives up ownership: the caller destroys the handle. Awaits on it still pending stop
    /// polling its async error (they only await their streams' work).
    [[nodiscard]] ncclComm_t release() noexcept {
        forget(false);
        return std::exchange(m_comm, nullptr);
    }

    /// The handle. @throws usage_error on an empty communicator
    [[nodiscard]] ncclComm_t get() const {
        if (m_comm == nullptr) {
            throw usage_error("cudawait::nccl::communicator is empty (moved from, aborted or "
                              "released)");
        }
        return m_comm;
    }
    [[nodiscard]] bool valid() const noexcept { return m_comm != nullptr; }
    explicit operator bool() const noexcept { return valid(); }
    /// This rank's index, its clique's size and its device (kept from construction).
    [[nodiscard]] int rank() const noexcept { return m_rank; }
    [[nodiscard]] int size() const noexcept { return m_size; }
    [[nodiscard]] int device() const noexcept { return m_device; }
    /// False for a non-blocking communicator (init_rank_async).
    [[nodiscard]] bool blocking() const noexcept { return m_blocking; }

    /// ncclCommAbort, on the calling thread: NCCL's kernels of this communicator that still run
    /// return early. Blocks until the streams it used reached its last collective (see the
    /// synopsis). The communicator is empty afterwards; awaits on it still pending throw
    /// error (ncclInvalidUsage), as they do when it is destroyed. A failure is reported on
    /// stderr.
    void abort() noexcept {
        if (m_comm != nullptr) {
            forget(true);
            detail::report(ncclCommAbort(std::exchange(m_comm, nullptr)), "ncclCommAbort");
        }
    }

private:
    friend struct detail::comm_access;

    communicator(ncclComm_t comm, bool blocking,
                 std::shared_ptr<detail::comm_state> shared) noexcept
        : m_comm(comm), m_shared(std::move(shared)), m_blocking(blocking) {
        m_shared->comm = comm;
    }

    /// Takes the handle from the awaits that share it, under their mutex (so that none is in an
    /// NCCL call with it then): `ending`, it is aborted or destroyed next (they throw error), else
    /// released (they stop polling).
    void forget(bool ending) noexcept {
        if (m_shared != nullptr) {
            std::lock_guard lock(m_shared->mutex);
            if (ending) {
                m_shared->mark_aborted(nullptr);
            }
            m_shared->comm = nullptr;
        }
        m_shared.reset();
    }

    void describe() {
        detail::check(ncclCommUserRank(m_comm, &m_rank), "ncclCommUserRank", m_comm);
        detail::check(ncclCommCount(m_comm, &m_size), "ncclCommCount", m_comm);
        detail::check(ncclCommCuDevice(m_comm, &m_device), "ncclCommCuDevice", m_comm);
    }

    void destroy() noexcept {
        if (m_comm != nullptr) {
            forget(true);
            detail::report(ncclCommDestroy(std::exchange(m_comm, nullptr)), "ncclCommDestroy");
        }
    }

    ncclComm_t m_comm = nullptr;
    std::shared_ptr<detail::comm_state> m_shared; ///< with the awaits on it
    int m_rank = -1;
    int m_size = 0;
    int m_device = -1;
    bool m_blocking = true;
};

namespace detail {

using cudawait::detail::scheduler_access;

/// The awaits' way into a communicator.
struct comm_access {
    /// The state `c` shares with its awaits. @throws usage_error on an empty communicator
    static std::shared_ptr<comm_state> shared(communicator& c) {
        (void)c.get();
        return c.m_shared;
    }
    /// Empties `c` once an await took its handle (`comm`) to abort it.
    static void aborted(communicator& c, ncclComm_t comm) noexcept {
        if (c.m_comm == comm) {
            c.m_comm = nullptr;
            c.m_shared.reset();
        }
    }
};

/// ncclCommAbort on a thread of its own, so that the scheduler's loop goes on while NCCL waits
/// for the streams (see the synopsis). The scheduler counts it as a child: run() and its
/// destructor wait until the abort returned. Loop thread.
inline void abort_detached(scheduler& s, ncclComm_t comm) noexcept {
    scheduler_access::child_started(s);
    try {
        std::thread([sched = &s, comm] {
            report(ncclCommAbort(comm), "ncclCommAbort");
            sched->post([sched] { scheduler_access::child_finished(*sched); });
        }).detach();
    } catch (...) {
        // No thread to be had: abort here, blocking the loop for its duration.
        report(ncclCommAbort(comm), "ncclCommAbort");
        scheduler_access::child_finished(s);
    }
}

inline task<communicator> init_rank_nonblocking(unique_id id, int nranks, int rank, int device,
                                                wait_options opts) {
    scheduler& s = co_await this_scheduler();
    ncclComm_t raw = nullptr;
    {
        device_guard guard{device_ref(device)};
        ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
        config.blocking = 0;
        const ncclResult_t r = ncclCommInitRankConfig(&raw, nranks, id.value, rank, &config);
        if (r != ncclSuccess && r != ncclInProgress) {
            const char* last = ncclGetLastError(raw);
            error e(r, "ncclCommInitRankConfig", last ? last : "");
            if (raw != nullptr) {
                report(ncclCommAbort(raw), "ncclCommAbort");
            }
            throw e;
        }
    }
    const auto t0 = std::chrono::steady_clock::now();
    const auto poll = std::max<std::chrono::nanoseconds>(opts.poll, std::chrono::microseconds(10));
    for (;;) {
        ncclResult_t state = ncclInProgress;
        const ncclResult_t q = ncclCommGetAsyncError(raw, &state);
        if (q != ncclSuccess) {
            state = q;
        }
        if (state == ncclSuccess) {
            break;
        }
        if (state != ncclInProgress) {
            const char* last = ncclGetLastError(raw);
            error e(state, "ncclCommInitRankConfig", last ? last : "");
            report(ncclCommAbort(raw), "ncclCommAbort");
            throw e;
        }
        const auto waited = std::chrono::steady_clock::now() - t0;
        if (opts.timeout > std::chrono::nanoseconds::zero() && waited >= opts.timeout) {
            // The init thread may be blocked on a rank that never comes: aborted off the loop.
            abort_detached(s, raw);
            throw error::timeout("ncclCommInitRankConfig", opts.timeout,
                                 "the communicator was aborted");
        }
        auto next = poll;
        if (opts.timeout > std::chrono::nanoseconds::zero()) {
            next = std::min<std::chrono::nanoseconds>(
                next, std::chrono::duration_cast<std::chrono::nanoseconds>(opts.timeout - waited));
        }
        co_await sleep_for(next);
    }
    try {
        co_return communicator::from_native_handle(raw, false);
    } catch (...) {
        report(ncclCommAbort(raw), "ncclCommAbort");
        throw;
    }
}

} // namespace detail

inline task<communicator> communicator::init_rank_async(const unique_id& id, int nranks, int rank,
                                                        int device, wait_options opts) {
    // The id is copied into the coroutine: the caller's may be gone by the co_await.
    return detail::init_rank_nonblocking(id, nranks, rank, device, opts);
}

} // namespace cudawait::nccl
