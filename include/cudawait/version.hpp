// SPDX-License-Identifier: Apache-2.0
#pragma once

// Synopsis
//   CUDAWAIT_VERSION_MAJOR / _MINOR / _PATCH, CUDAWAIT_VERSION (major * 10000 + minor * 100 +
//   patch) cudawait::version_string

#define CUDAWAIT_VERSION_MAJOR 0
#define CUDAWAIT_VERSION_MINOR 1
#define CUDAWAIT_VERSION_PATCH 0
#define CUDAWAIT_VERSION                                                                           \
    (CUDAWAIT_VERSION_MAJOR * 10000 + CUDAWAIT_VERSION_MINOR * 100 + CUDAWAIT_VERSION_PATCH)

namespace cudawait {
/// The library's version as "major.minor.patch".
inline constexpr const char* version_string = "0.1.0";
} // namespace cudawait
