// SPDX-License-Identifier: Apache-2.0
// The doorbell protocol's host side (detail::doorbell_gate), on a plain word in place of the
// mapped one: ringing only a blocked owner, the race between a post and the owner blocking, and
// the backstop. The GPU side is tested through the scheduler (scheduler_test).
#include <cudawait/core/detail/doorbell.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

namespace {

using namespace std::chrono_literals;
using cudawait::detail::doorbell_gate;
using clock_type = std::chrono::steady_clock;

std::uint32_t load(std::uint32_t& word) { return std::atomic_ref<std::uint32_t>(word).load(); }

/// What a waker stream does: waits until the word is rung. False when `limit` passed first.
bool wait_for_ring(std::uint32_t& word, std::chrono::nanoseconds limit) {
    const auto until = clock_type::now() + limit;
    while (load(word) == 0) {
        if (clock_type::now() > until) {
            return false;
        }
        std::this_thread::yield();
    }
    return true;
}

TEST(doorbell_gate, rings_only_an_owner_that_is_blocked) {
    std::uint32_t word = 7;
    doorbell_gate gate;
    gate.attach(&word);
    gate.reset();
    EXPECT_EQ(load(word), 0u);
    gate.ring_if_blocked();
    EXPECT_EQ(load(word), 0u) << "rang while nobody was blocked";
    std::atomic<bool> remote{false};
    std::atomic<bool> inside{false};
    std::jthread poster([&] {
        // Bounded: should block() never block, the test fails rather than hangs at the join.
        const auto until = clock_type::now() + 10s;
        while (!gate.blocked() && clock_type::now() < until) {
            std::this_thread::yield();
        }
        inside.store(true);
        gate.ring_if_blocked();
    });
    bool rung = false;
    EXPECT_EQ(gate.block(remote, 30s, [&] { rung = wait_for_ring(word, 10s); }),
              doorbell_gate::result::waited);
    EXPECT_TRUE(rung);
    EXPECT_TRUE(inside.load());
    EXPECT_FALSE(gate.blocked());
    EXPECT_EQ(gate.backstop_rings(), 0u);
}

TEST(doorbell_gate, work_flagged_before_the_block_is_not_waited_for) {
    std::uint32_t word = 0;
    doorbell_gate gate;
    gate.attach(&word);
    gate.reset();
    std::atomic<bool> remote{true};
    bool waited = false;
    EXPECT_EQ(gate.block(remote, 30s, [&] { waited = true; }), doorbell_gate::result::raced);
    EXPECT_FALSE(waited);
    EXPECT_FALSE(gate.blocked());
    EXPECT_EQ(load(word), 0u);
}

// The Dekker pair under stress: a poster queues items and rings if the owner is blocked; the
// owner runs rounds (clear, take what is queued, block unless work is flagged). The poster waits
// for each item to be taken before it queues the next (after a random pause), so every post must
// end a wait by itself: a lost wake-up leaves the owner waiting for a ring that never comes. Each
// wait is bounded, and one that times out fails the test. Every item is taken exactly once.
TEST(doorbell_gate, no_post_is_lost_between_the_check_and_the_block) {
    constexpr int items = 5000;
    std::uint32_t word = 0;
    doorbell_gate gate;
    gate.attach(&word);
    std::mutex mutex;
    std::vector<int> queue;
    std::atomic<bool> remote{false};
    std::atomic<int> taken_count{0};
    std::atomic<bool> gave_up{false};
    std::jthread poster([&] {
        std::mt19937 rng(20261216);
        for (int i = 0; i < items && !gave_up.load(); ++i) {
            for (unsigned spin = rng() % 4000; spin > 0; --spin) {
                std::atomic_signal_fence(std::memory_order_seq_cst);
            }
            {
                std::lock_guard lock(mutex);
                queue.push_back(i);
                remote.store(true);
            }
            gate.ring_if_blocked();
            while (taken_count.load() <= i && !gave_up.load()) {
                std::this_thread::yield();
            }
        }
    });
    std::vector<int> taken;
    int lost = 0;
    int waits = 0;
    while (static_cast<int>(taken.size()) < items && lost == 0) {
        gate.reset();
        {
            std::lock_guard lock(mutex);
            taken.insert(taken.end(), queue.begin(), queue.end());
            queue.clear();
            remote.store(false);
        }
        taken_count.store(static_cast<int>(taken.size()));
        if (static_cast<int>(taken.size()) == items) {
            break;
        }
        if (gate.block(remote, 30s, [&] {
                ++waits;
                lost += wait_for_ring(word, 2s) ? 0 : 1;
            }) == doorbell_gate::result::failed) {
            ADD_FAILURE() << "no backstop thread";
            break; // the poster is released below
        }
    }
    gave_up.store(true);
    poster.join();
    EXPECT_EQ(lost, 0) << "a post was not rung for";
    ASSERT_EQ(static_cast<int>(taken.size()), items);
    for (int i = 0; i < items; ++i) {
        ASSERT_EQ(taken[i], i);
    }
    EXPECT_GT(waits, 0);
    EXPECT_EQ(gate.backstop_rings(), 0u);
}

TEST(doorbell_gate, the_backstop_rings_a_block_that_nothing_else_ends) {
    std::uint32_t word = 0;
    doorbell_gate gate;
    gate.attach(&word);
    std::atomic<bool> remote{false};
    for (int round = 1; round <= 3; ++round) {
        gate.reset();
        bool rung = false;
        const auto t0 = clock_type::now();
        EXPECT_EQ(gate.block(remote, 30ms, [&] { rung = wait_for_ring(word, 10s); }),
                  doorbell_gate::result::waited);
        const auto took = clock_type::now() - t0;
        EXPECT_TRUE(rung) << "round " << round;
        EXPECT_GE(took, 30ms);
        EXPECT_LT(took, 5s);
        EXPECT_EQ(gate.backstop_rings(), static_cast<std::uint64_t>(round));
    }
}

TEST(doorbell_gate, the_backstop_leaves_a_block_that_ended) {
    std::uint32_t word = 0;
    doorbell_gate gate;
    gate.attach(&word);
    std::atomic<bool> remote{false};
    gate.reset();
    EXPECT_EQ(gate.block(remote, 20ms, [] {}), doorbell_gate::result::waited);
    std::this_thread::sleep_for(150ms);
    EXPECT_EQ(load(word), 0u) << "rang after the block ended";
    EXPECT_EQ(gate.backstop_rings(), 0u);
    // A later round still gets its own deadline.
    bool rung = false;
    EXPECT_EQ(gate.block(remote, 20ms, [&] { rung = wait_for_ring(word, 10s); }),
              doorbell_gate::result::waited);
    EXPECT_TRUE(rung);
    EXPECT_EQ(gate.backstop_rings(), 1u);
    gate.stop();
    gate.stop(); // idempotent; the destructor stops it again
}

} // namespace
