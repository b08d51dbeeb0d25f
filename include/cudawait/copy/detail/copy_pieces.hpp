// SPDX-License-Identifier: Apache-2.0
#pragma once

// A copy of several pieces whose host ends are not one range, enqueued by copy_batch as one
// cudaMemcpyBatchAsync (or one cudaMemcpyAsync per piece). See docs/copy.md#inside.

#include <cudawait/runtime/error.hpp>

#include <cstddef>
#include <span>
#include <vector>

#include <cuda_runtime_api.h>

namespace cudawait::detail {

/// One copy of a run: `bytes` from `src` to `dst`. `mergeable`: its host end is the pipeline's
/// own pinned buffer, so that it may join the piece before it (a caller's span never does).
struct copy_piece {
    void* dst = nullptr;
    const void* src = nullptr;
    std::size_t bytes = 0;
    bool mergeable = false;
};

/// Appends a piece to `pieces`, or extends the last one when both are mergeable and the new
/// one continues it on both ends (consecutive chunks of a slot's own buffers: one copy).
/// (`Pieces`: a std::vector<copy_piece>.)
template <class Pieces>
void append_piece(Pieces& pieces, void* dst, const void* src, std::size_t bytes, bool mergeable) {
    if (mergeable && !pieces.empty()) {
        copy_piece& last = pieces.back();
        if (last.mergeable && static_cast<char*>(last.dst) + last.bytes == dst &&
            static_cast<const char*>(last.src) + last.bytes == src) {
            last.bytes += bytes;
            return;
        }
    }
    pieces.push_back(copy_piece{dst, src, bytes, mergeable});
}

/// Enqueues lists of copy_piece's as one batched copy. Its arrays are kept between calls, so
/// that a steady stream of runs allocates nothing. Not thread-safe (one per pipeline).
template <class Unused = void>
class basic_copy_batch {
    template <class T>
    using list = std::vector<dependent_t<Unused, T>>;

public:
    /// Lays `pieces` out as the batch's arrays, one copy per piece; empty pieces are left out.
    void lay_out(std::span<const dependent_t<Unused, copy_piece>> pieces) {
        m_dsts.clear();
        m_srcs.clear();
        m_sizes.clear();
        for (const copy_piece& p : pieces) {
            if (p.bytes == 0) {
                continue;
            }
            m_dsts.push_back(p.dst);
            // The 12.8 signature takes non-const sources; nothing is written through them.
            m_srcs.push_back(const_cast<void*>(p.src));
            m_sizes.push_back(p.bytes);
        }
    }

    /// The copies lay_out() made, in order.
    [[nodiscard]] std::span<void* const> dsts() const noexcept { return m_dsts; }
    [[nodiscard]] std::span<void* const> srcs() const noexcept { return m_srcs; }
    [[nodiscard]] std::span<const std::size_t> sizes() const noexcept { return m_sizes; }

    /// Enqueues `pieces` (see lay_out) on `s` in the direction `kind` between the host and
    /// `device`: one cudaMemcpyAsync when they make one copy, else one cudaMemcpyBatchAsync, in
    /// stream order like any copy (the source is read in stream order).
    /// @throws cuda_error (with per-piece copies, the ones before the failing one stay enqueued)
    void enqueue(std::span<const dependent_t<Unused, copy_piece>> pieces, cudaMemcpyKind kind,
                 int device, cudaStream_t s) {
        lay_out(pieces);
        const std::size_t n = m_sizes.size();
        if (n == 0) {
            return;
        }
        if (n > 1 && !m_batch_refused && enqueue_batch(kind, device, s)) {
            return;
        }
        for (std::size_t i = 0; i < n; ++i) {
            check(cudaMemcpyAsync(m_dsts[i], m_srcs[i], m_sizes[i], kind, s), "cudaMemcpyAsync");
        }
    }

private:
    // False when the runtime or driver lacks the batch (the copies are then made one by one,
    // and from then on); true when it was enqueued.
    bool enqueue_batch([[maybe_unused]] cudaMemcpyKind kind, [[maybe_unused]] int device,
                       [[maybe_unused]] cudaStream_t s) {
#if CUDART_VERSION >= 12080
        const cudaMemLocation host{cudaMemLocationTypeHost, 0};
        const cudaMemLocation dev{cudaMemLocationTypeDevice, device};
        const bool to_device = kind == cudaMemcpyHostToDevice;
        cudaMemcpyAttributes attr{};
        attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream; // as cudaMemcpyAsync: in order
        attr.srcLocHint = to_device ? host : dev;
        attr.dstLocHint = to_device ? dev : host;
        // The pipeline's copies run beside its kernels: leave the SMs to them.
        attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
        std::size_t first = 0; // the attribute applies to every copy
#if CUDART_VERSION >= 13000
        const cudaError_t st = cudaMemcpyBatchAsync(m_dsts.data(), m_srcs.data(), m_sizes.data(),
                                                    m_sizes.size(), &attr, &first, 1, s);
#else
        std::size_t fail_index = 0;
        const cudaError_t st =
            cudaMemcpyBatchAsync(m_dsts.data(), m_srcs.data(), m_sizes.data(), m_sizes.size(),
                                 &attr, &first, 1, &fail_index, s);
#endif
        if (st == cudaErrorNotSupported || st == cudaErrorCallRequiresNewerDriver) {
            (void)cudaGetLastError(); // not sticky: later calls must not see it
            m_batch_refused = true;
            return false;
        }
        check(st, "cudaMemcpyBatchAsync");
        return true;
#else
        m_batch_refused = true;
        return false;
#endif
    }

    list<void*> m_dsts;
    list<void*> m_srcs;
    list<std::size_t> m_sizes;
    bool m_batch_refused = false;
};

using copy_batch = basic_copy_batch<>;

} // namespace cudawait::detail
