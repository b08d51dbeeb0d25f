// SPDX-License-Identifier: Apache-2.0
#pragma once

// What the files of pipeline_test share: the element type and the pipeline under test, the
// transform stage and its host reference, the GPU fixture, and the producers, consumers and
// stage factories that more than one file streams or runs with.

#include <cudawait/core/scheduler.hpp>
#include <cudawait/core/sync_wait.hpp>
#include <cudawait/core/when_all.hpp>
#include <cudawait/memory/host_registration.hpp>
#include <cudawait/memory/mapped_buffer.hpp>
#include <cudawait/pipeline/pipeline.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <new>
#include <optional>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <cuda_runtime.h>

#include "counting_device_resource.hpp"
#include "gpu_fixture.hpp"
#include "no_device.hpp"
#include "random_words.hpp"
#include "test_kernels.hpp"
#include <gtest/gtest.h>

namespace cudawait::testing::pipeline_checks {

using namespace std::chrono_literals;
using namespace cudawait::literals;
using cudawait::pinned_buffer;
using cudawait::pipeline;
using cudawait::pipeline_error;
using cudawait::pipeline_options;
using cudawait::usage_error;
using u32 = std::uint32_t;
using pipe_t = pipeline<u32>;

inline constexpr u32 salt = 0x5eed;

using cudawait::testing::random_words;

/// The host result of the transform stage, chunk by chunk (the index restarts in each chunk).
inline std::vector<u32> expected(const std::vector<u32>& in, std::size_t chunk) {
    std::vector<u32> out(in.size());
    for (std::size_t off = 0; off < in.size(); off += chunk) {
        std::size_t n = std::min(chunk, in.size() - off);
        cudawait::testing::transform_on_host(in.data() + off, out.data() + off, n, salt);
    }
    return out;
}

/// A stage that launches the transform, optionally slowly.
inline pipe_t::stage transform_stage(std::uint64_t spin_ns = 0) {
    return [spin_ns](std::span<u32> in, std::span<u32> out, cudawait::stream_ref s) {
        cudawait::check(cudawait::testing::launch_transform(in.data(), out.data(), in.size(), salt,
                                                            spin_ns, s.get()),
                        "launch_transform");
    };
}

/// The fallback: the same transform on the host.
inline void host_fallback(std::size_t, std::span<const u32> in, std::span<u32> out) {
    cudawait::testing::transform_on_host(in.data(), out.data(), in.size(), salt);
}

inline std::size_t first_mismatch(const std::vector<u32>& got, const std::vector<u32>& want) {
    for (std::size_t i = 0; i < want.size(); ++i) {
        if (got[i] != want[i]) {
            return i;
        }
    }
    return want.size();
}

template <class R>
inline void copy_into(R& dst, const std::vector<u32>& src) {
    std::copy(src.begin(), src.end(), dst.begin());
}

class pipeline_gpu : public cudawait::testing::pool_gpu_test {};

struct stream_log {
    std::size_t produced = 0;
    std::size_t consumed = 0;
    std::size_t max_outstanding = 0; ///< acquired or submitted, not yet consumed
    std::size_t bad = 0;
    std::size_t out_of_order = 0;
};

inline cudawait::task<void> producer(pipe_t& p, const std::vector<std::vector<u32>>& chunks,
                                     stream_log& log) {
    for (const auto& c : chunks) {
        auto slot = co_await p.acquire();
        ++log.produced;
        log.max_outstanding = std::max(log.max_outstanding, log.produced - log.consumed);
        std::copy(c.begin(), c.end(), slot.data().begin());
        p.submit(std::move(slot), c.size());
    }
    p.close();
}

inline cudawait::task<void> consumer(pipe_t& p, const std::vector<std::vector<u32>>& chunks,
                                     stream_log& log) {
    while (auto r = co_await p.next()) {
        if (r->chunk() != log.consumed) {
            ++log.out_of_order;
        }
        const auto& in = chunks[r->chunk()];
        std::vector<u32> want(in.size());
        cudawait::testing::transform_on_host(in.data(), want.data(), in.size(), salt);
        if (!std::equal(want.begin(), want.end(), r->data().begin(), r->data().end())) {
            ++log.bad;
        }
        ++log.consumed;
        co_await cudawait::sleep_for(200us); // a slow consumer: the producer must wait
    }
}

/// A stage that fails to launch (a non-sticky error) on the calls listed in `fail_calls`.
inline pipe_t::stage flaky_stage(std::shared_ptr<std::vector<int>> fail_calls,
                                 std::shared_ptr<int> calls) {
    return [fail_calls, calls](std::span<u32> in, std::span<u32> out, cudawait::stream_ref s) {
        int call = (*calls)++;
        if (std::find(fail_calls->begin(), fail_calls->end(), call) != fail_calls->end()) {
            cudawait::check(cudawait::testing::launch_bad_config(s.get()), "launch_bad_config");
        }
        cudawait::check(
            cudawait::testing::launch_transform(in.data(), out.data(), in.size(), salt, 0, s.get()),
            "launch_transform");
    };
}

/// What streaming made of one chunk.
struct streamed {
    bool right = false;       ///< the output matched the host reference
    bool by_fallback = false; ///< the fallback made it
    std::string error;        ///< what next() threw for it, if it threw
};

/// Streams `chunks` through `p`, three submitted ahead and consumed as they come, then closes it
/// and checks that next() ends. A pipeline_error must name the chunk next() had reached.
inline cudawait::task<std::vector<streamed>>
stream_chunks(pipe_t& p, const std::vector<std::vector<u32>>& chunks) {
    std::vector<streamed> seen;
    std::size_t submitted = 0;
    while (seen.size() < chunks.size()) {
        while (submitted < chunks.size() && submitted - seen.size() < 3) {
            auto slot = co_await p.acquire();
            const auto& c = chunks[submitted++];
            std::copy(c.begin(), c.end(), slot.data().begin());
            p.submit(std::move(slot), c.size());
        }
        try {
            auto r = co_await p.next();
            const auto& in = chunks[r->chunk()];
            std::vector<u32> want(in.size());
            cudawait::testing::transform_on_host(in.data(), want.data(), in.size(), salt);
            seen.push_back(
                {std::equal(want.begin(), want.end(), r->data().begin(), r->data().end()),
                 r->by_fallback(),
                 {}});
        } catch (const pipeline_error& e) {
            if (e.failed() != std::vector<std::size_t>{seen.size()}) {
                throw;
            }
            seen.push_back({false, false, e.what()});
        } catch (const std::runtime_error& e) {
            seen.push_back({false, false, e.what()});
        }
    }
    p.close();
    if (co_await p.next()) {
        throw std::logic_error("next() did not end after close()");
    }
    co_return seen;
}

/// What the fallback of the wait tests writes: not what the GPU computes.
inline constexpr u32 fallback_mark = 0xfa11u;

inline cudawait::task<void> submit_all(pipe_t& p, const std::vector<std::vector<u32>>& chunks) {
    for (const auto& c : chunks) {
        auto slot = co_await p.acquire();
        std::copy(c.begin(), c.end(), slot.data().begin());
        p.submit(std::move(slot), c.size());
    }
    p.close();
}

inline cudawait::task<void> take_all(pipe_t& p, std::vector<std::vector<u32>>& got) {
    while (auto r = co_await p.next()) {
        if (r->chunk() != got.size()) {
            throw std::runtime_error("chunk " + std::to_string(r->chunk()) + " came as number " +
                                     std::to_string(got.size()));
        }
        got.emplace_back(r->data().begin(), r->data().end());
    }
}

/// Streams `chunks` through `p` (producer and consumer on one scheduler): the outputs in the
/// order next() gave them.
inline std::vector<std::vector<u32>> stream_all(cudawait::scheduler& sched, pipe_t& p,
                                                const std::vector<std::vector<u32>>& chunks) {
    std::vector<std::vector<u32>> got;
    cudawait::sync_wait(sched, cudawait::when_all(submit_all(p, chunks), take_all(p, got)));
    return got;
}

inline std::vector<u32> transformed(const std::vector<u32>& in) {
    std::vector<u32> out(in.size());
    cudawait::testing::transform_on_host(in.data(), out.data(), in.size(), salt);
    return out;
}

inline pipe_t::stage affine_stage(u32 a, u32 b) {
    return [a, b](std::span<u32> in, std::span<u32> out, cudawait::stream_ref s) {
        cudawait::check(cudawait::testing::launch_affine(
                            in.data(), out.data(), std::min(in.size(), out.size()), a, b, s.get()),
                        "launch_affine");
    };
}

inline pipe_t::stage square_sub_stage(u32 c) {
    return [c](std::span<u32> in, std::span<u32> out, cudawait::stream_ref s) {
        cudawait::check(cudawait::testing::launch_square_sub(
                            in.data(), out.data(), std::min(in.size(), out.size()), c, s.get()),
                        "launch_square_sub");
    };
}

/// y = 2x + 1, then z = y * y - 3 from y, then (a third stage) w = 5z + 7 from z.
inline std::vector<pipe_t::stage> chain(std::size_t stages) {
    std::vector<pipe_t::stage> v{affine_stage(2, 1), square_sub_stage(3)};
    if (stages == 3) {
        v.push_back(affine_stage(5, 7));
    }
    return v;
}

inline std::vector<u32> chain_on_host(const std::vector<u32>& x, std::size_t stages) {
    std::vector<u32> y(x.size());
    std::vector<u32> z(x.size());
    cudawait::testing::affine_on_host(x.data(), y.data(), x.size(), 2, 1);
    cudawait::testing::square_sub_on_host(y.data(), z.data(), y.size(), 3);
    if (stages == 3) {
        cudawait::testing::affine_on_host(z.data(), z.data(), z.size(), 5, 7);
    }
    return z;
}

} // namespace cudawait::testing::pipeline_checks
