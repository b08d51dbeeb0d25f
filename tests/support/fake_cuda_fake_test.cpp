// SPDX-License-Identifier: Apache-2.0
// The fake CUDA runtime itself (tests/support/fake_cuda.hpp): holding and releasing work, the
// device rule of cudaEventRecord, how the special stream handles resolve per thread and device,
// dependencies through cudaStreamWaitEvent, handle reuse, fault injection; and a scheduler
// awaiting a cudawait::stream on top of it.
#include <cudawait/core/scheduler.hpp>
#include <cudawait/core/sync_wait.hpp>
#include <cudawait/core/task.hpp>
#include <cudawait/runtime/device.hpp>
#include <cudawait/runtime/stream.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <future>
#include <stdexcept>
#include <thread>
#include <vector>

#include <cuda.h>
#include <cuda_runtime_api.h>

#include "fake_cuda.hpp"
#include <gtest/gtest.h>

namespace {

using namespace std::chrono_literals;
namespace fake = cudawait::fake_cuda;

class fake_cuda : public ::testing::Test {
protected:
    void SetUp() override { fake::reset(); }
    void TearDown() override { fake::release_all(); }

    static cudaStream_t make_stream() {
        cudaStream_t s = nullptr;
        EXPECT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
        return s;
    }
    static cudaEvent_t make_event(unsigned flags = cudaEventDisableTiming) {
        cudaEvent_t e = nullptr;
        EXPECT_EQ(cudaEventCreateWithFlags(&e, flags), cudaSuccess);
        return e;
    }
};

/// True where `f` is still blocked after `d`.
bool still_blocked(std::future<cudaError_t>& f, std::chrono::milliseconds d = 50ms) {
    return f.wait_for(d) == std::future_status::timeout;
}

TEST_F(fake_cuda, work_completes_at_once_unless_its_stream_hangs) {
    // What earlier tests of this process left alive stays (fake_cuda.hpp: reset).
    const std::size_t streams = fake::live_streams();
    const std::size_t events = fake::live_events();
    cudaStream_t s = make_stream();
    cudaEvent_t before = make_event();
    cudaEvent_t during = make_event();
    cudaEvent_t never = make_event();
    EXPECT_EQ(cudaEventQuery(never), cudaSuccess) << "an event never recorded is complete";
    ASSERT_EQ(cudaEventRecord(before, s), cudaSuccess);
    fake::hang(s);
    ASSERT_EQ(cudaEventRecord(during, s), cudaSuccess);
    EXPECT_EQ(cudaEventQuery(before), cudaSuccess) << "recorded before the hang";
    EXPECT_EQ(cudaEventQuery(during), cudaErrorNotReady);
    EXPECT_EQ(cudaStreamQuery(s), cudaErrorNotReady);
    EXPECT_EQ(cudaGetLastError(), cudaSuccess) << "cudaErrorNotReady is not an error to keep";
    fake::release(s);
    EXPECT_EQ(cudaEventQuery(during), cudaSuccess);
    EXPECT_EQ(cudaStreamQuery(s), cudaSuccess);
    ASSERT_EQ(cudaEventRecord(during, s), cudaSuccess);
    EXPECT_EQ(cudaEventQuery(during), cudaSuccess) << "the release ended the hang";
    EXPECT_EQ(fake::live_streams(), streams + 1);
    EXPECT_EQ(fake::live_events(), events + 3);
    for (cudaEvent_t e : {before, during, never}) {
        EXPECT_EQ(cudaEventDestroy(e), cudaSuccess);
    }
    EXPECT_EQ(cudaStreamDestroy(s), cudaSuccess);
    EXPECT_EQ(fake::live_streams(), streams);
    EXPECT_EQ(fake::live_events(), events);
}

TEST_F(fake_cuda, synchronize_blocks_until_another_thread_releases) {
    cudaStream_t s = make_stream();
    cudaEvent_t e = make_event();
    fake::hang(s);
    ASSERT_EQ(cudaEventRecord(e, s), cudaSuccess);
    auto on_event = std::async(std::launch::async, [e] { return cudaEventSynchronize(e); });
    auto on_stream = std::async(std::launch::async, [s] { return cudaStreamSynchronize(s); });
    EXPECT_TRUE(still_blocked(on_event));
    EXPECT_TRUE(still_blocked(on_stream));
    fake::release(s);
    ASSERT_EQ(on_event.wait_for(10s), std::future_status::ready);
    ASSERT_EQ(on_stream.wait_for(10s), std::future_status::ready);
    EXPECT_EQ(on_event.get(), cudaSuccess);
    EXPECT_EQ(on_stream.get(), cudaSuccess);
    EXPECT_EQ(cudaEventDestroy(e), cudaSuccess);
    EXPECT_EQ(cudaStreamDestroy(s), cudaSuccess);
}

TEST_F(fake_cuda, an_event_records_only_on_streams_of_its_device) {
    fake::set_device_count(2);
    cudaEvent_t on0 = make_event();
    ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
    cudaStream_t s1 = make_stream();
    cudaEvent_t on1 = make_event();
    EXPECT_EQ(fake::stream_device(s1), 1);
    int dev = -1;
    ASSERT_EQ(cudaStreamGetDevice(s1, &dev), cudaSuccess);
    EXPECT_EQ(dev, 1);
    EXPECT_EQ(cudaEventRecord(on0, s1), cudaErrorInvalidResourceHandle);
    EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidResourceHandle);
    EXPECT_EQ(cudaGetLastError(), cudaSuccess) << "read and cleared";
    EXPECT_EQ(cudaEventRecord(on1, s1), cudaSuccess);
    EXPECT_FALSE(fake::last_record(on0).has_value());
    EXPECT_EQ(cudaSetDevice(2), cudaErrorInvalidDevice);
    EXPECT_EQ(cudaPeekAtLastError(), cudaErrorInvalidDevice);
    EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidDevice);
    ASSERT_EQ(cudaGetDevice(&dev), cudaSuccess);
    EXPECT_EQ(dev, 1) << "a refused cudaSetDevice changes nothing";
    EXPECT_EQ(cudaStreamDestroy(s1), cudaSuccess);
}

TEST_F(fake_cuda, special_handles_resolve_per_device_and_thread) {
    fake::set_device_count(2);
    cudaEvent_t e0 = make_event();
    ASSERT_EQ(cudaEventRecord(e0, cudaStreamLegacy), cudaSuccess);
    const auto legacy0 = fake::last_record(e0);
    ASSERT_TRUE(legacy0.has_value());
    EXPECT_TRUE(legacy0->legacy);
    EXPECT_FALSE(legacy0->per_thread);
    EXPECT_EQ(legacy0->device, 0);
    EXPECT_EQ(legacy0->thread, std::this_thread::get_id());
    ASSERT_EQ(cudaEventRecord(e0, nullptr), cudaSuccess);
    EXPECT_EQ(fake::last_record(e0)->stream, legacy0->stream) << "0 is the legacy stream";
    ASSERT_EQ(cudaEventRecord(e0, cudaStreamPerThread), cudaSuccess);
    const auto mine0 = fake::last_record(e0);
    EXPECT_TRUE(mine0->per_thread);
    EXPECT_NE(mine0->stream, legacy0->stream);

    ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
    cudaEvent_t e1 = make_event();
    int dev = -1;
    ASSERT_EQ(cudaStreamGetDevice(cudaStreamLegacy, &dev), cudaSuccess);
    EXPECT_EQ(dev, 1);
    EXPECT_EQ(fake::stream_device(cudaStreamPerThread), 1);
    EXPECT_EQ(cudaEventRecord(e0, cudaStreamLegacy), cudaErrorInvalidResourceHandle)
        << "the legacy stream of device 1 is not device 0's";
    ASSERT_EQ(cudaEventRecord(e1, cudaStreamLegacy), cudaSuccess);
    const auto legacy1 = fake::last_record(e1);
    EXPECT_EQ(legacy1->device, 1);
    EXPECT_NE(legacy1->stream, legacy0->stream);
    EXPECT_EQ(fake::stream_device(legacy1->stream), 1);

    // Another thread, on device 0: the same legacy stream, a per-thread stream of its own.
    std::thread([&] {
        cudaEvent_t e = make_event();
        EXPECT_EQ(cudaEventRecord(e, cudaStreamLegacy), cudaSuccess);
        EXPECT_EQ(fake::last_record(e)->stream, legacy0->stream);
        EXPECT_EQ(cudaEventRecord(e, cudaStreamPerThread), cudaSuccess);
        const auto theirs = fake::last_record(e);
        EXPECT_TRUE(theirs->per_thread);
        EXPECT_EQ(theirs->device, 0);
        EXPECT_NE(theirs->stream, mine0->stream);
        EXPECT_NE(theirs->thread, mine0->thread);
        // A hang of this thread's per-thread stream holds nothing of the main thread's.
        fake::hang(cudaStreamPerThread);
        EXPECT_EQ(cudaEventRecord(e, cudaStreamPerThread), cudaSuccess);
        EXPECT_EQ(cudaEventQuery(e), cudaErrorNotReady);
        EXPECT_EQ(cudaEventDestroy(e), cudaSuccess);
    }).join();
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
    ASSERT_EQ(cudaEventRecord(e0, cudaStreamPerThread), cudaSuccess);
    EXPECT_EQ(fake::last_record(e0)->stream, mine0->stream);
    EXPECT_EQ(cudaEventQuery(e0), cudaSuccess);
    // hang() resolves the way the runtime does: the legacy stream of the current device.
    fake::hang(nullptr);
    ASSERT_EQ(cudaEventRecord(e0, cudaStreamLegacy), cudaSuccess);
    EXPECT_EQ(cudaEventQuery(e0), cudaErrorNotReady);
    ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
    ASSERT_EQ(cudaEventRecord(e1, cudaStreamLegacy), cudaSuccess);
    EXPECT_EQ(cudaEventQuery(e1), cudaSuccess) << "device 1's legacy stream does not hang";
    fake::release(legacy0->stream);
    EXPECT_EQ(cudaEventQuery(e0), cudaSuccess);
}

TEST_F(fake_cuda, work_after_a_stream_wait_waits_for_the_event) {
    cudaStream_t a = make_stream();
    cudaStream_t b = make_stream();
    cudaStream_t c = make_stream();
    cudaEvent_t on_a = make_event();
    cudaEvent_t b_before = make_event();
    cudaEvent_t b_after = make_event();
    cudaEvent_t c_after = make_event();
    fake::hang(a);
    ASSERT_EQ(cudaEventRecord(on_a, a), cudaSuccess);
    ASSERT_EQ(cudaEventRecord(b_before, b), cudaSuccess);
    ASSERT_EQ(cudaStreamWaitEvent(b, on_a, 0), cudaSuccess);
    ASSERT_EQ(cudaEventRecord(b_after, b), cudaSuccess);
    // Through a second stream: c waits for b_after, which waits for on_a.
    ASSERT_EQ(cudaStreamWaitEvent(c, b_after, 0), cudaSuccess);
    ASSERT_EQ(cudaEventRecord(c_after, c), cudaSuccess);
    EXPECT_EQ(cudaEventQuery(b_before), cudaSuccess);
    EXPECT_EQ(cudaEventQuery(b_after), cudaErrorNotReady);
    EXPECT_EQ(cudaEventQuery(c_after), cudaErrorNotReady);
    EXPECT_EQ(cudaStreamQuery(b), cudaErrorNotReady);
    EXPECT_EQ(cudaStreamQuery(c), cudaErrorNotReady);
    // Re-recording on_a elsewhere does not free what waited for its earlier record.
    ASSERT_EQ(cudaEventRecord(on_a, c), cudaSuccess);
    EXPECT_EQ(cudaEventQuery(b_after), cudaErrorNotReady);
    auto sync_c = std::async(std::launch::async, [c] { return cudaStreamSynchronize(c); });
    EXPECT_TRUE(still_blocked(sync_c));
    fake::release(a);
    ASSERT_EQ(sync_c.wait_for(10s), std::future_status::ready);
    EXPECT_EQ(sync_c.get(), cudaSuccess);
    EXPECT_EQ(cudaEventQuery(b_after), cudaSuccess);
    EXPECT_EQ(cudaEventQuery(c_after), cudaSuccess);
    EXPECT_EQ(cudaStreamQuery(b), cudaSuccess);
    // A wait for an event never recorded, or complete, holds nothing.
    cudaEvent_t fresh = make_event();
    ASSERT_EQ(cudaStreamWaitEvent(b, fresh, 0), cudaSuccess);
    ASSERT_EQ(cudaEventRecord(b_after, b), cudaSuccess);
    EXPECT_EQ(cudaEventQuery(b_after), cudaSuccess);
    for (cudaStream_t s : {a, b, c}) {
        EXPECT_EQ(cudaStreamDestroy(s), cudaSuccess);
    }
}

TEST_F(fake_cuda, destroyed_handles_are_refused_and_counted) {
    cudaStream_t s = make_stream();
    cudaEvent_t e = make_event();
    ASSERT_EQ(cudaStreamDestroy(s), cudaSuccess);
    ASSERT_EQ(cudaEventDestroy(e), cudaSuccess);
    EXPECT_EQ(fake::dead_handle_calls(), 0u);
    EXPECT_EQ(cudaStreamQuery(s), cudaErrorInvalidResourceHandle);
    EXPECT_EQ(cudaEventQuery(e), cudaErrorInvalidResourceHandle);
    EXPECT_EQ(cudaStreamDestroy(s), cudaErrorInvalidResourceHandle);
    EXPECT_EQ(fake::dead_handle_calls(), 3u);
    EXPECT_EQ(fake::stream_device(s), 0) << "a destroyed stream keeps its device";
    EXPECT_EQ(fake::stream_device(reinterpret_cast<cudaStream_t>(&s)), -1);
    EXPECT_EQ(cudaStreamQuery(reinterpret_cast<cudaStream_t>(&s)), cudaErrorInvalidResourceHandle);
    EXPECT_EQ(fake::dead_handle_calls(), 4u);
    EXPECT_THROW(fake::hang(reinterpret_cast<cudaStream_t>(&s)), std::invalid_argument);
}

TEST_F(fake_cuda, reuse_hands_out_the_handle_destroyed_last) {
    cudaStream_t first = make_stream();
    cudaStream_t second = make_stream();
    ASSERT_EQ(cudaStreamDestroy(first), cudaSuccess);
    ASSERT_EQ(cudaStreamDestroy(second), cudaSuccess);
    cudaStream_t fresh = make_stream();
    EXPECT_NE(fresh, first);
    EXPECT_NE(fresh, second) << "reuse is off by default";
    fake::reuse_handles(true);
    fake::set_device_count(2);
    ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
    cudaStream_t again = make_stream();
    EXPECT_EQ(again, second);
    EXPECT_EQ(fake::stream_device(again), 1) << "a new stream under the old handle";
    EXPECT_EQ(cudaStreamQuery(again), cudaSuccess);
    EXPECT_EQ(make_stream(), first);
    EXPECT_NE(make_stream(), first) << "nothing destroyed is left to hand out";
    cudaEvent_t e = make_event();
    ASSERT_EQ(cudaEventDestroy(e), cudaSuccess);
    EXPECT_EQ(make_event(), e);
    EXPECT_EQ(fake::dead_handle_calls(), 0u);
}

TEST_F(fake_cuda, fail_next_fails_the_named_entry_point_so_many_times) {
    const std::size_t streams = fake::live_streams();
    fake::fail_next("cudaStreamCreateWithFlags", cudaErrorMemoryAllocation, 2);
    cudaStream_t s = nullptr;
    EXPECT_EQ(cudaStreamCreateWithFlags(&s, 0), cudaErrorMemoryAllocation);
    EXPECT_EQ(cudaGetLastError(), cudaErrorMemoryAllocation);
    EXPECT_EQ(cudaStreamCreateWithPriority(&s, 0, 0), cudaSuccess) << "another entry point";
    EXPECT_EQ(cudaStreamCreateWithFlags(&s, 0), cudaErrorMemoryAllocation);
    EXPECT_EQ(fake::live_streams(), streams + 1) << "a failed call makes nothing";
    EXPECT_EQ(cudaStreamCreateWithFlags(&s, 0), cudaSuccess);
    EXPECT_EQ(fake::calls("cudaStreamCreateWithFlags"), 3u);
    EXPECT_EQ(fake::calls("cudaStreamCreateWithPriority"), 1u);
    EXPECT_EQ(fake::calls("cudaStreamDestroy"), 0u);
    fake::fail_next("cudaLaunchKernel", cudaErrorNoKernelImageForDevice);
    EXPECT_EQ(cudaLaunchKernel(nullptr, dim3(1), dim3(1), nullptr, 0, s),
              cudaErrorNoKernelImageForDevice);
    EXPECT_EQ(cudaLaunchKernel(nullptr, dim3(1), dim3(1), nullptr, 0, s), cudaSuccess);
    EXPECT_EQ(cudaLaunchHostFunc(s, nullptr, nullptr), cudaErrorNotSupported);
    fake::reset();
    EXPECT_EQ(fake::calls("cudaLaunchKernel"), 0u);
}

TEST_F(fake_cuda, block_next_blocks_one_call_of_the_entry_point_on_the_device_until_unblock) {
    fake::set_device_count(2);
    fake::block_next("cudaStreamCreateWithFlags", 1);
    cudaStream_t on0 = make_stream(); // device 0 is current: not blocked
    EXPECT_FALSE(fake::wait_blocked(0ms));
    cudaStream_t on1 = nullptr;
    auto blocked = std::async(std::launch::async, [&on1] {
        const cudaError_t st = cudaSetDevice(1);
        return st != cudaSuccess ? st : cudaStreamCreateWithFlags(&on1, cudaStreamNonBlocking);
    });
    EXPECT_TRUE(fake::wait_blocked(10s));
    EXPECT_TRUE(still_blocked(blocked));
    // Other calls go on meanwhile, on either device and from any thread, that entry point's too.
    cudaStream_t other = nullptr;
    EXPECT_EQ(cudaSetDevice(1), cudaSuccess);
    EXPECT_EQ(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking), cudaSuccess);
    EXPECT_EQ(cudaStreamQuery(on0), cudaSuccess);
    fake::unblock();
    ASSERT_EQ(blocked.wait_for(10s), std::future_status::ready);
    EXPECT_EQ(blocked.get(), cudaSuccess);
    EXPECT_EQ(fake::stream_device(on1), 1);
    EXPECT_FALSE(fake::wait_blocked(0ms));
    EXPECT_EQ(fake::calls("cudaStreamCreateWithFlags"), 3u);
    for (cudaStream_t s : {on0, on1, other}) {
        EXPECT_EQ(cudaStreamDestroy(s), cudaSuccess);
    }
}

TEST_F(fake_cuda, memory_is_host_memory_the_runtime_classifies) {
    void* dev = nullptr;
    void* pinned = nullptr;
    ASSERT_EQ(cudaMalloc(&dev, 64), cudaSuccess);
    ASSERT_EQ(cudaHostAlloc(&pinned, 64, cudaHostAllocMapped), cudaSuccess);
    std::vector<std::uint8_t> pageable(64);
    for (std::size_t i = 0; i < pageable.size(); ++i) {
        pageable[i] = static_cast<std::uint8_t>(i * 7 + 1);
    }
    cudaStream_t s = make_stream();
    ASSERT_EQ(cudaMemsetAsync(dev, 0xee, 64, s), cudaSuccess);
    ASSERT_EQ(cudaMemcpyAsync(dev, pageable.data(), 32, cudaMemcpyHostToDevice, s), cudaSuccess);
    ASSERT_EQ(cudaMemcpyAsync(pinned, dev, 64, cudaMemcpyDeviceToHost, s), cudaSuccess);
    const auto* got = static_cast<const std::uint8_t*>(pinned);
    for (std::size_t i = 0; i < 64; ++i) {
        ASSERT_EQ(got[i], i < 32 ? pageable[i] : 0xee) << i;
    }
    cudaPointerAttributes a{};
    ASSERT_EQ(cudaPointerGetAttributes(&a, static_cast<char*>(dev) + 10), cudaSuccess);
    EXPECT_EQ(a.type, cudaMemoryTypeDevice);
    ASSERT_EQ(cudaPointerGetAttributes(&a, pinned), cudaSuccess);
    EXPECT_EQ(a.type, cudaMemoryTypeHost);
    ASSERT_EQ(cudaPointerGetAttributes(&a, pageable.data()), cudaSuccess);
    EXPECT_EQ(a.type, cudaMemoryTypeUnregistered);
    ASSERT_EQ(cudaHostRegister(pageable.data(), 64, cudaHostRegisterDefault), cudaSuccess);
    EXPECT_EQ(cudaHostRegister(pageable.data() + 8, 8, 0), cudaErrorHostMemoryAlreadyRegistered);
    ASSERT_EQ(cudaPointerGetAttributes(&a, pageable.data() + 63), cudaSuccess);
    EXPECT_EQ(a.type, cudaMemoryTypeHost);
    EXPECT_EQ(cudaHostUnregister(pageable.data()), cudaSuccess);
    EXPECT_EQ(cudaHostUnregister(pageable.data()), cudaErrorHostMemoryNotRegistered);
    EXPECT_EQ(cudaFree(pinned), cudaErrorInvalidValue) << "pinned memory goes to cudaFreeHost";
    EXPECT_EQ(cudaFreeHost(pinned), cudaSuccess);
    EXPECT_EQ(cudaFree(dev), cudaSuccess);
    EXPECT_EQ(cudaFree(dev), cudaErrorInvalidValue);
    EXPECT_EQ(cudaStreamDestroy(s), cudaSuccess);
}

/// A host function whose address stands for a __global__ function's.
void some_kernel() {}

TEST_F(fake_cuda, a_kernel_launches_only_on_a_stream_of_the_current_device) {
    fake::set_device_count(2);
    ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
    cudaStream_t s1 = make_stream();
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
    const void* k = reinterpret_cast<const void*>(&some_kernel);
    EXPECT_EQ(cudaLaunchKernel(k, dim3(1), dim3(1), nullptr, 0, s1),
              cudaErrorInvalidResourceHandle);
    EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidResourceHandle);
    EXPECT_EQ(cudaMemsetAsync(nullptr, 0, 0, s1), cudaSuccess) << "other work is not refused";
    ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
    EXPECT_EQ(cudaLaunchKernel(k, dim3(1), dim3(1), nullptr, 0, s1), cudaSuccess);
    EXPECT_EQ(cudaLaunchKernel(k, dim3(1), dim3(1), nullptr, 0, cudaStreamPerThread), cudaSuccess);
    // A library kernel takes its stream's context, whichever device is current.
    cudaLibrary_t lib = nullptr;
    cudaKernel_t lk = nullptr;
    ASSERT_EQ(cudaLibraryLoadData(&lib, "ptx", nullptr, nullptr, 0, nullptr, nullptr, 0),
              cudaSuccess);
    ASSERT_EQ(cudaLibraryGetKernel(&lk, lib, "k"), cudaSuccess);
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
    EXPECT_EQ(cudaLaunchKernel(reinterpret_cast<const void*>(lk), dim3(1), dim3(1), nullptr, 0, s1),
              cudaSuccess);
    const auto l = fake::launches();
    ASSERT_EQ(l.size(), 4u);
    const int want[4][3] = {{0, 1, cudaErrorInvalidResourceHandle},
                            {1, 1, cudaSuccess},
                            {1, 1, cudaSuccess},
                            {0, 1, cudaSuccess}};
    for (std::size_t i = 0; i < l.size(); ++i) {
        EXPECT_EQ(l[i].api, "cudaLaunchKernel") << i;
        EXPECT_EQ(l[i].function, i < 3 ? k : reinterpret_cast<const void*>(lk)) << i;
        EXPECT_EQ(l[i].current_device, want[i][0]) << i;
        EXPECT_EQ(l[i].stream_device, want[i][1]) << i;
        EXPECT_EQ(l[i].result, want[i][2]) << i;
    }
    fake::reset();
    EXPECT_TRUE(fake::launches().empty());
    EXPECT_EQ(cudaStreamDestroy(s1), cudaSuccess);
}

TEST_F(fake_cuda, the_driver_loads_and_launches_module_functions_that_a_test_defines) {
    fake::set_device_count(2);
    using load_fn = CUresult (*)(CUmodule*, const void*);
    using get_fn = CUresult (*)(CUfunction*, CUmodule, const char*);
    using launch_fn = CUresult (*)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned,
                                   unsigned, unsigned, CUstream, void**, void**);
    auto entry = [](const char* name) {
        void* fn = nullptr;
        cudaDriverEntryPointQueryResult found{};
        EXPECT_EQ(cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &found),
                  cudaSuccess);
        EXPECT_EQ(found == cudaDriverEntryPointSuccess, fn != nullptr) << name;
        return fn;
    };
    EXPECT_EQ(entry("cuStreamWaitValue32"), nullptr) << "no stream memory operations";
    const auto load = reinterpret_cast<load_fn>(entry("cuModuleLoadData"));
    const auto get = reinterpret_cast<get_fn>(entry("cuModuleGetFunction"));
    const auto launch = reinterpret_cast<launch_fn>(entry("cuLaunchKernel"));
    ASSERT_NE(load, nullptr);
    ASSERT_NE(get, nullptr);
    ASSERT_NE(launch, nullptr);
    ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
    cudaStream_t s1 = make_stream();
    CUmodule m = nullptr;
    CUfunction f = nullptr;
    ASSERT_EQ(load(&m, "ptx"), CUDA_SUCCESS);
    ASSERT_EQ(get(&f, m, "add_one"), CUDA_SUCCESS);
    fake::define_kernel("add_one", [](void** params) { ++**static_cast<int**>(params[0]); });
    int value = 41;
    int* arg = &value;
    void* params[] = {&arg};
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
    EXPECT_EQ(launch(f, 1, 1, 1, 1, 1, 1, 0, reinterpret_cast<CUstream>(s1), params, nullptr),
              CUDA_ERROR_INVALID_HANDLE);
    EXPECT_EQ(value, 41) << "a refused launch runs nothing";
    EXPECT_EQ(cudaGetLastError(), cudaSuccess) << "the driver's errors are not the runtime's";
    ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
    EXPECT_EQ(launch(f, 1, 1, 1, 1, 1, 1, 0, reinterpret_cast<CUstream>(s1), params, nullptr),
              CUDA_SUCCESS);
    EXPECT_EQ(value, 42);
    fake::define_kernel("add_one", nullptr);
    EXPECT_EQ(launch(f, 1, 1, 1, 1, 1, 1, 0, reinterpret_cast<CUstream>(s1), params, nullptr),
              CUDA_SUCCESS);
    EXPECT_EQ(value, 42) << "undefined again: it does nothing";
    const auto l = fake::launches();
    ASSERT_EQ(l.size(), 3u);
    EXPECT_EQ(l[0].api, "cuLaunchKernel");
    EXPECT_EQ(l[0].name, "add_one");
    EXPECT_EQ(l[0].function, static_cast<const void*>(f));
    EXPECT_EQ(l[0].current_device, 0);
    EXPECT_EQ(l[0].stream_device, 1);
    EXPECT_EQ(l[0].result, cudaErrorInvalidResourceHandle);
    EXPECT_EQ(l[1].current_device, 1);
    EXPECT_EQ(l[1].result, cudaSuccess);
    EXPECT_EQ(fake::calls("cuLaunchKernel"), 3u);
    EXPECT_EQ(cudaStreamDestroy(s1), cudaSuccess);
}

// ---- the library on top of it ---------------------------------------------------------------

TEST_F(fake_cuda, a_scheduler_awaits_a_stream) {
    cudawait::scheduler sched;
    cudawait::stream s(cudawait::device_ref(0));
    const int got = cudawait::sync_wait(sched, [&]() -> cudawait::task<int> {
        co_await s;
        co_return 7;
    }());
    EXPECT_EQ(got, 7);
    EXPECT_GE(fake::calls("cudaEventRecord"), 1u);
    EXPECT_EQ(fake::dead_handle_calls(), 0u);
}

TEST_F(fake_cuda, a_scheduler_resumes_an_await_on_a_hung_stream_after_its_release) {
    cudawait::scheduler sched;
    cudawait::stream s(cudawait::device_ref(0));
    fake::hang(s.get());
    std::atomic<bool> released{false};
    std::jthread releaser([&] {
        std::this_thread::sleep_for(100ms);
        released.store(true);
        fake::release(s.get());
    });
    const bool after = cudawait::sync_wait(sched, [&]() -> cudawait::task<bool> {
        co_await s;
        co_return released.load();
    }());
    EXPECT_TRUE(after) << "resumed before the stream's work completed";
    EXPECT_EQ(fake::dead_handle_calls(), 0u);
}

} // namespace
