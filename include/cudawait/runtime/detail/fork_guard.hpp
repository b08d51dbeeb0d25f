// SPDX-License-Identifier: Apache-2.0
#pragma once

// detail::fork_stamp: how the library's process-wide objects tell that they run in a child made
// by fork(), whose CUDA context and threads they did not inherit. See docs/runtime.md#fork-safety.

#include <atomic>
#include <cstdint>

#if defined(__unix__)
#include <pthread.h>
#include <unistd.h>
#endif

namespace cudawait::detail {

/// Forks this process descends from since the library first looked (0 in the original process).
inline std::atomic<std::uint64_t> g_fork_generation{0};

#if defined(__unix__)
inline void on_fork_child() noexcept {
    // Only an atomic increment: the child of a multi-threaded process may call no more than
    // async-signal-safe functions here.
    g_fork_generation.fetch_add(1, std::memory_order_relaxed);
}

/// Registers the child handler once; false when pthread_atfork failed.
inline bool fork_handler_registered() noexcept {
    static const bool registered = ::pthread_atfork(nullptr, nullptr, &on_fork_child) == 0;
    return registered;
}
#endif

/// Which process an object was made in, so that a forked child can tell an inherited object.
class fork_stamp {
public:
    fork_stamp() noexcept {
#if defined(__unix__)
        m_counted = fork_handler_registered();
        m_generation = g_fork_generation.load(std::memory_order_relaxed);
        m_pid = static_cast<long>(::getpid());
#endif
    }

    /// True in a child process forked after this stamp was taken (at any depth).
    [[nodiscard]] bool inherited() const noexcept {
#if defined(__unix__)
        if (m_counted) {
            return g_fork_generation.load(std::memory_order_relaxed) != m_generation;
        }
        return static_cast<long>(::getpid()) != m_pid;
#else
        return false; // no fork()
#endif
    }

private:
    std::uint64_t m_generation = 0;
    long m_pid = 0;
    bool m_counted = false;
};

} // namespace cudawait::detail
