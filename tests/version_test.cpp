// SPDX-License-Identifier: Apache-2.0
#include <cudawait/version.hpp>

#include <string>

#include <gtest/gtest.h>

namespace {

TEST(version, macros_and_string_agree) {
    const std::string expected = std::to_string(CUDAWAIT_VERSION_MAJOR) + "." +
                                 std::to_string(CUDAWAIT_VERSION_MINOR) + "." +
                                 std::to_string(CUDAWAIT_VERSION_PATCH);
    EXPECT_EQ(expected, cudawait::version_string);
    EXPECT_EQ(CUDAWAIT_VERSION, CUDAWAIT_VERSION_MAJOR * 10000 + CUDAWAIT_VERSION_MINOR * 100 +
                                    CUDAWAIT_VERSION_PATCH);
}

} // namespace
