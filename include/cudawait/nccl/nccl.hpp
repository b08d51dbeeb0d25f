// SPDX-License-Identifier: Apache-2.0
#pragma once

// Synopsis (namespace cudawait::nccl; link the CMake target cudawait::nccl)
//   error, unique_id, communicator, wait_options   error.hpp, unique_id.hpp, communicator.hpp
//   co_await wait(comm, stream, opts)                  the stream's work, the comm polled
//   co_await all_reduce(send, recv, op, comm, stream, opts)       enqueue, then wait
//            broadcast / reduce (root), all_gather, reduce_scatter     likewise
//   all_reduce_async(send, recv, op, comm, stream)     ... enqueue only: for groups and overlap
//   class group;          ncclGroupStart() now, ncclGroupEnd() at end() or in the destructor
//
// On an error or a timeout the communicator is aborted and the await throws nccl::error; the
// send and receive buffers must stay alive until the stream drained. NCCL_NVLS_ENABLE=0 is needed
// on the machines this library is tested on. See docs/nccl.md#errors-and-timeouts.

#include <cudawait/core/detail/detached.hpp>
#include <cudawait/core/scheduler.hpp>
#include <cudawait/core/task.hpp>
#include <cudawait/nccl/communicator.hpp>
#include <cudawait/nccl/error.hpp>
#include <cudawait/nccl/unique_id.hpp>
#include <cudawait/runtime/detail/chrono.hpp>
#include <cudawait/runtime/error.hpp>
#include <cudawait/runtime/event.hpp>
#include <cudawait/runtime/stream.hpp>

#include <algorithm>
#include <coroutine>
#include <cstddef>
#include <cstdio>
#include <exception>
#include <memory>
#include <mutex>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>
#if __has_include(<cuda_fp16.h>)
#include <cuda_fp16.h>
#define CUDAWAIT_NCCL_HAS_HALF 1
#else
#define CUDAWAIT_NCCL_HAS_HALF 0
#endif
#if __has_include(<cuda_bf16.h>)
#include <cuda_bf16.h>
#define CUDAWAIT_NCCL_HAS_BF16 1
#else
#define CUDAWAIT_NCCL_HAS_BF16 0
#endif

#include <nccl.h>

namespace cudawait::nccl {

namespace detail {

/// The ncclDataType_t of an element type, or ncclNumTypes where NCCL has none.
template <class T>
constexpr ncclDataType_t data_type_of() noexcept {
    using U = std::remove_cv_t<T>;
    if constexpr (std::is_same_v<U, float>) {
        return ncclFloat32;
    } else if constexpr (std::is_same_v<U, double>) {
        return ncclFloat64;
#if CUDAWAIT_NCCL_HAS_HALF
    } else if constexpr (std::is_same_v<U, __half>) {
        return ncclFloat16;
#endif
#if CUDAWAIT_NCCL_HAS_BF16
    } else if constexpr (std::is_same_v<U, __nv_bfloat16>) {
        return ncclBfloat16;
#endif
    } else if constexpr (std::is_integral_v<U> && !std::is_same_v<U, bool>) {
        constexpr bool s = std::is_signed_v<U>;
        if constexpr (sizeof(U) == 1) {
            return s ? ncclInt8 : ncclUint8;
        } else if constexpr (sizeof(U) == 4) {
            return s ? ncclInt32 : ncclUint32;
        } else if constexpr (sizeof(U) == 8) {
            return s ? ncclInt64 : ncclUint64;
        } else {
            return ncclNumTypes;
        }
    } else {
        return ncclNumTypes;
    }
}

} // namespace detail

/// Element types the collectives take: float, double, __half and __nv_bfloat16 (where the
/// toolkit's headers are found), and 8-, 32- and 64-bit integers, signed or not.
template <class T>
concept element = detail::data_type_of<T>()
!= ncclNumTypes;

/// The ncclDataType_t of T.
template <element T>
inline constexpr ncclDataType_t data_type_v = detail::data_type_of<T>();

namespace detail {

using cudawait::detail::scheduler_access;

/// What an nccl wait's awaiter and the detached coroutine that awaits the stream share.
struct wait_state {
    scheduler* sched = nullptr;
    std::shared_ptr<comm_state> shared; ///< the communicator's handle, polled under its mutex
    std::chrono::nanoseconds poll{};
    bool done = false; ///< the captured work completed (or its wait failed)
    cudawait::detail::result_slot<void> result;
    std::coroutine_handle<> waiter;
    cudawait::detail::timer_node* poll_timer = nullptr;
    cudawait::detail::timer_node* deadline_timer = nullptr;
    ncclResult_t async = ncclSuccess; ///< an error a poll found
    bool expired = false;

    /// Resumes the waiter once, for whichever reason came first.
    void wake() {
        if (!waiter) {
            return;
        }
        scheduler_access::cancel_timer(*sched, std::exchange(poll_timer, nullptr));
        scheduler_access::cancel_timer(*sched, std::exchange(deadline_timer, nullptr));
        scheduler_access::resume_soon(*sched, std::exchange(waiter, {}));
    }
    void complete(cudawait::detail::result_slot<void>&& r) {
        result = std::move(r);
        done = true;
        scheduler_access::child_finished(*sched);
        wake();
    }
};

struct wait_sink {
    std::shared_ptr<wait_state> state;
    void complete(cudawait::detail::result_slot<void>&& r) {
        if (scheduler_access::on_loop_thread(*state->sched)) {
            state->complete(std::move(r));
            return;
        }
        auto moved = std::make_shared<cudawait::detail::result_slot<void>>(std::move(r));
        state->sched->post([st = state, moved] { st->complete(std::move(*moved)); });
    }
};

/// Suspends until the captured work completed, a poll found an async error, or the deadline.
class wait_awaiter {
public:
    wait_awaiter(std::shared_ptr<wait_state> st, std::chrono::nanoseconds timeout)
        : m_state(std::move(st)), m_timeout(timeout) {}
    bool await_ready() const noexcept { return m_state->done; }
    void await_suspend(std::coroutine_handle<> h) {
        wait_state& st = *m_state;
        st.waiter = h;
        std::weak_ptr<wait_state> weak = m_state;
        if (m_timeout > std::chrono::nanoseconds::zero()) {
            st.deadline_timer = scheduler_access::add_timer(
                *st.sched, std::chrono::steady_clock::now() + m_timeout, [weak] {
                    if (auto s = weak.lock(); s && s->waiter) {
                        s->deadline_timer = nullptr; // fired: the scheduler deletes it
                        s->expired = true;
                        s->wake();
                    }
                });
        }
        arm_poll(m_state);
    }
    void await_resume() const noexcept {}

private:
    // A daemon timer: a poll is no work of its own, the pending GPU wait keeps the loop going.
    static void arm_poll(const std::shared_ptr<wait_state>& st) {
        std::weak_ptr<wait_state> weak = st;
        st->poll_timer = scheduler_access::add_daemon_timer(
            *st->sched, std::chrono::steady_clock::now() + st->poll, [weak] {
                auto s = weak.lock();
                if (!s || !s->waiter) {
                    return;
                }
                s->poll_timer = nullptr;
                ncclResult_t state = ncclSuccess;
                bool gone = false;
                {
                    comm_state& c = *s->shared;
                    std::lock_guard lock(c.mutex);
                    if (c.aborted) {
                        gone = true; // aborted by another: the await throws that error
                    } else if (c.comm == nullptr) {
                        return; // released: nothing to poll, the stream's work is awaited
                    } else if (const ncclResult_t q = ncclCommGetAsyncError(c.comm, &state);
                               q != ncclSuccess) {
                        state = q;
                    }
                }
                if (gone) {
                    s->wake();
                    return;
                }
                if (state != ncclSuccess && state != ncclInProgress) {
                    s->async = state;
                    s->wake();
                    return;
                }
                arm_poll(s);
            });
    }

    std::shared_ptr<wait_state> m_state;
    std::chrono::nanoseconds m_timeout;
};

/// The coroutine behind wait(): `work` (an event recorded at the call) is awaited by a detached
/// coroutine the scheduler tracks, so that a timeout or an async error leaves it tracked until
/// the GPU completed it.
inline task<void> await_collective(communicator& comm, stream_ref stream, wait_options opts,
                                   const char* api) {
    if (this_thread_groups().depth > 0) {
        throw usage_error(std::string("cudawait::nccl: ") + api +
                          " awaited inside an open group: the group's work is launched by "
                          "ncclGroupEnd, so await after group::end()");
    }
    scheduler& s = co_await this_scheduler();
    if (!scheduler_access::on_loop_thread(s)) {
        co_await s.schedule();
    }
    // The event is recorded here, at the co_await: after a group's end, it captures the
    // collectives the group launched.
    auto work = cudawait::detail::captured_wait::of_stream(stream, std::source_location::current());
    auto st = std::make_shared<wait_state>();
    st->sched = &s;
    st->shared = comm_access::shared(comm);
    st->poll = std::max<std::chrono::nanoseconds>(opts.poll, std::chrono::microseconds(10));
    auto child = cudawait::detail::run_detached<void>(std::move(work), wait_sink{st});
    child.handle().promise().set_scheduler(&s);
    scheduler_access::child_started(s);
    child.handle().resume();
    co_await wait_awaiter(st, opts.timeout);

    comm_state& shared = *st->shared;
    std::unique_lock lock(shared.mutex);
    if (shared.aborted) {
        // Another await (or the communicator's owner) aborted it: the collective may have been
        // cut short, and the handle is gone. That abort's error is this await's too.
        shared.rethrow();
    }
    ncclResult_t failed = st->async;
    if (st->done) {
        st->result.take(); // a CUDA failure the event reported: cuda_error
        if (shared.comm == nullptr) {
            co_return; // released meanwhile: nothing to ask
        }
        // The work finished; an error NCCL noted meanwhile still fails the await.
        ncclResult_t state = ncclSuccess;
        const ncclResult_t q = ncclCommGetAsyncError(shared.comm, &state);
        failed = q != ncclSuccess ? q : (state == ncclInProgress ? ncclSuccess : state);
        if (failed == ncclSuccess) {
            co_return;
        }
    } else if (shared.comm == nullptr) {
        lock.unlock();
        throw error::timeout(api, opts.timeout, "the communicator was released meanwhile");
    }
    const char* last = ncclGetLastError(shared.comm);
    const std::string detail = last ? last : "";
    const error e =
        st->expired && failed == ncclSuccess
            ? error::timeout(api, opts.timeout, "the communicator was aborted")
            : error(failed, api,
                    detail + (detail.empty() ? "" : "; ") + "the communicator was aborted");
    // From here the other awaits on it stop polling it and throw `e`.
    ncclComm_t aborting = shared.comm;
    shared.mark_aborted(&e);
    lock.unlock();
    comm_access::aborted(comm, aborting);
    // Aborted off the loop: NCCL's abort waits for the stream to reach the collective.
    abort_detached(s, aborting);
    throw e;
}

/// Enqueue's tail: inside an open group, the call only queued (a non-blocking communicator is
/// noted for group::end()); outside, a non-blocking communicator's ncclInProgress is waited out.
/// @throws error
inline void finish_enqueue(ncclResult_t r, const communicator& c, const char* api) {
    group_registry& groups = this_thread_groups();
    if (r == ncclInProgress && !c.blocking()) {
        if (groups.depth > 0) {
            groups.nonblocking.push_back(c.get());
            return;
        }
        r = settle(c.get());
    }
    check(r, api, c.get());
}

[[noreturn]] inline void size_mismatch(const char* api, const std::string& what) {
    throw usage_error(std::string("cudawait::nccl::") + api + ": " + what);
}

} // namespace detail

/// Awaits the work enqueued on `s` before the co_await, polling `comm`'s asynchronous error
/// meanwhile (see the synopsis): on an error or after `opts.timeout` the communicator is
/// aborted and the await throws. `comm` must outlive the await.
/// @throws usage_error (empty communicator), cuda_error at the call; at the co_await: error
///         (timed_out() for the timeout), cuda_error for a failure the stream's event reported
[[nodiscard]] inline task<void> wait(communicator& comm, stream_ref s, wait_options opts = {}) {
    (void)comm.get();
    return detail::await_collective(comm, s, opts, "cudawait::nccl::wait");
}

// ---- enqueue only ----------------------------------------------------------------------------

/// ncclAllReduce of send.size() elements; recv may be send (in place).
/// @throws usage_error (sizes, empty communicator), error
template <element T>
void all_reduce_async(std::type_identity_t<std::span<const T>> send, std::span<T> recv,
                      ncclRedOp_t op, communicator& comm, stream_ref s) {
    if (recv.size() != send.size()) {
        detail::size_mismatch("all_reduce", "recv.size() must equal send.size()");
    }
    detail::finish_enqueue(ncclAllReduce(send.data(), recv.data(), send.size(), data_type_v<T>, op,
                                         comm.get(), s.get()),
                           comm, "ncclAllReduce");
}

/// ncclBroadcast of recv.size() elements from `root`'s send (read only there; empty elsewhere
/// is fine); in place when send is recv.
/// @throws usage_error (sizes, empty communicator), error
template <element T>
void broadcast_async(std::type_identity_t<std::span<const T>> send, std::span<T> recv, int root,
                     communicator& comm, stream_ref s) {
    if (comm.rank() == root && send.size() != recv.size()) {
        detail::size_mismatch("broadcast", "at the root, send.size() must equal recv.size()");
    }
    detail::finish_enqueue(ncclBroadcast(send.data(), recv.data(), recv.size(), data_type_v<T>,
                                         root, comm.get(), s.get()),
                           comm, "ncclBroadcast");
}

/// ncclReduce of send.size() elements into `root`'s recv (written only there).
/// @throws usage_error (sizes, empty communicator), error
template <element T>
void reduce_async(std::type_identity_t<std::span<const T>> send, std::span<T> recv, ncclRedOp_t op,
                  int root, communicator& comm, stream_ref s) {
    if (comm.rank() == root && send.size() != recv.size()) {
        detail::size_mismatch("reduce", "at the root, recv.size() must equal send.size()");
    }
    detail::finish_enqueue(ncclReduce(send.data(), recv.data(), send.size(), data_type_v<T>, op,
                                      root, comm.get(), s.get()),
                           comm, "ncclReduce");
}

/// ncclAllGather: recv (size() x send.size()) gets every rank's send, by rank; in place when
/// send is recv's own slice (rank() x send.size() in).
/// @throws usage_error (sizes, empty communicator), error
template <element T>
void all_gather_async(std::type_identity_t<std::span<const T>> send, std::span<T> recv,
                      communicator& comm, stream_ref s) {
    if (recv.size() != send.size() * static_cast<std::size_t>(comm.size())) {
        detail::size_mismatch("all_gather", "recv.size() must be size() x send.size()");
    }
    detail::finish_enqueue(
        ncclAllGather(send.data(), recv.data(), send.size(), data_type_v<T>, comm.get(), s.get()),
        comm, "ncclAllGather");
}

/// ncclReduceScatter: send (size() x recv.size()) reduced across ranks, rank r keeping block r.
/// @throws usage_error (sizes, empty communicator), error
template <element T>
void reduce_scatter_async(std::type_identity_t<std::span<const T>> send, std::span<T> recv,
                          ncclRedOp_t op, communicator& comm, stream_ref s) {
    if (send.size() != recv.size() * static_cast<std::size_t>(comm.size())) {
        detail::size_mismatch("reduce_scatter", "send.size() must be size() x recv.size()");
    }
    detail::finish_enqueue(ncclReduceScatter(send.data(), recv.data(), recv.size(), data_type_v<T>,
                                             op, comm.get(), s.get()),
                           comm, "ncclReduceScatter");
}

// ---- enqueue and await -----------------------------------------------------------------------

/// all_reduce_async at the call, then wait(comm, s, opts) in the returned task.
/// @throws as all_reduce_async at the call; as wait() at the co_await (and usage_error when a
///         group is still open on the awaiting thread)
template <element T>
[[nodiscard]] task<void> all_reduce(std::type_identity_t<std::span<const T>> send,
                                    std::span<T> recv, ncclRedOp_t op, communicator& comm,
                                    stream_ref s, wait_options opts = {}) {
    all_reduce_async<T>(send, recv, op, comm, s);
    return detail::await_collective(comm, s, opts, "ncclAllReduce");
}

/// broadcast_async at the call, then wait(comm, s, opts). @throws as all_reduce
template <element T>
[[nodiscard]] task<void> broadcast(std::type_identity_t<std::span<const T>> send, std::span<T> recv,
                                   int root, communicator& comm, stream_ref s,
                                   wait_options opts = {}) {
    broadcast_async<T>(send, recv, root, comm, s);
    return detail::await_collective(comm, s, opts, "ncclBroadcast");
}

/// reduce_async at the call, then wait(comm, s, opts). @throws as all_reduce
template <element T>
[[nodiscard]] task<void> reduce(std::type_identity_t<std::span<const T>> send, std::span<T> recv,
                                ncclRedOp_t op, int root, communicator& comm, stream_ref s,
                                wait_options opts = {}) {
    reduce_async<T>(send, recv, op, root, comm, s);
    return detail::await_collective(comm, s, opts, "ncclReduce");
}

/// all_gather_async at the call, then wait(comm, s, opts). @throws as all_reduce
template <element T>
[[nodiscard]] task<void> all_gather(std::type_identity_t<std::span<const T>> send,
                                    std::span<T> recv, communicator& comm, stream_ref s,
                                    wait_options opts = {}) {
    all_gather_async<T>(send, recv, comm, s);
    return detail::await_collective(comm, s, opts, "ncclAllGather");
}

/// reduce_scatter_async at the call, then wait(comm, s, opts). @throws as all_reduce
template <element T>
[[nodiscard]] task<void> reduce_scatter(std::type_identity_t<std::span<const T>> send,
                                        std::span<T> recv, ncclRedOp_t op, communicator& comm,
                                        stream_ref s, wait_options opts = {}) {
    reduce_scatter_async<T>(send, recv, op, comm, s);
    return detail::await_collective(comm, s, opts, "ncclReduceScatter");
}

/// ncclGroupStart at construction, ncclGroupEnd at end(): the *_async calls between them are
/// fused (and, for several ranks driven by one thread, launched together). Groups nest. Not
/// copyable nor movable; use on one thread.
class group {
public:
    /// @throws error
    group() {
        detail::check(ncclGroupStart(), "ncclGroupStart");
        ++detail::this_thread_groups().depth;
    }
    group(const group&) = delete;
    group& operator=(const group&) = delete;
    /// Ends the group if end() was not called; a failure is reported on stderr.
    ~group() {
        if (m_open) {
            try {
                end();
            } catch (const std::exception& e) {
                std::fprintf(stderr, "cudawait: nccl::group ended in its destructor: %s\n",
                             e.what());
            }
        }
    }

    /// ncclGroupEnd; for non-blocking communicators enqueued in the group, waits (spinning)
    /// until their calls are no longer in progress.
    /// @throws usage_error when already ended; error
    void end() {
        if (!m_open) {
            throw usage_error("cudawait::nccl::group::end called twice");
        }
        m_open = false;
        detail::group_registry& groups = detail::this_thread_groups();
        --groups.depth;
        ncclResult_t r = ncclGroupEnd();
        std::vector<ncclComm_t> pending;
        if (groups.depth == 0) {
            pending.swap(groups.nonblocking);
        }
        if (r == ncclInProgress) {
            r = ncclSuccess;
            for (ncclComm_t c : pending) {
                if (const ncclResult_t st = detail::settle(c); st != ncclSuccess) {
                    detail::check(st, "ncclGroupEnd", c);
                }
            }
        }
        detail::check(r, "ncclGroupEnd");
    }

private:
    bool m_open = true;
};

} // namespace cudawait::nccl
