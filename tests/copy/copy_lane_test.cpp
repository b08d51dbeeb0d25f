// SPDX-License-Identifier: Apache-2.0
// copy_lane.hpp: the per-device transfer streams and small copies made by the SMs
// (copy_options::sm_copy_bytes, detail/sm_copy.hpp). Copies through the lanes, element by
// element, are in copy_test.cpp.
#include <cudawait/copy/copy.hpp>
#include <cudawait/copy/copy_lane.hpp>
#include <cudawait/copy/detail/bulk_streams.hpp>
#include <cudawait/copy/detail/sm_copy.hpp>
#include <cudawait/core/scheduler.hpp>
#include <cudawait/core/sync_wait.hpp>
#include <cudawait/core/task.hpp>
#include <cudawait/core/when_all.hpp>
#include <cudawait/memory/device_buffer.hpp>
#include <cudawait/memory/pinned_buffer.hpp>
#include <cudawait/pipeline/pipeline.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <random>
#include <set>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include <cuda_runtime.h>

#include "gpu_fixture.hpp"
#include "mapped_words.hpp"
#include "no_device.hpp"
#include "random_words.hpp"
#include "test_kernels.hpp"
#include <gtest/gtest.h>

namespace {

using namespace cudawait::literals;
using cudawait::copy_direction;
using cudawait::copy_lanes;
using cudawait::device_ref;
using cudawait::lane;
using u32 = std::uint32_t;

using cudawait::testing::random_bytes;
using cudawait::testing::random_words;

// ---- without a device ------------------------------------------------------------------------

TEST(copy_lane, names_and_the_default_threshold) {
    EXPECT_EQ(cudawait::to_string(lane::small), "small");
    EXPECT_EQ(cudawait::to_string(lane::bulk), "bulk");
    EXPECT_EQ(cudawait::to_string(copy_direction::h2d), "h2d");
    EXPECT_EQ(cudawait::to_string(copy_direction::d2h), "d2h");
    EXPECT_EQ(cudawait::copy_options{}.small_bytes, 64_KiB);
    EXPECT_EQ(cudawait::copy_options{}.busy_sm_copy_bytes, 64_KiB);
}

TEST(copy_lane, without_a_device_the_lanes_are_a_cuda_error) {
    auto child = [] {
        try {
            (void)copy_lanes::for_device(device_ref(0));
            std::fprintf(stderr, "no exception\n");
            std::exit(1);
        } catch (const cudawait::cuda_error& e) {
            std::fprintf(stderr, "lanes failed cleanly: %s\n", e.what());
        }
        std::vector<u32> a(10, 1);
        std::vector<u32> b(10, 2);
        try {
            (void)cudawait::copy(a, b, lane::small);
            std::fprintf(stderr, "no exception\n");
            std::exit(1);
        } catch (const cudawait::cuda_error& e) {
            std::fprintf(stderr, "lane copy failed cleanly: %s\n", e.what());
            std::exit(a == std::vector<u32>(10, 1) ? 0 : 1);
        }
    };
    CUDAWAIT_EXPECT_IN_CHILD_WITHOUT_DEVICE(child(), "lane copy failed cleanly");
}

// ---- with a GPU -------------------------------------------------------------------------------

class copy_lane_gpu : public cudawait::testing::pool_gpu_test {};

unsigned stream_flags(cudawait::stream_ref s) {
    unsigned flags = 0;
    cudawait::check(cudaStreamGetFlags(s.get(), &flags), "cudaStreamGetFlags");
    return flags;
}

// The fixture also checks that stream::live_count() did not change: the lanes' streams are the
// library's, for the process, and not counted among the streams users own.
TEST_F(copy_lane_gpu, lanes_are_made_once_per_device_non_blocking_and_small_ones_high) {
    for (int d = 0; d < cudawait::device_count(); ++d) {
        SCOPED_TRACE(d);
        const device_ref dev(d);
        copy_lanes& lanes = copy_lanes::for_device(dev);
        EXPECT_EQ(&copy_lanes::for_device(dev), &lanes) << "made once";
        EXPECT_EQ(lanes.device(), d);
        std::set<cudaStream_t> seen;
        for (lane l : {lane::small, lane::bulk}) {
            for (copy_direction dir : {copy_direction::h2d, copy_direction::d2h}) {
                const cudawait::stream_ref s = lanes.get(l, dir);
                ASSERT_NE(s.get(), nullptr);
                seen.insert(s.get());
                EXPECT_EQ(lanes.get(l, dir), s) << "the same stream every time";
                EXPECT_EQ(s.device(), d);
                EXPECT_NE(stream_flags(s) & cudaStreamNonBlocking, 0u)
                    << "does not wait for the legacy default stream";
                EXPECT_EQ(s.priority(), l == lane::small ? cudawait::priority_high(dev)
                                                         : cudawait::priority_low(dev));
            }
        }
        EXPECT_EQ(seen.size(), 4u) << "four queues";
        EXPECT_EQ(cudawait::small_copy_stream(dev, copy_direction::h2d),
                  lanes.get(lane::small, copy_direction::h2d));
        EXPECT_EQ(cudawait::small_copy_stream(dev, copy_direction::d2h),
                  lanes.get(lane::small, copy_direction::d2h));
    }
}

TEST_F(copy_lane_gpu, threads_asking_at_once_get_the_one_set) {
    const device_ref dev(0);
    std::vector<copy_lanes*> got(8, nullptr);
    std::vector<std::thread> threads;
    for (std::size_t i = 0; i < got.size(); ++i) {
        threads.emplace_back([&got, i, dev] { got[i] = &copy_lanes::for_device(dev); });
    }
    for (auto& t : threads) {
        t.join();
    }
    for (copy_lanes* p : got) {
        EXPECT_EQ(p, &copy_lanes::for_device(dev));
    }
}

// The first use of a device's lanes loads no kernel and waits for none of the device's work. A
// kernel spins until a flag in device memory is set; the process's first lane copy sets it (on
// the small lane). Loading a kernel on the device then would wait for the spinning kernel, which
// waits for the copy. Where there is a second device, a lane copy to it from another thread
// meanwhile does not wait either (its lanes made before). In a child process, where the lanes
// are made once; the kernel gives up after 10 s, so a failure cannot hang.
TEST_F(copy_lane_gpu, the_first_lane_copy_does_not_wait_for_the_device_s_running_work) {
    auto child = [] {
        using clock = std::chrono::steady_clock;
        auto fail = [](const std::string& why) {
            std::fprintf(stderr, "%s\n", why.c_str());
            std::exit(1);
        };
        auto seconds = [](clock::duration d) { return std::chrono::duration<double>(d).count(); };
        try {
            // Everything but the lanes is made before the kernel: page-locked allocations, for
            // one, wait for the device's work.
            constexpr std::size_t n = 1024;
            const bool two = cudawait::device_count() >= 2;
            cudawait::scheduler sched;
            cudawait::stream busy;
            cudawait::device_buffer<u32> flag(1, busy);
            cudawait::testing::mapped_words host(n); // word 0: the flag's value, then B's words
            host.write(0, 0);
            cudawait::sync_wait(sched, cudawait::copy(std::span<u32>(flag.data(), 1),
                                                      std::span<const u32>(host.host, 1), busy));
            host.write(0, 1);
            std::optional<cudawait::stream> on_1;
            cudawait::device_buffer<u32> dev_1;
            cudawait::testing::mapped_words back_1(n);
            if (two) {
                (void)copy_lanes::for_device(device_ref(1)); // made while all is idle
                on_1.emplace(device_ref(1));
                dev_1 = cudawait::device_buffer<u32>(n, *on_1);
                on_1->sync();
            }
            const auto want = random_words(n, 91);
            std::copy(want.begin() + 1, want.end(), host.host + 1);

            const auto t0 = clock::now();
            cudawait::check(
                cudawait::testing::launch_wait_flag(flag.data(), 10'000'000'000ull, busy.get()),
                "launch_wait_flag");
            // B: a lane copy to device 1 and back while A makes device 0's lanes.
            std::thread other;
            double other_took = 0;
            bool other_ok = true;
            if (two) {
                other = std::thread([&] {
                    std::this_thread::sleep_for(std::chrono::milliseconds(100));
                    cudawait::scheduler s1;
                    const auto t = clock::now();
                    cudawait::sync_wait(
                        s1, cudawait::copy(dev_1, std::span<const u32>(host.host, n), lane::small));
                    cudawait::sync_wait(
                        s1, cudawait::copy(std::span<u32>(back_1.host, n), dev_1, lane::small));
                    other_took = seconds(clock::now() - t);
                    other_ok = std::equal(want.begin() + 1, want.end(), back_1.host + 1) &&
                               back_1.read(0) == 1;
                });
            }
            // A: the process's first lane copy, to device 0.
            cudawait::sync_wait(sched,
                                cudawait::copy(std::span<u32>(flag.data(), 1),
                                               std::span<const u32>(host.host, 1), lane::small));
            const double copied = seconds(clock::now() - t0);
            busy.sync();
            const double ended = seconds(clock::now() - t0);
            if (other.joinable()) {
                other.join();
            }
            std::fprintf(stderr, "copied after %.3f s, the kernel ended after %.3f s\n", copied,
                         ended);
            if (copied > 2.0 || ended > 5.0) {
                fail("the first lane copy waited for the device's running kernel");
            }
            if (two && (other_took > 2.0 || !other_ok)) {
                fail("the copy to the other device waited (" + std::to_string(other_took) +
                     " s) or is wrong");
            }
        } catch (const std::exception& e) {
            fail(std::string("threw: ") + e.what());
        }
        std::fprintf(stderr, "the first lane copy did not wait\n");
        std::exit(0);
    };
    GTEST_FLAG_SET(death_test_style, "threadsafe");
    EXPECT_EXIT(child(), ::testing::ExitedWithCode(0), "the first lane copy did not wait");
}

// A lane is ordered with nothing of the caller's: a small copy completes while a user stream is
// still busy with a long kernel, and while the legacy default stream is.
TEST_F(copy_lane_gpu, a_lane_copy_does_not_wait_for_the_callers_streams) {
    cudawait::stream busy;
    const std::size_t n = 1024;
    auto want = random_words(n, 5);
    cudawait::device_buffer<u32> dev(n, busy);
    busy.sync();
    std::vector<u32> back(n, 0xdeadbeef);
    cudawait::scheduler sched;
    // Once before the kernels: the lanes, the staging pool's first slab and the scheduler's
    // events are made then (a page-locked allocation waits for the device's work).
    cudawait::sync_wait(sched, cudawait::copy(dev, want, lane::small));
    cudawait::sync_wait(sched, cudawait::copy(back, dev, lane::small));
    ASSERT_EQ(back, want);
    want = random_words(n, 55);
    std::fill(back.begin(), back.end(), 0xdeadbeef);
    ASSERT_EQ(cudawait::testing::launch_spin(500'000'000, nullptr, 0, busy.get()), cudaSuccess);
    ASSERT_EQ(cudawait::testing::launch_spin(500'000'000, nullptr, 0, cudaStreamLegacy),
              cudaSuccess);
    cudawait::sync_wait(sched, cudawait::copy(dev, want, lane::small));
    cudawait::sync_wait(sched, cudawait::copy(back, dev, lane::small));
    EXPECT_FALSE(busy.is_done()) << "the copies waited for the busy stream";
    EXPECT_EQ(cudaStreamQuery(cudaStreamLegacy), cudaErrorNotReady)
        << "the copies waited for the legacy default stream";
    EXPECT_EQ(back, want);
    busy.sync();
    ASSERT_EQ(cudaStreamSynchronize(cudaStreamLegacy), cudaSuccess);
}

} // namespace

namespace {

// ---- small copies made by the SMs ----------------------------------------------------------

TEST(copy_lane, sm_copies_are_off_by_default) {
    EXPECT_EQ(cudawait::copy_options{}.sm_copy_bytes, 0u);
    EXPECT_NE(std::strstr(cudawait::detail::sm_copy_ptx, cudawait::detail::sm_copy_kernel_name),
              nullptr);
}

// Where the SM copy kernel cannot be loaded (here: PTX of an ISA version no driver has, refused
// as the driver refuses PTX too new for the device or for itself), a pipeline and the lanes are
// made all the same, and every copy, sm_copy_bytes set or not, is made exactly by a copy engine.
// In a child process: the kernel is loaded once per process.
TEST_F(copy_lane_gpu, where_the_kernel_cannot_be_loaded_copy_engines_make_the_copies) {
    auto child = [] {
        static const std::string unloadable = [] {
            std::string t = cudawait::detail::sm_copy_ptx;
            t.replace(t.find(".version 7.0"), 12, ".version 99.9");
            return t;
        }();
        cudawait::detail::g_sm_copy_ptx.store(unloadable.c_str());
        auto fail = [](const std::string& why) {
            std::fprintf(stderr, "%s\n", why.c_str());
            std::exit(1);
        };
        try {
            constexpr u32 salt = 0x5e1f;
            cudawait::pipeline_options o;
            o.memory.group_bytes = 0; // one chunk per flight
            o.chunk_elements = 4096;
            cudawait::pipeline<u32> pipe(
                o, {[](std::span<u32> in, std::span<u32> out, cudawait::stream_ref st) {
                    cudawait::check(cudawait::testing::launch_transform(
                                        in.data(), out.data(), in.size(), salt, 0, st.get()),
                                    "launch_transform");
                }});
            const std::size_t total = 3 * o.chunk_elements + 17;
            const auto in = random_words(total, 81);
            std::vector<u32> want(total);
            for (std::size_t off = 0; off < total; off += o.chunk_elements) {
                const std::size_t k = std::min(o.chunk_elements, total - off);
                cudawait::testing::transform_on_host(in.data() + off, want.data() + off, k, salt);
            }
            std::vector<u32> out(total, 0xdeadbeef);
            cudawait::scheduler sched;
            cudawait::sync_wait(sched, pipe.run(std::span<const u32>(in), std::span<u32>(out)));
            if (out != want) {
                fail("the pipeline's output is wrong");
            }

            // Small copies both ways between device and page-locked memory, asked to go by the
            // SMs.
            cudawait::copy_options by_sms;
            by_sms.sm_copy_bytes = 64_KiB;
            const std::size_t n = 4096 + 3;
            const auto up = random_words(n, 82);
            cudawait::pinned_buffer<u32> pin(n);
            std::copy(up.begin(), up.end(), pin.data());
            cudawait::stream s;
            cudawait::device_buffer<u32> dev(n, s);
            s.sync();
            const unsigned long long made = cudawait::detail::sm_copies_enqueued.load();
            cudawait::sync_wait(sched, cudawait::copy(dev, pin, by_sms));
            std::fill(pin.data(), pin.data() + n, 0xdeadbeef);
            cudawait::sync_wait(sched, cudawait::copy(pin, dev, by_sms));
            if (!std::equal(up.begin(), up.end(), pin.data())) {
                fail("a small copy is wrong");
            }
            if (cudawait::detail::sm_copies_enqueued.load() != made) {
                fail("a copy went by the SMs");
            }
            if (cudawait::detail::preload_sm_copy(device_ref(0))) {
                fail("the kernel is said to be loaded");
            }
        } catch (const std::exception& e) {
            fail(std::string("threw: ") + e.what());
        }
        std::fprintf(stderr, "made by the copy engines\n");
        std::exit(0);
    };
    GTEST_FLAG_SET(death_test_style, "threadsafe");
    EXPECT_EXIT(child(), ::testing::ExitedWithCode(0), "made by the copy engines");
}

// Any other failure still surfaces: after a fault (a sticky error) the preload throws, and SM
// copies are not taken to be off.
TEST_F(copy_lane_gpu, a_sticky_error_fails_the_preload) {
    auto child = [] {
        const device_ref dev(0);
        cudawait::stream s;
        (void)cudawait::testing::launch_fault(s.get());
        (void)cudaStreamSynchronize(s.get());
        try {
            (void)cudawait::detail::preload_sm_copy(dev);
            std::fprintf(stderr, "no exception\n");
        } catch (const cudawait::cuda_error& e) {
            using cudawait::detail::sm_copy_devices;
            std::fprintf(stderr, "the preload failed (%s): %s\n",
                         e.sticky() ? "sticky" : "not sticky", e.what());
            std::exit(sm_copy_devices::get(dev) == sm_copy_devices::unknown ? 0 : 1);
        }
        std::exit(1);
    };
    GTEST_FLAG_SET(death_test_style, "threadsafe");
    EXPECT_EXIT(child(), ::testing::ExitedWithCode(0), "the preload failed \\(sticky\\)");
}

// Every size and alignment the kernel treats differently (16-byte words, 4-byte words, bytes;
// one block and several), both ways between device and pool memory: every byte of the range
// arrives and none around it is touched.
TEST_F(copy_lane_gpu, sm_copies_are_exact_for_any_size_and_alignment) {
    constexpr std::size_t cap = 64_KiB + 64;
    cudawait::stream s;
    cudawait::device_buffer<std::uint8_t> dev(cap + 64, s);
    cudawait::pinned_buffer<std::uint8_t> host(cap + 64);
    cudawait::scheduler sched;
    cudawait::copy_options o;
    o.sm_copy_bytes = 64_KiB + 32;
    std::uint32_t seed = 100;
    for (std::size_t bytes :
         {std::size_t{1}, std::size_t{3}, std::size_t{4}, std::size_t{16}, std::size_t{100},
          std::size_t{4096}, std::size_t{4100}, std::size_t{64_KiB}, std::size_t{64_KiB + 20}}) {
        for (std::size_t offset :
             {std::size_t{0}, std::size_t{1}, std::size_t{4}, std::size_t{16}}) {
            SCOPED_TRACE(::testing::Message() << bytes << " bytes at offset " << offset);
            const auto want = random_bytes(bytes, ++seed);
            // H2D: pool memory into device memory poisoned with 0xcd.
            ASSERT_EQ(cudaMemsetAsync(dev.data(), 0xcd, dev.size(), s.get()), cudaSuccess);
            s.sync();
            std::memset(host.data(), 0x11, host.size());
            std::memcpy(host.data() + offset, want.data(), bytes);
            cudawait::sync_wait(
                sched, cudawait::copy(std::span(dev.data() + offset, bytes),
                                      std::span<const std::uint8_t>(host.data() + offset, bytes),
                                      lane::small, o));
            std::vector<std::uint8_t> seen(dev.size());
            ASSERT_EQ(cudaMemcpy(seen.data(), dev.data(), dev.size(), cudaMemcpyDeviceToHost),
                      cudaSuccess);
            for (std::size_t i = 0; i < seen.size(); ++i) {
                const bool inside = i >= offset && i < offset + bytes;
                ASSERT_EQ(seen[i], inside ? want[i - offset] : 0xcd) << "device byte " << i;
            }
            // D2H: the device bytes back into pool memory poisoned with 0xab, through the
            // default lane choice (copy(dst, src, options): small for this size).
            std::memset(host.data(), 0xab, host.size());
            cudawait::sync_wait(
                sched,
                cudawait::copy(std::span(host.data() + offset, bytes),
                               std::span<const std::uint8_t>(dev.data() + offset, bytes), o));
            for (std::size_t i = 0; i < host.size(); ++i) {
                const bool inside = i >= offset && i < offset + bytes;
                ASSERT_EQ(host[i], inside ? want[i - offset] : 0xab) << "host byte " << i;
            }
        }
    }
}

// Memory the SMs cannot reach, or copies over the limit, take the copy engine as before, with
// sm_copy_bytes set: pageable host memory (staged), and a copy one byte over the limit.
TEST_F(copy_lane_gpu, copies_the_sms_do_not_make_are_exact_too) {
    cudawait::stream s;
    const std::size_t n = 2048;
    cudawait::device_buffer<u32> dev(n, s);
    s.sync();
    cudawait::scheduler sched;
    cudawait::copy_options o;
    o.sm_copy_bytes = n * sizeof(u32) - 1;
    cudawait::pinned_buffer<u32> pinned(n);
    for (bool pageable : {true, false}) {
        SCOPED_TRACE(pageable ? "pageable" : "pinned over the limit");
        const auto want = random_words(n, pageable ? 71 : 72);
        std::vector<u32> back(n, 0xdeadbeef);
        if (pageable) {
            cudawait::sync_wait(sched, cudawait::copy(dev, want, lane::small, o));
            cudawait::sync_wait(sched, cudawait::copy(back, dev, lane::small, o));
        } else {
            std::copy(want.begin(), want.end(), pinned.data());
            cudawait::sync_wait(sched, cudawait::copy(dev, pinned, lane::small, o));
            std::fill(pinned.data(), pinned.data() + n, 0xdeadbeef);
            cudawait::sync_wait(sched, cudawait::copy(pinned, dev, lane::small, o));
            std::copy(pinned.data(), pinned.data() + n, back.begin());
        }
        EXPECT_EQ(back, want);
    }
}

// What the tests of a small copy beside a bulk one start from: a 1 GiB device source of `fill`
// bytes and its pinned destination, and 1024 random words (from `seed`) in device memory.
struct beside_bulk {
    static constexpr std::size_t big = std::size_t{1} << 30;
    static constexpr std::size_t n = 1024;

    beside_bulk(std::uint8_t fill, std::uint64_t seed)
        : bulk_src(big, s), bulk_dst(big), dev(n, s), want(random_words(n, seed)) {
        cudawait::check(cudaMemcpyAsync(dev.data(), want.data(), n * sizeof(u32),
                                        cudaMemcpyHostToDevice, s.get()),
                        "cudaMemcpyAsync");
        cudawait::check(cudaMemsetAsync(bulk_src.data(), fill, big, s.get()), "cudaMemsetAsync");
        s.sync();
    }

    cudawait::stream s;
    cudawait::device_buffer<std::uint8_t> bulk_src;
    cudawait::pinned_buffer<std::uint8_t> bulk_dst;
    cudawait::device_buffer<u32> dev;
    std::vector<u32> want;
};

// The point of it: a small device-to-host copy made by the SMs completes while a bulk copy the
// engine took first is still running (1 GiB, about 20 ms at the link's rate).
TEST_F(copy_lane_gpu, an_sm_copy_does_not_wait_for_a_bulk_copy_on_the_engine) {
    beside_bulk b(0x5a, 73);
    const std::size_t big = beside_bulk::big;
    const std::size_t n = beside_bulk::n;
    cudawait::scheduler sched;
    cudawait::copy_options o;
    o.sm_copy_bytes = 64_KiB;
    cudawait::pinned_buffer<u32> back(n);
    // Once first: the kernel is loaded (and compiled by the driver) on first use.
    cudawait::sync_wait(sched, cudawait::copy(back, b.dev, lane::small, o));
    std::fill(back.data(), back.data() + n, 0xdeadbeef);
    const cudawait::stream_ref bulk =
        copy_lanes::for_device(device_ref(0)).get(lane::bulk, copy_direction::d2h);
    ASSERT_EQ(cudaMemcpyAsync(b.bulk_dst.data(), b.bulk_src.data(), big, cudaMemcpyDeviceToHost,
                              bulk.get()),
              cudaSuccess);
    cudawait::sync_wait(sched, cudawait::copy(back, b.dev, lane::small, o));
    EXPECT_FALSE(bulk.is_done()) << "the small copy waited for the bulk copy";
    EXPECT_TRUE(std::equal(b.want.begin(), b.want.end(), back.data()));
    bulk.sync();
    EXPECT_EQ(b.bulk_dst[0], 0x5a);
    EXPECT_EQ(b.bulk_dst[big - 1], 0x5a);
}

// ---- small device-to-host copies beside the library's bulk ones --------------------------------

using cudawait::detail::bulk_streams;

unsigned long long sm_copies() { return cudawait::detail::sm_copies_enqueued.load(); }

// Holds stream `s` until release() (or the destructor): a kernel on a stream of its own spins on
// a mapped flag, and `s` waits for the kernel's event.
class stream_gate {
public:
    explicit stream_gate(cudawait::stream_ref s) : m_flag(1) {
        m_flag.write(0, 0);
        cudawait::check(
            cudawait::testing::launch_wait_flag(m_flag.device, 20'000'000'000ull, m_spin.get()),
            "launch_wait_flag");
        m_done.record(m_spin);
        s.wait(m_done.get());
    }
    stream_gate(const stream_gate&) = delete;
    stream_gate& operator=(const stream_gate&) = delete;
    ~stream_gate() { release(); }
    void release() {
        m_flag.write(0, 1);
        m_spin.sync();
    }

private:
    cudawait::testing::mapped_words m_flag;
    cudawait::stream m_spin;
    cudawait::event m_done;
};

TEST_F(copy_lane_gpu, the_bulk_stream_registry_sees_work_pending_and_forgets_a_stream_gone) {
    bulk_streams& r = bulk_streams::instance();
    const std::size_t before = r.count(0);
    cudawait::stream s;
    {
        cudawait::detail::bulk_stream_registration reg(0, {s.get()});
        EXPECT_EQ(r.count(0), before + 1);
        EXPECT_FALSE(r.pending(0));
        reg.note_work();
        stream_gate gate(s);
        EXPECT_TRUE(r.pending(0));
        EXPECT_FALSE(r.pending(1)) << "another device's streams are not this one's";
        gate.release();
        s.sync();
        EXPECT_FALSE(r.pending(0));
        // Found idle, the stream is not asked again until its owner notes work.
        stream_gate unnoted(s);
        EXPECT_FALSE(r.pending(0));
        bulk_streams::instance().note_work(s.get());
        EXPECT_TRUE(r.pending(0));
        unnoted.release();
        s.sync();
        cudawait::detail::bulk_stream_registration moved(std::move(reg));
        EXPECT_EQ(r.count(0), before + 1);
    }
    EXPECT_EQ(r.count(0), before);
    // The bulk lane's D2H stream is registered with the lanes, for the process.
    (void)copy_lanes::for_device(device_ref(0));
    EXPECT_GE(r.count(0), 1u);
}

// The bulk lane's D2H stream of device 0.
cudawait::stream_ref bulk_d2h() {
    return copy_lanes::for_device(device_ref(0)).get(lane::bulk, copy_direction::d2h);
}

// Small D2H copies of b.dev into `back` (a pinned_buffer or a std::vector) on the small lane, with
// every word checked: idle, a copy engine makes it; beside a bulk D2H copy of the device (1 GiB
// on the bulk lane, about 20 ms at the link's rate, awaited beside it) the SMs do, and it
// completes while the bulk copy still runs; then, with the bulk lane's D2H stream busy again,
// neither a copy with busy_sm_copy_bytes 0 nor one over it goes by the SMs. It returns with that
// second bulk copy still running (on bulk_d2h()).
template <class Back>
void small_d2h_copies_beside_bulk(beside_bulk& b, Back& back, std::uint8_t fill) {
    const std::size_t big = beside_bulk::big;
    const std::size_t n = beside_bulk::n;
    cudawait::scheduler sched;
    const cudawait::stream_ref bulk = bulk_d2h();
    auto check_back = [&] {
        for (std::size_t i = 0; i < n; ++i) {
            ASSERT_EQ(back[i], b.want[i]) << "word " << i;
        }
    };
    auto small_copy_back = [&](const cudawait::copy_options& o) {
        std::fill(back.begin(), back.end(), 0xdeadbeef);
        cudawait::sync_wait(sched, cudawait::copy(back, b.dev, o));
        check_back();
    };
    unsigned long long made = sm_copies();
    small_copy_back({});
    EXPECT_EQ(sm_copies(), made) << "the bulk lane was idle";

    std::fill(back.begin(), back.end(), 0xdeadbeef);
    bool bulk_ran_on = false;
    made = sm_copies();
    auto small = [&]() -> cudawait::task<void> {
        co_await cudawait::copy(back, b.dev);
        bulk_ran_on = !bulk.is_done();
    };
    cudawait::sync_wait(
        sched, cudawait::when_all(cudawait::copy(b.bulk_dst, b.bulk_src, lane::bulk), small()));
    check_back();
    EXPECT_EQ(sm_copies(), made + 1) << "the copy was not made by the SMs";
    EXPECT_TRUE(bulk_ran_on) << "the small copy waited for the bulk copy";
    for (std::size_t i : {std::size_t{0}, big / 3, big / 2, big - 1}) {
        ASSERT_EQ(b.bulk_dst[i], fill) << "bulk byte " << i;
    }

    ASSERT_EQ(cudaMemcpyAsync(b.bulk_dst.data(), b.bulk_src.data(), big, cudaMemcpyDeviceToHost,
                              bulk.get()),
              cudaSuccess);
    bulk_streams::instance().note_work(bulk.get());
    cudawait::copy_options off;
    off.busy_sm_copy_bytes = 0;
    small_copy_back(off);
    cudawait::copy_options under;
    under.busy_sm_copy_bytes = n * sizeof(u32) - 1;
    small_copy_back(under);
    EXPECT_EQ(sm_copies(), made + 1) << "only the copy beside the bulk one goes by the SMs";
}

// Copies b.dev's words on the device with `up` through the small lane (with options `o`), then
// checks every word.
template <class Src>
void small_h2d_copy(beside_bulk& b, const Src& up, const cudawait::copy_options& o) {
    const std::size_t n = beside_bulk::n;
    cudawait::scheduler sched;
    cudawait::sync_wait(sched, cudawait::copy(b.dev, up, o));
    std::vector<u32> seen(n, 0);
    ASSERT_EQ(cudaMemcpy(seen.data(), b.dev.data(), n * sizeof(u32), cudaMemcpyDeviceToHost),
              cudaSuccess);
    for (std::size_t i = 0; i < n; ++i) {
        ASSERT_EQ(seen[i], up[i]) << "device word " << i;
    }
}

// With the default options a small D2H copy into page-locked memory on the lane goes by the SMs
// while a bulk D2H copy of the device runs and completes before it; with the bulk lane idle, or
// busy_sm_copy_bytes 0, or for a copy to the device, a copy engine makes it. It is the process's
// first SM copy: the bulk lane loaded the kernel before its first D2H copy, so the copy does not
// wait for a loading that waits for the bulk copy.
TEST_F(copy_lane_gpu, a_small_d2h_copy_goes_by_the_sms_while_a_bulk_d2h_copy_runs) {
    beside_bulk b(0x3c, 74);
    cudawait::pinned_buffer<u32> back(beside_bulk::n);
    small_d2h_copies_beside_bulk(b, back, 0x3c);

    const auto up = random_words(beside_bulk::n, 75);
    cudawait::pinned_buffer<u32> src(beside_bulk::n);
    std::copy(up.begin(), up.end(), src.data());
    const unsigned long long made = sm_copies();
    small_h2d_copy(b, src, {});
    EXPECT_EQ(sm_copies(), made) << "an H2D copy goes by a copy engine, beside bulk work too";
    bulk_d2h().sync();
}

// The same for pageable memory: a small D2H copy into a std::vector beside the bulk copy goes
// through a pinned block that the SMs fill, and completes while the bulk copy runs (a copy engine
// would have queued it behind the 1 GiB). With sm_copy_bytes set, a small pageable H2D copy goes
// by the SMs too (staged into its block, then copied by the SMs).
TEST_F(copy_lane_gpu, a_small_pageable_copy_goes_by_the_sms_through_its_pinned_block) {
    beside_bulk b(0x6b, 78);
    std::vector<u32> back(beside_bulk::n);
    small_d2h_copies_beside_bulk(b, back, 0x6b);
    bulk_d2h().sync();

    const auto up = random_words(beside_bulk::n, 79);
    cudawait::copy_options by_sms;
    by_sms.sm_copy_bytes = 64_KiB;
    const unsigned long long made = sm_copies();
    small_h2d_copy(b, up, by_sms);
    EXPECT_EQ(sm_copies(), made + 1) << "the H2D copy was not made by the SMs";
}

// A pipeline notes a chunk's work once the chunk is enqueued. A small copy that asks whether the
// device's bulk D2H streams are busy while the chunk is being enqueued (here: from the chunk's
// stage, before its D2H is enqueued) finds them idle, and that answer is kept; one that asks
// after the chunk was enqueued must find its D2H pending (held behind a kernel spinning on a
// flag). When the pipeline noted its work before enqueueing, the idle answer was kept past the
// enqueue, so the chunk's D2H went unseen (and small D2H copies queued behind it on a copy engine)
// until the next chunk.
TEST_F(copy_lane_gpu, a_chunk_s_work_is_seen_once_the_chunk_is_enqueued) {
    bulk_streams& registry = bulk_streams::instance();
    cudawait::testing::mapped_words flag(1);
    flag.write(0, 0);
    const std::size_t chunk = 1 << 12;
    cudawait::pipeline_options o;
    o.memory.group_bytes = 0; // one chunk per flight
    o.depth = 2;
    o.chunk_elements = chunk;
    constexpr u32 salt = 0x3d15;
    bool asked_in_stage = false;
    bool pending_in_stage = true;
    cudawait::pipeline<u32> pipe(
        o, {[&](std::span<u32> in, std::span<u32> out, cudawait::stream_ref st) {
            pending_in_stage = registry.pending(0);
            asked_in_stage = true;
            cudawait::check(cudawait::testing::launch_transform(in.data(), out.data(), in.size(),
                                                                salt, 0, st.get()),
                            "launch_transform");
            cudawait::check(
                cudawait::testing::launch_wait_flag(flag.device, 20'000'000'000ull, st.get()),
                "launch_wait_flag");
        }});
    const auto in = random_words(chunk, 95);
    std::vector<u32> expect(chunk);
    cudawait::testing::transform_on_host(in.data(), expect.data(), chunk, salt);
    cudawait::pinned_buffer<u32> pin_in(chunk);
    cudawait::pinned_buffer<u32> pin_out(chunk);
    std::copy(in.begin(), in.end(), pin_in.data());
    std::fill(pin_out.data(), pin_out.data() + chunk, 0xdeadbeef);
    cudawait::scheduler sched;
    bool pending_after = false;
    auto ask = [&]() -> cudawait::task<void> {
        // The stage runs inside the chunk's enqueue, on this thread: once it has run and this
        // coroutine runs again, the enqueue is over.
        const auto limit = std::chrono::steady_clock::now() + std::chrono::seconds(10);
        while (!asked_in_stage && std::chrono::steady_clock::now() < limit) {
            co_await sched.schedule();
        }
        pending_after = registry.pending(0);
        flag.write(0, 1);
    };
    cudawait::sync_wait(sched,
                        cudawait::when_all(pipe.run(std::span<const u32>(pin_in.data(), chunk),
                                                    std::span<u32>(pin_out.data(), chunk)),
                                           ask()));
    ASSERT_TRUE(asked_in_stage);
    EXPECT_FALSE(pending_in_stage) << "no bulk D2H work was pending yet";
    EXPECT_TRUE(pending_after) << "the chunk's D2H was not seen";
    EXPECT_EQ(std::memcmp(pin_out.data(), expect.data(), chunk * sizeof(u32)), 0);
    EXPECT_FALSE(registry.pending(0)) << "all done";
}

// A pipeline notes its work: while a chunk's D2H waits for its stage (then a kernel held on a
// flag), a small D2H copy of its device goes by the SMs; with the pipeline idle, and once it is
// gone, by a copy engine. The chunk's output is checked too.
TEST_F(copy_lane_gpu, a_pipeline_s_pending_chunk_sends_small_d2h_copies_to_the_sms) {
    cudawait::stream s;
    const std::size_t n = 4096 / sizeof(u32);
    cudawait::device_buffer<u32> dev(n, s);
    const auto want = random_words(n, 76);
    ASSERT_EQ(
        cudaMemcpyAsync(dev.data(), want.data(), n * sizeof(u32), cudaMemcpyHostToDevice, s.get()),
        cudaSuccess);
    s.sync();
    cudawait::scheduler sched;
    cudawait::pinned_buffer<u32> back(n);
    (void)copy_lanes::for_device(device_ref(0)); // their bulk D2H stream is registered for good
    const std::size_t before = bulk_streams::instance().count(0);
    auto check_back = [&] {
        for (std::size_t i = 0; i < n; ++i) {
            ASSERT_EQ(back[i], want[i]) << "word " << i;
        }
    };
    auto copy_back = [&] {
        std::fill(back.data(), back.data() + n, 0xdeadbeef);
        cudawait::sync_wait(sched, cudawait::copy(back, dev));
        check_back();
    };
    {
        cudawait::testing::mapped_words flag(1);
        flag.write(0, 0);
        const std::size_t chunk = 1 << 16;
        cudawait::pipeline_options o;
        o.memory.group_bytes = 0; // one chunk per flight
        o.depth = 2;
        o.chunk_elements = chunk;
        constexpr u32 salt = 0x77e1;
        cudawait::pipeline<u32> pipe(
            o, {[&](std::span<u32> in, std::span<u32> out, cudawait::stream_ref st) {
                // The transform first: a kernel's first launch loads it, and loading waits for
                // the kernels running on the device, the spinning one among them.
                cudawait::check(cudawait::testing::launch_transform(in.data(), out.data(),
                                                                    in.size(), salt, 0, st.get()),
                                "launch_transform");
                cudawait::check(
                    cudawait::testing::launch_wait_flag(flag.device, 20'000'000'000ull, st.get()),
                    "launch_wait_flag");
            }});
        EXPECT_GT(bulk_streams::instance().count(0), before) << "the pipeline's streams";
        unsigned long long made = sm_copies();
        copy_back();
        EXPECT_EQ(sm_copies(), made) << "the pipeline was idle";

        const auto in = random_words(chunk, 77);
        std::vector<u32> expect(chunk);
        cudawait::testing::transform_on_host(in.data(), expect.data(), chunk, salt);
        cudawait::pinned_buffer<u32> pin_in(chunk);
        cudawait::pinned_buffer<u32> pin_out(chunk);
        std::copy(in.begin(), in.end(), pin_in.data());
        std::fill(pin_out.data(), pin_out.data() + chunk, 0xdeadbeef);
        made = sm_copies();
        std::fill(back.data(), back.data() + n, 0xdeadbeef);
        auto small = [&]() -> cudawait::task<void> {
            // Until the chunk is on the GPU, held in its stage.
            const auto limit = std::chrono::steady_clock::now() + std::chrono::seconds(10);
            while (pipe.d2h_stream().is_done() && std::chrono::steady_clock::now() < limit) {
                co_await sched.schedule();
            }
            co_await cudawait::copy(back, dev);
            flag.write(0, 1);
        };
        cudawait::sync_wait(sched,
                            cudawait::when_all(pipe.run(std::span<const u32>(pin_in.data(), chunk),
                                                        std::span<u32>(pin_out.data(), chunk)),
                                               small()));
        check_back();
        EXPECT_EQ(sm_copies(), made + 1) << "the pipeline's chunk was pending";
        EXPECT_EQ(std::memcmp(pin_out.data(), expect.data(), chunk * sizeof(u32)), 0);
        made = sm_copies();
        copy_back();
        EXPECT_EQ(sm_copies(), made) << "the pipeline's run is over";
    }
    EXPECT_EQ(bulk_streams::instance().count(0), before);
    const unsigned long long made = sm_copies();
    copy_back();
    EXPECT_EQ(sm_copies(), made);
}

} // namespace
