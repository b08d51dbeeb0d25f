// SPDX-License-Identifier: Apache-2.0
#pragma once

// Shared by the GPU tests: a fixture that skips (with the reason) where no device is present,
// and checks that nothing the library created leaked by the end of each test; and one for tests
// of code that stages through the default pinned pool, which also checks that every block the
// test took came back.

#include <cudawait/memory/pinned_pool.hpp>
#include <cudawait/runtime/device.hpp>
#include <cudawait/runtime/event.hpp>
#include <cudawait/runtime/stream.hpp>

#include <string>

#include <cuda_runtime.h>

#include <gtest/gtest.h>

namespace cudawait::testing {

using cudawait::no_device_reason;

/// Events the library owns that are neither cached in a pool nor borrowed: must stay zero.
inline long unaccounted_events() {
    long cached = 0;
    long outstanding = 0;
    for (int d = 0; d < try_device_count(); ++d) {
        cached += static_cast<long>(event_pool::for_device(d).cached());
        outstanding += event_pool::for_device(d).outstanding();
    }
    return event::live_count() - cached - outstanding;
}

class gpu_test : public ::testing::Test {
protected:
    void SetUp() override {
        if (std::string why = no_device_reason(); !why.empty()) {
            GTEST_SKIP() << why;
        }
        m_streams_before = stream::live_count();
        m_events_before = unaccounted_events();
        m_outstanding_before = event_pool::for_device(0).outstanding();
    }
    void TearDown() override {
        if (IsSkipped()) {
            return;
        }
        EXPECT_EQ(stream::live_count(), m_streams_before) << "streams leaked";
        EXPECT_EQ(unaccounted_events(), m_events_before) << "events leaked";
        EXPECT_EQ(event_pool::for_device(0).outstanding(), m_outstanding_before)
            << "pooled events not given back";
    }

private:
    long m_streams_before = 0;
    long m_events_before = 0;
    long m_outstanding_before = 0;
};

/// gpu_test for code that takes staging memory from default_pinned_pool() (copy, pipeline): once
/// the device is idle, nothing the test freed may still be pending and nothing may be in use.
class pool_gpu_test : public gpu_test {
protected:
    void TearDown() override {
        if (!IsSkipped()) {
            // Chunks and buffers freed while the GPU still used them are pending in the default
            // pool, each holding a pooled event; once the device is idle they all come back, and
            // so do their events, before gpu_test counts the events.
            ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
            cudawait::default_pinned_pool().collect();
            auto st = cudawait::default_pinned_pool().stats();
            EXPECT_EQ(st.in_use_bytes, 0u) << "staging memory not given back";
            EXPECT_EQ(st.pending_bytes, 0u) << "blocks pending after the device went idle";
        }
        gpu_test::TearDown();
    }
};

} // namespace cudawait::testing
