// SPDX-License-Identifier: Apache-2.0
#pragma once

// What multi_pipeline adds around each shard's pipeline, below the facade:
//   rescue_lane<In, Out>    one shard's means to compute another shard's chunk: a stream and
//                           device buffers for one chunk on its device, made on the first
//                           rescue; run() copies in, calls the stages, copies out and waits.

#include <cudawait/memory/device_buffer.hpp>
#include <cudawait/observe/trace.hpp>
#include <cudawait/pipeline/options.hpp>
#include <cudawait/pipeline/stage.hpp>
#include <cudawait/runtime/device.hpp>
#include <cudawait/runtime/error.hpp>
#include <cudawait/runtime/stream.hpp>

#include <cstddef>
#include <cstdint>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>

namespace cudawait::detail {

/// A stream and one chunk's device buffers on a device, to run other shards' chunks through
/// the stages synchronously. Buffers as a pipeline slot's: input, output, a middle buffer for
/// chained stages and the scratch (same size and alignment).
template <class In, class Out>
class rescue_lane {
public:
    static constexpr std::size_t scratch_alignment = 256;

    /// `o`: the validated options of the rescuing shard (chunk and output sizes, scratch).
    /// @throws cuda_error
    rescue_lane(const pipeline_options& o, std::size_t stages, device_ref dev)
        : m_device(dev), m_stream(dev, priority_high(dev)), m_in(o.chunk_elements, m_stream),
          m_out(o.output_elements, m_stream),
          m_mid(stages > 1 ? device_buffer<Out>(o.output_elements, m_stream)
                           : device_buffer<Out>()),
          m_scratch_memory(o.memory.scratch_bytes != 0
                               ? device_buffer<std::byte>(
                                     o.memory.scratch_bytes + scratch_alignment - 1, m_stream)
                               : device_buffer<std::byte>()) {
        if (o.memory.scratch_bytes != 0) {
            auto at = reinterpret_cast<std::uintptr_t>(m_scratch_memory.data());
            std::size_t skip = (scratch_alignment - at % scratch_alignment) % scratch_alignment;
            m_scratch =
                std::span<std::byte>(m_scratch_memory.data() + skip, o.memory.scratch_bytes);
        }
        m_stream.sync(); // the allocations are complete before any use
    }
    rescue_lane(const rescue_lane&) = delete;
    rescue_lane& operator=(const rescue_lane&) = delete;
    ~rescue_lane() {
        // What a failed rescue left on the stream finishes before the buffers go.
        if (m_stream) {
            detail::report(cudaStreamSynchronize(m_stream.get()), "cudaStreamSynchronize");
        }
    }

    /// The lane's device.
    [[nodiscard]] device_ref device() const noexcept { return m_device; }
    /// The lane's stream (the stages' stage_context::stream in a rescue).
    [[nodiscard]] stream_ref get_stream() const noexcept { return m_stream; }

    /// Runs chunk `chunk` (`in` on the host, `out.size()` outputs) through `stages`, chained as
    /// in a pipeline slot, on this lane's device, and waits for it. The stages see slot 0, the
    /// lane's device and stream, and the lane's scratch. Nothing of the chunk is left on the
    /// GPU when this returns or throws (the stream was synchronised).
    /// @throws cuda_error (a launch error, or the chunk's error seen when waiting: the output
    ///         is not written unless the copy back itself failed); what a stage throws
    void run(const std::vector<pipeline_stage<In, Out>>& stages, std::size_t chunk,
             std::span<const In> in, std::span<Out> out) {
        trace_range r("rescue", chunk);
        device_guard guard(m_device);
        try {
            enqueue(stages, chunk, in, out);
        } catch (...) {
            // Whatever did launch finishes before the lane is used again or the caller's
            // fallback writes the output (a sticky error shows here again, on stderr).
            detail::report(cudaStreamSynchronize(m_stream.get()), "cudaStreamSynchronize");
            throw;
        }
        check(cudaStreamSynchronize(m_stream.get()), "cudaStreamSynchronize");
    }

private:
    void enqueue(const std::vector<pipeline_stage<In, Out>>& stages, std::size_t chunk,
                 std::span<const In> in, std::span<Out> out) {
        const std::size_t n = stages.size();
        check(cudaMemcpyAsync(m_in.data(), in.data(), in.size_bytes(), cudaMemcpyHostToDevice,
                              m_stream.get()),
              "cudaMemcpyAsync");
        std::span<In> din(m_in.data(), in.size());
        stage_context ctx{.stream = m_stream,
                          .slot = 0,
                          .stage = 0,
                          .device = m_device.get(),
                          .chunk = chunk,
                          .scratch = m_scratch};
        for (std::size_t k = 0; k < n; ++k) {
            ctx.stage = static_cast<unsigned>(k);
            if (k == 0) {
                stages[0](din, stage_output(n, 0, out.size()), ctx);
            } else if constexpr (std::is_same_v<In, Out>) { // several stages need it
                stages[k](stage_output(n, k - 1, out.size()), stage_output(n, k, out.size()), ctx);
            }
            check(cudaGetLastError(), "pipeline stage launch");
        }
        check(cudaMemcpyAsync(out.data(), m_out.data(), out.size_bytes(), cudaMemcpyDeviceToHost,
                              m_stream.get()),
              "cudaMemcpyAsync");
    }

    // As a pipeline slot: the last of n stages writes the output buffer, the ones before it
    // alternate between the middle buffer and the output buffer.
    std::span<Out> stage_output(std::size_t n, std::size_t k, std::size_t count) const {
        Out* p = (n - 1 - k) % 2 == 0 ? m_out.data() : m_mid.data();
        return std::span<Out>(p, count);
    }

    device_ref m_device;
    stream m_stream; // first: the buffers are freed on it, before it goes
    device_buffer<In> m_in;
    device_buffer<Out> m_out;
    device_buffer<Out> m_mid;
    device_buffer<std::byte> m_scratch_memory;
    std::span<std::byte> m_scratch;
};

} // namespace cudawait::detail
