// SPDX-License-Identifier: Apache-2.0
#pragma once

// Copies made by the SMs instead of a copy engine, for the small copy lane: a kernel shipped as
// PTX text (no nvcc in the user's build), loaded once per process and device with
// cudaLibraryLoadData, launched with cudaLaunchKernel. See docs/copy.md#sm-copies.

#include <cudawait/runtime/detail/fork_guard.hpp>
#include <cudawait/runtime/device.hpp>
#include <cudawait/runtime/error.hpp>
#include <cudawait/runtime/stream.hpp>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <mutex>
#include <vector>

#include <cuda_runtime_api.h>

namespace cudawait::detail {

/// The kernel `cudawait_sm_copy(const u8* src, u8* dst, u64 bytes)`, as PTX.
inline constexpr char sm_copy_ptx[] = R"ptx(
.version 7.0
.target sm_50
.address_size 64

.visible .entry cudawait_sm_copy(
	.param .u64 cudawait_sm_copy_param_0,
	.param .u64 cudawait_sm_copy_param_1,
	.param .u64 cudawait_sm_copy_param_2
)
{
	.reg .pred 	%p<9>;
	.reg .b16 	%rs<2>;
	.reg .b32 	%r<14>;
	.reg .b64 	%rd<33>;

	ld.param.u64 	%rd15, [cudawait_sm_copy_param_0];
	ld.param.u64 	%rd16, [cudawait_sm_copy_param_1];
	ld.param.u64 	%rd14, [cudawait_sm_copy_param_2];
	cvta.to.global.u64 	%rd1, %rd16;
	cvta.to.global.u64 	%rd2, %rd15;
	mov.u32 	%r1, %nctaid.x;
	mov.u32 	%r2, %ntid.x;
	mul.wide.u32 	%rd3, %r1, %r2;
	mov.u32 	%r3, %ctaid.x;
	mul.wide.u32 	%rd17, %r3, %r2;
	mov.u32 	%r4, %tid.x;
	cvt.u64.u32 	%rd18, %r4;
	add.s64 	%rd30, %rd17, %rd18;
	or.b64  	%rd19, %rd16, %rd15;
	or.b64  	%rd5, %rd19, %rd14;
	and.b64  	%rd20, %rd5, 15;
	setp.eq.s64 	%p1, %rd20, 0;
	@%p1 bra 	$L__BB0_6;

	and.b64  	%rd21, %rd5, 3;
	setp.eq.s64 	%p2, %rd21, 0;
	@%p2 bra 	$L__BB0_4;

	setp.ge.u64 	%p3, %rd30, %rd14;
	@%p3 bra 	$L__BB0_8;

$L__BB0_3:
	add.s64 	%rd22, %rd2, %rd30;
	ld.global.u8 	%rs1, [%rd22];
	add.s64 	%rd23, %rd1, %rd30;
	st.global.u8 	[%rd23], %rs1;
	add.s64 	%rd30, %rd30, %rd3;
	setp.lt.u64 	%p4, %rd30, %rd14;
	@%p4 bra 	$L__BB0_3;
	bra.uni 	$L__BB0_8;

$L__BB0_6:
	shr.u64 	%rd11, %rd14, 4;
	setp.ge.u64 	%p7, %rd30, %rd11;
	@%p7 bra 	$L__BB0_8;

$L__BB0_7:
	shl.b64 	%rd27, %rd30, 4;
	add.s64 	%rd28, %rd1, %rd27;
	add.s64 	%rd29, %rd2, %rd27;
	ld.global.v4.u32 	{%r6, %r7, %r8, %r9}, [%rd29];
	st.global.v4.u32 	[%rd28], {%r6, %r7, %r8, %r9};
	add.s64 	%rd30, %rd30, %rd3;
	setp.lt.u64 	%p8, %rd30, %rd11;
	@%p8 bra 	$L__BB0_7;
	bra.uni 	$L__BB0_8;

$L__BB0_4:
	shr.u64 	%rd8, %rd14, 2;
	setp.ge.u64 	%p5, %rd30, %rd8;
	@%p5 bra 	$L__BB0_8;

$L__BB0_5:
	shl.b64 	%rd24, %rd30, 2;
	add.s64 	%rd25, %rd2, %rd24;
	ld.global.u32 	%r5, [%rd25];
	add.s64 	%rd26, %rd1, %rd24;
	st.global.u32 	[%rd26], %r5;
	add.s64 	%rd30, %rd30, %rd3;
	setp.lt.u64 	%p6, %rd30, %rd8;
	@%p6 bra 	$L__BB0_5;

$L__BB0_8:
	ret;

}
)ptx";

/// The kernel's name in sm_copy_ptx.
inline constexpr char sm_copy_kernel_name[] = "cudawait_sm_copy";
/// Test hook: the PTX text the process loads the kernel from (sm_copy_ptx), read at the first
/// load: other text makes the load fail as on a device or driver the PTX does not suit.
inline std::atomic<const char*> g_sm_copy_ptx{sm_copy_ptx};
/// SM copies enqueued by the process so far (for the tests: which way a copy went).
inline std::atomic<unsigned long long> sm_copies_enqueued{0};

/// Threads per block, and the most blocks: 16 x 256 threads move 64 KiB in one pass of 16-byte
/// words.
inline constexpr unsigned sm_copy_threads = 256;
inline constexpr unsigned sm_copy_max_blocks = 16;

/// True for a status that says the kernel's code cannot be made to run on the device: no code for
/// its architecture, PTX the driver cannot compile (an ISA version newer than the driver's, a
/// target newer than the device), no JIT compiler. Such a failure leaves the context usable:
/// preload_sm_copy turns SM copies off on that device instead of failing.
[[nodiscard]] constexpr bool sm_copy_load_failure(cudaError_t status) noexcept {
    switch (status) {
    case cudaErrorNoKernelImageForDevice:
    case cudaErrorInvalidKernelImage:
    case cudaErrorInvalidPtx:
    case cudaErrorUnsupportedPtxVersion:
    case cudaErrorJitCompilerNotFound:
    case cudaErrorJitCompilationDisabled:
        return true;
    default:
        return false;
    }
}

/// The loaded kernel (cudaLibraryLoadData on first use, then kept for the process). PTX the
/// driver cannot compile for the device fails when the kernel is looked up (cudaLibraryGetKernel:
/// cudaErrorInvalidPtx for a target newer than an H200's sm_90); a failure is not kept, a later
/// call tries again.
/// @throws usage_error in a child forked after the parent loaded it; cuda_error (a driver that
///         cannot compile the PTX, for instance: sm_copy_load_failure)
template <class = void>
[[nodiscard]] cudaKernel_t sm_copy_kernel() {
    struct loaded {
        std::mutex mutex;
        fork_stamp stamp;
        cudaKernel_t kernel = nullptr;
    };
    static loaded* const state = new loaded(); // never destroyed, like the library
    std::lock_guard lock(state->mutex);
    if (state->stamp.inherited()) {
        throw usage_error("cudawait: the small-copy kernel was loaded before fork(); CUDA state "
                          "cannot be inherited by the child");
    }
    if (state->kernel == nullptr) {
        cudaLibrary_t library = nullptr;
        check(cudaLibraryLoadData(&library, g_sm_copy_ptx.load(), nullptr, nullptr, 0, nullptr,
                                  nullptr, 0),
              "cudaLibraryLoadData (the small-copy kernel)");
        cudaKernel_t kernel = nullptr;
        const cudaError_t st = cudaLibraryGetKernel(&kernel, library, sm_copy_kernel_name);
        if (st != cudaSuccess) {
            report(cudaLibraryUnload(library), "cudaLibraryUnload");
            check(st, "cudaLibraryGetKernel (the small-copy kernel)");
        }
        state->kernel = kernel;
    }
    return state->kernel;
}

/// The address by which device `dev` reaches page-locked host memory `p`, or nullptr where it
/// has none (memory that is not page-locked, or not mapped into the device's address space).
/// @throws cuda_error
template <class = void>
[[nodiscard]] void* host_memory_on_device(const void* p, device_ref dev) {
    device_guard on(dev);
    cudaPointerAttributes a{};
    check(cudaPointerGetAttributes(&a, p), "cudaPointerGetAttributes");
    return a.type == cudaMemoryTypeHost ? a.devicePointer : nullptr;
}

/// Launches the kernel over `bytes` (0: it touches nothing) on `s`, a stream of `dev`.
/// @throws cuda_error
template <class = void>
void launch_sm_copy(void* dst, const void* src, std::size_t bytes, device_ref dev, stream_ref s) {
    const cudaKernel_t kernel = sm_copy_kernel();
    const std::size_t per_pass = std::size_t{sm_copy_threads} * 16;
    const auto blocks = static_cast<unsigned>(
        std::clamp<std::size_t>((bytes + per_pass - 1) / per_pass, 1, sm_copy_max_blocks));
    const void* from = src;
    void* to = dst;
    unsigned long long count = bytes;
    void* args[] = {&from, &to, &count};
    device_guard on(dev);
    check(cudaLaunchKernel(reinterpret_cast<const void*>(kernel), dim3(blocks),
                           dim3(sm_copy_threads), args, 0, s.get()),
          "cudaLaunchKernel (the small-copy kernel)");
}

/// Enqueues the SM copy of `bytes` from `src` to `dst` (both addresses the device `dev` can
/// use) on `s`, a stream of `dev`.
/// @throws cuda_error
template <class = void>
void enqueue_sm_copy(void* dst, const void* src, std::size_t bytes, device_ref dev, stream_ref s) {
    launch_sm_copy(dst, src, bytes, dev, s);
    sm_copies_enqueued.fetch_add(1, std::memory_order_relaxed);
}

/// Per device id, whether the kernel is loaded there or cannot be, for the process (never
/// destroyed, like the kernel). Thread-safe. A class template (of an unused parameter, always
/// void) for the reason the functions here are templates; spelled sm_copy_devices.
template <class Unused = void>
class basic_sm_copy_devices {
public:
    enum state : unsigned char { unknown, loaded, unavailable };

    [[nodiscard]] static state get(device_ref dev) {
        table& t = instance();
        const auto id = static_cast<std::size_t>(dev.get());
        std::lock_guard lock(t.mutex);
        return id < t.states.size() ? t.states[id] : unknown;
    }
    static void set(device_ref dev, state s) {
        table& t = instance();
        const auto id = static_cast<std::size_t>(dev.get());
        std::lock_guard lock(t.mutex);
        if (t.states.size() <= id) {
            t.states.resize(id + 1, unknown);
        }
        t.states[id] = s;
    }

private:
    struct table {
        std::mutex mutex;
        std::vector<state> states;
    };
    static table& instance() {
        static table* const t = new table();
        return *t;
    }
};

using sm_copy_devices = basic_sm_copy_devices<>;

/// Loads the kernel on `dev` once per process and says whether SM copies can be made there.
/// cudaFuncGetAttributes with `dev` current makes the driver load it (as a first launch would),
/// without enqueueing anything. Loading waits for the work the device is running, and meanwhile
/// blocks every CUDA call of other threads on that device (measured on an H200, driver 580: for a
/// launch, cudaFuncGetAttributes and cudaKernelSetAttributeForDevice alike; a kernel's loading
/// cannot be had without that wait). So a first small copy made by the SMs beside a bulk copy
/// would wait for the bulk copy (1 GiB, in the tests): whatever makes bulk D2H copies that send
/// small copies to the SMs (a pipeline when it is made, the bulk lane before its first D2H copy)
/// loads the kernel before that work, and copy.hpp's sm_route loads it where nothing did. Where
/// the kernel's code cannot run on `dev` (sm_copy_load_failure), that is kept: false from then on,
/// and copies there take a copy engine.
/// @throws cuda_error for any other failure (a sticky error, for instance); usage_error in a
///         child forked after the parent loaded the kernel
template <class = void>
bool preload_sm_copy(device_ref dev) {
    if (const auto known = sm_copy_devices::get(dev); known != sm_copy_devices::unknown) {
        return known == sm_copy_devices::loaded;
    }
    try {
        device_guard on(dev);
        cudaFuncAttributes attributes{};
        check(cudaFuncGetAttributes(&attributes, reinterpret_cast<const void*>(sm_copy_kernel())),
              "cudaFuncGetAttributes (loading the small-copy kernel)");
    } catch (const cuda_error& e) {
        if (!sm_copy_load_failure(e.status())) {
            throw;
        }
        sm_copy_devices::set(dev, sm_copy_devices::unavailable); // check() cleared the error
        return false;
    }
    sm_copy_devices::set(dev, sm_copy_devices::loaded);
    return true;
}

} // namespace cudawait::detail
