// SPDX-License-Identifier: Apache-2.0
// task.hpp's coroutines in a .cu file, compiled by nvcc: the spellings the README teaches must
// compile under nvcc's front end as well as under the host compiler (task_test.cpp).
#include <cudawait/core/scheduler.hpp>
#include <cudawait/core/sync_wait.hpp>
#include <cudawait/core/task.hpp>

#include "this_scheduler_cases.hpp"
#include <gtest/gtest.h>

namespace {

TEST(task_cuda, this_scheduler_binds_to_a_scheduler_reference_under_nvcc) {
    EXPECT_EQ(cudawait::testing::run_this_scheduler_cases(), 0);
}

} // namespace
