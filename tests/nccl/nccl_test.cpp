// SPDX-License-Identifier: Apache-2.0
//
// nccl.hpp: the unique id's forms (host), the collectives over every visible device awaited on
// the scheduler and checked element by element against the host, groups, the unique-id
// bootstrap of a child process, and the two ways an await stalls (a rank that never joins, a
// stream that never reaches the collective), each of which must end in nccl::error within its
// timeout and leave nothing behind.

#include <cudawait/core/scheduler.hpp>
#include <cudawait/core/sync_wait.hpp>
#include <cudawait/core/task.hpp>
#include <cudawait/core/when_all.hpp>
#include <cudawait/nccl/nccl.hpp>
#include <cudawait/runtime/stream.hpp>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include <cuda_runtime.h>

#include "gpu_fixture.hpp"
#include "mapped_words.hpp"
#include "test_kernels.hpp"
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

extern char** environ;

namespace {

using namespace std::chrono_literals;
using cudawait::check;
using cudawait::scheduler;
using cudawait::stream;
using cudawait::sync_wait;
using cudawait::task;
namespace nccl = cudawait::nccl;

// NVLS must be off before the first NCCL call (and in every child's environment): forced, not
// defaulted, during static initialisation.
const bool g_nvls_off = [] { return ::setenv("NCCL_NVLS_ENABLE", "0", 1) == 0; }();

constexpr const char* kChildVar = "CUDAWAIT_NCCL_TEST_CHILD";

/// Device memory of one device, cudaMalloc'd (not stream-ordered: NCCL may map it for peers).
template <class T>
class dev_array {
public:
    dev_array(int device, std::size_t n) : m_device(device), m_count(n) {
        cudawait::device_guard guard{cudawait::device_ref(device)};
        check(cudaMalloc(reinterpret_cast<void**>(&m_ptr), n * sizeof(T)), "cudaMalloc");
    }
    dev_array(const dev_array&) = delete;
    dev_array& operator=(const dev_array&) = delete;
    ~dev_array() { cudawait::detail::report(cudaFree(m_ptr), "cudaFree"); }

    [[nodiscard]] std::span<T> span() const { return {m_ptr, m_count}; }
    [[nodiscard]] std::span<T> slice(std::size_t at, std::size_t n) const {
        return {m_ptr + at, n};
    }
    // The legacy default stream's cudaMemcpy and cudaMemset may return before the device memory
    // is written, and the library's streams do not wait for that stream: both end with a device
    // synchronisation, so a collective enqueued next reads and overwrites settled memory.
    void upload(const std::vector<T>& v) {
        cudawait::device_guard guard{cudawait::device_ref(m_device)};
        check(cudaMemcpy(m_ptr, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice),
              "cudaMemcpy");
        check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    }
    [[nodiscard]] std::vector<T> download() const {
        std::vector<T> v(m_count);
        check(cudaMemcpy(v.data(), m_ptr, m_count * sizeof(T), cudaMemcpyDeviceToHost),
              "cudaMemcpy");
        return v;
    }
    /// All-ones bytes: NaN for floats, -1 / max for integers; no collective here produces it.
    void poison() {
        cudawait::device_guard guard{cudawait::device_ref(m_device)};
        check(cudaMemset(m_ptr, 0xff, m_count * sizeof(T)), "cudaMemset");
        check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    }

private:
    int m_device;
    std::size_t m_count;
    T* m_ptr = nullptr;
};

/// Random values that sum exactly in any order: integers, as T (floats included).
template <class T>
std::vector<T> random_values(std::size_t n, std::uint32_t seed, int lo = -1000, int hi = 1000) {
    std::mt19937 rng(seed);
    std::uniform_int_distribution<int> dist(lo, hi);
    std::vector<T> v(n);
    for (T& x : v) {
        x = static_cast<T>(dist(rng));
    }
    return v;
}

/// Compares every element; reports the first few mismatches.
template <class T>
::testing::AssertionResult same(const std::vector<T>& expected, const std::vector<T>& got) {
    if (expected.size() != got.size()) {
        return ::testing::AssertionFailure() << "sizes differ";
    }
    std::size_t bad = 0;
    std::string first;
    for (std::size_t i = 0; i < expected.size(); ++i) {
        if (std::memcmp(&expected[i], &got[i], sizeof(T)) != 0) {
            if (bad++ == 0) {
                first = "element " + std::to_string(i) + ": expected " +
                        std::to_string(expected[i]) + ", got " + std::to_string(got[i]);
            }
        }
    }
    if (bad == 0) {
        return ::testing::AssertionSuccess();
    }
    return ::testing::AssertionFailure() << bad << " of " << expected.size() << " wrong; " << first;
}

nccl::unique_id random_id(std::uint32_t seed) {
    nccl::unique_id id;
    std::mt19937 rng(seed);
    for (char& c : id.value.internal) {
        c = static_cast<char>(rng() & 0xff);
    }
    return id;
}

// ---- host -----------------------------------------------------------------------------------

static_assert(nccl::data_type_v<float> == ncclFloat32);
static_assert(nccl::data_type_v<double> == ncclFloat64);
static_assert(nccl::data_type_v<std::int8_t> == ncclInt8);
static_assert(nccl::data_type_v<std::uint8_t> == ncclUint8);
static_assert(nccl::data_type_v<std::int32_t> == ncclInt32);
static_assert(nccl::data_type_v<std::uint32_t> == ncclUint32);
static_assert(nccl::data_type_v<std::int64_t> == ncclInt64);
static_assert(nccl::data_type_v<std::uint64_t> == ncclUint64);
static_assert(nccl::data_type_v<const float> == ncclFloat32);
#if CUDAWAIT_NCCL_HAS_HALF
static_assert(nccl::data_type_v<__half> == ncclFloat16);
#endif
static_assert(!nccl::element<bool>);
static_assert(!nccl::element<std::int16_t>);
static_assert(!nccl::element<long double>);
static_assert(!std::is_copy_constructible_v<nccl::communicator>);
static_assert(std::is_nothrow_move_constructible_v<nccl::communicator>);
static_assert(std::is_nothrow_move_assignable_v<nccl::communicator>);

TEST(nccl_host, unique_id_hex_round_trip) {
    for (std::uint32_t seed : {1u, 2u, 3u}) {
        const nccl::unique_id id = random_id(seed);
        const std::string hex = id.to_hex();
        ASSERT_EQ(hex.size(), 2 * sizeof(ncclUniqueId::internal));
        EXPECT_EQ(hex.find_first_not_of("0123456789abcdef"), std::string::npos);
        EXPECT_TRUE(nccl::unique_id::from_hex(hex) == id);
        std::string upper = hex;
        std::transform(upper.begin(), upper.end(), upper.begin(),
                       [](unsigned char c) { return static_cast<char>(std::toupper(c)); });
        EXPECT_TRUE(nccl::unique_id::from_hex(upper) == id);
    }
    EXPECT_FALSE(random_id(1) == random_id(2));
}

TEST(nccl_host, bad_hex_is_an_invalid_argument) {
    const std::string good = random_id(7).to_hex();
    auto expect_invalid = [](const std::string& hex) {
        try {
            (void)nccl::unique_id::from_hex(hex);
            ADD_FAILURE() << "accepted " << hex.size() << " characters";
        } catch (const nccl::error& e) {
            EXPECT_EQ(e.result(), ncclInvalidArgument);
            EXPECT_FALSE(e.timed_out());
            EXPECT_NE(std::string(e.what()).find("from_hex"), std::string::npos) << e.what();
        }
    };
    expect_invalid("");
    expect_invalid(good.substr(1));
    expect_invalid(good + "0");
    std::string bad = good;
    bad[100] = 'g';
    expect_invalid(bad);
    bad = good;
    bad[0] = ' ';
    expect_invalid(bad);
}

TEST(nccl_host, unique_id_file_round_trip) {
    const auto dir = std::filesystem::temp_directory_path() /
                     ("cudawait_nccl_test_" + std::to_string(::getpid()));
    std::filesystem::create_directories(dir);
    const auto path = dir / "id";
    const nccl::unique_id id = random_id(11);
    id.write_file(path);
    EXPECT_TRUE(nccl::unique_id::read_file(path, 1s) == id);

    // A reader that starts first waits for the writer.
    const auto later = dir / "later";
    std::thread writer([&] {
        std::this_thread::sleep_for(100ms);
        random_id(12).write_file(later);
    });
    EXPECT_TRUE(nccl::unique_id::read_file(later, 10s) == random_id(12));
    writer.join();

    // No file: a timeout, after the wait.
    const auto t0 = std::chrono::steady_clock::now();
    try {
        (void)nccl::unique_id::read_file(dir / "never", 50ms);
        ADD_FAILURE() << "read a file that does not exist";
    } catch (const nccl::error& e) {
        EXPECT_TRUE(e.timed_out());
        EXPECT_GE(std::chrono::steady_clock::now() - t0, 50ms);
    }
    std::filesystem::remove_all(dir);
}

TEST(nccl_host, unique_id_from_env) {
    const char* name = "CUDAWAIT_NCCL_TEST_ID";
    const nccl::unique_id id = random_id(21);
    ASSERT_EQ(::setenv(name, id.to_hex().c_str(), 1), 0);
    EXPECT_TRUE(nccl::unique_id::from_env(name) == id);
    ASSERT_EQ(::setenv(name, "12ab", 1), 0);
    EXPECT_THROW((void)nccl::unique_id::from_env(name), nccl::error);
    ASSERT_EQ(::unsetenv(name), 0);
    try {
        (void)nccl::unique_id::from_env(name);
        ADD_FAILURE() << "an unset variable gave an id";
    } catch (const nccl::error& e) {
        EXPECT_EQ(e.result(), ncclInvalidArgument);
        EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << e.what();
    }
}

TEST(nccl_host, errors_name_the_call_and_the_result) {
    const nccl::error e(ncclSystemError, "ncclAllReduce", "peer gone");
    EXPECT_EQ(e.result(), ncclSystemError);
    EXPECT_FALSE(e.timed_out());
    EXPECT_STREQ(e.api(), "ncclAllReduce");
    const std::string what = e.what();
    EXPECT_NE(what.find("ncclAllReduce"), std::string::npos);
    EXPECT_NE(what.find(ncclGetErrorString(ncclSystemError)), std::string::npos);
    EXPECT_NE(what.find("peer gone"), std::string::npos);
    const nccl::error t = nccl::error::timeout("ncclBroadcast", 5ms);
    EXPECT_TRUE(t.timed_out());
    EXPECT_EQ(t.result(), ncclInProgress);
    EXPECT_NE(std::string(t.what()).find("5000000 ns"), std::string::npos) << t.what();
}

TEST(nccl_host, an_empty_communicator_is_a_usage_error) {
    nccl::communicator c;
    EXPECT_FALSE(c.valid());
    EXPECT_THROW((void)c.get(), cudawait::usage_error);
    EXPECT_THROW((void)nccl::wait(c, cudawait::stream_ref(cudaStreamPerThread)),
                 cudawait::usage_error);
    c.abort(); // nothing to abort: no call, no error
    EXPECT_THROW((void)nccl::communicator::init_all(std::span<const int>{}), cudawait::usage_error);
}

// ---- GPU ------------------------------------------------------------------------------------

class nccl_gpu : public cudawait::testing::gpu_test {
protected:
    void SetUp() override {
        ASSERT_TRUE(g_nvls_off);
        gpu_test::SetUp();
    }
};

/// One stream per communicator, on its device.
std::vector<stream> streams_for(const std::vector<nccl::communicator>& comms) {
    std::vector<stream> out;
    for (const auto& c : comms) {
        out.emplace_back(cudawait::device_ref(c.device()));
    }
    return out;
}

/// Runs make(r) for every rank inside one group (one thread drives every rank), then awaits
/// all the tasks it returned.
template <class Make>
void run_grouped(scheduler& s, int n, Make make) {
    auto body = [&]() -> task<void> {
        std::vector<task<void>> ts;
        {
            nccl::group g;
            for (int r = 0; r < n; ++r) {
                ts.push_back(make(r));
            }
            g.end();
        }
        co_await cudawait::when_all(std::move(ts));
    };
    sync_wait(s, body());
}

TEST_F(nccl_gpu, collectives_over_every_device_match_the_host) {
    auto comms = nccl::communicator::init_all();
    const int n = static_cast<int>(comms.size());
    ASSERT_EQ(n, cudawait::device_count());
    for (int r = 0; r < n; ++r) {
        EXPECT_EQ(comms[static_cast<std::size_t>(r)].rank(), r);
        EXPECT_EQ(comms[static_cast<std::size_t>(r)].size(), n);
        EXPECT_EQ(comms[static_cast<std::size_t>(r)].device(), r);
        EXPECT_TRUE(comms[static_cast<std::size_t>(r)].blocking());
    }
    auto streams = streams_for(comms);
    const auto un = static_cast<std::size_t>(n);
    constexpr std::size_t count = (std::size_t{1} << 16) + 3; // not a multiple of anything
    scheduler s;

    // Per rank: float and int32 inputs, and outputs of every shape.
    std::vector<std::vector<float>> f_in(un);
    std::vector<std::vector<std::int32_t>> i_in(un);
    std::vector<std::vector<float>> rs_in(un);
    std::vector<std::vector<std::int64_t>> l_in(un);
    std::vector<std::unique_ptr<dev_array<float>>> f_send, f_recv, rs_send, rs_recv, b_recv;
    std::vector<std::unique_ptr<dev_array<std::int32_t>>> i_send, i_recv, g_recv;
    std::vector<std::unique_ptr<dev_array<std::int64_t>>> l_send, l_recv;
    for (int r = 0; r < n; ++r) {
        const auto ur = static_cast<std::size_t>(r);
        f_in[ur] = random_values<float>(count, 100 + ur);
        i_in[ur] = random_values<std::int32_t>(count, 200 + ur, -1'000'000, 1'000'000);
        rs_in[ur] = random_values<float>(count * un, 300 + ur);
        l_in[ur] = random_values<std::int64_t>(count, 400 + ur, -1'000'000, 1'000'000);
        f_send.push_back(std::make_unique<dev_array<float>>(r, count));
        f_recv.push_back(std::make_unique<dev_array<float>>(r, count));
        b_recv.push_back(std::make_unique<dev_array<float>>(r, count));
        rs_send.push_back(std::make_unique<dev_array<float>>(r, count * un));
        rs_recv.push_back(std::make_unique<dev_array<float>>(r, count));
        i_send.push_back(std::make_unique<dev_array<std::int32_t>>(r, count));
        i_recv.push_back(std::make_unique<dev_array<std::int32_t>>(r, count));
        g_recv.push_back(std::make_unique<dev_array<std::int32_t>>(r, count * un));
        l_send.push_back(std::make_unique<dev_array<std::int64_t>>(r, count));
        l_recv.push_back(std::make_unique<dev_array<std::int64_t>>(r, count));
        f_send[ur]->upload(f_in[ur]);
        i_send[ur]->upload(i_in[ur]);
        rs_send[ur]->upload(rs_in[ur]);
        l_send[ur]->upload(l_in[ur]);
        for (auto* out : {f_recv[ur].get(), b_recv[ur].get(), rs_recv[ur].get()}) {
            out->poison();
        }
        i_recv[ur]->poison();
        g_recv[ur]->poison();
        l_recv[ur]->poison();
    }
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

    // The host's answers.
    std::vector<float> f_sum(count, 0.0f);
    std::vector<std::int32_t> i_sum(count, 0);
    std::vector<std::int64_t> l_max(count, INT64_MIN);
    std::vector<std::int32_t> gathered;
    for (std::size_t r = 0; r < un; ++r) {
        for (std::size_t i = 0; i < count; ++i) {
            f_sum[i] += f_in[r][i];
            i_sum[i] += i_in[r][i];
            l_max[i] = std::max(l_max[i], l_in[r][i]);
        }
        gathered.insert(gathered.end(), i_in[r].begin(), i_in[r].end());
    }
    const int root = n - 1;

    auto comm = [&](int r) -> nccl::communicator& { return comms[static_cast<std::size_t>(r)]; };
    auto st = [&](int r) { return cudawait::stream_ref(streams[static_cast<std::size_t>(r)]); };
    auto at = [](auto& v, int r) -> auto& { return *v[static_cast<std::size_t>(r)]; };
    run_grouped(s, n, [&](int r) {
        return nccl::all_reduce<float>(at(f_send, r).span(), at(f_recv, r).span(), ncclSum, comm(r),
                                       st(r));
    });
    run_grouped(s, n, [&](int r) {
        return nccl::all_reduce<std::int32_t>(at(i_send, r).span(), at(i_recv, r).span(), ncclSum,
                                              comm(r), st(r));
    });
    run_grouped(s, n, [&](int r) {
        return nccl::broadcast<float>(at(f_send, r).span(), at(b_recv, r).span(), root, comm(r),
                                      st(r));
    });
    run_grouped(s, n, [&](int r) {
        return nccl::all_gather<std::int32_t>(at(i_send, r).span(), at(g_recv, r).span(), comm(r),
                                              st(r));
    });
    run_grouped(s, n, [&](int r) {
        return nccl::reduce_scatter<float>(at(rs_send, r).span(), at(rs_recv, r).span(), ncclSum,
                                           comm(r), st(r));
    });
    run_grouped(s, n, [&](int r) {
        return nccl::reduce<std::int64_t>(at(l_send, r).span(), at(l_recv, r).span(), ncclMax, 0,
                                          comm(r), st(r));
    });

    for (int r = 0; r < n; ++r) {
        const auto ur = static_cast<std::size_t>(r);
        SCOPED_TRACE("rank " + std::to_string(r));
        EXPECT_TRUE(same(f_sum, at(f_recv, r).download())) << "all_reduce float sum";
        EXPECT_TRUE(same(i_sum, at(i_recv, r).download())) << "all_reduce int32 sum";
        EXPECT_TRUE(same(f_in[static_cast<std::size_t>(root)], at(b_recv, r).download()))
            << "broadcast";
        EXPECT_TRUE(same(gathered, at(g_recv, r).download())) << "all_gather";
        std::vector<float> block(count, 0.0f);
        for (std::size_t q = 0; q < un; ++q) {
            for (std::size_t i = 0; i < count; ++i) {
                block[i] += rs_in[q][ur * count + i];
            }
        }
        EXPECT_TRUE(same(block, at(rs_recv, r).download())) << "reduce_scatter";
        if (r == 0) {
            EXPECT_TRUE(same(l_max, at(l_recv, r).download())) << "reduce max at the root";
        }
    }
}

TEST_F(nccl_gpu, several_all_reduces_in_one_group) {
    auto comms = nccl::communicator::init_all();
    const int n = static_cast<int>(comms.size());
    const auto un = static_cast<std::size_t>(n);
    auto streams = streams_for(comms);
    constexpr std::size_t count = 4099;
    scheduler s;
    std::vector<std::vector<float>> a_in(un);
    std::vector<std::vector<std::int32_t>> b_in(un);
    std::vector<std::vector<std::uint64_t>> c_in(un);
    std::vector<std::unique_ptr<dev_array<float>>> a_send, a_recv;
    std::vector<std::unique_ptr<dev_array<std::int32_t>>> b_send, b_recv;
    std::vector<std::unique_ptr<dev_array<std::uint64_t>>> c_buf; // in place
    for (int r = 0; r < n; ++r) {
        const auto ur = static_cast<std::size_t>(r);
        a_in[ur] = random_values<float>(count, 500 + ur);
        b_in[ur] = random_values<std::int32_t>(count, 600 + ur, -1'000'000, 1'000'000);
        c_in[ur] = random_values<std::uint64_t>(count, 700 + ur, 0, 1'000'000);
        a_send.push_back(std::make_unique<dev_array<float>>(r, count));
        a_recv.push_back(std::make_unique<dev_array<float>>(r, count));
        b_send.push_back(std::make_unique<dev_array<std::int32_t>>(r, count));
        b_recv.push_back(std::make_unique<dev_array<std::int32_t>>(r, count));
        c_buf.push_back(std::make_unique<dev_array<std::uint64_t>>(r, count));
        a_send[ur]->upload(a_in[ur]);
        b_send[ur]->upload(b_in[ur]);
        c_buf[ur]->upload(c_in[ur]);
        a_recv[ur]->poison();
        b_recv[ur]->poison();
    }
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

    auto body = [&]() -> task<void> {
        {
            nccl::group g;
            for (std::size_t r = 0; r < un; ++r) {
                stream& st = streams[r];
                nccl::all_reduce_async<float>(a_send[r]->span(), a_recv[r]->span(), ncclSum,
                                              comms[r], st);
                nccl::all_reduce_async<std::int32_t>(b_send[r]->span(), b_recv[r]->span(), ncclMax,
                                                     comms[r], st);
                nccl::all_reduce_async<std::uint64_t>(c_buf[r]->span(), c_buf[r]->span(), ncclSum,
                                                      comms[r], st);
            }
            g.end();
        }
        std::vector<task<void>> waits;
        for (std::size_t r = 0; r < un; ++r) {
            waits.push_back(nccl::wait(comms[r], streams[r], {.timeout = 60s}));
        }
        co_await cudawait::when_all(std::move(waits));
    };
    sync_wait(s, body());

    std::vector<float> a_sum(count, 0.0f);
    std::vector<std::int32_t> b_max(count, INT32_MIN);
    std::vector<std::uint64_t> c_sum(count, 0);
    for (std::size_t r = 0; r < un; ++r) {
        for (std::size_t i = 0; i < count; ++i) {
            a_sum[i] += a_in[r][i];
            b_max[i] = std::max(b_max[i], b_in[r][i]);
            c_sum[i] += c_in[r][i];
        }
    }
    for (std::size_t r = 0; r < un; ++r) {
        SCOPED_TRACE("rank " + std::to_string(r));
        EXPECT_TRUE(same(a_sum, a_recv[r]->download()));
        EXPECT_TRUE(same(b_max, b_recv[r]->download()));
        EXPECT_TRUE(same(c_sum, c_buf[r]->download())) << "in place";
        EXPECT_TRUE(comms[r].valid());
    }
}

TEST_F(nccl_gpu, awaiting_inside_an_open_group_is_a_usage_error) {
    std::vector<int> zero{0};
    auto comms = nccl::communicator::init_all(zero);
    stream st;
    dev_array<float> buf(0, 256);
    buf.upload(random_values<float>(256, 9));
    scheduler s;
    auto body = [&]() -> task<bool> {
        bool refused = false;
        nccl::group g;
        auto t = nccl::all_reduce<float>(buf.span(), buf.span(), ncclSum, comms[0], st);
        try {
            co_await t;
        } catch (const cudawait::usage_error&) {
            refused = true;
        }
        g.end();
        co_await nccl::wait(comms[0], st);
        co_return refused;
    };
    EXPECT_TRUE(sync_wait(s, body()));
    EXPECT_TRUE(comms[0].valid());
}

TEST_F(nccl_gpu, sizes_that_do_not_fit_are_usage_errors) {
    std::vector<int> zero{0};
    auto comms = nccl::communicator::init_all(zero);
    stream st;
    dev_array<float> a(0, 64);
    dev_array<float> b(0, 32);
    EXPECT_THROW(nccl::all_reduce_async<float>(a.span(), b.span(), ncclSum, comms[0], st),
                 cudawait::usage_error);
    EXPECT_THROW(nccl::all_gather_async<float>(a.span(), b.span(), comms[0], st),
                 cudawait::usage_error);
    EXPECT_THROW(nccl::reduce_scatter_async<float>(b.span(), a.span(), ncclSum, comms[0], st),
                 cudawait::usage_error);
    st.sync();
}

// The multi-process form: the parent makes the id, a child started with it in its environment
// joins (here as the only rank of its own communicator) and checks an all_reduce.
TEST(nccl_child, DISABLED_rank_from_env) {
    if (std::getenv(kChildVar) == nullptr) {
        GTEST_SKIP() << "runs only as the child of nccl_gpu.a_child_process_joins_by_the_id";
    }
    ASSERT_STREQ(std::getenv("NCCL_NVLS_ENABLE"), "0");
    const nccl::unique_id id = nccl::unique_id::from_env();
    nccl::communicator comm = nccl::communicator::init_rank(id, 1, 0, 0);
    ASSERT_EQ(comm.size(), 1);
    ASSERT_EQ(comm.rank(), 0);
    stream st;
    constexpr std::size_t count = 10007;
    const auto in = random_values<float>(count, 31);
    dev_array<float> send(0, count);
    dev_array<float> recv(0, count);
    send.upload(in);
    recv.poison();
    scheduler s;
    sync_wait(
        s, nccl::all_reduce<float>(send.span(), recv.span(), ncclSum, comm, st, {.timeout = 60s}));
    EXPECT_TRUE(same(in, recv.download()));
}

TEST_F(nccl_gpu, a_child_process_joins_by_the_id) {
    const nccl::unique_id id = nccl::unique_id::create();
    std::vector<std::string> env_strings;
    for (char** e = environ; *e != nullptr; ++e) {
        const std::string_view kv(*e);
        if (kv.starts_with("CUDAWAIT_NCCL_ID=") || kv.starts_with("NCCL_NVLS_ENABLE=") ||
            kv.starts_with(std::string(kChildVar) + "=")) {
            continue;
        }
        env_strings.emplace_back(kv);
    }
    env_strings.push_back("CUDAWAIT_NCCL_ID=" + id.to_hex());
    env_strings.push_back("NCCL_NVLS_ENABLE=0");
    env_strings.push_back(std::string(kChildVar) + "=1");
    std::vector<char*> envp;
    for (auto& kv : env_strings) {
        envp.push_back(kv.data());
    }
    envp.push_back(nullptr);
    std::string exe = "/proc/self/exe";
    std::string filter = "--gtest_filter=nccl_child.DISABLED_rank_from_env";
    std::string disabled = "--gtest_also_run_disabled_tests";
    char* argv[] = {exe.data(), filter.data(), disabled.data(), nullptr};
    pid_t pid = 0;
    ASSERT_EQ(::posix_spawn(&pid, exe.c_str(), nullptr, nullptr, argv, envp.data()), 0);

    const auto deadline = std::chrono::steady_clock::now() + 120s;
    int status = 0;
    pid_t done = 0;
    while ((done = ::waitpid(pid, &status, WNOHANG)) == 0 &&
           std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(20ms);
    }
    if (done == 0) {
        ::kill(pid, SIGKILL);
        (void)::waitpid(pid, &status, 0);
        FAIL() << "the child did not finish within 120 s";
    }
    ASSERT_EQ(done, pid);
    ASSERT_TRUE(WIFEXITED(status)) << "the child died of signal " << WTERMSIG(status);
    EXPECT_EQ(WEXITSTATUS(status), 0) << "the child's all_reduce failed (its output is above)";
}

// Stall 1: rank 0 of 2, and rank 1 never comes. The non-blocking init gives up at the timeout;
// the half-made communicator is aborted off the loop and the scheduler waits for that abort.
TEST_F(nccl_gpu, an_init_whose_peer_never_joins_times_out) {
    const nccl::unique_id id = nccl::unique_id::create();
    const auto t0 = std::chrono::steady_clock::now();
    std::chrono::steady_clock::duration threw_after{};
    {
        scheduler s;
        try {
            (void)sync_wait(s, nccl::communicator::init_rank_async(
                                   id, 2, 0, 0, nccl::wait_options{.timeout = 2s}));
            ADD_FAILURE() << "a 2-rank communicator was made with one rank";
        } catch (const nccl::error& e) {
            threw_after = std::chrono::steady_clock::now() - t0;
            EXPECT_TRUE(e.timed_out()) << e.what();
        }
    } // the scheduler's destructor waits for the abort's thread
    EXPECT_GE(threw_after, 2s);
    EXPECT_LT(threw_after, 2s + 3s);
    EXPECT_LT(std::chrono::steady_clock::now() - t0, 2s + 60s) << "the abort took too long";
}

// Stall 2: the stream never reaches the collective while the await's timeout runs (a kernel
// before it spins on a flag). The await throws at the timeout; the event it recorded stays
// tracked; once the flag is raised everything drains and nothing leaks.
TEST_F(nccl_gpu, an_await_whose_stream_stalls_times_out_and_aborts) {
    std::vector<int> zero{0};
    auto comms = nccl::communicator::init_all(zero);
    stream st;
    cudawait::testing::mapped_words flag(1);
    flag.write(0, 0);
    constexpr std::size_t count = 4096;
    const auto in = random_values<float>(count, 41);
    dev_array<float> send(0, count);
    dev_array<float> recv(0, count);
    send.upload(in);
    recv.poison();
    {
        scheduler s;
        std::size_t tracked = 0;
        std::chrono::steady_clock::duration threw_after{};
        auto body = [&]() -> task<bool> {
            // Ends by itself after 20 s if the flag never comes, so a failure cannot hang.
            check(cudawait::testing::launch_wait_flag(flag.device, 20'000'000'000ull, st.get()),
                  "launch_wait_flag");
            const auto t0 = std::chrono::steady_clock::now();
            try {
                co_await nccl::all_reduce<float>(send.span(), recv.span(), ncclSum, comms[0], st,
                                                 {.timeout = 300ms});
            } catch (const nccl::error& e) {
                threw_after = std::chrono::steady_clock::now() - t0;
                tracked = s.pending().event_waits;
                co_return e.timed_out();
            }
            co_return false;
        };
        EXPECT_TRUE(sync_wait(s, body()));
        EXPECT_GE(threw_after, 300ms);
        EXPECT_LT(threw_after, 300ms + 3s);
        EXPECT_EQ(tracked, 1u) << "the abandoned wait's event must stay tracked";
        EXPECT_FALSE(st.is_done()) << "the kernel must still be spinning";
        EXPECT_FALSE(comms[0].valid()) << "the communicator is aborted";
        flag.write(0, 1);
        st.sync();
        s.run(); // the event wait and the abort's thread
        const auto left = s.pending();
        EXPECT_EQ(left.event_waits, 0u);
        EXPECT_EQ(left.stream_waits, 0u);
    }
}

// Two awaits on one communicator, neither of whose collectives can run (each stream held by a
// kernel spinning on a flag, as a rank that never joins would hold them): the first times out
// and aborts the communicator; the second, with a far longer timeout, must stop polling the
// aborted handle (ncclCommAbort frees it) and fail at once with the same error. Before, it kept
// calling ncclCommGetAsyncError on the handle while another thread aborted it, and failed only at
// its own timeout.
TEST_F(nccl_gpu, awaits_on_a_communicator_another_await_aborted_fail_with_its_error) {
    std::vector<int> zero{0};
    auto comms = nccl::communicator::init_all(zero);
    stream s1;
    stream s2;
    cudawait::testing::mapped_words flag(1);
    flag.write(0, 0);
    constexpr std::size_t count = 4096;
    const auto in = random_values<float>(count, 43);
    dev_array<float> send(0, count);
    dev_array<float> recv1(0, count);
    dev_array<float> recv2(0, count);
    send.upload(in);
    recv1.poison();
    recv2.poison();
    using clock = std::chrono::steady_clock;
    struct outcome {
        bool threw = false;
        bool timed_out = false;
        std::string what;
        clock::duration after{};
    };
    outcome first;
    outcome second;
    {
        scheduler s;
        const auto t0 = clock::now();
        auto await_one = [&](dev_array<float>& recv, stream& st, std::chrono::nanoseconds timeout,
                             outcome& out) -> task<void> {
            try {
                co_await nccl::all_reduce<float>(send.span(), recv.span(), ncclSum, comms[0], st,
                                                 {.timeout = timeout});
            } catch (const nccl::error& e) {
                out = {true, e.timed_out(), e.what(), clock::now() - t0};
            }
        };
        // Both kernels end by themselves after 20 s if the flag never comes: a failure cannot
        // hang.
        for (stream* st : {&s1, &s2}) {
            check(cudawait::testing::launch_wait_flag(flag.device, 20'000'000'000ull, st->get()),
                  "launch_wait_flag");
        }
        sync_wait(s, cudawait::when_all(await_one(recv1, s1, 300ms, first),
                                        await_one(recv2, s2, 15s, second)));
        EXPECT_FALSE(comms[0].valid()) << "the communicator is aborted";
        EXPECT_FALSE(s1.is_done()) << "the kernel must still be spinning";
        flag.write(0, 1);
        s1.sync();
        s2.sync();
        s.run(); // the event waits and the abort's thread
        const auto left = s.pending();
        EXPECT_EQ(left.event_waits, 0u);
        EXPECT_EQ(left.stream_waits, 0u);
    }
    ASSERT_TRUE(first.threw) << "the first await did not fail";
    ASSERT_TRUE(second.threw) << "the second await did not fail";
    EXPECT_TRUE(first.timed_out) << first.what;
    EXPECT_GE(first.after, 300ms);
    EXPECT_TRUE(second.timed_out) << second.what;
    EXPECT_EQ(second.what, first.what) << "the second await fails with the abort's error";
    EXPECT_LT(second.after, first.after + 2s)
        << "the second await went on after the abort (it failed after "
        << std::chrono::duration<double>(second.after).count() << " s)";
}

} // namespace
