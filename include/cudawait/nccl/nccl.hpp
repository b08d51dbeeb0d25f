// SPDX-License-Identifier: Apache-2.0
#pragma once

// Synopsis (namespace cudawait::nccl; link the CMake target cudawait::nccl)
//   class error;          a failed NCCL call, an asynchronous NCCL error or a timed-out wait:
//                         result(), timed_out(), api(); what() names the call and the reason
//   struct unique_id;     create(), to_hex() / from_hex(), from_env("CUDAWAIT_NCCL_ID"),
//                         write_file(path) / read_file(path, wait): how ranks meet
//   struct wait_options;  timeout (0: none) and poll (how often the async error is checked)
//   class communicator;   RAII over ncclComm_t, move-only: init_all(devices), init_rank(id, n,
//                         rank, device), co_await init_rank_async(id, n, rank, device, opts);
//                         get(), rank(), size(), device(), abort(), release()
//   co_await wait(comm, stream, opts)                  the stream's work, the comm polled
//   co_await all_reduce(send, recv, op, comm, stream, opts)       enqueue, then wait
//            broadcast(send, recv, root, comm, stream, opts)      (send: read at the root)
//            reduce(send, recv, op, root, comm, stream, opts)     (recv: written at the root)
//            all_gather(send, recv, comm, stream, opts)           recv = size() x send
//            reduce_scatter(send, recv, op, comm, stream, opts)   send = size() x recv
//   all_reduce_async(send, recv, op, comm, stream)     ... the same, enqueue only: for groups
//                                                      and for overlap by hand
//   class group;          ncclGroupStart() now, ncclGroupEnd() at end() or in the destructor
//
// Awaiting. The collectives are enqueued at the call; the returned task, once awaited, awaits
// the work its stream holds at the co_await, like `co_await stream`, and meanwhile polls the
// communicator's asynchronous error (ncclCommGetAsyncError) from the scheduler's loop every
// `poll`. When that reports an error, or `timeout` passes first, the communicator is aborted and
// the await throws nccl::error (timed_out() for the timeout).
//
// Several ranks driven by one thread (init_all) must enqueue in one group, as NCCL requires:
//   std::vector<task<>> ts;
//   { nccl::group g; for (r...) ts.push_back(nccl::all_reduce(..., comms[r], streams[r]));
//     g.end(); }
//   co_await when_all(std::move(ts));        // awaiting inside the open group: usage_error
//
// What an abort means for the memory. ncclCommAbort makes NCCL's kernels that still run return
// early, but it does not cancel the stream: whatever was enqueued before and after the
// collective still runs, and NCCL's abort itself waits until the stream reached the
// collective. So the abort runs on a thread of its own (the scheduler counts it like a
// with_timeout's work: run() and its destructor wait for it), and the awaiter gets its error at
// once. The send and receive buffers must stay alive until the stream drained (synchronise it,
// or await it): the GPU may still read and write them. The event the wait recorded stays
// tracked by the scheduler until the GPU completed it, so nothing the library owns is reused
// early. The communicator is empty after an abort (get() throws usage_error). The other awaits
// on it stop polling it once the abort started (the handle is gone) and throw the same error.
//
// Environment. NVLink SHARP (NVLS) must be off on the GPU machines this library is tested on:
// set NCCL_NVLS_ENABLE=0 in the environment before the first NCCL call (and in the environment
// of every child process that uses NCCL). The library does not set it; its tests, examples and
// benchmarks do.
//
// Threads. One thread at a time per communicator, as NCCL requires; the awaited collectives
// and wait() run their polls on the scheduler's thread. A communicator made by
// init_rank_async is non-blocking (ncclConfig_t::blocking = 0): its calls may report
// ncclInProgress, which the library waits out before it returns (the *_async calls and group
// end() by spinning, init_rank_async on the scheduler).

#include <cudawait/core/detail/detached.hpp>
#include <cudawait/core/scheduler.hpp>
#include <cudawait/core/task.hpp>
#include <cudawait/core/timeout.hpp>
#include <cudawait/runtime/error.hpp>
#include <cudawait/runtime/event.hpp>
#include <cudawait/runtime/stream.hpp>

#include <algorithm>
#include <chrono>
#include <coroutine>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>
#include <optional>
#include <source_location>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
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

inline std::string format_error(ncclResult_t result, const char* api, std::string_view detail) {
    std::string msg = api ? api : "NCCL call";
    msg += " failed: ";
    msg += ncclGetErrorString(result);
    msg += " (";
    msg += std::to_string(static_cast<int>(result));
    msg += ')';
    if (!detail.empty()) {
        msg += ": ";
        msg += detail;
    }
    return msg;
}

} // namespace detail

/// A failed NCCL call, an asynchronous error a wait observed, or a wait that timed out.
class error : public std::runtime_error {
public:
    /// `detail`: what NCCL said beyond the result's name (ncclGetLastError), if anything.
    error(ncclResult_t result, const char* api, std::string_view detail = {})
        : std::runtime_error(detail::format_error(result, api, detail)), m_result(result),
          m_api(api ? api : "NCCL call") {}

    /// A wait (or an init) that did not finish within `after`. result() is ncclInProgress.
    [[nodiscard]] static error timeout(const char* api, std::chrono::nanoseconds after,
                                       std::string_view detail = {}) {
        return error(api, after, detail);
    }

    /// What NCCL returned or reported (ncclInProgress for a timeout).
    [[nodiscard]] ncclResult_t result() const noexcept { return m_result; }
    /// True when the error is a timeout, not a failure NCCL reported.
    [[nodiscard]] bool timed_out() const noexcept { return m_timed_out; }
    /// The NCCL function (or library call) concerned, e.g. "ncclAllReduce".
    [[nodiscard]] const char* api() const noexcept { return m_api; }

private:
    error(const char* api, std::chrono::nanoseconds after, std::string_view detail)
        : std::runtime_error(std::string(api ? api : "NCCL call") + " timed out after " +
                             std::to_string(after.count()) + " ns" + (detail.empty() ? "" : "; ") +
                             std::string(detail)),
          m_result(ncclInProgress), m_api(api ? api : "NCCL call"), m_timed_out(true) {}

    ncclResult_t m_result;
    const char* m_api;
    bool m_timed_out = false;
};

namespace detail {

/// Throws nccl::error unless `r` is ncclSuccess; the message carries NCCL's last error text.
/// @throws error
inline void check(ncclResult_t r, const char* api, ncclComm_t comm = nullptr) {
    if (r != ncclSuccess) [[unlikely]] {
        const char* last = ncclGetLastError(comm);
        throw error(r, api, last ? std::string_view(last) : std::string_view());
    }
}

/// For destructors and other noexcept paths: a failure goes to stderr. ncclInProgress is no
/// failure here: a non-blocking communicator finishes its teardown in NCCL's background.
inline void report(ncclResult_t r, const char* api) noexcept {
    if (r == ncclSuccess || r == ncclInProgress) {
        return;
    }
    std::fprintf(stderr, "cudawait: %s failed in a noexcept path: %s (%d)\n", api,
                 ncclGetErrorString(r), static_cast<int>(r));
}

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

/// The token every rank needs to join one communicator: made once (create()) by one process
/// and handed to the others (environment, file, any channel).
struct unique_id {
    ncclUniqueId value{};

    /// A fresh id (ncclGetUniqueId). The creating process hosts NCCL's bootstrap root.
    /// @throws error
    [[nodiscard]] static unique_id create() {
        unique_id id;
        detail::check(ncclGetUniqueId(&id.value), "ncclGetUniqueId");
        return id;
    }

    /// Two lowercase hex digits per byte (256 characters).
    [[nodiscard]] std::string to_hex() const {
        static constexpr char digits[] = "0123456789abcdef";
        std::string out;
        out.reserve(sizeof value.internal * 2);
        for (char c : value.internal) {
            const auto b = static_cast<unsigned char>(c);
            out += digits[b >> 4];
            out += digits[b & 0xf];
        }
        return out;
    }

    /// Parses to_hex()'s form (either case).
    /// @throws error (ncclInvalidArgument) for a wrong length or a character that is no digit
    [[nodiscard]] static unique_id from_hex(std::string_view hex) {
        constexpr std::size_t bytes = sizeof(ncclUniqueId::internal);
        if (hex.size() != bytes * 2) {
            throw error(ncclInvalidArgument, "cudawait::nccl::unique_id::from_hex",
                        "expected " + std::to_string(bytes * 2) + " hex digits, got " +
                            std::to_string(hex.size()) + " characters");
        }
        auto nibble = [](char c) -> int {
            if (c >= '0' && c <= '9') {
                return c - '0';
            }
            if (c >= 'a' && c <= 'f') {
                return c - 'a' + 10;
            }
            if (c >= 'A' && c <= 'F') {
                return c - 'A' + 10;
            }
            return -1;
        };
        unique_id id;
        for (std::size_t i = 0; i < bytes; ++i) {
            const int hi = nibble(hex[2 * i]);
            const int lo = nibble(hex[2 * i + 1]);
            if (hi < 0 || lo < 0) {
                throw error(ncclInvalidArgument, "cudawait::nccl::unique_id::from_hex",
                            "not a hex digit at position " +
                                std::to_string(hi < 0 ? 2 * i : 2 * i + 1));
            }
            id.value.internal[i] = static_cast<char>((hi << 4) | lo);
        }
        return id;
    }

    /// The id in the environment variable `name` (to_hex()'s form).
    /// @throws error (ncclInvalidArgument) when it is unset or malformed
    [[nodiscard]] static unique_id from_env(const char* name = "CUDAWAIT_NCCL_ID") {
        const char* v = std::getenv(name);
        if (v == nullptr) {
            throw error(ncclInvalidArgument, "cudawait::nccl::unique_id::from_env",
                        std::string(name) + " is not set");
        }
        return from_hex(v);
    }

    /// Writes to_hex() and a newline to `path`, atomically (a temporary file in the same
    /// directory, renamed): a reader never sees half an id.
    /// @throws error (ncclSystemError) when the file cannot be written
    void write_file(const std::filesystem::path& path) const {
        std::filesystem::path tmp = path;
        tmp += ".tmp." + std::to_string(std::hash<std::thread::id>{}(std::this_thread::get_id()));
        {
            std::ofstream out(tmp, std::ios::trunc);
            out << to_hex() << '\n';
            out.flush();
            if (!out) {
                throw error(ncclSystemError, "cudawait::nccl::unique_id::write_file",
                            "cannot write " + tmp.string());
            }
        }
        std::error_code ec;
        std::filesystem::rename(tmp, path, ec);
        if (ec) {
            std::filesystem::remove(tmp, ec);
            throw error(ncclSystemError, "cudawait::nccl::unique_id::write_file",
                        "cannot rename to " + path.string());
        }
    }

    /// Reads an id write_file() wrote, waiting up to `wait` (polling every 10 ms) for the file
    /// to appear. Blocks the calling thread.
    /// @throws error: timed_out() when no file appeared in time; ncclInvalidArgument when its
    ///         content is no id
    [[nodiscard]] static unique_id read_file(const std::filesystem::path& path,
                                             std::chrono::nanoseconds wait) {
        const auto deadline = std::chrono::steady_clock::now() + wait;
        for (;;) {
            std::ifstream in(path);
            if (in) {
                std::string hex;
                in >> hex;
                return from_hex(hex);
            }
            if (std::chrono::steady_clock::now() >= deadline) {
                throw error::timeout("cudawait::nccl::unique_id::read_file", wait);
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(10));
        }
    }

    friend bool operator==(const unique_id& a, const unique_id& b) noexcept {
        return std::memcmp(a.value.internal, b.value.internal, sizeof a.value.internal) == 0;
    }
};

namespace detail {

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

namespace detail {

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
