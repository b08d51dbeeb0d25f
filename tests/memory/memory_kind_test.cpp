// SPDX-License-Identifier: Apache-2.0
#include <cudawait/memory/device_buffer.hpp>
#include <cudawait/memory/mapped_buffer.hpp>
#include <cudawait/memory/memory_kind.hpp>
#include <cudawait/memory/pinned_buffer.hpp>

#include <span>
#include <vector>

#include <gtest/gtest.h>

using cudawait::memory_kind;
using cudawait::memory_kind_of;

// ---- what a type states ----------------------------------------------------------------------

TEST(memory_kind, the_library_buffers_state_their_kind) {
    static_assert(memory_kind_of<cudawait::pinned_buffer<float>> == memory_kind::pinned);
    static_assert(memory_kind_of<const cudawait::mapped_buffer<int>&> == memory_kind::pinned);
    static_assert(memory_kind_of<cudawait::device_buffer<double>&> == memory_kind::device);
    EXPECT_EQ(memory_kind_of<cudawait::device_buffer<char>>, memory_kind::device);
}

TEST(memory_kind, ranges_that_do_not_know_state_nothing) {
    static_assert(!memory_kind_of<std::vector<float>>.has_value());
    static_assert(!memory_kind_of<std::span<const int>>.has_value());
    EXPECT_FALSE(memory_kind_of<std::vector<int>&>.has_value());
}

struct user_buffer {
    static constexpr memory_kind memory = memory_kind::managed;
};

TEST(memory_kind, a_user_type_can_state_its_kind) {
    static_assert(memory_kind_of<user_buffer> == memory_kind::managed);
    // kind_of asks the type and never the driver for a type that states its kind.
    user_buffer b;
    EXPECT_EQ(cudawait::kind_of(b, nullptr), memory_kind::managed);
}

TEST(memory_kind, names_every_kind) {
    EXPECT_EQ(cudawait::to_string(memory_kind::pageable), "pageable");
    EXPECT_EQ(cudawait::to_string(memory_kind::pinned), "pinned");
    EXPECT_EQ(cudawait::to_string(memory_kind::device), "device");
    EXPECT_EQ(cudawait::to_string(memory_kind::managed), "managed");
}
