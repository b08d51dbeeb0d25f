// SPDX-License-Identifier: Apache-2.0
#pragma once

// Synopsis
//   memory_kind classify(const void* p);       pageable, pinned, device or managed (driver query)
//   memory_kind_of<R>                          the kind a range type states, if it states one
//
// A type states where its memory lives with `static constexpr memory_kind memory = ...;`
// (pinned_buffer, mapped_buffer, device_buffer and managed_buffer do); copy and the pipeline ask
// the type first and the driver only for other ranges. Managed memory (cudaMallocManaged) is
// `managed` whether its pages are resident on the host or on a device at the time.

#include <cudawait/runtime/error.hpp>

#include <optional>
#include <string_view>
#include <type_traits>

#include <cuda_runtime_api.h>

namespace cudawait {

/// Where a pointer's memory lives, as cudaPointerGetAttributes sees it.
enum class memory_kind {
    pageable, ///< ordinary host memory, not registered with CUDA
    pinned,   ///< page-locked host memory (cudaHostAlloc, cudaHostRegister, the pinned pool)
    device,   ///< device memory
    managed,  ///< unified (managed) memory
};

[[nodiscard]] constexpr std::string_view to_string(memory_kind k) noexcept {
    switch (k) {
    case memory_kind::pageable:
        return "pageable";
    case memory_kind::pinned:
        return "pinned";
    case memory_kind::device:
        return "device";
    case memory_kind::managed:
        return "managed";
    }
    return "unknown";
}

/// @throws cuda_error (no driver, no device)
[[nodiscard]] inline memory_kind classify(const void* p) {
    cudaPointerAttributes a{};
    check(cudaPointerGetAttributes(&a, p), "cudaPointerGetAttributes");
    switch (a.type) {
    case cudaMemoryTypeHost:
        return memory_kind::pinned;
    case cudaMemoryTypeDevice:
        return memory_kind::device;
    case cudaMemoryTypeManaged:
        return memory_kind::managed;
    default:
        return memory_kind::pageable;
    }
}

/// The memory kind a type states with a `static constexpr memory_kind memory` member, or
/// std::nullopt where the type does not know (a std::vector, a std::span).
template <class R>
inline constexpr std::optional<memory_kind> memory_kind_of = [] {
    using plain = std::remove_cvref_t<R>;
    if constexpr (requires { plain::memory; }) {
        return std::optional<memory_kind>(plain::memory);
    } else {
        return std::optional<memory_kind>();
    }
}();

/// Where a range's memory lives: from its type where it states it, else from the driver.
/// @throws cuda_error from classify
template <class R>
[[nodiscard]] memory_kind kind_of(const R&, const void* p) {
    if constexpr (memory_kind_of<R>.has_value()) {
        return *memory_kind_of<R>;
    } else {
        return classify(p);
    }
}

} // namespace cudawait
