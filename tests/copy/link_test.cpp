// SPDX-License-Identifier: Apache-2.0
// describe_link (PCIe figures from NVML or sysfs, copy engines, measured peak) and the
// pipeline's utilisation alert, which fires when the host does not keep the link fed.

#include <cudawait/copy/link.hpp>
#include <cudawait/core/scheduler.hpp>
#include <cudawait/core/sync_wait.hpp>
#include <cudawait/core/task.hpp>
#include <cudawait/core/when_all.hpp>
#include <cudawait/memory/pinned_buffer.hpp>
#include <cudawait/pipeline/pipeline.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "gpu_fixture.hpp"
#include "random_words.hpp"
#include "test_kernels.hpp"

namespace {

using namespace cudawait::literals;
using cudawait::link_info;
using cudawait::pinned_buffer;
using cudawait::pipeline_options;
using u32 = std::uint32_t;
using pipe_t = cudawait::pipeline<u32>;

constexpr u32 salt = 0x11c;

// A fake sysfs tree below a fresh temporary directory, removed at the end.
struct fake_sysfs {
    std::filesystem::path root;
    explicit fake_sysfs(const std::string& name) {
        root = std::filesystem::temp_directory_path() /
               ("cudawait_link_test_" + name + "_" + std::to_string(::getpid()));
        std::filesystem::remove_all(root);
    }
    ~fake_sysfs() { std::filesystem::remove_all(root); }
    void write(const std::string& bus, const std::string& file, const std::string& text) {
        auto dir = root / "sys/bus/pci/devices" / bus;
        std::filesystem::create_directories(dir);
        std::ofstream(dir / file) << text;
    }
};

using cudawait::testing::random_words;

} // namespace

TEST(link, speeds_map_to_generations) {
    using cudawait::detail::pcie_generation_of_speed;
    EXPECT_EQ(pcie_generation_of_speed("2.5 GT/s"), 1);
    EXPECT_EQ(pcie_generation_of_speed("5.0 GT/s PCIe"), 2);
    EXPECT_EQ(pcie_generation_of_speed("8.0 GT/s PCIe"), 3);
    EXPECT_EQ(pcie_generation_of_speed("16.0 GT/s PCIe"), 4);
    EXPECT_EQ(pcie_generation_of_speed("32.0 GT/s PCIe"), 5);
    EXPECT_EQ(pcie_generation_of_speed("64.0 GT/s PCIe"), 6);
    EXPECT_EQ(pcie_generation_of_speed("Unknown"), 0);
    EXPECT_EQ(pcie_generation_of_speed(""), 0);
    EXPECT_EQ(pcie_generation_of_speed("12.0 GT/s"), 0);
}

TEST(link, sysfs_figures_are_read_for_the_bus_id) {
    fake_sysfs fs("read");
    const std::string bus = "0000:3b:00.0";
    fs.write(bus, "current_link_speed", "16.0 GT/s PCIe\n");
    fs.write(bus, "current_link_width", "8\n");
    fs.write(bus, "max_link_speed", "32.0 GT/s PCIe\n");
    fs.write(bus, "max_link_width", "16\n");
    link_info info;
    info.pci_bus_id = bus;
    std::string why;
    ASSERT_TRUE(cudawait::detail::pcie_from_sysfs(info, why, fs.root.string())) << why;
    EXPECT_EQ(info.pcie_generation, 4);
    EXPECT_EQ(info.pcie_width, 8);
    EXPECT_EQ(info.max_pcie_generation, 5);
    EXPECT_EQ(info.max_pcie_width, 16);
    EXPECT_TRUE(why.empty());
}

TEST(link, unreadable_sysfs_leaves_zeros_and_says_why) {
    fake_sysfs fs("missing");
    const std::string bus = "0000:01:00.0";
    fs.write(bus, "current_link_speed", "Unknown\n"); // as some virtual machines report it
    fs.write(bus, "current_link_width", "16\n");
    fs.write(bus, "max_link_width", "16\n");
    link_info info;
    info.pci_bus_id = bus;
    std::string why;
    EXPECT_FALSE(cudawait::detail::pcie_from_sysfs(info, why, fs.root.string()));
    EXPECT_EQ(info.pcie_generation, 0);
    EXPECT_EQ(info.pcie_width, 0);
    EXPECT_EQ(info.max_pcie_generation, 0);
    EXPECT_EQ(info.max_pcie_width, 0);
    EXPECT_NE(why.find(bus), std::string::npos) << why;

    link_info other;
    other.pci_bus_id = "0000:ff:00.0"; // no directory at all
    EXPECT_FALSE(cudawait::detail::pcie_from_sysfs(other, why, fs.root.string()));
    EXPECT_NE(why.find("0000:ff:00.0"), std::string::npos) << why;
}

TEST(link, to_string_marks_unknown_figures) {
    link_info info;
    info.device = 1;
    info.pci_bus_id = "0000:3b:00.0";
    info.pcie_generation = 5;
    info.pcie_width = 16;
    info.copy_engines = 3;
    info.peak_gbps = 52.25;
    info.source = "sysfs";
    EXPECT_EQ(cudawait::to_string(info), "device 1 (0000:3b:00.0): PCIe gen 5 x16 (max gen ? x?), "
                                         "3 copy engines, peak 52.2 GB/s [sysfs]");
}

TEST(link, alert_kinds_have_names) {
    EXPECT_EQ(cudawait::to_string(cudawait::alert_kind::bandwidth), "bandwidth");
    EXPECT_EQ(cudawait::to_string(cudawait::alert_kind::utilisation), "utilisation");
    cudawait::pipeline_alert a{"h2d", 1.0, 2.0, 8};
    EXPECT_EQ(a.kind, cudawait::alert_kind::bandwidth) << "the old four-field form stays valid";
    EXPECT_EQ(pipeline_options{}.monitoring.utilisation_fraction, 0.8);
}

// ---- on a GPU ---------------------------------------------------------------------------------

class link_gpu : public cudawait::testing::pool_gpu_test {};

// NVML or sysfs answers on a real machine; the figures are plausible and the source is named.
TEST_F(link_gpu, describe_link_reports_the_pcie_link_engines_and_peak) {
    link_info l = cudawait::describe_link(0);
    std::printf("%s\n", cudawait::to_string(l).c_str());
    EXPECT_EQ(l.device, 0);
    EXPECT_EQ(l.pci_bus_id.size(), 12u) << l.pci_bus_id;
    ASSERT_TRUE(l.source == "nvml" || l.source == "sysfs") << l.source;
    EXPECT_GE(l.pcie_generation, 1);
    EXPECT_GE(l.pcie_width, 1);
    EXPECT_GE(l.max_pcie_generation, l.pcie_generation);
    EXPECT_GE(l.max_pcie_width, l.pcie_width);
    EXPECT_GE(l.copy_engines, 1);
    EXPECT_GT(l.peak_gbps, 0);
    EXPECT_THROW((void)cudawait::describe_link(cudawait::try_device_count()), cudawait::cuda_error);
}

// The utilisation alert, both ways. A streaming producer that sleeps 20 ms before each
// submit starves the link and the GPU: every window's utilisation alert fires (kind
// utilisation, utilisation below the fraction). A pinned batch of 64 MiB chunks keeps the
// link busy: no utilisation alert. Outputs are checked in both runs.
namespace {

struct alert_count {
    std::size_t utilisation = 0;
    std::size_t all = 0;
};

pipeline_options utilisation_options(std::size_t chunk, alert_count& count) {
    pipeline_options o;
    o.memory.group_bytes = 0; // one chunk per flight
    o.chunk_elements = chunk;
    o.depth = 4;
    o.monitoring.timing = true;
    o.monitoring.alert_window = 4;
    o.monitoring.alert_fraction = 0.01; // no bandwidth alert: only the utilisation alert is watched
    const double fraction = o.monitoring.utilisation_fraction;
    o.monitoring.on_alert = [&count, fraction](const cudawait::pipeline_alert& a) {
        ++count.all;
        if (a.kind == cudawait::alert_kind::utilisation) {
            ++count.utilisation;
            EXPECT_LT(a.utilisation, fraction);
            EXPECT_GE(a.utilisation, 0.0);
            EXPECT_GT(a.peak_gbps, 0);
            EXPECT_EQ(a.window, 4u);
        }
    };
    return o;
}

pipe_t::stage transform_stage() {
    return [](std::span<u32> a, std::span<u32> b, cudawait::stream_ref s) {
        cudawait::check(
            cudawait::testing::launch_transform(a.data(), b.data(), a.size(), salt, 0, s.get()),
            "launch_transform");
    };
}

cudawait::task<void> slow_producer(pipe_t& p, const std::vector<u32>& data, std::size_t chunk) {
    for (std::size_t off = 0; off < data.size(); off += chunk) {
        co_await cudawait::sleep_for(std::chrono::milliseconds(20)); // the host is slow
        auto slot = co_await p.acquire();
        std::copy(data.begin() + static_cast<std::ptrdiff_t>(off),
                  data.begin() + static_cast<std::ptrdiff_t>(off + chunk), slot.data().begin());
        p.submit(std::move(slot), chunk);
    }
    p.close();
}

cudawait::task<void> checking_consumer(pipe_t& p, const std::vector<u32>& want, std::size_t chunk,
                                       std::size_t& bad, std::size_t& taken) {
    while (auto r = co_await p.next()) {
        const u32* expect = want.data() + r->chunk() * chunk;
        if (!std::equal(expect, expect + chunk, r->data().begin(), r->data().end())) {
            ++bad;
        }
        ++taken;
    }
}

} // namespace

TEST_F(link_gpu, utilisation_alert_fires_only_when_the_host_starves_the_link) {
    {
        // Streaming, 12 chunks of 16 MiB submitted 20 ms apart: a copy takes well under 1 ms, so
        // the link and the GPU are busy a few percent of each window.
        const std::size_t chunk = 16_MiB / sizeof(u32);
        const std::size_t chunks = 12;
        auto data = random_words(chunk * chunks, 77);
        std::vector<u32> want(data.size());
        for (std::size_t off = 0; off < data.size(); off += chunk) { // indices restart per chunk
            cudawait::testing::transform_on_host(data.data() + off, want.data() + off, chunk, salt);
        }
        alert_count count;
        pipe_t p(utilisation_options(chunk, count), {transform_stage()});
        std::size_t bad = 0;
        std::size_t taken = 0;
        cudawait::scheduler sched;
        cudawait::sync_wait(sched,
                            cudawait::when_all(slow_producer(p, data, chunk),
                                               checking_consumer(p, want, chunk, bad, taken)));
        EXPECT_EQ(taken, chunks);
        EXPECT_EQ(bad, 0u);
        EXPECT_EQ(p.stats().alerts, count.all);
        EXPECT_GE(count.utilisation, 2u) << "3 windows of 4 chunks, each starved by the host";
    }
    {
        // A pinned batch of 64 MiB chunks: each copy takes about 1.2 ms against a few
        // microseconds of host work per chunk, so the link stays busy.
        const std::size_t chunk = 64_MiB / sizeof(u32);
        const std::size_t n = chunk * 12;
        pinned_buffer<u32> in(n);
        pinned_buffer<u32> out(n);
        auto data = random_words(n, 78);
        std::copy(data.begin(), data.end(), in.begin());
        std::vector<u32> want(n);
        for (std::size_t off = 0; off < n; off += chunk) { // indices restart per chunk
            cudawait::testing::transform_on_host(data.data() + off, want.data() + off, chunk, salt);
        }
        alert_count count;
        pipe_t p(utilisation_options(chunk, count), {transform_stage()});
        std::fill(out.begin(), out.end(), 0xdeadbeefu);
        cudawait::scheduler sched;
        cudawait::sync_wait(sched, p.run(in.span(), out.span()));
        for (std::size_t i = 0; i < n; ++i) {
            ASSERT_EQ(out[i], want[i]) << "element " << i;
        }
        EXPECT_EQ(p.stats().alerts, count.all);
        EXPECT_EQ(count.utilisation, 0u) << "a pinned copy-bound run keeps the link busy";
    }
}
