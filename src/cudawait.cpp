// SPDX-License-Identifier: Apache-2.0
// cudawait::compiled: the parts of cudawait compiled once, here, instead of in every translation
// unit that makes a scheduler. Code built with CUDAWAIT_SEPARATE_COMPILATION (which linking
// cudawait::compiled defines) declares them and links these; see
// docs/getting-started.md#compile-time.

#include <cudawait/core/detail/scheduler_impl.hpp>
#include <cudawait/core/scheduler.hpp>

namespace cudawait::detail {

// The event loop (basic_scheduler<void>) and everything it instantiates.
template scheduler_core* new_scheduler_core<void>(const poll_policy& policy);

} // namespace cudawait::detail
