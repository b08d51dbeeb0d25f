// SPDX-License-Identifier: Apache-2.0
#include <cudawait/copy/copy.hpp>
#include <cudawait/memory/detail/numa.hpp>
#include <cudawait/memory/device_buffer.hpp>
#include <cudawait/memory/numa_pool.hpp>
#include <cudawait/memory/pinned_buffer.hpp>
#include <cudawait/memory/pinned_pool.hpp>
#include <cudawait/pipeline/detail/multi_pool.hpp>
#include <cudawait/runtime/stream.hpp>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <system_error>
#include <vector>

#include <cuda_runtime.h>

#include "gpu_fixture.hpp"
#include <gtest/gtest.h>
#include <sys/mman.h>

namespace {

using namespace cudawait::literals;
using cudawait::numa_policy;
using cudawait::numa_slab_source;
using cudawait::usage_error;
using cudawait::detail::numa_node_count;
using cudawait::detail::numa_node_exists;
using cudawait::detail::numa_node_ids;
using cudawait::detail::pci_numa_node;

// A fake /sys below a fresh temporary directory.
class fake_root {
public:
    fake_root() {
        std::string tmpl = ::testing::TempDir() + "cudawait_numa_XXXXXX";
        if (::mkdtemp(tmpl.data()) == nullptr) {
            throw std::runtime_error("mkdtemp failed");
        }
        m_dir = tmpl;
    }
    fake_root(const fake_root&) = delete;
    fake_root& operator=(const fake_root&) = delete;
    ~fake_root() {
        std::error_code ec;
        std::filesystem::remove_all(m_dir, ec);
    }
    void write(const std::string& relative, const std::string& text) const {
        std::filesystem::path p = m_dir / relative;
        std::filesystem::create_directories(p.parent_path());
        std::ofstream(p) << text;
    }
    [[nodiscard]] std::string path() const { return m_dir.string(); }

private:
    std::filesystem::path m_dir;
};

// The first node this machine lists (0 where sysfs lists none): the one tests place memory on.
int first_node() {
    std::vector<int> ids = numa_node_ids();
    return ids.empty() ? 0 : ids.front();
}

// Why the kernel refused a NUMA system call, for a skip; empty for any other error.
std::string refusal(const std::system_error& e) {
    int code = e.code().value();
    if (code == EPERM || code == ENOSYS) {
        return std::string("the kernel refuses it here (a container's seccomp profile?): ") +
               e.what();
    }
    return {};
}

// ---- sysfs, on fake trees and on this machine ---------------------------------------------

TEST(numa_sysfs, node_count_counts_the_node_directories) {
    fake_root r;
    r.write("sys/devices/system/node/node0/cpulist", "0-3\n");
    r.write("sys/devices/system/node/node1/cpulist", "4-7\n");
    r.write("sys/devices/system/node/node3/cpulist", "8-11\n");
    r.write("sys/devices/system/node/has_cpu", "0-1,3\n");
    r.write("sys/devices/system/node/nodefoo/x", "");
    r.write("sys/devices/system/node/node/x", "");
    r.write("sys/devices/system/node/node2x/x", "");
    r.write("sys/devices/system/node/possible", "0-3\n");
    EXPECT_EQ(numa_node_count(r.path()), 3);
    EXPECT_EQ(numa_node_ids(r.path()), (std::vector<int>{0, 1, 3}));
    EXPECT_TRUE(numa_node_exists(0, r.path()));
    EXPECT_TRUE(numa_node_exists(3, r.path()));
    EXPECT_FALSE(numa_node_exists(2, r.path())) << "ids may have gaps";
    EXPECT_FALSE(numa_node_exists(4, r.path()));
    EXPECT_FALSE(numa_node_exists(-1, r.path()));
}

TEST(numa_sysfs, without_the_node_directory_there_is_one_node) {
    fake_root r;
    EXPECT_EQ(numa_node_count(r.path()), 1);
    EXPECT_TRUE(numa_node_ids(r.path()).empty());
    EXPECT_TRUE(numa_node_exists(0, r.path()));
    EXPECT_FALSE(numa_node_exists(1, r.path()));
}

TEST(numa_sysfs, a_pci_devices_node_is_read_by_its_lower_case_name) {
    fake_root r;
    r.write("sys/bus/pci/devices/0000:3b:00.0/numa_node", "1\n");
    r.write("sys/bus/pci/devices/0000:18:00.0/numa_node", "-1\n");
    r.write("sys/bus/pci/devices/0001:af:00.0/numa_node", "3\n");
    r.write("sys/bus/pci/devices/0000:5e:00.0/numa_node", "not a node\n");
    EXPECT_EQ(pci_numa_node("0000:3B:00.0", r.path()), 1) << "upper case, as CUDA writes it";
    EXPECT_EQ(pci_numa_node("0000:3b:00.0", r.path()), 1);
    EXPECT_EQ(pci_numa_node("00000000:3B:00.0", r.path()), 1) << "an 8-digit domain";
    EXPECT_EQ(pci_numa_node("0001:AF:00.0", r.path()), 3);
    EXPECT_EQ(pci_numa_node("0000:18:00.0", r.path()), -1) << "sysfs's own unknown";
    EXPECT_EQ(pci_numa_node("0000:5E:00.0", r.path()), -1) << "garbage in the file";
    EXPECT_EQ(pci_numa_node("0000:99:00.0", r.path()), -1) << "no such device";
    EXPECT_EQ(pci_numa_node("", r.path()), -1);
    EXPECT_EQ(pci_numa_node(":3b:00.0", r.path()), -1);
    EXPECT_EQ(pci_numa_node("zz:3b:00.0", r.path()), -1);
}

TEST(numa_sysfs, this_machine) {
    std::vector<int> ids = numa_node_ids();
    int count = numa_node_count();
    std::printf("NUMA nodes here: %d\n", count);
    EXPECT_GE(count, 1);
    EXPECT_EQ(count, ids.empty() ? 1 : static_cast<int>(ids.size()));
    if (std::filesystem::exists("/sys/devices/system/node/node0") &&
        !std::filesystem::exists("/sys/devices/system/node/node1")) {
        EXPECT_EQ(count, 1) << "a single-node machine";
    }
    EXPECT_TRUE(numa_node_exists(first_node()));
}

// ---- mbind and get_mempolicy on plain host memory (no GPU needed) -------------------------

TEST(numa_bind, bound_pages_are_faulted_in_on_the_node) {
    const std::size_t bytes = 4_MiB;
    void* raw = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    ASSERT_NE(raw, MAP_FAILED);
    auto* p = static_cast<std::byte*>(raw);
    const int node = first_node();
    std::string skip;
    try {
        cudawait::detail::bind_to_node(p, bytes, node, cudawait::detail::mpol_bind);
        cudawait::detail::fault_in(p, bytes);
        for (std::size_t off : {std::size_t{0}, bytes / 2 + 4096, bytes - 1}) {
            EXPECT_EQ(cudawait::detail::page_numa_node(p + off), node) << "byte " << off;
        }
    } catch (const std::system_error& e) {
        skip = refusal(e);
        if (skip.empty()) {
            ADD_FAILURE() << e.what();
        }
    }
    ::munmap(p, bytes);
    if (!skip.empty()) {
        GTEST_SKIP() << skip;
    }
}

TEST(numa_bind, a_node_that_does_not_exist_is_refused_by_the_kernel) {
    const std::size_t bytes = 2_MiB;
    void* raw = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    ASSERT_NE(raw, MAP_FAILED);
    try {
        cudawait::detail::bind_to_node(raw, bytes, 1000, cudawait::detail::mpol_bind);
        ADD_FAILURE() << "no exception";
    } catch (const std::system_error& e) {
        EXPECT_NE(e.code().value(), 0) << e.what();
        EXPECT_NE(std::string(e.what()).find("1000"), std::string::npos) << e.what();
    }
    ::munmap(raw, bytes);
}

// ---- argument checks: typed errors before any CUDA call ------------------------------------

TEST(numa_slab_source, a_node_this_machine_lacks_is_a_usage_error) {
    std::vector<int> ids = numa_node_ids();
    const int missing = ids.empty() ? 1 : ids.back() + 1;
    EXPECT_THROW(numa_slab_source{-1}, usage_error);
    EXPECT_THROW(numa_slab_source{missing}, usage_error);
    EXPECT_THROW((numa_slab_source{missing, numa_policy::preferred}), usage_error);
    EXPECT_THROW((void)cudawait::numa_pinned_pool(-1), usage_error);
    EXPECT_THROW((void)cudawait::numa_pinned_pool(missing), usage_error);
    EXPECT_THROW((void)cudawait::numa_pinned_pool(1 << 20), usage_error);
    numa_slab_source ok(first_node());
    EXPECT_EQ(ok.node(), first_node());
    EXPECT_EQ(ok.policy(), numa_policy::bind);
}

TEST(numa_slab_source, a_slab_size_that_is_no_multiple_of_2_mib_is_a_usage_error) {
    numa_slab_source src(first_node());
    EXPECT_THROW((void)src.allocate(0), usage_error);
    EXPECT_THROW((void)src.allocate(1_MiB), usage_error);
    EXPECT_THROW((void)src.allocate(3_MiB), usage_error);
    EXPECT_THROW((void)src.allocate(66_GiB), usage_error);
}

TEST(numa_device, a_device_id_that_names_no_device_is_a_cuda_error) {
    // Without a driver or a device the id check fails the same way.
    EXPECT_THROW((void)cudawait::detail::device_numa_node(-1), cudawait::cuda_error);
    EXPECT_THROW((void)cudawait::detail::device_numa_node(1 << 20), cudawait::cuda_error);
}

TEST(numa_staging, one_node_stages_through_the_default_pool) {
    if (numa_node_count() != 1) {
        GTEST_SKIP() << "a machine with " << numa_node_count() << " NUMA nodes";
    }
    // No CUDA call: this holds without a device too.
    EXPECT_EQ(&cudawait::detail::staging_pool_for_device(0), &cudawait::default_pinned_pool());
    EXPECT_EQ(&cudawait::detail::staging_pool_for_device(3), &cudawait::default_pinned_pool());
}

// ---- with a GPU -----------------------------------------------------------------------------

class numa_gpu : public cudawait::testing::gpu_test {};

TEST_F(numa_gpu, the_device_node_is_a_node_of_this_machine_or_unknown) {
    int node = cudawait::detail::device_numa_node(0);
    std::printf("device 0: NUMA node %d of %d\n", node, numa_node_count());
    if (numa_node_count() == 1) {
        EXPECT_TRUE(node == 0 || node == -1) << node;
    } else {
        EXPECT_TRUE(node == -1 || numa_node_exists(node)) << node;
    }
    EXPECT_EQ(cudawait::detail::cached_device_numa_node(0), node);
    EXPECT_EQ(cudawait::detail::cached_device_numa_node(0), node) << "asked twice";
}

TEST_F(numa_gpu, staging_for_a_device_uses_its_nodes_pool_where_there_are_several) {
    cudawait::pinned_pool& got = cudawait::detail::staging_pool_for_device(0);
    int node = cudawait::detail::device_numa_node(0);
    if (numa_node_count() > 1 && node >= 0) {
        EXPECT_EQ(&got, &cudawait::numa_pinned_pool(node));
        EXPECT_NE(&got, &cudawait::default_pinned_pool());
    } else {
        EXPECT_EQ(&got, &cudawait::default_pinned_pool());
    }
}

std::vector<std::uint32_t> random_words(std::size_t n, std::uint64_t seed) {
    std::vector<std::uint32_t> v(n);
    std::mt19937_64 rng(seed);
    for (auto& x : v) {
        x = static_cast<std::uint32_t>(rng());
    }
    return v;
}

// A 4 MiB slab: page-locked (the driver says host-registered), on the node where the policy
// placed it, and a copy of its first half to the GPU and back into its poisoned second half is
// exact.
void slab_round_trip(numa_policy policy) {
    const int node = first_node();
    numa_slab_source src(node, policy);
    const std::size_t bytes = 4_MiB;
    void* raw = nullptr;
    try {
        raw = src.allocate(bytes);
    } catch (const std::system_error& e) {
        std::string why = refusal(e);
        ASSERT_FALSE(why.empty()) << e.what();
        ASSERT_EQ(policy, numa_policy::bind) << "preferred makes the slab anyway";
        GTEST_SKIP() << "mbind: " << why;
    }
    ASSERT_NE(raw, nullptr);
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(raw) % numa_slab_source::alignment, 0u);
    auto* p = static_cast<std::byte*>(raw);
    for (std::size_t off : {std::size_t{0}, bytes - 1}) {
        cudaPointerAttributes a{};
        ASSERT_EQ(cudaPointerGetAttributes(&a, p + off), cudaSuccess);
        EXPECT_EQ(a.type, cudaMemoryTypeHost) << "host-registered, byte " << off;
    }
    EXPECT_EQ(cudawait::classify(p), cudawait::memory_kind::pinned);

    const std::size_t n = bytes / 2 / sizeof(std::uint32_t);
    std::span<std::uint32_t> in(static_cast<std::uint32_t*>(raw), n);
    std::span<std::uint32_t> out(static_cast<std::uint32_t*>(raw) + n, n);
    auto want = random_words(n, 77 + static_cast<std::uint64_t>(policy));
    std::memcpy(in.data(), want.data(), bytes / 2);
    std::memset(out.data(), 0xcd, bytes / 2);
    {
        cudawait::stream s;
        cudawait::device_buffer<std::uint32_t> dev(n, s);
        ASSERT_EQ(cudaMemsetAsync(dev.data(), 0x77, bytes / 2, s.get()), cudaSuccess);
        cudawait::copy_async(dev, std::span<const std::uint32_t>(in), s);
        cudawait::copy_async(out, dev, s);
        s.sync();
    }
    for (std::size_t i = 0; i < n; ++i) {
        if (out[i] != want[i]) {
            ADD_FAILURE() << "element " << i << ": " << out[i] << " != " << want[i];
            break;
        }
    }

    if (policy == numa_policy::bind || src.unplaced_slabs() == 0) {
        try {
            for (std::size_t off : {std::size_t{0}, bytes / 2, bytes - 1}) {
                EXPECT_EQ(cudawait::detail::page_numa_node(p + off), node) << "byte " << off;
            }
        } catch (const std::system_error& e) {
            std::string why = refusal(e);
            EXPECT_FALSE(why.empty()) << e.what();
            std::printf("get_mempolicy: %s\n", why.c_str());
        }
    }
    src.deallocate(raw, bytes);
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

TEST_F(numa_gpu, a_bound_slab_is_page_locked_on_its_node_and_round_trips) {
    slab_round_trip(numa_policy::bind);
}

TEST_F(numa_gpu, a_preferred_slab_is_page_locked_and_round_trips) {
    slab_round_trip(numa_policy::preferred);
}

TEST_F(numa_gpu, a_pool_over_a_numa_source_hands_out_page_locked_blocks) {
    cudawait::pinned_pool_options opt;
    opt.upstream = std::make_shared<numa_slab_source>(first_node(), numa_policy::preferred);
    opt.slab_bytes = 4_MiB;
    cudawait::pinned_pool pool(opt);
    const std::size_t n = 300'001;
    auto want = random_words(n, 5);
    cudawait::stream s;
    {
        cudawait::pinned_buffer<std::uint32_t> in(n, pool);
        cudawait::pinned_buffer<std::uint32_t> out(n, pool);
        std::memcpy(in.data(), want.data(), n * sizeof(std::uint32_t));
        std::memset(out.data(), 0xcd, n * sizeof(std::uint32_t));
        cudawait::device_buffer<std::uint32_t> dev(n, s);
        cudawait::copy_async(dev, in, s);
        cudawait::copy_async(out, dev, s);
        s.sync();
        EXPECT_TRUE(std::equal(out.begin(), out.end(), want.begin())) << "every element";
        EXPECT_GE(pool.stats().reserved_bytes, 2 * n * sizeof(std::uint32_t));
    }
    (void)pool.collect(); // the stream passed every use: the freed blocks come back
    EXPECT_EQ(pool.stats().pending_bytes, 0u);
    EXPECT_EQ(pool.stats().in_use_bytes, 0u);
}

} // namespace
