// SPDX-License-Identifier: Apache-2.0
#pragma once

// Runs a statement in a fresh child process that sees no CUDA device (CUDA_VISIBLE_DEVICES is
// empty there), so the "no device" path is exercised on GPU machines too; on a machine without
// a driver the child simply has none.

#include <cstdlib>
#include <optional>
#include <string>

#include <gtest/gtest.h>

namespace cudawait::testing {

class hidden_devices {
public:
    hidden_devices() {
        if (const char* v = std::getenv("CUDA_VISIBLE_DEVICES")) {
            m_saved = v;
        }
        ::setenv("CUDA_VISIBLE_DEVICES", "", 1);
    }
    hidden_devices(const hidden_devices&) = delete;
    hidden_devices& operator=(const hidden_devices&) = delete;
    ~hidden_devices() {
        if (m_saved) {
            ::setenv("CUDA_VISIBLE_DEVICES", m_saved->c_str(), 1);
        } else {
            ::unsetenv("CUDA_VISIBLE_DEVICES");
        }
    }

private:
    std::optional<std::string> m_saved;
};

} // namespace cudawait::testing

/// EXPECT_EXIT in a re-executed child that sees no device; the child must print `marker` and
/// exit with status 0.
#define CUDAWAIT_EXPECT_IN_CHILD_WITHOUT_DEVICE(statement, marker)                                 \
    do {                                                                                           \
        GTEST_FLAG_SET(death_test_style, "threadsafe");                                            \
        ::cudawait::testing::hidden_devices hide_;                                                 \
        EXPECT_EXIT(statement, ::testing::ExitedWithCode(0), marker);                              \
    } while (false)
