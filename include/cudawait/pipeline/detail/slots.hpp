// SPDX-License-Identifier: Apache-2.0
#pragma once

// The pipeline's slots and the enqueue of one flight (a chunk or a group): H2D, the stages and
// D2H on their streams, ordered by the slot's events, or the slot's graph. No waiting on the host
// here: the drivers co_await await_completion. Who waits on what: docs/pipeline.md#inside.

#include <cudawait/copy/detail/bulk_streams.hpp>
#include <cudawait/copy/detail/copy_pieces.hpp>
#include <cudawait/copy/detail/sm_copy.hpp>
#include <cudawait/core/scheduler.hpp>
#include <cudawait/core/task.hpp>
#include <cudawait/core/timeout.hpp>
#include <cudawait/memory/device_buffer.hpp>
#include <cudawait/memory/pinned_buffer.hpp>
#include <cudawait/memory/pinned_pool.hpp>
#include <cudawait/observe/trace.hpp>
#include <cudawait/pipeline/detail/group.hpp>
#include <cudawait/pipeline/detail/monitor.hpp>
#include <cudawait/pipeline/options.hpp>
#include <cudawait/pipeline/stage.hpp>
#include <cudawait/runtime/detail/chrono.hpp>
#include <cudawait/runtime/device.hpp>
#include <cudawait/runtime/error.hpp>
#include <cudawait/runtime/event.hpp>
#include <cudawait/runtime/graph.hpp>
#include <cudawait/runtime/stream.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <new>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>

namespace cudawait::detail {

/// One slot's chunk as an instantiated CUDA graph: H2D memcpy node -> the stages (captured) ->
/// D2H memcpy node. The device ends are the slot's; the host ends are set per chunk (retarget).
class slot_graph {
public:
    /// Not built yet.
    slot_graph() = default;

    /// Builds the graph: `stages(s)` enqueues the chunk's work on the capture stream `s`. The
    /// memcpy nodes start with `src` and `dst`; retarget() sets later chunks' host ends.
    /// @throws cuda_error; what `stages` throws (nothing is kept then)
    template <class Stages>
    void build(void* dev_in, const void* src, std::size_t in_bytes, void* dst, const void* dev_out,
               std::size_t out_bytes, device_ref dev, Stages&& stages) {
        graph g = graph::create();
        cudaGraphNode_t h2d = g.add_memcpy_1d(dev_in, src, in_bytes, cudaMemcpyHostToDevice);
        stream capture_stream(dev, 0);
        graph work = capture(capture_stream, std::forward<Stages>(stages));
        cudaGraphNode_t kernels = g.add_child(work, {h2d});
        cudaGraphNode_t d2h =
            g.add_memcpy_1d(dst, dev_out, out_bytes, cudaMemcpyDeviceToHost, {kernels});
        m_exec = g.instantiate();
        m_graph = std::move(g);
        m_h2d = h2d;
        m_d2h = d2h;
        m_dev_in = dev_in;
        m_dev_out = dev_out;
    }

    [[nodiscard]] explicit operator bool() const noexcept { return static_cast<bool>(m_exec); }

    /// Points the next replays' host ends at `src` (in_bytes to dev_in) and `dst` (out_bytes
    /// from dev_out).
    /// @throws usage_error before build(); cuda_error
    void retarget(const void* src, std::size_t in_bytes, void* dst, std::size_t out_bytes) {
        m_exec.set_memcpy_1d(m_h2d, m_dev_in, src, in_bytes, cudaMemcpyHostToDevice);
        m_exec.set_memcpy_1d(m_d2h, dst, m_dev_out, out_bytes, cudaMemcpyDeviceToHost);
    }

    /// Enqueues one replay on `s`.
    /// @throws usage_error before build(); cuda_error
    void launch(stream_ref s) const { m_exec.launch(s); }

private:
    graph m_graph;
    graph_exec m_exec;
    cudaGraphNode_t m_h2d = nullptr;
    cudaGraphNode_t m_d2h = nullptr;
    void* m_dev_in = nullptr;
    const void* m_dev_out = nullptr;
};

/// A slot: the device buffers of one chunk in flight, its pinned staging buffers (made on first
/// need) and the events that order the slot's reuse on the GPU.
template <class In, class Out>
struct pipeline_slot {
    /// Scratch alignment: what cudaMalloc gives, and what library temp storage expects.
    static constexpr std::size_t scratch_alignment = 256;

    /// The device buffers, each `group` chunks long, are allocated in `alloc`'s order, from
    /// o.memory.device_resource.
    /// @throws cuda_error
    pipeline_slot(const pipeline_options& o, std::size_t stages, std::size_t group,
                  stream_ref alloc, int graph_priority)
        : chunks(group), dev_in(group * o.chunk_elements, alloc, o.memory.device_resource),
          dev_out(group * o.output_elements, alloc, o.memory.device_resource),
          dev_mid(stages > 1 ? device_buffer<Out>(group * o.output_elements, alloc,
                                                  o.memory.device_resource)
                             : device_buffer<Out>()),
          scratch_memory(padded_scratch(o.memory.scratch_bytes, alloc, o.memory.device_resource)),
          h2d_done(device_ref(o.streams.device)), compute_done(device_ref(o.streams.device)),
          d2h_done(device_ref(o.streams.device)),
          graph_stream(device_ref(o.streams.device), graph_priority) {
        if (o.memory.scratch_bytes != 0) {
            // The stream-ordered allocator promises less alignment than cudaMalloc's 256 bytes
            // in writing; the spare bytes make the span's start aligned whatever it returns.
            auto at = reinterpret_cast<std::uintptr_t>(scratch_memory.data());
            std::size_t skip = (scratch_alignment - at % scratch_alignment) % scratch_alignment;
            scratch = std::span<std::byte>(scratch_memory.data() + skip, o.memory.scratch_bytes);
        }
        if (o.streams.stage_streams) {
            for (std::size_t k = 0; k + 1 < stages; ++k) {
                stage_done.emplace_back(device_ref(o.streams.device));
            }
        }
    }
    pipeline_slot(const pipeline_slot&) = delete;
    pipeline_slot& operator=(const pipeline_slot&) = delete;

    /// `bytes` of scratch and room to align its start; none for 0.
    static device_buffer<std::byte> padded_scratch(std::size_t bytes, stream_ref alloc,
                                                   const device_resource& resource) {
        if (bytes == 0) {
            return {};
        }
        return device_buffer<std::byte>(bytes + scratch_alignment - 1, alloc, resource);
    }

    /// @throws std::bad_alloc, cuda_error
    void ensure_host_buffers(const pipeline_options& o, pinned_pool& pool) {
        if (!host_in) {
            host_in = pinned_buffer<In>(chunks * o.chunk_elements, pool);
        }
        if (!host_out) {
            host_out = pinned_buffer<Out>(chunks * o.output_elements, pool);
        }
    }

    std::size_t chunks = 1; // chunks per group: the buffers hold this many chunks
    device_buffer<In> dev_in;
    device_buffer<Out> dev_out;
    device_buffer<Out> dev_mid;              // chained stages: the outputs alternate with dev_out
    device_buffer<std::byte> scratch_memory; // scratch, with room to align its start
    std::span<std::byte> scratch;            // the stages' scratch (aligned) in it
    pinned_buffer<In> host_in;               // streaming only (a batch stages through its rings)
    pinned_buffer<Out> host_out;
    event h2d_done;
    event compute_done;
    event d2h_done;
    std::vector<event> stage_done; // stage_streams: stage k of the slot's chunk finished (k < last)
    stream graph_stream;
    slot_graph graph;
};

/// A chunk in flight: which part of the input, on which slot, and its completion event (back to
/// the pool when the record goes, or moved to pipeline_core::abandoned_events). Move-only.
/// With chunk groups a flight is a group: `chunk` its first chunk, `chunks` how many, the counts
/// and pointers the group's.
template <class In, class Out>
struct pipeline_flight {
    std::size_t chunk = 0;
    std::size_t chunks = 1;
    std::size_t position = 0; // its first chunk's place in the slot (streaming; a batch: 0)
    std::size_t offset = 0;   // input elements
    std::size_t count = 0;
    std::size_t output_count = 0;
    std::size_t slot = 0;
    pooled_event done;
    std::size_t timing_set = 0;
    bool timed = false;
    chunk_error error;           // streaming: the enqueue failed (next() reports it in order)
    const In* host_in = nullptr; // the chunk in the caller's range or the streaming slot
    Out* host_out = nullptr;     // (streaming with views: the run's first chunk's host ends)
    // Streaming: some chunk of the run is copied from or to the caller's own page-locked span,
    // so the host ends are these pieces (one per chunk, the slot's own chunks merged), not
    // host_in / host_out; the device ends stay the slot's, contiguous. Such a run never replays
    // the slot's graph.
    bool views = false;
    std::vector<copy_piece> h2d_pieces;    // views: host -> the slot's dev_in
    std::vector<copy_piece> d2h_pieces;    // views: the slot's dev_out -> host
    Out* staged_out = nullptr;             // batch with pageable output: copy from the slot here
    cudaStream_t compute_stream = nullptr; // plain path: the compute stream it took
    std::chrono::steady_clock::time_point started{}; // streaming: submitted (for its latency)
};

/// A cuda_error as a chunk_error.
inline chunk_error chunk_error_of(const cuda_error& e) {
    return chunk_error{e.status(), e.sticky(), false, nullptr, e.what()};
}

/// True when `e`, from a wait for a chunk's completion, is what the completion reported (the
/// query of the event: api() "cudaEventQuery") or sticky: the chunk's work will not complete.
/// Any other error came from setting the wait up (an event or a relay stream not made, a
/// record, the scheduler's bookkeeping), while the chunk's work may still be running.
[[nodiscard]] inline bool reported_by_completion(const cuda_error& e) noexcept {
    return e.sticky() || std::string_view(e.api()) == "cudaEventQuery";
}

/// Waits for a chunk's completion event `done`, for at most `limit` when it is positive (then
/// timeout_error). A cuda_error it throws is one the completion reported. A wait that cannot be
/// set up is no failure of the chunk, whose copies may still be landing: `done` is then polled,
/// with sleeps on the scheduler, until it completes or `limit` passed.
/// @throws timeout_error; cuda_error (reported_by_completion); what a sleep throws
template <class Unused = void>
task<void> await_completion(event_ref done, std::chrono::nanoseconds limit) {
    using clock = std::chrono::steady_clock;
    const clock::time_point until = clock::now() + limit;
    try {
        if (limit.count() > 0) {
            co_await with_timeout(done, limit);
        } else {
            co_await done;
        }
        co_return;
    } catch (const cuda_error& e) {
        if (reported_by_completion(e)) {
            throw;
        }
    } catch (const std::bad_alloc&) {
        // No memory for the wait's state: not the chunk's failure either.
    }
    std::chrono::microseconds pause(50);
    while (!done.is_done()) {
        if (limit.count() > 0 && clock::now() >= until) {
            throw timeout_error(limit);
        }
        co_await sleep_for(pause);
        pause = std::min(pause * 2, std::chrono::microseconds(2000));
    }
}

/// What both drivers share: the options, stages and fallback, the streams, the slots, the
/// monitor, and the state of degradation and of the session rule.
template <class In, class Out>
struct pipeline_core {
    using stage = pipeline_stage<In, Out>;
    using fallback =
        std::function<void(std::size_t chunk, std::span<const In> in, std::span<Out> out)>;
    using slot = pipeline_slot<In, Out>;
    using flight = pipeline_flight<In, Out>;

    /// Chunks in flight per slot when the host may run ahead (pinned host ranges).
    static constexpr std::size_t runahead_factor = 4;

    /// @throws usage_error for options that validate() refuses, no stages or an empty one, or
    ///         several stages with In != Out; cuda_error
    pipeline_core(pipeline_options o, std::vector<stage> s, fallback f)
        : options(chosen(validated(std::move(o)), s)), stages(checked(std::move(s))),
          on_gpu_failure(std::move(f)),
          group_chunks(group_chunks_for(options.memory.group_bytes.value_or(0),
                                        options.chunk_elements * sizeof(In),
                                        pipeline_options::max_group_chunks)),
          pool(options.memory.pool != nullptr ? options.memory.pool
                                              : &default_pinned_pool<dependent_t<In, void>>()),
          h2d(device_ref(options.streams.device), transfer_priority()),
          d2h(device_ref(options.streams.device), transfer_priority()),
          events(event_pool::for_device(options.streams.device)), compute(make_compute_streams()),
          slots(make_slots()), bulk_registration(options.streams.device, d2h_streams()),
          monitor(options, runahead_factor * options.depth) {
        free_slots.reserve(slots.size()); // each slot once: giving one back never allocates
        for (std::size_t i = 0; i < slots.size(); ++i) {
            free_slots.push_back(i);
        }
        active_depth = options.depth;
        // The slots' device buffers were allocated in the H2D stream's order; every other stream
        // (the graph streams among them) may use them from now on.
        h2d.sync();
        // The small copies the lane makes by the SMs beside this pipeline's chunks must not
        // wait for the kernel's loading (detail/sm_copy.hpp).
        (void)preload_sm_copy(
            device_ref(options.streams.device)); // false: a copy engine makes them
    }
    pipeline_core(const pipeline_core&) = delete;
    pipeline_core& operator=(const pipeline_core&) = delete;
    /// The streams are synchronised before the slots, and the abandoned events, go.
    ~pipeline_core() { synchronize(); }

    /// The streams whose copies write the host: d2h, and in graph mode every slot's graph
    /// stream.
    std::vector<cudaStream_t> d2h_streams() const {
        std::vector<cudaStream_t> v{d2h.get()};
        if (options.graph) {
            for (const auto& sl : slots) {
                v.push_back(sl->graph_stream.get());
            }
        }
        return v;
    }

    /// Waits for every stream the slots' work ran on (before buffers and events go).
    void synchronize() noexcept {
        auto sync = [](const stream& s) {
            if (s) {
                detail::report(cudaStreamSynchronize(s.get()), "cudaStreamSynchronize");
            }
        };
        sync(h2d);
        sync(d2h);
        for (auto& s : compute) {
            sync(s);
        }
        for (auto& sl : slots) {
            sync(sl->graph_stream);
        }
    }

    /// Output elements of a chunk with `inputs` input elements.
    [[nodiscard]] std::size_t output_count(std::size_t inputs) const noexcept {
        return (inputs * options.output_elements + options.chunk_elements - 1) /
               options.chunk_elements;
    }

    /// Gives `f` (its chunk, counts and slot set) a timing set and a completion event.
    /// @throws cuda_error
    void start_flight(flight& f) {
        if (monitor.timing()) {
            f.timing_set = monitor.next_set();
        }
        f.done = events.acquire();
    }

    /// Enqueues one chunk: H2D from `src`, the stages, D2H to `dst`; records f.done after it.
    /// @throws cuda_error; what a stage throws
    void enqueue(flight& f, const In* src, Out* dst) {
        // The D2H stream's work is noted once enqueued, at the scope's end
        // (detail/bulk_streams.hpp).
        const auto noted = bulk_registration.enqueuing();
        slot& sl = *slots[f.slot];
        f.timed = monitor.timing();
        std::vector<event>* t = f.timed ? &monitor.set(f.timing_set) : nullptr;
        if (replays(f)) {
            enqueue_graph(f, sl, src, dst, t);
            return;
        }
        using m = dependent_t<In, pipeline_monitor>;
        // With stage_streams, compute[k] is stage k's stream, and stage 0 starts the chunk there.
        stream_ref cs = options.streams.stage_streams
                            ? stream_ref(compute.front())
                            : stream_ref(compute[compute_next++ % compute.size()]);
        {
            trace_range r("h2d", f.chunk);
            h2d.wait(sl.compute_done.get()); // the previous chunk's stages read dev_in
            if (f.timed) {
                (*t)[m::h2d_start].record(h2d);
            }
            if (f.views) {
                copies.enqueue(f.h2d_pieces, cudaMemcpyHostToDevice, options.streams.device,
                               h2d.get());
            } else {
                check(cudaMemcpyAsync(device_in(f, sl), src, f.count * sizeof(In),
                                      cudaMemcpyHostToDevice, h2d.get()),
                      "cudaMemcpyAsync");
            }
            if (f.timed) {
                (*t)[m::h2d_end].record(h2d);
            }
            sl.h2d_done.record(h2d);
        }
        {
            trace_range r("compute", f.chunk);
            f.compute_stream = cs.get();
            cs.wait(sl.h2d_done.get());
            cs.wait(sl.d2h_done.get()); // the previous chunk's D2H read dev_out
            if (f.timed) {
                (*t)[m::compute_start].record(cs);
            }
            // The last stage's stream: the chunk's stages end there.
            stream_ref last = launch_stages(f, sl, cs, options.streams.stage_streams, true);
            if (f.timed) {
                (*t)[m::compute_end].record(last);
            }
            sl.compute_done.record(last);
        }
        {
            trace_range r("d2h", f.chunk);
            d2h.wait(sl.compute_done.get());
            if (f.timed) {
                (*t)[m::d2h_start].record(d2h);
            }
            if (f.views) {
                copies.enqueue(f.d2h_pieces, cudaMemcpyDeviceToHost, options.streams.device,
                               d2h.get());
            } else {
                check(cudaMemcpyAsync(dst, device_out(f, sl), f.output_count * sizeof(Out),
                                      cudaMemcpyDeviceToHost, d2h.get()),
                      "cudaMemcpyAsync");
            }
            if (f.timed) {
                (*t)[m::d2h_end].record(d2h);
            }
            sl.d2h_done.record(d2h);
            f.done.record(d2h);
        }
    }

    /// f's device input and output: from chunk f.position of its slot's buffers.
    [[nodiscard]] In* device_in(const flight& f, const slot& sl) const {
        return sl.dev_in.data() + f.position * options.chunk_elements;
    }
    [[nodiscard]] Out* device_out(const flight& f, const slot& sl) const {
        return sl.dev_out.data() + f.position * options.output_elements;
    }

    /// True when `f` runs as its slot's graph: graph mode and a full group (a full chunk) from
    /// the slot's first chunk on, all of it in the slot's own pinned buffers (the graph's copies
    /// have one host range each way).
    [[nodiscard]] bool replays(const flight& f) const noexcept {
        return options.graph && !f.views && f.position == 0 && f.chunks == group_chunks &&
               f.count == group_chunks * options.chunk_elements;
    }

    /// f completed on the GPU: its bytes and times go to the monitor.
    /// @throws cuda_error; what on_alert throws
    void chunk_done(const flight& f) {
        monitor.chunk_done(f.count * sizeof(In), f.output_count * sizeof(Out),
                           f.timed ? std::optional<std::size_t>(f.timing_set) : std::nullopt,
                           replays(f));
        if (f.timed && options.monitoring.timeline != nullptr) {
            trace_chunk(f);
        }
    }

    /// f's GPU spans go to the timeline: a track per stream ("compute <i>" with several compute
    /// streams, "graph <slot>" for a slot's graph stream).
    /// @throws cuda_error
    void trace_chunk(const flight& f) {
        const bool graph_replay = replays(f);
        std::string compute_track = "compute";
        if (!graph_replay && compute.size() > 1 && !options.streams.stage_streams) {
            for (std::size_t i = 0; i < compute.size(); ++i) {
                if (compute[i].get() == f.compute_stream) {
                    compute_track += " " + std::to_string(i);
                }
            }
        }
        const std::string graph_track =
            graph_replay ? "graph " + std::to_string(f.slot) : std::string();
        monitor.trace_chunk(f.timing_set, f.chunk, graph_replay, compute_track, graph_track);
    }

    /// Tells on_degrade (default: stderr) what happened to `f` and what was done about it.
    /// @throws what on_degrade throws
    void report_degradation(const flight& f, degrade_level level, degrade_action action,
                            const chunk_error& error) {
        const slot& sl = *slots[f.slot];
        chunk_failure c;
        c.chunk = f.chunk;
        c.offset = f.offset;
        c.chunks = f.chunks;
        c.elements = f.count;
        c.output_elements = f.output_count;
        c.input_bytes = f.count * sizeof(In);
        c.output_bytes = f.output_count * sizeof(Out);
        c.depth = active_depth;
        c.compute_streams = options.streams.compute_streams;
        c.device = options.streams.device;
        c.graph = options.graph;
        if (replays(f)) {
            c.h2d_stream = c.compute_stream = c.d2h_stream = sl.graph_stream.get();
        } else {
            c.h2d_stream = h2d.get();
            c.compute_stream = f.compute_stream;
            c.d2h_stream = d2h.get();
        }
        c.host_in = f.host_in;
        c.host_out = f.host_out;
        c.device_in = device_in(f, sl);
        c.device_out = device_out(f, sl);
        c.level = level;
        c.action = action;
        c.error = error;
        monitor.record_failure(c);
        if (options.recovery.on_degrade) {
            options.recovery.on_degrade(c);
            return;
        }
        std::string_view lv = to_string(c.level);
        std::string_view act = to_string(c.action);
        std::fprintf(stderr,
                     "cudawait pipeline: chunk %zu (elements %zu..%zu, %zu out) %.*s: %.*s; "
                     "depth %u, %u compute stream(s), device %d%s; streams h2d %p compute %p "
                     "d2h %p; host %p -> %p, device %p -> %p: %s\n",
                     c.chunk, c.offset, c.offset + c.elements, c.output_elements,
                     static_cast<int>(lv.size()), lv.data(), static_cast<int>(act.size()),
                     act.data(), c.depth, c.compute_streams, c.device, c.graph ? ", graph" : "",
                     static_cast<void*>(c.h2d_stream), static_cast<void*>(c.compute_stream),
                     static_cast<void*>(c.d2h_stream), c.host_in, c.host_out, c.device_in,
                     c.device_out, c.error.what.c_str());
    }

    pipeline_options options;
    std::vector<stage> stages;
    fallback on_gpu_failure;
    /// Chunks per group (options.memory.group_bytes): each slot holds this many, a flight moves up
    /// to this many; 1 without grouping.
    std::size_t group_chunks = 1;
    pinned_pool* pool = nullptr;
    stream h2d;
    stream d2h;
    event_pool& events; ///< the device's pool, for the flights' completion events
    std::vector<stream> compute;
    std::vector<std::unique_ptr<slot>> slots;
    /// The streams that copy chunks to the host (d2h_streams()), registered so that a
    /// small copy of the device's lane goes by the SMs while they are busy (copy.hpp). Declared
    /// after them: it goes first.
    bulk_stream_registration bulk_registration;
    dependent_t<In, pipeline_monitor> monitor;
    /// The copies of runs with views (flight::views), their arrays kept between runs.
    copy_batch copies;
    /// Events of chunks given up while their work may still complete: out of the pool until
    /// destruction (a late completion must not signal a reused event).
    std::vector<pooled_event> abandoned_events;
    /// Pinned buffers of slots given up while the GPU may still use them: kept until the
    /// streams were synchronised (the destructor).
    std::vector<pinned_buffer<In>> abandoned_inputs;
    std::vector<pinned_buffer<Out>> abandoned_outputs;

    /// Room in the abandoned buffers for every slot's: taken before a slot is marked to
    /// abandon its buffers, so that abandon_host_buffers (on the noexcept path of a result or
    /// input_slot given back) does not allocate.
    /// @throws std::bad_alloc
    void reserve_abandoned() {
        abandoned_inputs.reserve(abandoned_inputs.size() + slots.size());
        abandoned_outputs.reserve(abandoned_outputs.size() + slots.size());
    }
    /// Moves `sl`'s pinned buffers to the abandoned ones; it gets new ones on its next use.
    /// Within the room reserve_abandoned() made.
    void abandon_host_buffers(slot& sl) noexcept {
        if (sl.host_in) {
            abandoned_inputs.push_back(std::move(sl.host_in));
        }
        if (sl.host_out) {
            abandoned_outputs.push_back(std::move(sl.host_out));
        }
    }
    unsigned active_depth = 1; ///< slots in use (lowered by level-1 degradation)
    unsigned clean_chunks = 0; ///< chunks done without a retry since the depth last changed

    /// Level 1: one slot fewer, down to one; the clean chunks are counted anew.
    void lower_depth() noexcept {
        active_depth = std::max(1u, active_depth - 1);
        clean_chunks = 0;
    }

    /// A chunk completed without a retry: recover_after of them in a row, since the depth last
    /// changed, raise the depth by one, up to the configured one (stats().recoveries).
    void note_clean() noexcept {
        if (options.recovery.recover_after == 0 || active_depth >= options.depth) {
            clean_chunks = 0;
            return;
        }
        if (++clean_chunks >= options.recovery.recover_after) {
            ++active_depth;
            ++monitor.counters().recoveries;
            clean_chunks = 0;
        }
    }
    std::size_t compute_next = 0;
    bool gpu_abandoned = false;
    // The session rule (see pipeline.hpp): a batch and a streaming session exclude each other.
    /// Slots not held by a streaming producer or consumer, oldest first (room for all).
    std::vector<std::size_t> free_slots;
    bool batch_running = false;
    bool session_open = false; ///< from acquire() until next() returned the end after close()

private:
    // The options checked (pipeline_options::validate), with their defaults filled in.
    static pipeline_options validated(pipeline_options o) {
        o.validate();
        if (o.output_elements == 0) {
            o.output_elements = o.chunk_elements;
        }
        if (o.memory.queue_capacity == 0) {
            o.memory.queue_capacity = (2 + std::size_t{o.streams.compute_streams}) * 2;
        }
        return o;
    }
    // An unset memory.group_bytes chosen: default_group_bytes where it groups at least two
    // chunks, else 0; graph replay too where it groups and every stage is replayable.
    static pipeline_options chosen(pipeline_options o, const std::vector<stage>& stages) {
        if (o.memory.group_bytes) {
            return o;
        }
        constexpr std::size_t group = pipeline_options::default_group_bytes;
        const bool small = o.chunk_elements <= group / sizeof(In) &&
                           group_chunks_for(group, o.chunk_elements * sizeof(In),
                                            pipeline_options::max_group_chunks) > 1;
        o.memory.group_bytes = small ? group : 0;
        if (small && !stages.empty() &&
            std::all_of(stages.begin(), stages.end(),
                        [](const stage& st) { return st.is_replayable(); })) {
            o.graph = true;
        }
        return o;
    }
    static std::vector<stage> checked(std::vector<stage> stages) {
        if (stages.empty() ||
            std::any_of(stages.begin(), stages.end(), [](const stage& s) { return !s; })) {
            throw usage_error("pipeline: at least one stage, and no empty ones");
        }
        if (stages.size() > 1 && !std::is_same_v<In, Out>) {
            throw usage_error("pipeline: stages are chained (each reads the previous one's "
                              "output), which needs In == Out; with In != Out pass one stage, "
                              "which may launch several kernels");
        }
        return stages;
    }
    int transfer_priority() const {
        return options.streams.transfer_priority.value_or(
            priority_low(device_ref(options.streams.device)));
    }
    // With stage_streams, one per stage: stage k of every chunk runs on compute[k].
    std::vector<stream> make_compute_streams() const {
        device_ref dev(options.streams.device);
        int high = options.streams.compute_priority.value_or(priority_high(dev));
        std::vector<stream> v;
        const std::size_t n =
            options.streams.stage_streams ? stages.size() : options.streams.compute_streams;
        for (std::size_t i = 0; i < n; ++i) {
            v.emplace_back(dev, high);
        }
        return v;
    }
    std::vector<std::unique_ptr<slot>> make_slots() const {
        std::vector<std::unique_ptr<slot>> v;
        v.reserve(options.depth);
        for (unsigned i = 0; i < options.depth; ++i) {
            v.push_back(std::make_unique<slot>(options, stages.size(), group_chunks, h2d,
                                               compute.front().priority()));
        }
        return v;
    }

    // Launches the stages of chunk `f` on its slot, chained: stage 0 reads dev_in, each later one
    // the previous one's output; the destinations alternate between dev_mid and dev_out so that
    // the last stage writes dev_out. All stages run on `first` (a compute stream, the capture
    // stream), or with `own_streams` stage k on compute[k] after the same chunk's stage k-1
    // (s.stage_done). A slot's next chunk reaches its stages only after this one's finished (see
    // the top of this file), so dev_mid and the scratch need no events of their own. `plain`:
    // not capturing, so launch errors are checked and, when a stage throws, s.compute_done is
    // recorded after what did launch (it must finish before the slot is reused). The stages are
    // called with the pipeline's device current (a kernel launch on a stream of another device
    // fails), whatever device the calling thread had; it is restored after them. Returns the
    // last stage's stream.
    stream_ref launch_stages(const flight& f, slot& sl, stream_ref first, bool own_streams,
                             bool plain) {
        device_guard current(device_ref(options.streams.device));
        const std::size_t n = stages.size();
        std::span<In> din(device_in(f, sl), f.count);
        std::span<Out> dout(device_out(f, sl), f.output_count);
        // A group's chunks lie back to back: chunk j at j x chunk_elements in dev_in, at j x
        // output_elements in the outputs (a later stage's input is the previous one's output).
        group_context ctx{.stream = first,
                          .slot = static_cast<unsigned>(f.slot),
                          .stage = 0,
                          .device = options.streams.device,
                          .first_chunk = f.chunk,
                          .chunks = f.chunks,
                          .in_stride = options.chunk_elements,
                          .out_stride = options.output_elements,
                          .scratch = sl.scratch};
        stream_ref tail = first; // follows everything launched so far
        for (std::size_t k = 0; k < n; ++k) {
            ctx.stage = static_cast<unsigned>(k);
            try {
                if (own_streams && k > 0) {
                    ctx.stream = compute[k];
                    ctx.stream.wait(sl.stage_done[k - 1].get());
                    tail = ctx.stream;
                }
                if (k == 0) {
                    stages[0].run_group(din, n == 1 ? dout : stage_output(f, sl, 0), ctx);
                } else if constexpr (std::is_same_v<In, Out>) { // several stages need it
                    ctx.in_stride = options.output_elements;
                    stages[k].run_group(stage_output(f, sl, k - 1), stage_output(f, sl, k), ctx);
                }
                if (plain) {
                    check(cudaGetLastError(), "pipeline stage launch");
                }
            } catch (...) {
                if (plain) {
                    // Whatever the stages did launch must finish before the slot is reused.
                    detail::report(cudaEventRecord(sl.compute_done.get(), tail.get()),
                                   "cudaEventRecord");
                }
                throw;
            }
            if (own_streams && k + 1 < n) {
                sl.stage_done[k].record(ctx.stream);
            }
        }
        return ctx.stream;
    }

    // Where stage k of n writes (when there are several): dev_out for the last stage, and
    // alternately dev_mid and dev_out before it.
    // A flight at position p of its slot uses the outputs from chunk p on.
    std::span<Out> stage_output(const flight& f, slot& sl, std::size_t k) const {
        const std::size_t n = stages.size();
        Out* p = (n - 1 - k) % 2 == 0 ? sl.dev_out.data() : sl.dev_mid.data();
        return std::span<Out>(p + f.position * options.output_elements, f.output_count);
    }

    // The slot's graph is built with the first full chunk's host pointers; later chunks set
    // theirs. The graph is built (captured, instantiated), retargeted and launched with the
    // pipeline's device current, as the stages are called.
    void enqueue_graph(flight& f, slot& sl, const In* src, Out* dst, std::vector<event>* t) {
        using m = dependent_t<In, pipeline_monitor>;
        trace_range r("graph", f.chunk);
        device_guard current(device_ref(options.streams.device));
        if (!sl.graph) {
            sl.graph.build(sl.dev_in.data(), src, f.count * sizeof(In), dst, sl.dev_out.data(),
                           f.output_count * sizeof(Out), device_ref(options.streams.device),
                           [&](stream_ref capture_stream) {
                               // One capture stream for all stages, stage_streams or not.
                               launch_stages(f, sl, capture_stream, false, false);
                           });
        }
        // The addresses of the host ends change per chunk; the device ones are the slot's.
        sl.graph.retarget(src, f.count * sizeof(In), dst, f.output_count * sizeof(Out));
        stream& gs = sl.graph_stream;
        // Plain-path work on this slot (a short chunk) must be done first.
        gs.wait(sl.compute_done.get());
        gs.wait(sl.d2h_done.get());
        if (f.timed) {
            (*t)[m::h2d_start].record(gs);
        }
        sl.graph.launch(gs);
        if (f.timed) {
            (*t)[m::d2h_end].record(gs);
        }
        sl.h2d_done.record(gs);
        sl.compute_done.record(gs);
        sl.d2h_done.record(gs);
        f.done.record(gs);
    }
};

} // namespace cudawait::detail
