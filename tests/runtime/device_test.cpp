// SPDX-License-Identifier: Apache-2.0
#include <cudawait/copy/copy_lane.hpp>
#include <cudawait/memory/managed_buffer.hpp>
#include <cudawait/runtime/device.hpp>
#include <cudawait/runtime/stream.hpp>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <type_traits>

#include <cuda_runtime.h>

#include "gpu_fixture.hpp"
#include "no_device.hpp"
#include <gtest/gtest.h>

namespace {

using cudawait::cuda_error;
using cudawait::device_count;
using cudawait::device_guard;
using cudawait::device_ref;
using cudawait::try_device_count;

// Whatever takes a device takes a plain id too, as with cuda::device_ref.
static_assert(std::is_convertible_v<int, device_ref>);
template <class D>
concept names_a_device_everywhere = requires(D d, cudawait::managed_buffer<int>& m,
                                             cudawait::stream_ref s) {
    cudawait::stream(d);
    cudawait::stream(d, 0);
    cudawait::priority_high(d);
    cudawait::priority_low(d);
    device_guard(d);
    cudawait::copy_lanes::for_device(d);
    cudawait::small_copy_stream(d, cudawait::copy_direction::h2d);
    cudawait::prefetch_async(m, d, s);
    cudawait::prefetch(m, d, s);
};
static_assert(names_a_device_everywhere<device_ref>);
static_assert(names_a_device_everywhere<int>);

bool is_no_device_status(cudaError_t st) {
    return st == cudaErrorNoDevice || st == cudaErrorInsufficientDriver;
}

[[noreturn]] void no_device_child() {
    int failures = 0;
    auto expect = [&](bool ok, const char* what) {
        if (!ok) {
            std::fprintf(stderr, "FAILED: %s\n", what);
            ++failures;
        }
    };
    expect(try_device_count() == 0, "try_device_count() == 0");
    expect(!cudawait::no_device_reason().empty(), "no_device_reason() says why");
    try {
        (void)device_count();
        expect(false, "device_count() throws");
    } catch (const cuda_error& e) {
        expect(is_no_device_status(e.status()), "device_count status is no-device/no-driver");
        expect(!e.sticky(), "no-device error is not sticky");
    }
    try {
        device_ref d(0);
        expect(false, "device_ref(0) throws");
    } catch (const cuda_error& e) {
        expect(is_no_device_status(e.status()), "device_ref status is no-device/no-driver");
    }
    try {
        (void)cudawait::current_device();
        expect(false, "current_device() throws");
    } catch (const cuda_error& e) {
        expect(is_no_device_status(e.status()), "current_device status is no-device/no-driver");
    }
    std::fprintf(stderr, failures == 0 ? "no-device path ok\n" : "no-device path broken\n");
    std::exit(failures == 0 ? 0 : 1);
}

TEST(device, no_device_gives_a_typed_error_not_a_crash) {
    CUDAWAIT_EXPECT_IN_CHILD_WITHOUT_DEVICE(no_device_child(), "no-device path ok");
}

TEST(device, no_device_reason_agrees_with_the_device_count) {
    std::string why = cudawait::no_device_reason();
    EXPECT_EQ(why.empty(), try_device_count() > 0) << why;
}

TEST(device, try_device_count_never_throws) {
    int n = -1;
    EXPECT_NO_THROW(n = try_device_count());
    EXPECT_GE(n, 0);
}

class device_gpu : public cudawait::testing::gpu_test {};

TEST_F(device_gpu, count_matches_runtime) {
    int n = 0;
    ASSERT_EQ(cudaGetDeviceCount(&n), cudaSuccess);
    EXPECT_EQ(device_count(), n);
    EXPECT_EQ(try_device_count(), n);
}

TEST_F(device_gpu, bad_device_ids_are_typed_errors) {
    const int n = device_count();
    for (int bad : {-1, n, n + 7, 1 << 20}) {
        try {
            device_ref d(bad);
            FAIL() << "device_ref(" << bad << ") did not throw";
        } catch (const cuda_error& e) {
            EXPECT_EQ(e.status(), cudaErrorInvalidDevice);
        }
    }
    EXPECT_EQ(device_ref(n - 1).get(), n - 1);
}

TEST_F(device_gpu, guard_switches_and_restores) {
    const int n = device_count();
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
    {
        device_guard g(device_ref(n - 1));
        int cur = -1;
        ASSERT_EQ(cudaGetDevice(&cur), cudaSuccess);
        EXPECT_EQ(cur, n - 1);
        EXPECT_EQ(cudawait::current_device().get(), n - 1);
    }
    int cur = -1;
    ASSERT_EQ(cudaGetDevice(&cur), cudaSuccess);
    EXPECT_EQ(cur, 0);
}

TEST_F(device_gpu, priority_range_is_ordered) {
    auto r = device_ref(0).stream_priorities();
    EXPECT_LE(r.greatest, r.least);
    int least = 0;
    int greatest = 0;
    ASSERT_EQ(cudaDeviceGetStreamPriorityRange(&least, &greatest), cudaSuccess);
    EXPECT_EQ(r.least, least);
    EXPECT_EQ(r.greatest, greatest);
}

TEST_F(device_gpu, a_plain_id_names_a_device_and_compares_without_validation) {
    const int n = device_count();
    device_ref d = 0;
    EXPECT_TRUE(d == 0);
    EXPECT_TRUE(0 == d);
    EXPECT_FALSE(d == n) << "an id that names no device compares unequal, without a throw";
    EXPECT_FALSE(d == -1);
    EXPECT_TRUE(d != n + 7);
    EXPECT_TRUE(d == device_ref(0));
}

TEST_F(device_gpu, the_lanes_and_prefetch_take_a_plain_id) {
    cudawait::stream_ref lane = cudawait::small_copy_stream(0, cudawait::copy_direction::h2d);
    EXPECT_EQ(lane.device(), 0);
    EXPECT_EQ(&cudawait::copy_lanes::for_device(0),
              &cudawait::copy_lanes::for_device(device_ref(0)));
    EXPECT_EQ(lane, cudawait::copy_lanes::for_device(0).get(cudawait::lane::small,
                                                            cudawait::copy_direction::h2d));
    int managed = 0;
    ASSERT_EQ(cudaDeviceGetAttribute(&managed, cudaDevAttrManagedMemory, 0), cudaSuccess);
    if (managed == 0) {
        return;
    }
    cudawait::stream s(0);
    cudawait::managed_buffer<std::uint32_t> m(1024);
    for (std::size_t i = 0; i < m.size(); ++i) {
        m[i] = static_cast<std::uint32_t>(i * 2654435761u);
    }
    cudawait::prefetch_async(m, 0, s);
    s.sync();
    for (std::size_t i = 0; i < m.size(); ++i) {
        ASSERT_EQ(m[i], static_cast<std::uint32_t>(i * 2654435761u)) << i;
    }
}

} // namespace
