// SPDX-License-Identifier: Apache-2.0
#pragma once

// Chunk groups (pipeline_options::memory_options::group_bytes): how many chunks move as one unit,
// and which elements a group covers (its chunks lie back to back in the host ranges and in the
// slot's buffers alike, so a group is one copy each way). Pure arithmetic, tested without a device.

#include <algorithm>
#include <cstddef>

namespace cudawait::detail {

/// Chunks per group for groups of `group_bytes` and chunks of `chunk_bytes`, at most
/// `max_chunks`: 1 when grouping is off (0), or when a chunk alone reaches group_bytes.
[[nodiscard]] constexpr std::size_t group_chunks_for(std::size_t group_bytes,
                                                     std::size_t chunk_bytes,
                                                     std::size_t max_chunks) noexcept {
    if (group_bytes == 0 || chunk_bytes == 0 || chunk_bytes >= group_bytes) {
        return 1;
    }
    return std::clamp<std::size_t>(group_bytes / chunk_bytes, 1,
                                   std::max<std::size_t>(1, max_chunks));
}

/// The chunks and elements of one group.
struct chunk_group {
    std::size_t first = 0;      ///< first chunk
    std::size_t chunks = 0;     ///< chunks in the group
    std::size_t in_offset = 0;  ///< first input element
    std::size_t in_count = 0;   ///< input elements
    std::size_t out_offset = 0; ///< first output element
    std::size_t out_count = 0;  ///< output elements
    std::size_t last_in = 0;    ///< input elements of the group's last chunk

    /// A full group: `group_chunks` full chunks.
    [[nodiscard]] constexpr bool full(std::size_t group_chunks,
                                      std::size_t chunk_elements) const noexcept {
        return chunks == group_chunks && last_in == chunk_elements;
    }
};

/// Output elements of a chunk of `inputs` input elements: ceil(inputs x output_elements /
/// chunk_elements) (the pipeline's rule).
[[nodiscard]] constexpr std::size_t chunk_outputs(std::size_t inputs, std::size_t chunk_elements,
                                                  std::size_t output_elements) noexcept {
    return (inputs * output_elements + chunk_elements - 1) / chunk_elements;
}

/// The group that starts at chunk `first` of a batch of `inputs` input elements (first is below
/// the batch's chunk count): up to `group_chunks` chunks, fewer at the end of the batch.
[[nodiscard]] constexpr chunk_group plan_group(std::size_t first, std::size_t group_chunks,
                                               std::size_t inputs, std::size_t chunk_elements,
                                               std::size_t output_elements) noexcept {
    chunk_group g;
    const std::size_t total = (inputs + chunk_elements - 1) / chunk_elements;
    g.first = first;
    g.chunks = std::min(group_chunks, total - first);
    g.in_offset = first * chunk_elements;
    g.in_count = std::min(g.chunks * chunk_elements, inputs - g.in_offset);
    g.last_in = g.in_count - (g.chunks - 1) * chunk_elements;
    g.out_offset = first * output_elements;
    g.out_count = (g.chunks - 1) * output_elements +
                  chunk_outputs(g.last_in, chunk_elements, output_elements);
    return g;
}

} // namespace cudawait::detail
