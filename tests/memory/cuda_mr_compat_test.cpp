// SPDX-License-Identifier: Apache-2.0
// Built against a newer CCCL than the toolkit's (3.1 or later: the pip package nvidia-cuda-cccl,
// CUDAWAIT_NEWER_CCCL_DIR): the renamed cuda::mr spellings. The pool is a synchronous and a
// stream-ordered resource; a copyable stream-ordered device resource converts to
// device_resource_ref and device_resource; device_buffer and pipeline_options take it.

#include <cudawait/memory/device_buffer.hpp>
#include <cudawait/memory/pinned_pool.hpp>
#include <cudawait/pipeline/options.hpp>

#include <concepts>
#include <type_traits>

#include "counting_device_resource.hpp"
#include <gtest/gtest.h>

static_assert(CCCL_VERSION >= 3001000, "this test is for CCCL 3.1 and later");
static_assert(CUDAWAIT_HAS_CUDA_MR == 1);

namespace {

using cudawait::pinned_pool;
namespace mr = cuda::mr;

static_assert(
    mr::synchronous_resource_with<pinned_pool, mr::host_accessible, mr::device_accessible>);
static_assert(mr::resource_with<pinned_pool, mr::host_accessible, mr::device_accessible>);
// CCCL 3.1's references take only copyable resources; the pool is not one.
static_assert(!cudawait::is_device_resource_v<pinned_pool>);
// Its view is: references and owning any_resources of both kinds are made from it.
using cudawait::pinned_pool_resource;
static_assert(std::copyable<pinned_pool_resource>);
static_assert(mr::synchronous_resource_with<pinned_pool_resource, mr::host_accessible,
                                            mr::device_accessible>);
static_assert(mr::resource_with<pinned_pool_resource, mr::host_accessible, mr::device_accessible>);
static_assert(std::is_constructible_v<mr::resource_ref<mr::host_accessible, mr::device_accessible>,
                                      pinned_pool_resource&>);
static_assert(std::is_constructible_v<
              mr::synchronous_resource_ref<mr::host_accessible, mr::device_accessible>,
              pinned_pool_resource&>);
static_assert(std::is_constructible_v<mr::any_resource<mr::host_accessible, mr::device_accessible>,
                                      pinned_pool_resource>);

using counting = cudawait::testing::counting_device_resource;
static_assert(mr::resource_with<counting, mr::device_accessible>);
static_assert(
    std::is_same_v<cudawait::device_resource_ref, mr::resource_ref<mr::device_accessible>>);
static_assert(std::is_convertible_v<counting&, cudawait::device_resource_ref>);
static_assert(std::is_convertible_v<counting&, cudawait::device_resource>);
static_assert(std::is_convertible_v<cudawait::device_resource_ref, cudawait::device_resource>);
static_assert(std::is_constructible_v<cudawait::device_buffer<float>, std::size_t,
                                      cudawait::stream_ref, cudawait::device_resource_ref>);

TEST(cuda_mr_compat, a_newer_cccl_resource_becomes_a_device_resource) {
    cudawait::testing::device_resource_counts counts;
    counting c(counts);
    cudawait::device_resource_ref ref = c;
    cudawait::device_resource r = ref;
    cudawait::device_resource r2 = c;
    EXPECT_FALSE(r.is_default());
    EXPECT_TRUE(r == r2);
    cudawait::pipeline_options o;
    o.memory.group_bytes = 0; // one chunk per flight
    o.memory.device_resource = ref;
    EXPECT_FALSE(o.memory.device_resource.is_default());
    o.memory.device_resource = nullptr;
    EXPECT_TRUE(o.memory.device_resource.is_default());
    EXPECT_EQ(counts.allocations.load(), 0);
}

} // namespace
