// SPDX-License-Identifier: Apache-2.0
#pragma once

// pipeline_stream's runs (detail/stream.hpp): a run sent as one flight, a submitted chunk, the
// pool that reuses runs, and the wait for a run. See docs/pipeline.md#streaming-in-groups.

#include <cudawait/copy/detail/copy_pieces.hpp>
#include <cudawait/core/task.hpp>
#include <cudawait/core/timeout.hpp>
#include <cudawait/pipeline/detail/slots.hpp>
#include <cudawait/pipeline/options.hpp>
#include <cudawait/runtime/detail/chrono.hpp>
#include <cudawait/runtime/error.hpp>
#include <cudawait/runtime/event.hpp>

#include <cstddef>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

namespace cudawait::detail {

/// A run of chunks submitted one after the other into consecutive chunks of one slot group,
/// all full but the last: one flight once sent (f.chunk its first submission index).
template <class Flight>
struct stream_flight {
    Flight f;
    bool sent = false;     ///< enqueued (or, with the GPU given up, handed to next())
    bool landed = false;   ///< seen complete by next()
    bool reported = false; ///< its give-up was reported (one record per run)
    bool last_full = true; ///< its last chunk is full, so another may join
    unsigned waits = 0;    ///< chunk_timeout retries of its wait

    /// As new, for another run; the piece lists keep their capacity.
    void reset() noexcept {
        std::vector<copy_piece> h2d = std::move(f.h2d_pieces);
        std::vector<copy_piece> d2h = std::move(f.d2h_pieces);
        h2d.clear();
        d2h.clear();
        f = Flight{}; // its completion event goes back to the pool
        f.h2d_pieces = std::move(h2d);
        f.d2h_pieces = std::move(d2h);
        sent = landed = reported = false;
        last_full = true;
        waits = 0;
    }
};

/// A submitted chunk, in submission order.
template <class In, class Out, class Run>
struct stream_item {
    std::size_t seq = 0;      ///< submission index
    std::size_t slot = 0;     ///< slot group
    std::size_t position = 0; ///< chunk of the slot group
    std::size_t count = 0;
    std::size_t output_count = 0;
    std::chrono::steady_clock::time_point started{}; ///< submitted (its latency runs from here)
    std::shared_ptr<Run> flight;
    const In* in_view = nullptr; ///< submitted with views: the caller's input and output
    Out* out_view = nullptr;
    bool copy_out = false; ///< out_view is pageable: next() copies the slot's output there
};

/// Chunk `it` extends `run`: the next chunk of the same slot group, after a full one.
template <class Run, class Item>
[[nodiscard]] bool joins(const Run& run, const Item& it) noexcept {
    return run.last_full && run.f.slot == it.slot && run.f.position + run.f.chunks == it.position;
}

/// How a wait for a run ended.
struct stream_wait_outcome {
    bool timed_out = false; ///< not complete (yet)
    bool by_caller = false; ///< the caller's deadline passed, not chunk_timeout
    chunk_error error;      ///< a CUDA error the completion reported
};

/// Every run made, reused once nothing refers to it (reset, its piece lists keeping their
/// capacity). The pool grows to the runs alive at once (queued, held back, kept for throttling),
/// so that a steady stream allocates none.
template <class Run>
class stream_run_pool {
public:
    /// A run nothing refers to any more, else a new one.
    std::shared_ptr<Run> fresh() {
        const std::size_t n = m_runs.size();
        for (std::size_t j = 0; j < n; ++j) {
            const std::size_t i = (m_cursor + j) % n; // runs free up in about this order
            if (m_runs[i].use_count() == 1) {
                m_cursor = (i + 1) % n;
                m_runs[i]->reset();
                return m_runs[i];
            }
        }
        m_runs.push_back(std::make_shared<Run>());
        return m_runs.back();
    }

    /// The events of the runs kept for reuse go back to the pool (the end of a session).
    void return_events() {
        for (const auto& p : m_runs) {
            if (p.use_count() == 1) {
                p->f.done = pooled_event();
            }
        }
    }

private:
    std::vector<std::shared_ptr<Run>> m_runs;
    std::size_t m_cursor = 0; // where fresh() looks first
};

/// Waits for f's completion until the caller's deadline or `limit` (chunk_timeout; 0: none),
/// whichever is first.
template <class Flight>
task<stream_wait_outcome>
wait_for_run(Flight& f, std::chrono::nanoseconds limit,
             std::optional<std::chrono::steady_clock::time_point> deadline) {
    using clock = std::chrono::steady_clock;
    std::optional<clock::time_point> until = deadline;
    bool by_caller = deadline.has_value();
    if (limit.count() > 0 && (!deadline || clock::now() + limit < *deadline)) {
        until = clock::now() + limit;
        by_caller = false;
    }
    stream_wait_outcome w;
    try {
        if (!until) {
            co_await await_completion(event_ref(f.done), {});
        } else if (auto left = *until - clock::now(); left.count() > 0) {
            co_await await_completion(event_ref(f.done),
                                      std::chrono::duration_cast<std::chrono::nanoseconds>(left));
        } else if (!event_ref(f.done).is_done()) {
            w.timed_out = true; // a deadline already passed: a poll
        }
    } catch (const timeout_error&) {
        w.timed_out = true;
    } catch (const cuda_error& e) {
        w.error = chunk_error_of(e); // reported by the completion (await_completion)
    }
    w.by_caller = w.timed_out && by_caller;
    co_return w;
}

} // namespace cudawait::detail
