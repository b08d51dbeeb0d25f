// SPDX-License-Identifier: Apache-2.0
#pragma once

// Synopsis
//   multi_pipeline_options o;        devices (empty: every visible one), shards_per_device,
//                                    per_shard (a pipeline_options)
//   multi_pipeline<float> mp(o, {stage...}, fallback);    stages and fallback as pipeline's
//   co_await mp.run(host_in, host_out);                   batch over every shard
//   acquire, submit, next, close as pipeline's            global submission order
//   mp.stats()    per_shard, combined, rescued_chunks, shard_devices
//
// Data parallel over several GPUs: a pipeline per shard, all driven from one scheduler thread; a
// chunk a shard gives up is rescued on another GPU, else by the fallback. Not thread-safe. See
// docs/pipeline.md#multi_pipeline.

#include <cudawait/core/detail/wait_list.hpp>
#include <cudawait/core/scheduler.hpp>
#include <cudawait/core/task.hpp>
#include <cudawait/core/when_all.hpp>
#include <cudawait/pipeline/detail/multi_pool.hpp>
#include <cudawait/pipeline/detail/multi_rescue.hpp>
#include <cudawait/pipeline/detail/multi_stats.hpp>
#include <cudawait/pipeline/options.hpp>
#include <cudawait/pipeline/pipeline.hpp>
#include <cudawait/pipeline/stage.hpp>
#include <cudawait/runtime/detail/chrono.hpp>
#include <cudawait/runtime/device.hpp>
#include <cudawait/runtime/error.hpp>

#include <algorithm>
#include <cstddef>
#include <deque>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace cudawait {

/// How a multi_pipeline is built; per_shard.chunk_elements is required.
struct multi_pipeline_options {
    /// CUDA device ids, each at most once; empty: every visible device (0 .. count-1).
    std::vector<int> devices;
    /// Shards (pipelines) per device, at least 1.
    unsigned shards_per_device = 1;
    /// Each shard's options; `device` is set per shard, `pool` (when null) per device.
    pipeline_options per_shard;
    /// Each shard's device_resource by its device, else per_shard's (each outlives the pipeline).
    std::function<device_resource(int device)> device_resource_for;

    /// Checks shards_per_device, the devices and per_shard (as pipeline_options::validate).
    /// @throws usage_error naming the field, e.g. "multi_pipeline_options.per_shard.depth ..."
    void validate() const {
        if (shards_per_device == 0) {
            throw usage_error("multi_pipeline_options.shards_per_device must be at least 1");
        }
        if (std::set<int>(devices.begin(), devices.end()).size() != devices.size()) {
            throw usage_error("multi_pipeline_options.devices: a device is listed twice "
                              "(shards_per_device puts several shards on one device)");
        }
        per_shard.validate("multi_pipeline_options.per_shard");
    }
};

/// What a multi_pipeline's last batch run (or its streaming session so far) achieved.
struct multi_pipeline_stats {
    std::vector<pipeline_stats> per_shard; ///< each shard's own stats, by shard index
    pipeline_stats combined;               ///< the shards as one (docs/pipeline.md#multi_pipeline)
    std::size_t rescued_chunks = 0;        ///< chunks another shard's GPU produced
    std::vector<int> shard_devices;        ///< the device of each shard
};

template <class In, class Out = In>
class multi_pipeline;

namespace detail {

/// multi_pipeline<In, Out>::input_slot: a slot the producer fills before submit(), on the shard
/// acquire() chose; given back unused if dropped.
template <class In, class Out>
class multi_input_slot {
public:
    multi_input_slot() = default;
    /// The slot's pinned input: chunk_elements elements.
    /// @throws usage_error when empty or already submitted
    [[nodiscard]] std::span<In> data() const { return m_slot.data(); }
    /// The shard the slot belongs to.
    [[nodiscard]] std::size_t shard() const noexcept { return m_shard; }

private:
    friend class cudawait::multi_pipeline<In, Out>;
    multi_input_slot(typename pipeline<In, Out>::input_slot s, std::size_t shard)
        : m_slot(std::move(s)), m_shard(shard) {}
    typename pipeline<In, Out>::input_slot m_slot;
    std::size_t m_shard = 0;
};

/// multi_pipeline<In, Out>::result: a chunk's output, in global submission order; its shard's slot
/// is reused once this is destroyed.
template <class In, class Out>
class multi_result {
public:
    multi_result(multi_result&&) noexcept = default;
    multi_result& operator=(multi_result&&) = delete;
    [[nodiscard]] std::span<const Out> data() const { return m_result.data(); }
    /// Global submission index.
    [[nodiscard]] std::size_t chunk() const noexcept { return m_chunk; }
    /// The shard it was submitted to.
    [[nodiscard]] std::size_t shard() const noexcept { return m_shard; }
    /// Another shard's GPU produced it (a rescue).
    [[nodiscard]] bool rescued() const noexcept { return m_rescued; }
    /// The user's fallback produced it.
    [[nodiscard]] bool by_fallback() const noexcept { return m_by_fallback; }

private:
    friend class cudawait::multi_pipeline<In, Out>;
    multi_result(typename pipeline<In, Out>::result r, std::size_t chunk, std::size_t shard,
                 bool rescued)
        : m_result(std::move(r)), m_chunk(chunk), m_shard(shard), m_rescued(rescued),
          m_by_fallback(m_result.by_fallback() && !rescued) {}
    typename pipeline<In, Out>::result m_result;
    std::size_t m_chunk;
    std::size_t m_shard;
    bool m_rescued;
    bool m_by_fallback;
};

/// `o` checked before any CUDA call: usage_error for what multi_pipeline() refuses up front.
template <class Stage>
multi_pipeline_options checked_multi_options(multi_pipeline_options o,
                                             const std::vector<Stage>& stages) {
    if (stages.empty() ||
        std::any_of(stages.begin(), stages.end(), [](const Stage& s) { return !s; })) {
        throw usage_error("multi_pipeline: at least one stage, and no empty ones");
    }
    o.validate();
    return o;
}

/// now + timeout; usage_error for a negative one (a bug, not a poll).
inline std::chrono::steady_clock::time_point multi_deadline_after(std::chrono::nanoseconds timeout,
                                                                  const char* call) {
    if (timeout.count() < 0) {
        throw usage_error(std::string("multi_pipeline::") + call + ": negative timeout");
    }
    return std::chrono::steady_clock::now() + timeout;
}
/// What is left until `deadline`, at least zero.
inline std::chrono::nanoseconds multi_time_left(std::chrono::steady_clock::time_point deadline) {
    auto left = deadline - std::chrono::steady_clock::now();
    return std::max(std::chrono::nanoseconds(0),
                    std::chrono::duration_cast<std::chrono::nanoseconds>(left));
}

} // namespace detail

/// One pipeline over several GPUs: a pipeline<In, Out> per shard, batches split over the
/// shards, streams dealt round-robin and delivered in order, and a chunk a shard gives up
/// rescued on another shard's GPU.
///
/// Not thread-safe: drive it from one scheduler's coroutines. Destruction waits for the GPU
/// work in flight.
template <class In, class Out>
class multi_pipeline {
    using shard_pipeline = pipeline<In, Out>;
    using clock = std::chrono::steady_clock;

public:
    /// As pipeline's (pipeline/stage.hpp).
    using stage = typename shard_pipeline::stage;
    /// Computes chunk `chunk` (its global index) on the host when no GPU could.
    using fallback = typename shard_pipeline::fallback;
    /// A slot the producer fills before submit(), on the shard acquire() chose.
    using input_slot = detail::multi_input_slot<In, Out>;
    /// A chunk's output, in global submission order.
    using result = detail::multi_result<In, Out>;

    /// @throws usage_error for no stages or an empty one, options that validate() refuses
    ///         (before any CUDA call), a shard's device_resource giving another device's memory;
    ///         cuda_error (cudaErrorInvalidDevice: a device id no visible device has); as
    ///         pipeline()
    multi_pipeline(multi_pipeline_options options, std::vector<stage> stages,
                   fallback on_gpu_failure = {})
        : m_options(detail::checked_multi_options(std::move(options), stages)),
          m_stages(std::move(stages)), m_user_fallback(std::move(on_gpu_failure)) {
        if (m_options.devices.empty()) {
            const int n = device_count();
            for (int d = 0; d < n; ++d) {
                m_options.devices.push_back(d);
            }
        }
        std::vector<device_ref> devices;
        for (int d : m_options.devices) {
            devices.emplace_back(d); // cudaErrorInvalidDevice for an id out of range
        }
        const std::size_t count = devices.size() * m_options.shards_per_device;
        m_lanes.resize(count);
        m_abandoned.assign(count, false);
        m_rescued_bytes.resize(count);
        m_local_to_global.resize(count);
        for (std::size_t i = 0; i < count; ++i) {
            device_ref dev = devices[i % devices.size()];
            m_shard_devices.push_back(dev.get());
            pipeline_options o = m_options.per_shard;
            o.streams.device = dev.get();
            if (o.memory.pool == nullptr) {
                o.memory.pool = &detail::staging_pool_for_device(dev.get());
            }
            o.memory.device_resource =
                detail::shard_device_resource(o, m_options.device_resource_for, dev);
            if (!o.recovery.report_path.empty() && count > 1) {
                o.recovery.report_path += ".shard" + std::to_string(i);
            }
            if (o.recovery.on_degrade) {
                // A throw from it in submit() leaves the chunk queued (pipeline's submit says
                // so); submit() needs to know which case it saw.
                o.recovery.on_degrade =
                    [this, user = std::move(o.recovery.on_degrade)](const chunk_failure& f) {
                        try {
                            user(f);
                        } catch (...) {
                            m_degrade_threw = true;
                            throw;
                        }
                    };
            }
            m_shards.push_back(std::make_unique<shard_pipeline>(
                std::move(o), m_stages,
                [this, i](std::size_t c, std::span<const In> in, std::span<Out> out) {
                    rescue(i, c, in, out);
                }));
        }
        // The sizes as the shards validated them (output_elements filled in, say).
        const pipeline_options& v = m_shards.front()->options();
        m_options.per_shard.output_elements = v.output_elements;
        m_options.per_shard.memory.queue_capacity = v.memory.queue_capacity;
        m_options.per_shard.streams.device = v.streams.device;
    }

    multi_pipeline(const multi_pipeline&) = delete;
    multi_pipeline& operator=(const multi_pipeline&) = delete;
    ~multi_pipeline() = default; // each shard waits for its GPU work; then the rescue lanes

    /// Shards: devices x shards_per_device.
    [[nodiscard]] std::size_t shard_count() const noexcept { return m_shards.size(); }
    /// Shard `i`, for inspection (its streams, options, stats); running it directly bypasses
    /// the multi pipeline's bookkeeping.
    /// @throws usage_error when i >= shard_count()
    [[nodiscard]] const shard_pipeline& shard(std::size_t i) const {
        if (i >= m_shards.size()) {
            throw usage_error("multi_pipeline::shard: index out of range");
        }
        return *m_shards[i];
    }
    /// The options as validated: devices filled in, per_shard's sizes as the shards took them
    /// (and its device shard 0's).
    [[nodiscard]] const multi_pipeline_options& options() const noexcept { return m_options; }

    /// Output elements for `inputs` input elements in chunks.
    [[nodiscard]] std::size_t output_size(std::size_t inputs) const noexcept {
        return m_shards.front()->output_size(inputs);
    }

    /// Runs `in` through the shards into `out` (output_size(in.size()) elements).
    /// @throws usage_error for empty or mis-sized ranges, device memory, during a streaming
    ///         session or another batch; pipeline_error naming the failed chunks (indices in
    ///         the whole input) once every part finished; what the fallback or a callback
    ///         throws, once every part finished
    [[nodiscard]] task<void> run(std::span<const In> in, std::span<Out> out) {
        if (in.empty() || in.data() == nullptr) {
            throw usage_error("multi_pipeline::run: empty input");
        }
        if (out.size() != output_size(in.size()) || out.data() == nullptr) {
            throw usage_error("multi_pipeline::run: output has " + std::to_string(out.size()) +
                              " elements, the input needs " +
                              std::to_string(output_size(in.size())));
        }
        check_idle("run");
        return run_batch(in, out);
    }

    /// Waits for a free slot on the next shard (round-robin, skipping abandoned GPUs). On an
    /// idle multi pipeline it begins a streaming session.
    /// @throws usage_error after close() until next() returned the end, or during a batch
    [[nodiscard]] task<input_slot> acquire() { return acquire_on({}, {}); }
    /// acquire() that gives up after `timeout` (from this call): no slot is taken then.
    /// @throws usage_error for a negative timeout (at the call) and as acquire();
    ///         timeout_error (after() == timeout) once it passed
    [[nodiscard]] task<input_slot> acquire(std::chrono::nanoseconds timeout) {
        return acquire_on(detail::multi_deadline_after(timeout, "acquire"), timeout);
    }
    /// acquire() that gives up at `deadline`; one already passed polls.
    [[nodiscard]] task<input_slot> acquire(clock::time_point deadline) {
        return acquire_on(deadline, detail::multi_time_left(deadline));
    }

    /// Starts the slot's chunk of `count` elements on its shard.
    /// @throws usage_error for an empty slot or another pipeline's, a bad count, after close():
    ///         the slot stays the caller's; else (cuda_error, on_degrade's) the slot was taken
    void submit(input_slot&& s, std::size_t count) {
        if (m_closed || !m_session_open) {
            throw usage_error("multi_pipeline::submit: the streaming session is closed");
        }
        if (s.m_shard >= m_shards.size()) {
            throw usage_error("multi_pipeline::submit: the slot is from another pipeline");
        }
        const std::size_t j = s.m_shard;
        const std::size_t global = m_submit_seq;
        m_degrade_threw = false;
        try {
            m_shards[j]->submit(std::move(s.m_slot), count);
        } catch (const usage_error&) {
            throw; // nothing was numbered or queued
        } catch (...) {
            // The shard numbered the chunk; it is queued when on_degrade threw (pipeline's
            // submit still reports it in order then), else it is lost there.
            if (m_degrade_threw) {
                enqueued(j, global);
            } else {
                m_local_to_global[j].push_back(no_chunk);
            }
            throw;
        }
        enqueued(j, global);
    }

    /// The next chunk's output in global submission order; std::nullopt once closed and
    /// drained, which ends the streaming session.
    /// @throws pipeline_error for a chunk that failed (named by its global index); what the
    ///         fallback throws (the chunk is then consumed)
    [[nodiscard]] task<std::optional<result>> next() { return next_on({}, {}); }
    /// next() that gives up after `timeout`: the chunk it waited for is not consumed.
    /// @throws usage_error for a negative timeout (at the call); timeout_error (after() ==
    ///         timeout) once it passed; as next()
    [[nodiscard]] task<std::optional<result>> next(std::chrono::nanoseconds timeout) {
        return next_on(detail::multi_deadline_after(timeout, "next"), timeout);
    }
    /// next() that gives up at `deadline`; one already passed polls.
    [[nodiscard]] task<std::optional<result>> next(clock::time_point deadline) {
        return next_on(deadline, detail::multi_time_left(deadline));
    }

    /// No more submissions on any shard; next() returns what is queued, then std::nullopt.
    void close() {
        m_closed = true;
        for (auto& p : m_shards) {
            p->close();
        }
        m_submitted.notify_all();
    }

    /// What the last batch run (or the streaming session so far) achieved.
    [[nodiscard]] multi_pipeline_stats stats() const {
        multi_pipeline_stats s;
        detail::multi_run_counts counts{m_wall_seconds, m_rescued, m_failed_rescues, {}};
        for (std::size_t j = 0; j < m_shards.size(); ++j) {
            s.per_shard.push_back(m_shards[j]->stats());
            detail::count_rescued(s.per_shard.back(), m_rescued_bytes[j]);
            counts.rescued_bytes.input += m_rescued_bytes[j].input;
            counts.rescued_bytes.output += m_rescued_bytes[j].output;
        }
        if (m_session_open) {
            counts.wall_seconds = std::chrono::duration<double>(clock::now() - m_started).count();
        }
        s.combined = detail::combine_stats(s.per_shard, counts);
        s.rescued_chunks = m_rescued;
        s.shard_devices = m_shard_devices;
        return s;
    }

private:
    static constexpr std::size_t no_chunk = std::numeric_limits<std::size_t>::max();

    struct queued {
        std::size_t shard;
        std::size_t chunk; // global submission index
    };

    void check_idle(const char* call) const {
        if (m_session_open) {
            throw usage_error(std::string("multi_pipeline::") + call +
                              ": a streaming session is open (next() has not returned the end "
                              "after close())");
        }
        if (m_batch_running) {
            throw usage_error(std::string("multi_pipeline::") + call +
                              ": another batch is running");
        }
    }

    void reset_counts() noexcept {
        m_rescued = 0;
        m_failed_rescues = 0;
        std::fill(m_rescued_bytes.begin(), m_rescued_bytes.end(), detail::byte_counts{});
        m_wall_seconds = 0;
        m_started = clock::now();
    }

    // ---- batch ----------------------------------------------------------------------------

    task<void> run_batch(std::span<const In> in, std::span<Out> out) {
        check_idle("run");
        m_batch_running = true;
        struct running_flag {
            bool* flag;
            ~running_flag() { *flag = false; }
        } guard{&m_batch_running};
        refresh_health();
        reset_counts();
        m_batch_failed.clear();
        const pipeline_options& o = m_options.per_shard;
        const std::size_t n = (in.size() + o.chunk_elements - 1) / o.chunk_elements;
        const std::size_t shards = m_shards.size();
        m_part_first.assign(shards, 0);
        std::vector<std::vector<std::size_t>> part_failed(shards);
        std::vector<task<void>> parts;
        std::size_t first = 0;
        for (std::size_t j = 0; j < shards; ++j) {
            const std::size_t chunks = n / shards + (j < n % shards ? 1 : 0);
            m_part_first[j] = first;
            if (chunks != 0) {
                const std::size_t off = first * o.chunk_elements;
                const std::size_t len = std::min(chunks * o.chunk_elements, in.size() - off);
                parts.push_back(run_part(j, in.subspan(off, len),
                                         out.subspan(first * o.output_elements, output_size(len)),
                                         part_failed[j]));
            }
            first += chunks;
        }
        if (parts.size() == 1) {
            co_await std::move(parts.front());
        } else {
            co_await when_all(std::move(parts));
        }
        m_wall_seconds = std::chrono::duration<double>(clock::now() - m_started).count();
        std::vector<std::size_t> failed = m_batch_failed;
        for (std::size_t j = 0; j < shards; ++j) {
            for (std::size_t c : part_failed[j]) {
                failed.push_back(m_part_first[j] + c);
            }
        }
        if (!failed.empty()) {
            std::sort(failed.begin(), failed.end());
            std::vector<std::size_t> completed;
            for (std::size_t c = 0, f = 0; c < n; ++c) {
                if (f < failed.size() && failed[f] == c) {
                    ++f;
                } else {
                    completed.push_back(c);
                }
            }
            throw detail::batch_failed(std::move(completed), std::move(failed));
        }
    }

    // Shard j's part; the chunks it reports failed (its own indices) go to `failed`.
    task<void> run_part(std::size_t j, std::span<const In> in, std::span<Out> out,
                        std::vector<std::size_t>& failed) {
        try {
            co_await m_shards[j]->run(in, out);
        } catch (const pipeline_error& e) {
            failed = e.failed();
        }
    }

    // ---- rescue ---------------------------------------------------------------------------

    // The global index of shard `origin`'s chunk `local` in the current batch or session.
    std::size_t global_chunk(std::size_t origin, std::size_t local) const {
        if (m_batch_running) {
            return m_part_first[origin] + local;
        }
        const std::vector<std::size_t>& map = m_local_to_global[origin];
        return local < map.size() ? map[local] : local;
    }

    // Shard j's fallback: the chunk on another shard's GPU, else the user's fallback, else
    // failed (recorded here; the shard counts it as produced by its fallback).
    void rescue(std::size_t origin, std::size_t local, std::span<const In> in, std::span<Out> out) {
        const std::size_t global = global_chunk(origin, local);
        if (std::optional<std::size_t> by = rescuer(origin)) {
            try {
                if (!m_lanes[*by]) {
                    m_lanes[*by] = std::make_unique<detail::rescue_lane<In, Out>>(
                        m_shards[*by]->options(), m_stages.size(),
                        device_ref(m_shard_devices[*by]));
                }
                m_lanes[*by]->run(m_stages, local, in, out);
                ++m_rescued;
                m_rescued_bytes[origin].input += in.size_bytes();
                m_rescued_bytes[origin].output += out.size_bytes();
                if (!m_batch_running) {
                    m_stream_rescued.insert(global);
                }
                return;
            } catch (const cuda_error& e) {
                if (e.sticky()) {
                    abandon_device(m_shard_devices[*by]);
                }
            }
        }
        if (m_user_fallback) {
            m_user_fallback(global, in, out);
            return;
        }
        ++m_failed_rescues;
        if (m_batch_running) {
            m_batch_failed.push_back(global);
        } else {
            m_stream_failed.insert(global);
        }
    }

    // The next shard other than `origin` whose GPU is not abandoned (round-robin), if any.
    std::optional<std::size_t> rescuer(std::size_t origin) {
        note_health();
        const std::size_t shards = m_shards.size();
        for (std::size_t k = 0; k < shards; ++k) {
            const std::size_t j = (m_rescue_next + k) % shards;
            if (j != origin && !m_abandoned[j]) {
                m_rescue_next = j + 1;
                return j;
            }
        }
        return std::nullopt;
    }

    // Reads the shards' degradation records for a GPU given up (cheap: empty when all is well;
    // the flag itself never clears, as pipeline's does not). A sticky error takes every shard
    // of its device with it.
    void note_health() {
        for (std::size_t j = 0; j < m_shards.size(); ++j) {
            if (m_abandoned[j]) {
                continue;
            }
            for (const chunk_failure& f : m_shards[j]->failures()) {
                if (f.level != degrade_level::give_up) {
                    continue;
                }
                if (f.error.sticky) {
                    abandon_device(m_shard_devices[j]);
                }
                switch (f.action) {
                case degrade_action::gpu_lost:
                case degrade_action::fallback_after_gpu_lost:
                case degrade_action::failed_after_gpu_lost:
                case degrade_action::failed_timed_out:
                    m_abandoned[j] = true;
                    break;
                default:
                    break;
                }
            }
        }
    }

    // The shards' own flag, which the records above may no longer show (a run or session
    // starts them anew): read once per batch and per session.
    void refresh_health() {
        for (std::size_t j = 0; j < m_shards.size(); ++j) {
            if (!m_abandoned[j] && m_shards[j]->stats().gpu_abandoned) {
                m_abandoned[j] = true;
            }
        }
    }

    void abandon_device(int dev) {
        for (std::size_t j = 0; j < m_shards.size(); ++j) {
            if (m_shard_devices[j] == dev) {
                m_abandoned[j] = true;
            }
        }
    }

    // ---- streaming ------------------------------------------------------------------------

    void begin_session() {
        m_session_open = true;
        m_closed = false;
        m_submit_seq = 0;
        m_acquire_next = 0; // each session deals from shard 0
        m_fifo.clear();
        for (auto& map : m_local_to_global) {
            map.clear();
        }
        m_stream_rescued.clear();
        m_stream_failed.clear();
        refresh_health();
        reset_counts();
    }

    // Shard j numbered its chunk and queued it: the chunk's global index.
    void enqueued(std::size_t j, std::size_t global) {
        m_local_to_global[j].push_back(global);
        m_fifo.push_back({j, global});
        ++m_submit_seq;
        m_submitted.notify_all();
    }

    task<input_slot> acquire_on(std::optional<clock::time_point> deadline,
                                std::chrono::nanoseconds budget) {
        if (m_batch_running) {
            throw usage_error("multi_pipeline::acquire: a batch run is in progress");
        }
        if (!m_session_open) {
            begin_session();
        } else if (m_closed) {
            throw usage_error("multi_pipeline::acquire: the pipeline is closed; a new streaming "
                              "session may begin once next() has returned the end");
        }
        note_health();
        const std::size_t shards = m_shards.size();
        std::size_t j = m_acquire_next % shards;
        for (std::size_t k = 0; k < shards; ++k) {
            if (!m_abandoned[(m_acquire_next + k) % shards]) {
                j = (m_acquire_next + k) % shards;
                break;
            }
        }
        std::optional<typename shard_pipeline::input_slot> s;
        try {
            if (deadline) {
                s.emplace(co_await m_shards[j]->acquire(*deadline));
            } else {
                s.emplace(co_await m_shards[j]->acquire());
            }
        } catch (const timeout_error&) {
            throw timeout_error(budget); // after() as this call's
        }
        m_acquire_next = j + 1;
        co_return input_slot(std::move(*s), j);
    }

    task<std::optional<result>> next_on(std::optional<clock::time_point> deadline,
                                        std::chrono::nanoseconds budget) {
        scheduler& sched = co_await this_scheduler();
        const std::size_t session = m_sessions_ended;
        while (m_fifo.empty()) {
            if (m_closed) {
                co_await end_session();
                co_return std::nullopt;
            }
            if (!deadline) {
                co_await m_submitted.wait(sched);
            } else if (clock::now() >= *deadline) {
                throw timeout_error(budget);
            } else {
                co_await m_submitted.wait_until(sched, *deadline);
            }
            if (m_sessions_ended != session) {
                co_return std::nullopt; // another consumer took the end of this one's session
            }
        }
        const queued q = m_fifo.front();
        m_fifo.pop_front();
        // A result is not assignable: the awaited optional is constructed in place.
        std::optional<std::optional<typename shard_pipeline::result>> got;
        try {
            if (deadline) {
                got.emplace(co_await m_shards[q.shard]->next(*deadline));
            } else {
                got.emplace(co_await m_shards[q.shard]->next());
            }
        } catch (const timeout_error&) {
            m_fifo.push_front(q); // not consumed: first in line again, as in the shard
            throw timeout_error(budget);
        } catch (const pipeline_error& e) {
            forget(q.chunk);
            throw pipeline_error("multi_pipeline: chunk " + std::to_string(q.chunk) + " (shard " +
                                     std::to_string(q.shard) + "): " + e.what(),
                                 {}, {q.chunk});
        } catch (...) {
            // Thrown before the shard took the chunk: first in line there, so here too.
            const auto first = m_shards[q.shard]->m_stream.next_seq();
            const auto& map = m_local_to_global[q.shard];
            if (first && *first < map.size() && map[*first] == q.chunk) {
                m_fifo.push_front(q);
            } else {
                forget(q.chunk);
            }
            throw;
        }
        std::optional<typename shard_pipeline::result>& r = *got;
        if (!r) {
            throw usage_error("multi_pipeline::next: a shard ended its session while chunks "
                              "were queued on it (was it driven directly?)");
        }
        // The shard's own numbering says which chunk this is (with one consumer, q's).
        const std::vector<std::size_t>& map = m_local_to_global[q.shard];
        const std::size_t global = r->chunk() < map.size() ? map[r->chunk()] : q.chunk;
        const bool rescued = m_stream_rescued.erase(global) != 0;
        if (m_stream_failed.erase(global) != 0) {
            r.reset(); // the slot goes back; its output was never written
            throw pipeline_error("multi_pipeline: chunk " + std::to_string(global) + " (shard " +
                                     std::to_string(q.shard) +
                                     ") failed: its shard gave it up, no other shard could "
                                     "rescue it and there is no fallback",
                                 {}, {global});
        }
        co_return result(std::move(*r), global, q.shard, rescued);
    }

    void forget(std::size_t global) {
        m_stream_rescued.erase(global);
        m_stream_failed.erase(global);
    }

    // Every shard's next() returns its end (each is closed and drained), which ends its own
    // session; then the multi pipeline's ends.
    task<void> end_session() {
        for (auto& p : m_shards) {
            while (auto left = co_await p->next()) {
                // Not reachable through this class (every queued chunk is in m_fifo); dropped.
            }
        }
        m_wall_seconds = std::chrono::duration<double>(clock::now() - m_started).count();
        m_session_open = false;
        m_closed = false;
        ++m_sessions_ended;
    }

    multi_pipeline_options m_options;
    std::vector<stage> m_stages; // the user's, for rescues
    fallback m_user_fallback;
    std::vector<int> m_shard_devices;
    // The rescue lanes go after the shards (declared first, destroyed last).
    std::vector<std::unique_ptr<detail::rescue_lane<In, Out>>> m_lanes;
    std::vector<std::unique_ptr<shard_pipeline>> m_shards;
    std::vector<bool> m_abandoned; ///< known abandoned (note_health, refresh_health), for good
    std::size_t m_rescue_next = 0;
    std::size_t m_rescued = 0;
    std::size_t m_failed_rescues = 0;
    /// Per shard: the bytes of its chunks that other shards rescued (its stats lack them).
    std::vector<detail::byte_counts> m_rescued_bytes;
    double m_wall_seconds = 0;
    clock::time_point m_started{};
    bool m_degrade_threw = false;
    // Batch.
    bool m_batch_running = false;
    std::vector<std::size_t> m_part_first; ///< each shard's first chunk in the whole input
    std::vector<std::size_t> m_batch_failed;
    // Streaming.
    bool m_session_open = false;
    bool m_closed = false;
    std::size_t m_sessions_ended = 0;
    std::size_t m_acquire_next = 0;
    std::size_t m_submit_seq = 0;
    std::deque<queued> m_fifo;                               ///< submitted, not yet taken
    std::vector<std::vector<std::size_t>> m_local_to_global; ///< per shard: its index -> global
    std::set<std::size_t> m_stream_rescued;
    std::set<std::size_t> m_stream_failed;
    detail::wait_list m_submitted;
};

} // namespace cudawait
