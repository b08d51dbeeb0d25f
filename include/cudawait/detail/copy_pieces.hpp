// SPDX-License-Identifier: Apache-2.0
#pragma once

// A bulk copy enqueued as several smaller ones (pipeline_options::copy_piece_bytes): a copy
// engine finishes the copy it is on before it takes the next of another stream's queue, so a
// small copy made on another stream (the small lane, copy_lane.hpp) waits at most for one
// piece, not for a whole chunk. The pieces go on one stream, in order, so that to every other
// stream and event they are one copy.

#include <cudawait/error.hpp>

#include <algorithm>
#include <cstddef>

#include <cuda_runtime_api.h>

namespace cudawait::detail {

/// Enqueues the copy of `bytes` from `src` to `dst` on `s` as pieces of `piece_bytes` (the
/// last one shorter), or as one copy when piece_bytes is 0 or not below `bytes`.
/// @throws cuda_error (the pieces enqueued before the failing one stay enqueued)
inline void enqueue_in_pieces(void* dst, const void* src, std::size_t bytes,
                              std::size_t piece_bytes, cudaMemcpyKind kind, cudaStream_t s) {
    if (piece_bytes == 0 || piece_bytes >= bytes) {
        check(cudaMemcpyAsync(dst, src, bytes, kind, s), "cudaMemcpyAsync");
        return;
    }
    auto* d = static_cast<char*>(dst);
    const auto* p = static_cast<const char*>(src);
    for (std::size_t done = 0; done < bytes; done += piece_bytes) {
        const std::size_t n = std::min(piece_bytes, bytes - done);
        check(cudaMemcpyAsync(d + done, p + done, n, kind, s), "cudaMemcpyAsync");
    }
}

} // namespace cudawait::detail
