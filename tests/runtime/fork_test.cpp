// SPDX-License-Identifier: Apache-2.0
// A child made by fork() after the parent used the library's process-wide objects: the ones
// holding CUDA state (default pinned pool, event pools) throw usage_error there, the copy
// workers start afresh, and an inherited pool's destructor touches nothing, so that a child
// that exits normally neither hangs nor crashes. Each child reports through its exit code and
// must end within a deadline; the parent kills it otherwise.

#include <cudawait/copy/detail/parallel_memcpy.hpp>
#include <cudawait/memory/pinned_pool.hpp>
#include <cudawait/runtime/detail/fork_guard.hpp>
#include <cudawait/runtime/error.hpp>
#include <cudawait/runtime/event.hpp>
#include <cudawait/runtime/stream.hpp>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gpu_fixture.hpp"
#include "host_pool.hpp"
#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

namespace {

using namespace cudawait::literals;
using cudawait::detail::memcpy_workers;

constexpr int timed_out = -1;

// Runs `body` in a forked child that leaves through std::exit (static destructors and atexit
// handlers run, as in a child that ends normally). Returns its exit code, 128 + the signal that
// killed it, or timed_out when it did not end within `deadline` (it is then killed).
int run_in_child(const std::function<int()>& body,
                 std::chrono::milliseconds deadline = std::chrono::seconds(10)) {
    std::fflush(nullptr); // buffered output is not written twice
    pid_t pid = ::fork();
    if (pid < 0) {
        ADD_FAILURE() << "fork failed: " << std::strerror(errno);
        return timed_out;
    }
    if (pid == 0) {
        int code = 99;
        try {
            code = body();
        } catch (...) {
            code = 98;
        }
        std::exit(code);
    }
    auto until = std::chrono::steady_clock::now() + deadline;
    for (;;) {
        int status = 0;
        pid_t r = ::waitpid(pid, &status, WNOHANG);
        if (r == pid) {
            if (WIFEXITED(status)) {
                return WEXITSTATUS(status);
            }
            return WIFSIGNALED(status) ? 128 + WTERMSIG(status) : 97;
        }
        if (r < 0 && errno != EINTR) {
            ADD_FAILURE() << "waitpid failed: " << std::strerror(errno);
            return timed_out;
        }
        if (std::chrono::steady_clock::now() >= until) {
            ::kill(pid, SIGKILL);
            ::waitpid(pid, &status, 0);
            return timed_out;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
}

// 0 when `f` throws a usage_error that names fork(), else `code`.
template <class F>
int throws_fork_usage_error(F&& f, int code) {
    try {
        (void)f();
    } catch (const cudawait::usage_error& e) {
        return std::strstr(e.what(), "fork()") != nullptr ? 0 : code;
    } catch (...) {
        return code;
    }
    return code;
}

// 0 when the process-wide copy workers copy `n` random bytes exactly, else `code`.
int workers_copy_exactly(std::size_t n, std::uint64_t seed, int code) {
    std::mt19937_64 rng(seed);
    std::vector<std::uint8_t> src(n);
    for (auto& b : src) {
        b = static_cast<std::uint8_t>(rng());
    }
    std::vector<std::uint8_t> dst(n, 0xa5);
    memcpy_workers::instance().copy(dst.data(), src.data(), n);
    return dst == src ? 0 : code;
}

} // namespace

TEST(fork_stamp, inherited_only_in_a_child) {
    cudawait::detail::fork_stamp stamp;
    EXPECT_FALSE(stamp.inherited());
    int code = run_in_child([&] {
        cudawait::detail::fork_stamp mine;
        if (!stamp.inherited()) {
            return 1;
        }
        if (mine.inherited()) {
            return 2;
        }
        // A grandchild sees both stamps as inherited.
        pid_t pid = ::fork();
        if (pid == 0) {
            std::_Exit(stamp.inherited() && mine.inherited() ? 0 : 3);
        }
        int status = 0;
        ::waitpid(pid, &status, 0);
        return WIFEXITED(status) ? WEXITSTATUS(status) : 4;
    });
    EXPECT_EQ(code, 0);
    EXPECT_FALSE(stamp.inherited()) << "the parent is not a child";
}

// The workers' threads do not survive fork(): a child handing them work would wait forever.
// The child gets a fresh set instead, and copies complete and are exact.
TEST(fork, copy_workers_start_afresh_in_a_child) {
    constexpr std::size_t n = 9_MiB + 17;
    ASSERT_EQ(workers_copy_exactly(n, 1, 1), 0);
    memcpy_workers* parents = &memcpy_workers::instance();
    int code = run_in_child([&] {
        if (&memcpy_workers::instance() == parents) {
            return 10;
        }
        if (int c = workers_copy_exactly(n, 2, 11); c != 0) {
            return c;
        }
        // Later calls keep the child's set.
        memcpy_workers* childs = &memcpy_workers::instance();
        if (int c = workers_copy_exactly(n, 3, 12); c != 0) {
            return c;
        }
        return &memcpy_workers::instance() == childs ? 0 : 13;
    });
    EXPECT_EQ(code, 0);
    EXPECT_EQ(&memcpy_workers::instance(), parents) << "the parent keeps its set";
    EXPECT_EQ(workers_copy_exactly(n, 4, 1), 0);
}

// Making the default pool needs no device; once made, a child may not use it.
TEST(fork, default_pinned_pool_throws_in_a_child) {
    cudawait::pinned_pool* parents = &cudawait::default_pinned_pool();
    int code = run_in_child([] {
        return throws_fork_usage_error([] { return &cudawait::default_pinned_pool(); }, 20);
    });
    EXPECT_EQ(code, 0);
    EXPECT_EQ(&cudawait::default_pinned_pool(), parents) << "the parent still uses it";
}

// A pool made in the parent and destroyed in the child (as a static one is when the child exits)
// neither waits on its marks nor gives slabs back: both may be the parent's CUDA state. A pool
// made in the child behaves as usual.
TEST(fork, inherited_pool_destructor_touches_nothing_in_a_child) {
    cudawait::testing::host_pool host;
    auto* pool = new cudawait::pinned_pool(host.options(64_MiB, 2_MiB));
    void* kept = pool->allocate(1000);
    void* pending = pool->allocate(3000);
    pool->record_use(pending, cudawait::testing::fake_stream(1));
    pool->deallocate(pending);
    ASSERT_EQ(host.slabs->allocations, 1);
    int code = run_in_child([&] {
        int waits = host.tracker->waits;
        int deallocations = host.slabs->deallocations;
        delete pool;
        if (host.tracker->waits != waits) {
            return 30;
        }
        if (host.slabs->deallocations != deallocations) {
            return 31;
        }
        cudawait::testing::host_pool fresh;
        {
            cudawait::pinned_pool own(fresh.options(64_MiB, 2_MiB));
            void* p = own.allocate(5000);
            std::memset(p, 0x5a, 5000);
            own.record_use(p, cudawait::testing::fake_stream(2));
            own.deallocate(p);
        }
        // The child's own pool waited on its mark and gave its slab back.
        return fresh.tracker->waits == 1 && fresh.slabs->deallocations == 1 ? 0 : 32;
    });
    EXPECT_EQ(code, 0);
    // The parent's pool is intact: the kept block is still handed out, the pending one comes
    // back once its mark completes.
    host.tracker->complete(0);
    pool->deallocate(kept);
    delete pool;
    EXPECT_EQ(host.slabs->deallocations, 1);
    EXPECT_EQ(host.tracker->outstanding, 0);
}

// On the GPU: the parent uses the default pool and the event pool (so both hold CUDA state) and
// the copy workers, then forks. In the child, event_pool::for_device and default_pinned_pool
// throw usage_error naming fork(), the copy workers still copy exactly, and the child exits
// normally (the event pools' static destructors make no CUDA call) within the deadline. The
// parent's objects still work afterwards.
class fork_gpu : public cudawait::testing::gpu_test {};

TEST_F(fork_gpu, child_gets_usage_errors_and_exits_cleanly) {
    cudawait::stream s;
    auto& pool = cudawait::default_pinned_pool();
    void* block = pool.allocate(1_MiB);
    std::memset(block, 0x3c, 1_MiB);
    pool.record_use(block, s);
    pool.deallocate(block);
    {
        cudawait::pooled_event ev = cudawait::event_pool::for_device(0).acquire();
        ev.record(s);
        ev.sync();
    }
    s.sync();
    ASSERT_EQ(workers_copy_exactly(3_MiB, 5, 1), 0);

    int code = run_in_child([] {
        if (int c =
                throws_fork_usage_error([] { return &cudawait::event_pool::for_device(0); }, 40);
            c != 0) {
            return c;
        }
        if (int c = throws_fork_usage_error([] { return &cudawait::default_pinned_pool(); }, 41);
            c != 0) {
            return c;
        }
        return workers_copy_exactly(3_MiB, 6, 42);
    });
    EXPECT_EQ(code, 0) << "exit code " << code << " (-1: did not end within the deadline)";

    // The parent goes on as before.
    void* again = pool.allocate(1_MiB);
    pool.record_use(again, s);
    pool.deallocate(again);
    cudawait::pooled_event ev = cudawait::event_pool::for_device(0).acquire();
    ev.record(s);
    ev.sync();
    s.sync();
    cudawait::default_pinned_pool().collect();
}
