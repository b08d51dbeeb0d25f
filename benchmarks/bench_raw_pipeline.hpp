// SPDX-License-Identifier: Apache-2.0
#pragma once

// raw_pipeline: the H2D -> kernel -> D2H pipeline written by hand in raw CUDA. pipeline_bench
// compares cudawait::pipeline with it, and it is the shortest complete answer to "what does the
// pipeline do on the GPU?" for one stage over pinned memory (the library adds several stages,
// pageable staging, CUDA graphs, streaming, stage timing and a host fallback).
//
// Three non-blocking streams, one per stage, with the pipeline's default priorities: h2d and d2h
// at the device's lowest, compute at its highest. A ring of device slots, each an input buffer,
// an output buffer and three events; chunk c of the batch uses slot c mod ring.
//
// For every chunk, in plain words:
//   1. The h2d stream copies the chunk into the slot's input buffer, then records h2d_done.
//   2. The compute stream waits for h2d_done, runs the kernel from the input into the output
//      buffer, then records compute_done.
//   3. The d2h stream waits for compute_done, copies the output buffer to the host, then
//      records d2h_done.
// When the slot held an earlier chunk, that chunk must be done with the buffers first:
//   - before step 1, the h2d stream waits for the earlier chunk's compute_done (its kernel has
//     read the input buffer the copy is about to overwrite);
//   - before step 2, the compute stream also waits for the earlier chunk's d2h_done (its copy
//     has read the output buffer the kernel is about to overwrite).
// cudaStreamWaitEvent waits for the work an event captured when the wait was enqueued, so
// re-recording an event for a later chunk does not disturb an earlier wait. The host enqueues
// every chunk up front and blocks once, at the end: the streams keep each other going.
//
// Below the class, the hand-written baselines pipeline_bench measures the ring and the library
// against (serial, both copy directions at once, one stage alone); they borrow the ring's
// buffers and streams, so every variant moves the same memory.
//
// Raw CUDA calls only, each checked with cudawait::check (failures while tearing down are
// reported, never thrown). Everything lives on the device current at construction.

#include <cudawait/runtime/error.hpp>

#include <algorithm>
#include <cstddef>
#include <initializer_list>
#include <vector>

#include <cuda_runtime.h>

namespace bench {

/// The hand-written three-stream pipeline over float chunks; see the comment atop this file.
class raw_pipeline {
public:
    /// Creates the three streams and `slots` device slots of `chunk_elements` floats each (one
    /// stream-ordered allocation per buffer, on the h2d stream).
    /// @throws cuda_error
    raw_pipeline(std::size_t chunk_elements, unsigned slots) : m_chunk(chunk_elements) {
        try {
            int least = 0;
            int greatest = 0;
            cudawait::check(cudaDeviceGetStreamPriorityRange(&least, &greatest),
                            "cudaDeviceGetStreamPriorityRange");
            create_stream(m_h2d, least);
            create_stream(m_compute, greatest);
            create_stream(m_d2h, least);
            m_slots.resize(slots);
            for (slot& s : m_slots) {
                allocate(s.in);
                allocate(s.out);
                create_event(s.h2d_done);
                create_event(s.compute_done);
                create_event(s.d2h_done);
            }
            // The allocations are ordered on h2d; after this they are usable from every stream.
            cudawait::check(cudaStreamSynchronize(m_h2d), "cudaStreamSynchronize");
        } catch (...) {
            release();
            throw;
        }
    }
    raw_pipeline(const raw_pipeline&) = delete;
    raw_pipeline& operator=(const raw_pipeline&) = delete;
    ~raw_pipeline() { release(); }

    /// Runs `kernel(in_chunk, out_chunk, elements, stream)` over in[0, n) into out[0, n), in
    /// chunks of chunk_elements() on a ring of the first `ring` slots, and returns when every
    /// chunk is back on the host. `in` and `out` should be pinned: pageable memory would make
    /// each copy synchronous.
    /// @throws cuda_error
    template <class Kernel>
    void run(const float* in, float* out, std::size_t n, unsigned ring, Kernel&& kernel) {
        ring = std::clamp<unsigned>(ring, 1, slots());
        std::size_t c = 0;
        for (std::size_t off = 0; off < n; off += m_chunk, ++c) {
            enqueue_chunk(m_slots[c % ring], c >= ring, in + off, out + off,
                          std::min(m_chunk, n - off), kernel);
        }
        // The last D2H waits, through the events, for every operation before it.
        sync(m_d2h);
        sync(m_h2d);
        sync(m_compute);
    }

    /// Waits for all three streams.
    /// @throws cuda_error
    void sync_all() const {
        sync(m_h2d);
        sync(m_compute);
        sync(m_d2h);
    }

    [[nodiscard]] std::size_t chunk_elements() const noexcept { return m_chunk; }
    [[nodiscard]] unsigned slots() const noexcept { return static_cast<unsigned>(m_slots.size()); }
    [[nodiscard]] cudaStream_t h2d_stream() const noexcept { return m_h2d; }
    [[nodiscard]] cudaStream_t compute_stream() const noexcept { return m_compute; }
    [[nodiscard]] cudaStream_t d2h_stream() const noexcept { return m_d2h; }
    /// The input and output buffers of slot `i` (chunk_elements() floats each).
    [[nodiscard]] float* input(unsigned i) const noexcept { return m_slots[i].in; }
    [[nodiscard]] float* output(unsigned i) const noexcept { return m_slots[i].out; }

private:
    struct slot {
        float* in = nullptr;
        float* out = nullptr;
        cudaEvent_t h2d_done = nullptr;
        cudaEvent_t compute_done = nullptr;
        cudaEvent_t d2h_done = nullptr;
    };

    /// Steps 1 to 3 of the comment atop this file for one chunk; `reuse`: the slot held one.
    template <class Kernel>
    void enqueue_chunk(slot& s, bool reuse, const float* src, float* dst, std::size_t len,
                       Kernel& kernel) {
        if (reuse) {
            wait(m_h2d, s.compute_done);
        }
        cudawait::check(
            cudaMemcpyAsync(s.in, src, len * sizeof(float), cudaMemcpyHostToDevice, m_h2d),
            "cudaMemcpyAsync");
        record(s.h2d_done, m_h2d);

        wait(m_compute, s.h2d_done);
        if (reuse) {
            wait(m_compute, s.d2h_done);
        }
        kernel(static_cast<const float*>(s.in), s.out, len, m_compute);
        record(s.compute_done, m_compute);

        wait(m_d2h, s.compute_done);
        cudawait::check(
            cudaMemcpyAsync(dst, s.out, len * sizeof(float), cudaMemcpyDeviceToHost, m_d2h),
            "cudaMemcpyAsync");
        record(s.d2h_done, m_d2h);
    }

    static void wait(cudaStream_t s, cudaEvent_t e) {
        cudawait::check(cudaStreamWaitEvent(s, e, 0), "cudaStreamWaitEvent");
    }
    static void record(cudaEvent_t e, cudaStream_t s) {
        cudawait::check(cudaEventRecord(e, s), "cudaEventRecord");
    }
    static void sync(cudaStream_t s) {
        cudawait::check(cudaStreamSynchronize(s), "cudaStreamSynchronize");
    }
    static void create_stream(cudaStream_t& s, int priority) {
        cudawait::check(cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, priority),
                        "cudaStreamCreateWithPriority");
    }
    static void create_event(cudaEvent_t& e) {
        // Only waited on, never timed: timing-disabled events are cheaper to record.
        cudawait::check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming),
                        "cudaEventCreateWithFlags");
    }
    void allocate(float*& p) const {
        void* raw = nullptr;
        cudawait::check(cudaMallocAsync(&raw, m_chunk * sizeof(float), m_h2d), "cudaMallocAsync");
        p = static_cast<float*>(raw);
    }

    /// Undoes whatever the constructor got to. A run that threw may have left work on compute
    /// or d2h that uses the buffers, which are freed in h2d's order only: every stream finishes
    /// first.
    void release() noexcept {
        using cudawait::detail::report;
        for (cudaStream_t s : {m_h2d, m_compute, m_d2h}) {
            if (s != nullptr) {
                report(cudaStreamSynchronize(s), "cudaStreamSynchronize");
            }
        }
        for (slot& s : m_slots) {
            for (float* p : {s.in, s.out}) {
                if (p != nullptr) {
                    report(cudaFreeAsync(p, m_h2d), "cudaFreeAsync");
                }
            }
            for (cudaEvent_t e : {s.h2d_done, s.compute_done, s.d2h_done}) {
                if (e != nullptr) {
                    report(cudaEventDestroy(e), "cudaEventDestroy");
                }
            }
        }
        m_slots.clear();
        for (cudaStream_t* s : {&m_h2d, &m_compute, &m_d2h}) {
            if (*s != nullptr) {
                report(cudaStreamSynchronize(*s), "cudaStreamSynchronize"); // the frees on h2d
                report(cudaStreamDestroy(*s), "cudaStreamDestroy");
                *s = nullptr;
            }
        }
    }

    std::size_t m_chunk;
    cudaStream_t m_h2d = nullptr;
    cudaStream_t m_compute = nullptr;
    cudaStream_t m_d2h = nullptr;
    std::vector<slot> m_slots;
};

// ---- the baselines ------------------------------------------------------------------------------

/// Per chunk, all on `s` (what a naive user writes): H2D, kernel, D2H, cudaStreamSynchronize.
/// Uses slot 0's buffers.
/// @throws cuda_error
template <class Kernel>
void run_serial(const raw_pipeline& p, cudaStream_t s, const float* in, float* out, std::size_t n,
                Kernel&& kernel) {
    float* din = p.input(0);
    float* dout = p.output(0);
    const std::size_t chunk = p.chunk_elements();
    for (std::size_t off = 0; off < n; off += chunk) {
        const std::size_t len = std::min(chunk, n - off);
        cudawait::check(
            cudaMemcpyAsync(din, in + off, len * sizeof(float), cudaMemcpyHostToDevice, s),
            "cudaMemcpyAsync");
        kernel(static_cast<const float*>(din), dout, len, s);
        cudawait::check(
            cudaMemcpyAsync(out + off, dout, len * sizeof(float), cudaMemcpyDeviceToHost, s),
            "cudaMemcpyAsync");
        cudawait::check(cudaStreamSynchronize(s), "cudaStreamSynchronize");
    }
}

/// No kernel: in[0, n) to the device on the h2d stream while the device sends n elements to
/// out[0, n) on the d2h stream, a chunk per copy (slot 0's buffers): what the link carries in
/// both directions at once.
/// @throws cuda_error
inline void copy_both_ways(const raw_pipeline& p, const float* in, float* out, std::size_t n) {
    float* din = p.input(0);
    const float* dout = p.output(0);
    for (std::size_t off = 0; off < n; off += p.chunk_elements()) {
        const std::size_t bytes = std::min(p.chunk_elements(), n - off) * sizeof(float);
        cudawait::check(
            cudaMemcpyAsync(din, in + off, bytes, cudaMemcpyHostToDevice, p.h2d_stream()),
            "cudaMemcpyAsync");
        cudawait::check(
            cudaMemcpyAsync(out + off, dout, bytes, cudaMemcpyDeviceToHost, p.d2h_stream()),
            "cudaMemcpyAsync");
    }
    cudawait::check(cudaStreamSynchronize(p.h2d_stream()), "cudaStreamSynchronize");
    cudawait::check(cudaStreamSynchronize(p.d2h_stream()), "cudaStreamSynchronize");
}

enum class stage { h2d, kernel, d2h };

/// One stage of every chunk, alone, on that stage's stream, the slots rotating as in the ring.
/// @throws cuda_error
template <class Kernel>
void run_one_stage(const raw_pipeline& p, stage st, const float* in, float* out, std::size_t n,
                   Kernel&& kernel) {
    const cudaStream_t s = st == stage::h2d      ? p.h2d_stream()
                           : st == stage::kernel ? p.compute_stream()
                                                 : p.d2h_stream();
    const std::size_t chunk = p.chunk_elements();
    std::size_t c = 0;
    for (std::size_t off = 0; off < n; off += chunk, ++c) {
        const std::size_t len = std::min(chunk, n - off);
        float* din = p.input(static_cast<unsigned>(c % p.slots()));
        float* dout = p.output(static_cast<unsigned>(c % p.slots()));
        if (st == stage::h2d) {
            cudawait::check(
                cudaMemcpyAsync(din, in + off, len * sizeof(float), cudaMemcpyHostToDevice, s),
                "cudaMemcpyAsync");
        } else if (st == stage::kernel) {
            kernel(static_cast<const float*>(din), dout, len, s);
        } else {
            cudawait::check(
                cudaMemcpyAsync(out + off, dout, len * sizeof(float), cudaMemcpyDeviceToHost, s),
                "cudaMemcpyAsync");
        }
    }
    cudawait::check(cudaStreamSynchronize(s), "cudaStreamSynchronize");
}

} // namespace bench
