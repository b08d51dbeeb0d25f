// SPDX-License-Identifier: Apache-2.0
// The fake CUDA runtime (fake_cuda.hpp says what it models): the runtime's entry points as
// extern "C" functions, spelled as <cuda_runtime_api.h> declares them, and the control API.
#include "fake_cuda.hpp"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <cuda.h>
#include <cuda_runtime_api.h>

namespace cudawait::fake_cuda {
namespace {

/// A record on a stream (or a synchronize's snapshot of it): complete once it is not held and
/// every record the stream had waited for before it is complete. Completion never goes back.
struct mark {
    bool held = false;
    bool done = false;
    std::vector<std::shared_ptr<mark>> after;
};
using mark_ptr = std::shared_ptr<mark>;

bool complete(mark& m) {
    if (m.done) {
        return true;
    }
    if (m.held || !std::all_of(m.after.begin(), m.after.end(),
                               [](const mark_ptr& a) { return complete(*a); })) {
        return false;
    }
    m.after.clear();
    m.done = true;
    return true;
}

struct stream_obj {
    int device = 0;
    unsigned flags = 0;
    int priority = 0;
    bool legacy = false;     ///< the legacy stream of `device`
    bool per_thread = false; ///< a thread's per-thread stream of `device`
    bool dead = false;
    bool hung = false;
    std::vector<mark_ptr> held;  ///< records a release() completes
    std::vector<mark_ptr> waits; ///< what later records wait for (cudaStreamWaitEvent)
};

struct event_obj {
    int device = 0;
    unsigned flags = 0;
    bool dead = false;
    mark_ptr last; ///< the last record; none: complete
    std::optional<record_info> where;
};

/// A module (cuModuleLoadData) or one of its functions (cuModuleGetFunction): bound to the
/// device current where the module was loaded, as a driver context's are.
struct module_obj {
    int device = 0;
    std::string name; ///< a function's name
    const module_obj* module = nullptr;
};

enum class memory { device, host, managed, registered };
struct allocation {
    std::size_t bytes;
    memory kind;
    int device;
};

constexpr int least_priority = 0;
constexpr int greatest_priority = -5;

/// Everything, under one mutex. Never destroyed: the tests' static destructors may call in.
/// Streams and events are never freed either: a handle stays unique, and what the library keeps
/// for the process (the copy lanes, the event pools) stays valid across reset().
struct state {
    std::mutex mutex;
    std::condition_variable changed; ///< a release
    int device_count = 1;
    bool reuse = false;
    // Keyed by handle (the object's address); destroyed ones stay, marked dead.
    std::unordered_map<const void*, std::unique_ptr<stream_obj>> streams;
    std::unordered_map<const void*, std::unique_ptr<event_obj>> events;
    std::vector<stream_obj*> destroyed_streams; ///< the handles reuse_handles hands out
    std::vector<event_obj*> destroyed_events;
    std::map<int, stream_obj*> legacy;
    std::map<std::pair<std::thread::id, int>, stream_obj*> per_thread;
    std::vector<mark_ptr> orphans; ///< held records of streams whose handles were reused
    std::map<std::string, std::size_t, std::less<>> calls;
    std::map<std::string, std::pair<cudaError_t, int>, std::less<>> failures;
    std::size_t dead_calls = 0;
    std::set<std::pair<int, int>> peers;
    std::map<std::uintptr_t, allocation> allocations; ///< by start address
    std::vector<std::unique_ptr<char>> tokens;        ///< libraries and kernels
    std::set<const void*> library_kernels;            ///< cudaLibraryGetKernel's handles
    std::vector<std::unique_ptr<module_obj>> modules; ///< modules and their functions
    std::vector<launch_info> launches;
    std::map<std::string, std::function<void(void**)>, std::less<>> kernel_bodies;
    std::optional<std::pair<std::string, int>> block; ///< block_next's entry point and device
    bool blocked = false;                             ///< a call waits in block_next's hook
    std::uint64_t unblocks = 0;                       ///< unblock() calls, so far
};

state& g() {
    static state* const s = new state();
    return *s;
}

thread_local int t_device = 0;
thread_local cudaError_t t_last = cudaSuccess;

// ---- helpers (called with the mutex held) ----------------------------------------------------

stream_obj* special_stream(bool per_thread) {
    state& st = g();
    stream_obj*& slot =
        per_thread ? st.per_thread[{std::this_thread::get_id(), t_device}] : st.legacy[t_device];
    if (slot == nullptr) {
        auto s = std::make_unique<stream_obj>();
        s->device = t_device;
        s->legacy = !per_thread;
        s->per_thread = per_thread;
        slot = s.get();
        st.streams.emplace(slot, std::move(s));
    }
    return slot;
}

/// The stream object `s` names, dead ones included; nullptr for a handle never made.
stream_obj* any_stream(cudaStream_t s) {
    if (s == nullptr || s == cudaStreamLegacy || s == cudaStreamPerThread) {
        return special_stream(s == cudaStreamPerThread);
    }
    auto it = g().streams.find(s);
    return it != g().streams.end() ? it->second.get() : nullptr;
}

/// The live stream `s` names; nullptr (counted) for a destroyed or unknown handle.
stream_obj* live_stream(cudaStream_t s) {
    stream_obj* o = any_stream(s);
    if (o == nullptr || o->dead) {
        ++g().dead_calls;
        return nullptr;
    }
    return o;
}

event_obj* live_event(cudaEvent_t e) {
    auto it = g().events.find(e);
    if (it == g().events.end() || it->second->dead) {
        ++g().dead_calls;
        return nullptr;
    }
    return it->second.get();
}

bool idle(stream_obj& s) {
    std::erase_if(s.waits, [](const mark_ptr& w) { return complete(*w); });
    return !s.hung && s.waits.empty();
}

/// A record of what `s` holds now: held while it hangs, after what it waited for.
mark_ptr snapshot(stream_obj& s) {
    auto m = std::make_shared<mark>();
    std::erase_if(s.waits, [](const mark_ptr& w) { return complete(*w); });
    m->after = s.waits;
    m->held = s.hung;
    if (m->held) {
        s.held.push_back(m);
    }
    return m;
}

void release_stream(stream_obj& s) {
    s.hung = false;
    for (const mark_ptr& m : s.held) {
        m->held = false;
    }
    s.held.clear();
}

/// Blocks until every mark of `marks` is complete.
void wait_for(std::unique_lock<std::mutex>& lock, const std::vector<mark_ptr>& marks) {
    g().changed.wait(lock, [&] {
        return std::all_of(marks.begin(), marks.end(),
                           [](const mark_ptr& m) { return complete(*m); });
    });
}

bool valid_device(int d) { return d >= 0 && d < g().device_count; }

const std::pair<const std::uintptr_t, allocation>* find_memory(const void* p) {
    const auto a = reinterpret_cast<std::uintptr_t>(p);
    auto it = g().allocations.upper_bound(a);
    if (it == g().allocations.begin()) {
        return nullptr;
    }
    --it;
    return a < it->first + std::max<std::size_t>(it->second.bytes, 1) ? &*it : nullptr;
}

/// Copies where both sides are host memory: every allocation of the fake is, and so is an
/// unknown address that `kind` does not call device memory.
void copy_bytes(void* dst, const void* src, std::size_t n, cudaMemcpyKind kind) {
    const bool dst_device = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice;
    const bool src_device = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice;
    if (n != 0 && dst != nullptr && src != nullptr &&
        (find_memory(dst) != nullptr || !dst_device) &&
        (find_memory(src) != nullptr || !src_device)) {
        std::memmove(dst, src, n);
    }
}

/// Writes `value` to `*out`, where `out` is not null.
template <class T, class V>
cudaError_t put(T* out, V value) {
    if (out == nullptr) {
        return cudaErrorInvalidValue;
    }
    *out = static_cast<T>(value);
    return cudaSuccess;
}

cudaError_t allocate(void** p, std::size_t bytes, memory kind) {
    if (p == nullptr) {
        return cudaErrorInvalidValue;
    }
    constexpr std::size_t align = 256;
    void* m =
        std::aligned_alloc(align, (std::max<std::size_t>(bytes, 1) + align - 1) / align * align);
    if (m == nullptr) {
        return cudaErrorMemoryAllocation;
    }
    g().allocations.emplace(reinterpret_cast<std::uintptr_t>(m), allocation{bytes, kind, t_device});
    *p = m;
    return cudaSuccess;
}

cudaError_t deallocate(void* p, bool host) {
    if (p == nullptr) {
        return cudaSuccess;
    }
    auto it = g().allocations.find(reinterpret_cast<std::uintptr_t>(p));
    if (it == g().allocations.end() || it->second.kind == memory::registered ||
        (it->second.kind == memory::host) != host) {
        return cudaErrorInvalidValue;
    }
    g().allocations.erase(it);
    std::free(p);
    return cudaSuccess;
}

/// Runs entry point `api`: counts the call, applies a fail_next hook, runs `body` under the
/// mutex and keeps a failure as the thread's last error.
cudaError_t run(
    const char* api, const std::function<cudaError_t(std::unique_lock<std::mutex>&)>& body =
                         [](std::unique_lock<std::mutex>&) { return cudaSuccess; }) {
    std::unique_lock lock(g().mutex);
    ++g().calls[api];
    if (g().block && g().block->first == api && g().block->second == t_device) {
        // block_next: waits, the mutex free, until unblock().
        g().block.reset();
        g().blocked = true;
        g().changed.notify_all();
        const std::uint64_t gen = g().unblocks;
        g().changed.wait(lock, [gen] { return g().unblocks != gen; });
    }
    cudaError_t st = cudaSuccess;
    if (auto it = g().failures.find(std::string_view(api)); it != g().failures.end()) {
        st = it->second.first;
        if (--it->second.second <= 0) {
            g().failures.erase(it);
        }
    } else {
        st = body(lock);
    }
    if (st != cudaSuccess && st != cudaErrorNotReady) {
        t_last = st;
    }
    return st;
}

/// An entry point the fake does not support.
cudaError_t unsupported(const char* api) {
    return run(api, [](auto&) { return cudaErrorNotSupported; });
}

/// A stream-ordered operation that has no effect here beyond its stream's validity.
cudaError_t on_stream(const char* api, cudaStream_t s, const std::function<void()>& effect = {}) {
    return run(api, [&](auto&) {
        if (live_stream(s) == nullptr) {
            return cudaErrorInvalidResourceHandle;
        }
        if (effect) {
            effect();
        }
        return cudaSuccess;
    });
}

cudaError_t create_stream(const char* api, cudaStream_t* out, unsigned flags, int priority) {
    return run(api, [&](auto&) {
        if (out == nullptr) {
            return cudaErrorInvalidValue;
        }
        state& st = g();
        stream_obj* s = nullptr;
        if (st.reuse && !st.destroyed_streams.empty()) {
            s = st.destroyed_streams.back();
            st.destroyed_streams.pop_back();
            st.orphans.insert(st.orphans.end(), s->held.begin(), s->held.end());
            *s = stream_obj{};
        } else {
            auto made = std::make_unique<stream_obj>();
            s = made.get();
            st.streams.emplace(s, std::move(made));
        }
        s->device = t_device;
        s->flags = flags;
        s->priority = std::clamp(priority, greatest_priority, least_priority);
        *out = reinterpret_cast<cudaStream_t>(s);
        return cudaSuccess;
    });
}

cudaError_t create_event(const char* api, cudaEvent_t* out, unsigned flags) {
    return run(api, [&](auto&) {
        if (out == nullptr) {
            return cudaErrorInvalidValue;
        }
        state& st = g();
        event_obj* e = nullptr;
        if (st.reuse && !st.destroyed_events.empty()) {
            e = st.destroyed_events.back();
            st.destroyed_events.pop_back();
            *e = event_obj{};
        } else {
            auto made = std::make_unique<event_obj>();
            e = made.get();
            st.events.emplace(e, std::move(made));
        }
        e->device = t_device;
        e->flags = flags;
        *out = reinterpret_cast<cudaEvent_t>(e);
        return cudaSuccess;
    });
}

cudaError_t record(const char* api, cudaEvent_t e, cudaStream_t s) {
    return run(api, [&](auto&) {
        event_obj* ev = live_event(e);
        stream_obj* so = ev != nullptr ? live_stream(s) : nullptr;
        if (so == nullptr) {
            return cudaErrorInvalidResourceHandle;
        }
        if (so->device != ev->device) {
            return cudaErrorInvalidResourceHandle; // an event records on streams of its device
        }
        ev->last = snapshot(*so);
        ev->where = record_info{reinterpret_cast<cudaStream_t>(so), so->device, so->per_thread,
                                so->legacy, std::this_thread::get_id()};
        return cudaSuccess;
    });
}

/// Checks and records a kernel launch of `function` on `s`. A function bound to a device
/// (`bound` >= 0: a __global__ function, loaded in the current context, or a CUfunction) launches
/// only with that device current and on one of its streams; a library kernel (`bound` -1) runs in
/// its stream's context, whichever device is current.
cudaError_t launch(const char* api, const void* function, const std::string& name, cudaStream_t s,
                   int bound) {
    const stream_obj* so = live_stream(s);
    cudaError_t st = cudaSuccess;
    if (so == nullptr) {
        st = cudaErrorInvalidResourceHandle;
    } else if (bound >= 0 && (so->device != t_device || bound != t_device)) {
        st = cudaErrorInvalidResourceHandle; // a stream (or function) of another device
    }
    g().launches.push_back(
        launch_info{api, function, name, t_device, so != nullptr ? so->device : -1, st});
    return st;
}

/// The module or function handle `h`, or nullptr.
const module_obj* find_module(const void* h) {
    for (const auto& m : g().modules) {
        if (m.get() == h) {
            return m.get();
        }
    }
    return nullptr;
}

/// Runs driver entry point `api` as run() does, but leaves the runtime's last error alone.
CUresult driver_run(const char* api,
                    const std::function<cudaError_t(std::unique_lock<std::mutex>&)>& body) {
    const cudaError_t last = t_last;
    const cudaError_t st = run(api, body);
    t_last = last;
    return static_cast<CUresult>(st); // the codes the fake returns agree (1, 400)
}

// The driver's entry points the fake provides (driver_function): the watchdog's heartbeat
// loads and launches its kernel through them.

CUresult CUDAAPI fake_module_load_data(CUmodule* module, const void* image) {
    return driver_run("cuModuleLoadData", [&](auto&) {
        if (module == nullptr || image == nullptr) {
            return cudaErrorInvalidValue;
        }
        auto m = std::make_unique<module_obj>();
        m->device = t_device;
        *module = reinterpret_cast<CUmodule>(m.get());
        g().modules.push_back(std::move(m));
        return cudaSuccess;
    });
}

CUresult CUDAAPI fake_module_get_function(CUfunction* function, CUmodule module, const char* name) {
    return driver_run("cuModuleGetFunction", [&](auto&) {
        const module_obj* m = find_module(module);
        if (function == nullptr || name == nullptr) {
            return cudaErrorInvalidValue;
        }
        if (m == nullptr || m->module != nullptr) {
            return cudaErrorInvalidResourceHandle;
        }
        auto f = std::make_unique<module_obj>();
        f->device = m->device;
        f->name = name;
        f->module = m;
        *function = reinterpret_cast<CUfunction>(f.get());
        g().modules.push_back(std::move(f));
        return cudaSuccess;
    });
}

CUresult CUDAAPI fake_launch_kernel(CUfunction f, unsigned, unsigned, unsigned, unsigned, unsigned,
                                    unsigned, unsigned, CUstream hStream, void** kernelParams,
                                    void** extra) {
    std::function<void(void**)> body;
    const CUresult r = driver_run("cuLaunchKernel", [&](auto&) {
        const module_obj* fn = find_module(f);
        if (fn == nullptr || fn->module == nullptr) {
            return cudaErrorInvalidResourceHandle;
        }
        if (kernelParams != nullptr && extra != nullptr) {
            return cudaErrorInvalidValue;
        }
        const cudaError_t st = launch("cuLaunchKernel", f, fn->name,
                                      reinterpret_cast<cudaStream_t>(hStream), fn->device);
        if (auto it = g().kernel_bodies.find(fn->name);
            st == cudaSuccess && it != g().kernel_bodies.end()) {
            body = it->second;
        }
        return st;
    });
    if (body) {
        body(kernelParams); // outside the mutex: it may call the fake
    }
    return r;
}

/// The fake's driver entry point `symbol`, or nullptr: no other is found (no stream memory
/// operations, so no doorbell).
void* driver_function(const char* symbol) {
    const std::string_view name(symbol);
    if (name == "cuModuleLoadData") {
        return reinterpret_cast<void*>(&fake_module_load_data);
    }
    if (name == "cuModuleGetFunction") {
        return reinterpret_cast<void*>(&fake_module_get_function);
    }
    if (name == "cuLaunchKernel") {
        return reinterpret_cast<void*>(&fake_launch_kernel);
    }
    return nullptr;
}

cudaError_t entry_point(const char* api, const char* symbol, void** funcPtr,
                        cudaDriverEntryPointQueryResult* driverStatus) {
    return run(api, [&](auto&) {
        if (funcPtr == nullptr || symbol == nullptr) {
            return cudaErrorInvalidValue;
        }
        *funcPtr = driver_function(symbol);
        if (driverStatus == nullptr) {
            return *funcPtr != nullptr ? cudaSuccess : cudaErrorSymbolNotFound;
        }
        *driverStatus =
            *funcPtr != nullptr ? cudaDriverEntryPointSuccess : cudaDriverEntryPointSymbolNotFound;
        return cudaSuccess;
    });
}

int attribute(cudaDeviceAttr a, int device) {
    switch (a) {
    case cudaDevAttrMaxThreadsPerBlock:
    case cudaDevAttrMaxBlockDimX:
    case cudaDevAttrMaxBlockDimY:
        return 1024;
    case cudaDevAttrMaxBlockDimZ:
        return 64;
    case cudaDevAttrMaxGridDimX:
        return 2147483647;
    case cudaDevAttrMaxGridDimY:
    case cudaDevAttrMaxGridDimZ:
        return 65535;
    case cudaDevAttrMaxSharedMemoryPerBlock:
        return 49152;
    case cudaDevAttrWarpSize:
        return 32;
    case cudaDevAttrMultiProcessorCount:
        return 132;
    case cudaDevAttrMaxThreadsPerMultiProcessor:
        return 2048;
    case cudaDevAttrAsyncEngineCount:
        return 3;
    case cudaDevAttrComputeCapabilityMajor:
        return 9;
    case cudaDevAttrL2CacheSize:
        return 50 << 20;
    case cudaDevAttrGlobalMemoryBusWidth:
        return 6144;
    case cudaDevAttrPciBusId:
        return 0x18 + device;
    case cudaDevAttrHostNumaId:
    case cudaDevAttrNumaId:
        return -1;
    case cudaDevAttrCanMapHostMemory:
    case cudaDevAttrUnifiedAddressing:
    case cudaDevAttrConcurrentKernels:
    case cudaDevAttrManagedMemory:
    case cudaDevAttrConcurrentManagedAccess:
    case cudaDevAttrCanUseHostPointerForRegisteredMem:
    case cudaDevAttrMemoryPoolsSupported:
    case cudaDevAttrHostRegisterSupported:
    case cudaDevAttrComputePreemptionSupported:
        return 1;
    default: // cudaDevAttrPageableMemoryAccess, cudaDevAttrIntegrated, minor version, ...
        return 0;
    }
}

} // namespace

// ---- control API --------------------------------------------------------------------------

void reset() {
    release_all();
    unblock();
    state& st = g();
    std::lock_guard lock(st.mutex);
    for (auto& [handle, s] : st.streams) {
        s->waits.clear();
    }
    st.device_count = 1;
    st.reuse = false;
    st.destroyed_streams.clear();
    st.destroyed_events.clear();
    st.calls.clear();
    st.failures.clear();
    st.dead_calls = 0;
    st.peers.clear();
    st.launches.clear();
    st.kernel_bodies.clear();
    t_device = 0;
    t_last = cudaSuccess;
}

void set_device_count(int n) {
    std::lock_guard lock(g().mutex);
    g().device_count = n;
}

void hang(cudaStream_t s) {
    std::lock_guard lock(g().mutex);
    stream_obj* o = any_stream(s);
    if (o == nullptr) {
        throw std::invalid_argument("fake_cuda::hang: a stream handle the fake never made");
    }
    o->hung = true;
}

void release(cudaStream_t s) {
    std::lock_guard lock(g().mutex);
    stream_obj* o = any_stream(s);
    if (o == nullptr) {
        throw std::invalid_argument("fake_cuda::release: a stream handle the fake never made");
    }
    release_stream(*o);
    g().changed.notify_all();
}

void release_all() {
    std::lock_guard lock(g().mutex);
    for (auto& [handle, s] : g().streams) {
        release_stream(*s);
    }
    for (const mark_ptr& m : g().orphans) {
        m->held = false;
    }
    g().orphans.clear();
    g().changed.notify_all();
}

void fail_next(std::string_view api, cudaError_t err, int times) {
    std::lock_guard lock(g().mutex);
    if (times > 0) {
        g().failures[std::string(api)] = {err, times};
    } else if (auto it = g().failures.find(api); it != g().failures.end()) {
        g().failures.erase(it);
    }
}

void block_next(std::string_view api, int device) {
    std::lock_guard lock(g().mutex);
    g().block.emplace(std::string(api), device);
}

bool wait_blocked(std::chrono::milliseconds timeout) {
    std::unique_lock lock(g().mutex);
    return g().changed.wait_for(lock, timeout, [] { return g().blocked; });
}

void unblock() {
    std::lock_guard lock(g().mutex);
    g().block.reset();
    g().blocked = false;
    ++g().unblocks;
    g().changed.notify_all();
}

void reuse_handles(bool on) {
    std::lock_guard lock(g().mutex);
    g().reuse = on;
}

std::size_t calls(std::string_view api) {
    std::lock_guard lock(g().mutex);
    auto it = g().calls.find(api);
    return it != g().calls.end() ? it->second : 0;
}

std::size_t live_streams() {
    std::lock_guard lock(g().mutex);
    return static_cast<std::size_t>(
        std::count_if(g().streams.begin(), g().streams.end(), [](const auto& e) {
            return !e.second->dead && !e.second->legacy && !e.second->per_thread;
        }));
}

std::size_t live_events() {
    std::lock_guard lock(g().mutex);
    return static_cast<std::size_t>(std::count_if(g().events.begin(), g().events.end(),
                                                  [](const auto& e) { return !e.second->dead; }));
}

std::size_t dead_handle_calls() {
    std::lock_guard lock(g().mutex);
    return g().dead_calls;
}

int stream_device(cudaStream_t s) {
    std::lock_guard lock(g().mutex);
    const stream_obj* o = any_stream(s);
    return o != nullptr ? o->device : -1;
}

std::vector<launch_info> launches() {
    std::lock_guard lock(g().mutex);
    return g().launches;
}

void define_kernel(std::string_view name, std::function<void(void** params)> body) {
    std::lock_guard lock(g().mutex);
    if (body) {
        g().kernel_bodies[std::string(name)] = std::move(body);
    } else if (auto it = g().kernel_bodies.find(name); it != g().kernel_bodies.end()) {
        g().kernel_bodies.erase(it);
    }
}

std::optional<record_info> last_record(cudaEvent_t e) {
    std::lock_guard lock(g().mutex);
    auto it = g().events.find(e);
    return it != g().events.end() ? it->second->where : std::nullopt;
}

} // namespace cudawait::fake_cuda

// ---- the runtime's entry points -------------------------------------------------------------

using namespace cudawait::fake_cuda;

extern "C" {

// Errors

cudaError_t cudaGetLastError(void) {
    (void)run("cudaGetLastError");
    return std::exchange(t_last, cudaSuccess);
}

cudaError_t cudaPeekAtLastError(void) {
    (void)run("cudaPeekAtLastError");
    return t_last;
}

const char* cudaGetErrorName(cudaError_t error) {
    switch (error) {
#define CUDAWAIT_FAKE_NAME(e)                                                                      \
    case e:                                                                                        \
        return #e;
        CUDAWAIT_FAKE_NAME(cudaSuccess)
        CUDAWAIT_FAKE_NAME(cudaErrorInvalidValue)
        CUDAWAIT_FAKE_NAME(cudaErrorMemoryAllocation)
        CUDAWAIT_FAKE_NAME(cudaErrorInitializationError)
        CUDAWAIT_FAKE_NAME(cudaErrorCudartUnloading)
        CUDAWAIT_FAKE_NAME(cudaErrorInvalidDevicePointer)
        CUDAWAIT_FAKE_NAME(cudaErrorInvalidMemcpyDirection)
        CUDAWAIT_FAKE_NAME(cudaErrorInsufficientDriver)
        CUDAWAIT_FAKE_NAME(cudaErrorNoDevice)
        CUDAWAIT_FAKE_NAME(cudaErrorInvalidDevice)
        CUDAWAIT_FAKE_NAME(cudaErrorNoKernelImageForDevice)
        CUDAWAIT_FAKE_NAME(cudaErrorInvalidPtx)
        CUDAWAIT_FAKE_NAME(cudaErrorInvalidResourceHandle)
        CUDAWAIT_FAKE_NAME(cudaErrorSymbolNotFound)
        CUDAWAIT_FAKE_NAME(cudaErrorNotReady)
        CUDAWAIT_FAKE_NAME(cudaErrorIllegalAddress)
        CUDAWAIT_FAKE_NAME(cudaErrorLaunchFailure)
        CUDAWAIT_FAKE_NAME(cudaErrorLaunchOutOfResources)
        CUDAWAIT_FAKE_NAME(cudaErrorLaunchTimeout)
        CUDAWAIT_FAKE_NAME(cudaErrorPeerAccessAlreadyEnabled)
        CUDAWAIT_FAKE_NAME(cudaErrorPeerAccessNotEnabled)
        CUDAWAIT_FAKE_NAME(cudaErrorHostMemoryAlreadyRegistered)
        CUDAWAIT_FAKE_NAME(cudaErrorHostMemoryNotRegistered)
        CUDAWAIT_FAKE_NAME(cudaErrorNotSupported)
        CUDAWAIT_FAKE_NAME(cudaErrorNotPermitted)
        CUDAWAIT_FAKE_NAME(cudaErrorTimeout)
        CUDAWAIT_FAKE_NAME(cudaErrorDevicesUnavailable)
        CUDAWAIT_FAKE_NAME(cudaErrorContextIsDestroyed)
        CUDAWAIT_FAKE_NAME(cudaErrorStreamCaptureUnsupported)
        CUDAWAIT_FAKE_NAME(cudaErrorUnknown)
#undef CUDAWAIT_FAKE_NAME
    default:
        return "cudaErrorUnrecognized";
    }
}

const char* cudaGetErrorString(cudaError_t error) {
    return cudaGetErrorName(error); // the name says enough in a test
}

// Devices

cudaError_t cudaGetDeviceCount(int* count) {
    return run("cudaGetDeviceCount", [&](auto&) { return put(count, g().device_count); });
}

cudaError_t cudaGetDevice(int* device) {
    return run("cudaGetDevice", [&](auto&) { return put(device, t_device); });
}

cudaError_t cudaSetDevice(int device) {
    return run("cudaSetDevice", [&](auto&) {
        if (!valid_device(device)) {
            return cudaErrorInvalidDevice;
        }
        t_device = device;
        return cudaSuccess;
    });
}

cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
    return run("cudaDeviceGetAttribute", [&](auto&) {
        return valid_device(device) ? put(value, attribute(attr, device)) : cudaErrorInvalidDevice;
    });
}

cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device) {
    return run("cudaGetDeviceProperties", [&](auto&) {
        if (!valid_device(device)) {
            return cudaErrorInvalidDevice;
        }
        if (prop == nullptr) {
            return cudaErrorInvalidValue;
        }
        *prop = cudaDeviceProp{};
        std::snprintf(prop->name, sizeof prop->name, "fake CUDA device %d", device);
        prop->totalGlobalMem = std::size_t{141} << 30;
        prop->sharedMemPerBlock = 49152;
        prop->warpSize = 32;
        prop->maxThreadsPerBlock = 1024;
        prop->maxThreadsDim[0] = prop->maxThreadsDim[1] = 1024;
        prop->maxThreadsDim[2] = 64;
        prop->maxGridSize[0] = 2147483647;
        prop->maxGridSize[1] = prop->maxGridSize[2] = 65535;
        prop->major = 9;
        prop->minor = 0;
        prop->multiProcessorCount = 132;
        prop->asyncEngineCount = 3;
        prop->unifiedAddressing = 1;
        prop->canMapHostMemory = 1;
        prop->managedMemory = 1;
        prop->concurrentManagedAccess = 1;
        prop->pciBusID = 0x18 + device;
        prop->l2CacheSize = 50 << 20;
        prop->maxThreadsPerMultiProcessor = 2048;
        return cudaSuccess;
    });
}

cudaError_t cudaDeviceGetPCIBusId(char* pciBusId, int len, int device) {
    return run("cudaDeviceGetPCIBusId", [&](auto&) {
        if (!valid_device(device)) {
            return cudaErrorInvalidDevice;
        }
        if (pciBusId == nullptr || len <= 0) {
            return cudaErrorInvalidValue;
        }
        std::snprintf(pciBusId, static_cast<std::size_t>(len), "0000:%02x:00.0", 0x18 + device);
        return cudaSuccess;
    });
}

cudaError_t cudaDeviceGetStreamPriorityRange(int* leastPriority, int* greatestPriority) {
    return run("cudaDeviceGetStreamPriorityRange", [&](auto&) {
        if (leastPriority != nullptr) {
            *leastPriority = least_priority;
        }
        if (greatestPriority != nullptr) {
            *greatestPriority = greatest_priority;
        }
        return cudaSuccess;
    });
}

cudaError_t cudaDeviceCanAccessPeer(int* canAccessPeer, int device, int peerDevice) {
    return run("cudaDeviceCanAccessPeer", [&](auto&) {
        return valid_device(device) && valid_device(peerDevice)
                   ? put(canAccessPeer, device != peerDevice ? 1 : 0)
                   : cudaErrorInvalidDevice;
    });
}

cudaError_t cudaDeviceEnablePeerAccess(int peerDevice, unsigned int) {
    return run("cudaDeviceEnablePeerAccess", [&](auto&) {
        if (!valid_device(peerDevice) || peerDevice == t_device) {
            return cudaErrorInvalidDevice;
        }
        return g().peers.insert({t_device, peerDevice}).second ? cudaSuccess
                                                               : cudaErrorPeerAccessAlreadyEnabled;
    });
}

cudaError_t cudaDeviceSynchronize(void) {
    return run("cudaDeviceSynchronize", [&](std::unique_lock<std::mutex>& lock) {
        std::vector<mark_ptr> marks;
        for (auto& [handle, s] : g().streams) {
            if (s->device == t_device) {
                marks.push_back(snapshot(*s));
            }
        }
        wait_for(lock, marks);
        return cudaSuccess;
    });
}

cudaError_t cudaDriverGetVersion(int* driverVersion) {
    return run("cudaDriverGetVersion", [&](auto&) { return put(driverVersion, 13000); });
}

cudaError_t cudaRuntimeGetVersion(int* runtimeVersion) {
    return run("cudaRuntimeGetVersion", [&](auto&) { return put(runtimeVersion, CUDART_VERSION); });
}

cudaError_t cudaMemGetInfo(size_t* free, size_t* total) {
    return run("cudaMemGetInfo", [&](auto&) {
        const std::size_t all = std::size_t{141} << 30;
        std::size_t used = 0;
        for (const auto& [start, a] : g().allocations) {
            used += a.kind == memory::device && a.device == t_device ? a.bytes : 0;
        }
        if (free != nullptr) {
            *free = all - std::min(used, all);
        }
        if (total != nullptr) {
            *total = all;
        }
        return cudaSuccess;
    });
}

// Streams

cudaError_t cudaStreamCreate(cudaStream_t* pStream) {
    return create_stream("cudaStreamCreate", pStream, cudaStreamDefault, 0);
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* pStream, unsigned int flags) {
    return create_stream("cudaStreamCreateWithFlags", pStream, flags, 0);
}

cudaError_t cudaStreamCreateWithPriority(cudaStream_t* pStream, unsigned int flags, int priority) {
    return create_stream("cudaStreamCreateWithPriority", pStream, flags, priority);
}

cudaError_t cudaStreamDestroy(cudaStream_t stream) {
    return run("cudaStreamDestroy", [&](auto&) {
        if (stream == nullptr || stream == cudaStreamLegacy || stream == cudaStreamPerThread) {
            return cudaErrorInvalidResourceHandle;
        }
        stream_obj* s = live_stream(stream);
        if (s == nullptr) {
            return cudaErrorInvalidResourceHandle;
        }
        s->dead = true; // what it holds stays held, as the GPU's work would go on
        g().destroyed_streams.push_back(s);
        return cudaSuccess;
    });
}

cudaError_t cudaStreamQuery(cudaStream_t stream) {
    return run("cudaStreamQuery", [&](auto&) {
        stream_obj* s = live_stream(stream);
        if (s == nullptr) {
            return cudaErrorInvalidResourceHandle;
        }
        return idle(*s) ? cudaSuccess : cudaErrorNotReady;
    });
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
    return run("cudaStreamSynchronize", [&](std::unique_lock<std::mutex>& lock) {
        stream_obj* s = live_stream(stream);
        if (s == nullptr) {
            return cudaErrorInvalidResourceHandle;
        }
        wait_for(lock, {snapshot(*s)});
        return cudaSuccess;
    });
}

cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int) {
    return run("cudaStreamWaitEvent", [&](auto&) {
        stream_obj* s = live_stream(stream);
        event_obj* e = s != nullptr ? live_event(event) : nullptr;
        if (e == nullptr) {
            return cudaErrorInvalidResourceHandle;
        }
        if (e->last != nullptr && !complete(*e->last)) {
            s->waits.push_back(e->last);
        }
        return cudaSuccess;
    });
}

cudaError_t cudaStreamGetDevice(cudaStream_t hStream, int* device) {
    return run("cudaStreamGetDevice", [&](auto&) {
        const stream_obj* s = live_stream(hStream);
        return s != nullptr ? put(device, s->device) : cudaErrorInvalidResourceHandle;
    });
}

cudaError_t cudaStreamGetFlags(cudaStream_t hStream, unsigned int* flags) {
    return run("cudaStreamGetFlags", [&](auto&) {
        const stream_obj* s = live_stream(hStream);
        return s != nullptr ? put(flags, s->flags) : cudaErrorInvalidResourceHandle;
    });
}

cudaError_t cudaStreamGetPriority(cudaStream_t hStream, int* priority) {
    return run("cudaStreamGetPriority", [&](auto&) {
        const stream_obj* s = live_stream(hStream);
        return s != nullptr ? put(priority, s->priority) : cudaErrorInvalidResourceHandle;
    });
}

cudaError_t cudaStreamBeginCapture(cudaStream_t, cudaStreamCaptureMode) {
    return unsupported("cudaStreamBeginCapture");
}

cudaError_t cudaStreamEndCapture(cudaStream_t, cudaGraph_t*) {
    return unsupported("cudaStreamEndCapture");
}

// Events

cudaError_t cudaEventCreate(cudaEvent_t* event) {
    return create_event("cudaEventCreate", event, cudaEventDefault);
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int flags) {
    return create_event("cudaEventCreateWithFlags", event, flags);
}

cudaError_t cudaEventDestroy(cudaEvent_t event) {
    return run("cudaEventDestroy", [&](auto&) {
        event_obj* e = live_event(event);
        if (e == nullptr) {
            return cudaErrorInvalidResourceHandle;
        }
        e->dead = true;
        g().destroyed_events.push_back(e);
        return cudaSuccess;
    });
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
    return record("cudaEventRecord", event, stream);
}

cudaError_t cudaEventRecordWithFlags(cudaEvent_t event, cudaStream_t stream, unsigned int) {
    return record("cudaEventRecordWithFlags", event, stream);
}

cudaError_t cudaEventQuery(cudaEvent_t event) {
    return run("cudaEventQuery", [&](auto&) {
        event_obj* e = live_event(event);
        if (e == nullptr) {
            return cudaErrorInvalidResourceHandle;
        }
        return e->last == nullptr || complete(*e->last) ? cudaSuccess : cudaErrorNotReady;
    });
}

cudaError_t cudaEventSynchronize(cudaEvent_t event) {
    return run("cudaEventSynchronize", [&](std::unique_lock<std::mutex>& lock) {
        event_obj* e = live_event(event);
        if (e == nullptr) {
            return cudaErrorInvalidResourceHandle;
        }
        if (e->last != nullptr) {
            wait_for(lock, {e->last});
        }
        return cudaSuccess;
    });
}

cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
    return run("cudaEventElapsedTime", [&](auto&) {
        event_obj* a = live_event(start);
        event_obj* b = a != nullptr ? live_event(end) : nullptr;
        if (b == nullptr || ((a->flags | b->flags) & cudaEventDisableTiming) != 0) {
            return cudaErrorInvalidResourceHandle;
        }
        if (ms == nullptr) {
            return cudaErrorInvalidValue;
        }
        for (const event_obj* e : {a, b}) {
            if (e->last != nullptr && !complete(*e->last)) {
                return cudaErrorNotReady;
            }
        }
        *ms = 0.0f;
        return cudaSuccess;
    });
}

// Work on streams

cudaError_t cudaLaunchKernel(const void* func, dim3, dim3, void**, size_t, cudaStream_t stream) {
    return run("cudaLaunchKernel", [&](auto&) {
        const bool library_kernel = g().library_kernels.count(func) != 0;
        return launch("cudaLaunchKernel", func, {}, stream, library_kernel ? -1 : t_device);
    });
}

cudaError_t cudaLaunchHostFunc(cudaStream_t, cudaHostFn_t, void*) {
    return unsupported("cudaLaunchHostFunc");
}

cudaError_t cudaMemcpy(void* dst, const void* src, size_t count, cudaMemcpyKind kind) {
    return run("cudaMemcpy", [&](auto&) {
        copy_bytes(dst, src, count, kind);
        return cudaSuccess;
    });
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t count, cudaMemcpyKind kind,
                            cudaStream_t stream) {
    return on_stream("cudaMemcpyAsync", stream, [&] { copy_bytes(dst, src, count, kind); });
}

cudaError_t cudaMemcpyPeerAsync(void* dst, int, const void* src, int, size_t count,
                                cudaStream_t stream) {
    return on_stream("cudaMemcpyPeerAsync", stream,
                     [&] { copy_bytes(dst, src, count, cudaMemcpyDefault); });
}

cudaError_t cudaMemcpyBatchAsync(void* const* dsts, const void* const* srcs, const size_t* sizes,
                                 size_t count, cudaMemcpyAttributes*, size_t*, size_t,
                                 cudaStream_t stream) {
    return on_stream("cudaMemcpyBatchAsync", stream, [&] {
        for (std::size_t i = 0; i < count; ++i) {
            copy_bytes(dsts[i], srcs[i], sizes[i], cudaMemcpyDefault);
        }
    });
}

cudaError_t cudaMemset(void* devPtr, int value, size_t count) {
    return run("cudaMemset", [&](auto&) {
        if (count != 0 && find_memory(devPtr) != nullptr) {
            std::memset(devPtr, value, count);
        }
        return cudaSuccess;
    });
}

cudaError_t cudaMemsetAsync(void* devPtr, int value, size_t count, cudaStream_t stream) {
    return on_stream("cudaMemsetAsync", stream, [&] {
        if (count != 0 && find_memory(devPtr) != nullptr) {
            std::memset(devPtr, value, count);
        }
    });
}

cudaError_t cudaMemPrefetchAsync(const void*, size_t, cudaMemLocation, unsigned int,
                                 cudaStream_t stream) {
    return on_stream("cudaMemPrefetchAsync", stream);
}

// Memory

cudaError_t cudaMalloc(void** devPtr, size_t size) {
    return run("cudaMalloc", [&](auto&) { return allocate(devPtr, size, memory::device); });
}

cudaError_t cudaMallocAsync(void** devPtr, size_t size, cudaStream_t hStream) {
    return run("cudaMallocAsync", [&](auto&) {
        return live_stream(hStream) == nullptr ? cudaErrorInvalidResourceHandle
                                               : allocate(devPtr, size, memory::device);
    });
}

cudaError_t cudaMallocManaged(void** devPtr, size_t size, unsigned int) {
    return run("cudaMallocManaged", [&](auto&) { return allocate(devPtr, size, memory::managed); });
}

cudaError_t cudaMallocHost(void** ptr, size_t size) {
    return run("cudaMallocHost", [&](auto&) { return allocate(ptr, size, memory::host); });
}

cudaError_t cudaHostAlloc(void** pHost, size_t size, unsigned int) {
    return run("cudaHostAlloc", [&](auto&) { return allocate(pHost, size, memory::host); });
}

cudaError_t cudaFree(void* devPtr) {
    return run("cudaFree", [&](auto&) { return deallocate(devPtr, false); });
}

cudaError_t cudaFreeAsync(void* devPtr, cudaStream_t hStream) {
    return run("cudaFreeAsync", [&](auto&) {
        return live_stream(hStream) == nullptr ? cudaErrorInvalidResourceHandle
                                               : deallocate(devPtr, false);
    });
}

cudaError_t cudaFreeHost(void* ptr) {
    return run("cudaFreeHost", [&](auto&) { return deallocate(ptr, true); });
}

cudaError_t cudaHostRegister(void* ptr, size_t size, unsigned int) {
    return run("cudaHostRegister", [&](auto&) {
        if (ptr == nullptr || size == 0) {
            return cudaErrorInvalidValue;
        }
        const auto a = reinterpret_cast<std::uintptr_t>(ptr);
        auto it = g().allocations.lower_bound(a);
        if (find_memory(ptr) != nullptr || (it != g().allocations.end() && it->first < a + size)) {
            return cudaErrorHostMemoryAlreadyRegistered;
        }
        g().allocations.emplace(a, allocation{size, memory::registered, t_device});
        return cudaSuccess;
    });
}

cudaError_t cudaHostUnregister(void* ptr) {
    return run("cudaHostUnregister", [&](auto&) {
        auto it = g().allocations.find(reinterpret_cast<std::uintptr_t>(ptr));
        if (it == g().allocations.end() || it->second.kind != memory::registered) {
            return cudaErrorHostMemoryNotRegistered;
        }
        g().allocations.erase(it);
        return cudaSuccess;
    });
}

cudaError_t cudaHostGetDevicePointer(void** pDevice, void* pHost, unsigned int) {
    return run("cudaHostGetDevicePointer", [&](auto&) {
        const auto* m = find_memory(pHost);
        if (pDevice == nullptr || m == nullptr ||
            (m->second.kind != memory::host && m->second.kind != memory::registered)) {
            return cudaErrorInvalidValue;
        }
        *pDevice = pHost; // one address space
        return cudaSuccess;
    });
}

cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* attributes, const void* ptr) {
    return run("cudaPointerGetAttributes", [&](auto&) {
        if (attributes == nullptr) {
            return cudaErrorInvalidValue;
        }
        *attributes = cudaPointerAttributes{};
        void* p = const_cast<void*>(ptr);
        const auto* m = find_memory(ptr);
        if (m == nullptr) {
            attributes->type = cudaMemoryTypeUnregistered;
            attributes->device = -2;
            attributes->hostPointer = p;
            return cudaSuccess;
        }
        attributes->device = m->second.device;
        switch (m->second.kind) {
        case memory::device:
            attributes->type = cudaMemoryTypeDevice;
            attributes->devicePointer = p;
            break;
        case memory::managed:
            attributes->type = cudaMemoryTypeManaged;
            attributes->devicePointer = attributes->hostPointer = p;
            break;
        case memory::host:
        case memory::registered:
            attributes->type = cudaMemoryTypeHost;
            attributes->devicePointer = attributes->hostPointer = p;
            break;
        }
        return cudaSuccess;
    });
}

// Modules and the driver

cudaError_t cudaLibraryLoadData(cudaLibrary_t* library, const void*, cudaJitOption*, void**,
                                unsigned int, cudaLibraryOption*, void**, unsigned int) {
    return run("cudaLibraryLoadData", [&](auto&) {
        if (library == nullptr) {
            return cudaErrorInvalidValue;
        }
        g().tokens.push_back(std::make_unique<char>());
        *library = reinterpret_cast<cudaLibrary_t>(g().tokens.back().get());
        return cudaSuccess;
    });
}

cudaError_t cudaLibraryGetKernel(cudaKernel_t* pKernel, cudaLibrary_t library, const char* name) {
    return run("cudaLibraryGetKernel", [&](auto&) {
        if (pKernel == nullptr || library == nullptr || name == nullptr) {
            return cudaErrorInvalidValue;
        }
        g().tokens.push_back(std::make_unique<char>());
        *pKernel = reinterpret_cast<cudaKernel_t>(g().tokens.back().get());
        g().library_kernels.insert(g().tokens.back().get());
        return cudaSuccess;
    });
}

cudaError_t cudaLibraryUnload(cudaLibrary_t) { return run("cudaLibraryUnload"); }

cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* attr, const void* func) {
    return run("cudaFuncGetAttributes", [&](auto&) {
        if (attr == nullptr || func == nullptr) {
            return cudaErrorInvalidValue;
        }
        *attr = cudaFuncAttributes{};
        attr->maxThreadsPerBlock = 1024;
        return cudaSuccess;
    });
}

cudaError_t cudaGetDriverEntryPoint(const char* symbol, void** funcPtr, unsigned long long,
                                    cudaDriverEntryPointQueryResult* driverStatus) {
    return entry_point("cudaGetDriverEntryPoint", symbol, funcPtr, driverStatus);
}

cudaError_t cudaGetDriverEntryPointByVersion(const char* symbol, void** funcPtr, unsigned int,
                                             unsigned long long,
                                             cudaDriverEntryPointQueryResult* driverStatus) {
    return entry_point("cudaGetDriverEntryPointByVersion", symbol, funcPtr, driverStatus);
}

// Graphs: not supported

cudaError_t cudaGraphCreate(cudaGraph_t*, unsigned int) { return unsupported("cudaGraphCreate"); }

cudaError_t cudaGraphDestroy(cudaGraph_t) { return unsupported("cudaGraphDestroy"); }

cudaError_t cudaGraphInstantiate(cudaGraphExec_t*, cudaGraph_t, unsigned long long) {
    return unsupported("cudaGraphInstantiate");
}

cudaError_t cudaGraphExecDestroy(cudaGraphExec_t) { return unsupported("cudaGraphExecDestroy"); }

cudaError_t cudaGraphLaunch(cudaGraphExec_t, cudaStream_t) {
    return unsupported("cudaGraphLaunch");
}

cudaError_t cudaGraphAddMemcpyNode1D(cudaGraphNode_t*, cudaGraph_t, const cudaGraphNode_t*, size_t,
                                     void*, const void*, size_t, cudaMemcpyKind) {
    return unsupported("cudaGraphAddMemcpyNode1D");
}

cudaError_t cudaGraphAddChildGraphNode(cudaGraphNode_t*, cudaGraph_t, const cudaGraphNode_t*,
                                       size_t, cudaGraph_t) {
    return unsupported("cudaGraphAddChildGraphNode");
}

cudaError_t cudaGraphExecMemcpyNodeSetParams1D(cudaGraphExec_t, cudaGraphNode_t, void*, const void*,
                                               size_t, cudaMemcpyKind) {
    return unsupported("cudaGraphExecMemcpyNodeSetParams1D");
}

} // extern "C"
