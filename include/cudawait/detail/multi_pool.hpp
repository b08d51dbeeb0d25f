// SPDX-License-Identifier: Apache-2.0
#pragma once

// The per-device staging hook of multi_pipeline: where the pinned staging and streaming
// buffers of a shard on device `dev` come from when multi_pipeline_options::per_shard.pool is
// not set. One place, so that the memory can later be placed near the device (on its NUMA
// node) without touching the pipeline.

#include <cudawait/pinned_pool.hpp>

namespace cudawait::detail {

/// The pool a shard on device `dev` stages through: default_pinned_pool() for every device
/// for now (pinned memory is usable by every device of the process).
/// @throws usage_error in a child process after fork() (see default_pinned_pool)
[[nodiscard]] inline pinned_pool& staging_pool_for_device(int dev) {
    (void)dev;
    return default_pinned_pool();
}

} // namespace cudawait::detail
