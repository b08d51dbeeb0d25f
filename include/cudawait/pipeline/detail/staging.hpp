// SPDX-License-Identifier: Apache-2.0
#pragma once

// A batch's pageable staging off the scheduler's thread (detail/batch.hpp drives it): rings of
// pinned chunks, filled and drained by worker threads of their own per direction, which resume
// the batch through staging_signal. The rings' states: docs/pipeline.md#inside.

#include <cudawait/copy/detail/parallel_memcpy.hpp>
#include <cudawait/core/scheduler.hpp>
#include <cudawait/memory/pinned_buffer.hpp>
#include <cudawait/memory/pinned_pool.hpp>
#include <cudawait/observe/timeline.hpp>
#include <cudawait/observe/trace.hpp>
#include <cudawait/runtime/detail/chrono.hpp>

#include <condition_variable>
#include <coroutine>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

namespace cudawait::detail {

/// Host copies finished on worker threads, handed to one coroutine on its scheduler's thread.
/// A class template (`Unused` is always void; use staging_signal) so that only a translation
/// unit that runs a batch instantiates its std::function, shared state and vector.
template <class Unused = void>
class basic_staging_signal {
public:
    using clock = std::chrono::steady_clock;

    /// A finished copy: which buffer (its token) and when it finished.
    struct finished {
        std::size_t token;
        clock::time_point at;
    };

    basic_staging_signal() : m_state(std::make_shared<state>()) {}
    basic_staging_signal(const basic_staging_signal&) = delete;
    basic_staging_signal& operator=(const basic_staging_signal&) = delete;
    /// Waits for the copies still running (they write memory the caller owns).
    ~basic_staging_signal() {
        std::unique_lock lock(m_state->mutex);
        m_state->idle.wait(lock, [this] { return m_state->outstanding == 0; });
    }

    /// Where wake-ups go from now on (loop thread, with no copy running).
    void bind(scheduler& s) noexcept { m_state->sched = &s; }

    /// A copy is about to be handed to the workers: the function that its last part calls.
    /// Any thread may call the result once.
    [[nodiscard]] std::function<void()> expect(std::size_t token) {
        {
            std::lock_guard lock(m_state->mutex);
            ++m_state->outstanding;
        }
        return [st = m_state, token] { state::complete(st, token); };
    }

    /// Copies handed out and not finished.
    [[nodiscard]] std::size_t outstanding() const {
        std::lock_guard lock(m_state->mutex);
        return m_state->outstanding;
    }

    /// Copies handed out whose finish the loop has not taken yet: still running, or finished
    /// and waiting for take(). A worker counts its copy finished only after it queued it for
    /// take(), so outstanding() can be 0 while a finished copy is still to be taken.
    [[nodiscard]] bool unsettled() const {
        std::lock_guard lock(m_state->mutex);
        return m_state->outstanding != 0 || !m_state->done.empty();
    }

    /// Moves the finished copies into `out` (loop thread).
    void take(std::vector<finished>& out) {
        std::lock_guard lock(m_state->mutex);
        for (const finished& f : m_state->done) {
            out.push_back(f);
        }
        m_state->done.clear();
    }

    /// `co_await wait(poll)`: resumes once a finished copy is waiting to be taken, or after
    /// `poll` at the latest (the caller checks the GPU meanwhile; and a wake-up lost to a failed
    /// post only costs that long). Loop thread only.
    /// What wait() returns (defined below, after the state it holds): a named type, so that a
    /// caller's declaration does not instantiate wait() to learn it.
    struct wait_awaiter;
    [[nodiscard]] wait_awaiter wait(std::chrono::nanoseconds poll) {
        return wait_awaiter{m_state, poll};
    }

private:
    struct state {
        mutable std::mutex mutex;
        std::condition_variable idle;
        std::vector<finished> done;
        std::size_t outstanding = 0;
        std::coroutine_handle<> waiter; // under the mutex
        bool wake_posted = false;       // under the mutex
        scheduler* sched = nullptr;
        timer_node* timer = nullptr; // loop thread only

        // A worker's last part finished: note it, post a wake-up if a coroutine waits, and only
        // then count the copy finished (the batch may end, and its scheduler go, right after).
        // The wake-up holds the state: it may run after the batch and its pipeline are gone.
        static void complete(const std::shared_ptr<state>& self, std::size_t token) {
            bool post = false;
            {
                std::lock_guard lock(self->mutex);
                self->done.push_back({token, clock::now()});
                post = self->waiter && !self->wake_posted;
                self->wake_posted = self->wake_posted || post;
            }
            if (post) {
                self->sched->post([self] { self->wake(); });
            }
            std::lock_guard lock(self->mutex);
            --self->outstanding;
            self->idle.notify_all();
        }

        // Loop thread: resumes the waiter once, whichever of the post and the timer comes first.
        void wake() {
            std::coroutine_handle<> h;
            {
                std::lock_guard lock(mutex);
                h = std::exchange(waiter, {});
                wake_posted = false;
            }
            if (!h) {
                return;
            }
            if (timer != nullptr) {
                scheduler_access::cancel_timer(*sched, std::exchange(timer, nullptr));
            }
            scheduler_access::resume_soon(*sched, h);
        }
    };

public:
    struct wait_awaiter {
        std::shared_ptr<state> st;
        std::chrono::nanoseconds poll;

        bool await_ready() const {
            std::lock_guard lock(st->mutex);
            return !st->done.empty();
        }
        bool await_suspend(std::coroutine_handle<> h) {
            {
                std::lock_guard lock(st->mutex);
                if (!st->done.empty()) {
                    return false;
                }
                st->waiter = h;
            }
            // A wake posted meanwhile runs on this thread after we return: it finds the
            // timer set and cancels it.
            st->timer = scheduler_access::add_timer(*st->sched, clock::now() + poll, [s = st] {
                s->timer = nullptr; // it fired
                s->wake();
            });
            return true;
        }
        void await_resume() const noexcept {}
    };

private:
    std::shared_ptr<state> m_state;
};

using staging_signal = basic_staging_signal<>;

/// The batch's staging rings (see the top of this file). Loop thread only, but for the copies.
template <class In, class Out>
class batch_staging {
public:
    /// Extra buffers per direction beyond the depth: one filling or draining while the others
    /// wait for the GPU.
    static constexpr std::size_t spare_buffers = 2;

    batch_staging() = default;
    batch_staging(const batch_staging&) = delete;
    batch_staging& operator=(const batch_staging&) = delete;

    /// A batch begins (no copy of an earlier one runs any more).
    void begin(scheduler& s, timeline* tl, pinned_pool& pool, std::size_t depth,
               std::size_t in_elements, std::size_t out_elements, bool stage_in, bool stage_out) {
        m_signal.bind(s);
        m_timeline = tl;
        m_pool = &pool;
        m_stage_in = stage_in;
        m_stage_out = stage_out;
        m_in_elements = in_elements;
        m_out_elements = out_elements;
        m_next_in = 0;
        m_finished.clear();
        m_landed.clear();
        std::size_t count = depth + spare_buffers;
        if (m_in.size() < count) {
            m_in.resize(count);
        }
        if (m_out.size() < count) {
            m_out.resize(count);
        }
        for (auto& b : m_in) {
            b.state = buffer_state::free;
            b.discard = false;
        }
        for (auto& b : m_out) {
            b.state = buffer_state::free;
        }
    }

    [[nodiscard]] bool stages_in() const noexcept { return m_stage_in; }
    [[nodiscard]] bool stages_out() const noexcept { return m_stage_out; }

    /// Copies running on the workers.
    [[nodiscard]] bool busy() const { return m_signal.outstanding() != 0; }
    /// Copies running, or finished since the last collect(): a buffer may change state at the
    /// next collect().
    [[nodiscard]] bool unsettled() const { return m_signal.unsettled(); }

    /// The next chunk whose input is to be staged, if an input buffer is free for it.
    [[nodiscard]] bool can_start_in(std::size_t chunks) const noexcept {
        return m_stage_in && m_next_in < chunks && find_in(buffer_state::free) != npos;
    }
    [[nodiscard]] std::size_t next_in() const noexcept { return m_next_in; }

    /// Chunks before `c` need no staging any more (started, done, or taken by the fallback
    /// before their stage-in began).
    void skip_to(std::size_t c) noexcept {
        if (m_next_in < c) {
            m_next_in = c;
        }
    }

    /// Starts staging chunk m_next_in (`count` elements at `src`) into a free input buffer.
    /// @throws std::bad_alloc, pool_exhausted (a buffer made anew), cuda_error
    void start_in(const In* src, std::size_t count) {
        std::size_t i = find_in(buffer_state::free);
        in_buffer& b = m_in[i];
        if (!b.buffer) {
            b.buffer = pinned_buffer<In>(m_in_elements, *m_pool);
        }
        b.chunk = m_next_in++;
        b.state = buffer_state::filling;
        b.discard = false;
        b.started = staging_signal::clock::now();
        auto range = std::make_shared<trace_async_range>("stage-in", b.chunk);
        std::function<void()> done = m_signal.expect(token(i, false));
        memcpy_workers::stage_in_workers().copy_async(
            b.buffer.data(), src, count * sizeof(In),
            [range = std::move(range), done = std::move(done)]() mutable {
                range.reset(); // the NVTX range ends with the copy
                done();
            });
    }

    /// Chunk c can be enqueued now: its input is staged (or needs no staging) and an output
    /// buffer is free (or none is needed).
    [[nodiscard]] bool ready(std::size_t c) const noexcept {
        if (m_stage_in && find_in_chunk(c, buffer_state::filled) == npos) {
            return false;
        }
        return !m_stage_out || find_out(buffer_state::free) != npos;
    }

    /// Chunk c's staged input, now read by the GPU until the chunk retires (ready(c) held).
    const In* input(std::size_t c) noexcept {
        in_buffer& b = m_in[find_in_chunk(c, buffer_state::filled)];
        b.state = buffer_state::on_gpu;
        return b.buffer.data();
    }

    /// A free output buffer for chunk c's D2H (ready(c) held).
    /// @throws std::bad_alloc, pool_exhausted (a buffer made anew), cuda_error
    Out* output(std::size_t c) {
        out_buffer& b = m_out[find_out(buffer_state::free)];
        if (!b.buffer) {
            b.buffer = pinned_buffer<Out>(m_out_elements, *m_pool);
        }
        b.chunk = c;
        b.state = buffer_state::on_gpu;
        return b.buffer.data();
    }

    /// Chunk c's enqueue failed before it went to the GPU, or it went to the GPU and the
    /// context is gone: its buffers are free again (what the GPU enqueued before the failure
    /// is ordered before the buffers' next use by the streams).
    void unstart(std::size_t c) noexcept {
        if (std::size_t i = find_in_chunk(c, buffer_state::on_gpu); i != npos) {
            m_in[i].state = buffer_state::filled; // still holds the chunk: a retry uses it
        }
        if (std::size_t i = find_out_chunk(c, buffer_state::on_gpu); i != npos) {
            m_out[i].state = buffer_state::free;
        }
    }

    /// Chunk c completed on the GPU: its input buffer is free, and its output (if staged)
    /// starts for `dst` (`count` elements). Returns whether a stage-out started.
    bool landed(std::size_t c, Out* dst, std::size_t count) {
        if (std::size_t i = find_in_chunk(c, buffer_state::on_gpu); i != npos) {
            m_in[i].state = buffer_state::free;
        }
        std::size_t o = find_out_chunk(c, buffer_state::on_gpu);
        if (o == npos || dst == nullptr) {
            return false;
        }
        out_buffer& b = m_out[o];
        b.state = buffer_state::draining;
        b.started = staging_signal::clock::now();
        auto range = std::make_shared<trace_async_range>("stage-out", c);
        std::function<void()> done = m_signal.expect(token(o, true));
        memcpy_workers::stage_out_workers().copy_async(
            dst, b.buffer.data(), count * sizeof(Out),
            [range = std::move(range), done = std::move(done)]() mutable {
                range.reset();
                done();
            });
        return true;
    }

    /// Chunk c will not be produced by the GPU (the fallback takes it, or it failed while the
    /// context is gone): its buffers are free, one still filling once its copy finished.
    void drop(std::size_t c) noexcept {
        for (in_buffer& b : m_in) {
            if (b.chunk == c && b.state != buffer_state::free) {
                if (b.state == buffer_state::filling) {
                    b.discard = true;
                } else {
                    b.state = buffer_state::free;
                }
            }
        }
        if (std::size_t o = find_out_chunk(c, buffer_state::on_gpu); o != npos) {
            m_out[o].state = buffer_state::free;
        }
    }

    /// Chunk c was given up while the GPU may still read its input buffer and write its output
    /// buffer: both move to `inputs` and `outputs` (kept until the streams were synchronised);
    /// fresh ones are made on their next use.
    void abandon(std::size_t c, std::vector<pinned_buffer<In>>& inputs,
                 std::vector<pinned_buffer<Out>>& outputs) {
        if (std::size_t i = find_in_chunk(c, buffer_state::on_gpu); i != npos) {
            inputs.push_back(std::move(m_in[i].buffer));
            m_in[i].buffer = pinned_buffer<In>();
            m_in[i].state = buffer_state::free;
        }
        if (std::size_t o = find_out_chunk(c, buffer_state::on_gpu); o != npos) {
            outputs.push_back(std::move(m_out[o].buffer));
            m_out[o].buffer = pinned_buffer<Out>();
            m_out[o].state = buffer_state::free;
        }
    }

    /// Takes the copies finished since the last call; returns the chunks whose output is now in
    /// place (the spans go to the timeline).
    const std::vector<std::size_t>& collect() {
        m_finished.clear();
        m_landed.clear();
        m_signal.take(m_finished);
        for (const staging_signal::finished& f : m_finished) {
            std::size_t i = f.token / 2;
            if (f.token % 2 == 0) {
                in_buffer& b = m_in[i];
                span(b.started, f.at, "stage-in", b.chunk);
                b.state = b.discard ? buffer_state::free : buffer_state::filled;
                b.discard = false;
            } else {
                out_buffer& b = m_out[i];
                span(b.started, f.at, "stage-out", b.chunk);
                b.state = buffer_state::free;
                m_landed.push_back(b.chunk);
            }
        }
        return m_landed;
    }

    /// `co_await wait(poll)`: until a copy finished, or `poll` passed.
    [[nodiscard]] auto wait(std::chrono::nanoseconds poll) { return m_signal.wait(poll); }

private:
    static constexpr std::size_t npos = static_cast<std::size_t>(-1);
    enum class buffer_state { free, filling, filled, on_gpu, draining };

    struct in_buffer {
        pinned_buffer<In> buffer;
        std::size_t chunk = npos;
        buffer_state state = buffer_state::free;
        bool discard = false; ///< filling for a chunk that was dropped meanwhile
        staging_signal::clock::time_point started{};
    };
    struct out_buffer {
        pinned_buffer<Out> buffer;
        std::size_t chunk = npos;
        buffer_state state = buffer_state::free;
        staging_signal::clock::time_point started{};
    };

    static std::size_t token(std::size_t i, bool out) noexcept { return i * 2 + (out ? 1 : 0); }

    [[nodiscard]] std::size_t find_in(buffer_state s) const noexcept {
        for (std::size_t i = 0; i < m_in.size(); ++i) {
            if (m_in[i].state == s) {
                return i;
            }
        }
        return npos;
    }
    [[nodiscard]] std::size_t find_in_chunk(std::size_t c, buffer_state s) const noexcept {
        for (std::size_t i = 0; i < m_in.size(); ++i) {
            if (m_in[i].state == s && m_in[i].chunk == c) {
                return i;
            }
        }
        return npos;
    }
    [[nodiscard]] std::size_t find_out(buffer_state s) const noexcept {
        for (std::size_t i = 0; i < m_out.size(); ++i) {
            if (m_out[i].state == s) {
                return i;
            }
        }
        return npos;
    }
    [[nodiscard]] std::size_t find_out_chunk(std::size_t c, buffer_state s) const noexcept {
        for (std::size_t i = 0; i < m_out.size(); ++i) {
            if (m_out[i].state == s && m_out[i].chunk == c) {
                return i;
            }
        }
        return npos;
    }

    void span(staging_signal::clock::time_point from, staging_signal::clock::time_point to,
              const char* track, std::size_t chunk) noexcept {
        if (m_timeline != nullptr) {
            try {
                m_timeline->record(track, track, from, to, chunk);
            } catch (...) {
                // A span that cannot be recorded (out of memory) is not worth failing a batch.
            }
        }
    }

    std::vector<in_buffer> m_in;
    std::vector<out_buffer> m_out;
    std::vector<staging_signal::finished> m_finished;
    std::vector<std::size_t> m_landed;
    timeline* m_timeline = nullptr;
    pinned_pool* m_pool = nullptr;
    bool m_stage_in = false;
    bool m_stage_out = false;
    std::size_t m_in_elements = 0;
    std::size_t m_out_elements = 0;
    std::size_t m_next_in = 0; ///< the next chunk whose input is to be staged
    staging_signal m_signal;   ///< last, so destroyed first: waits for the copies into the rings
};

} // namespace cudawait::detail
