// SPDX-License-Identifier: Apache-2.0
#pragma once

// Synopsis
//   co_await copy(dst, src, stream);       inside a task: resumes once the bytes are in place
//   copy_async(dst, src, stream);          enqueue only
//   co_await copy(dst, src);               on a copy lane of the device (copy_lane.hpp)
//   co_await copy(dst, src, lane::small);  on the named lane, whatever the size
//   copy_options o; o.sm_copy_bytes = 64 << 10;  co_await copy(dst, src, o);   SM copies
//
// `dst` and `src` are contiguous ranges of one trivially copyable type; the direction follows
// from where their memory lives, and pageable host memory is staged through pinned chunks. See
// docs/copy.md.

#include <cudawait/copy/copy_lane.hpp>
#include <cudawait/copy/detail/bulk_streams.hpp>
#include <cudawait/copy/detail/sm_copy.hpp>
#include <cudawait/copy/detail/staging.hpp>
#include <cudawait/core/scheduler.hpp>
#include <cudawait/core/task.hpp>
#include <cudawait/memory/memory_kind.hpp>
#include <cudawait/memory/pinned_buffer.hpp> // detail::staged_copy's chunks, not the buffer arguments
#include <cudawait/memory/pinned_pool.hpp>
#include <cudawait/runtime/device.hpp>
#include <cudawait/runtime/error.hpp>
#include <cudawait/runtime/event.hpp>
#include <cudawait/runtime/stream.hpp>

#include <algorithm>
#include <cstddef>
#include <exception>
#include <iterator>
#include <optional>
#include <ranges>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include <cuda_runtime_api.h>

namespace cudawait {

/// How copies stage pageable memory.
struct copy_options {
    /// Where staging chunks come from; nullptr means default_pinned_pool(). Pointers into this
    /// pool are also marked with record_use.
    pinned_pool* pool = nullptr;
    /// Size of one staging chunk.
    std::size_t chunk_bytes = std::size_t{8} << 20;
    /// Chunks in flight (2 at least).
    unsigned depth = 3;
    /// Copies on a lane without one named (`copy(dst, src)`) of at most this many bytes go on
    /// the small lane, larger ones on the bulk lane (copy_lane.hpp).
    std::size_t small_bytes = std::size_t{64} << 10;
    /// Copies on the small lane of at most this many bytes between device memory and
    /// page-locked host memory the device can address are made by a kernel (the SMs load and
    /// store the bytes over the link) instead of a copy engine, so that they never queue behind
    /// a bulk copy already on the engine (detail/sm_copy.hpp). 0, the default: every copy uses
    /// a copy engine. Other copies (pageable or managed memory, two devices, another lane) are
    /// not affected.
    std::size_t sm_copy_bytes = 0;
    /// Copies on the small lane from device memory to page-locked host memory the device can
    /// address, of at most this many bytes, are made by the SMs (as with sm_copy_bytes) while
    /// one of the library's bulk device-to-host streams of the device has work pending (a
    /// pipeline's, the bulk lane's): a copy engine could hold them behind its chunk (1.2 ms
    /// beside a pipeline's 64 MiB chunks on an H200, against about 20 us by the SMs). With
    /// those streams idle they take a copy engine, a few microseconds faster. 0: never.
    std::size_t busy_sm_copy_bytes = std::size_t{64} << 10;
};

namespace detail {

/// A copy's bytes, checked and classified, and the pools that own either side (if any).
struct copy_plan {
    std::byte* dst;
    const std::byte* src;
    std::size_t bytes;
    memory_kind dst_kind;
    memory_kind src_kind;
    pinned_pool* dst_pool = nullptr;
    pinned_pool* src_pool = nullptr;
    int dst_device = -1; ///< the device of device memory, else -1
    int src_device = -1;

    /// Device memory of two different devices: a peer copy.
    [[nodiscard]] bool peer() const noexcept {
        return dst_device >= 0 && src_device >= 0 && dst_device != src_device;
    }

    // Managed memory is never staged: the driver knows where its pages are and copies it with
    // cudaMemcpyDefault from wherever they live, host or device; a ring of pinned chunks would
    // only add a host memcpy.
    [[nodiscard]] bool staged() const noexcept {
        return (src_kind == memory_kind::pageable && dst_kind == memory_kind::device) ||
               (dst_kind == memory_kind::pageable && src_kind == memory_kind::device);
    }
    [[nodiscard]] bool to_device() const noexcept { return src_kind == memory_kind::pageable; }
};

template <class R>
concept copy_range = std::ranges::contiguous_range<R> && std::ranges::sized_range<R> &&
    std::is_trivially_copyable_v<std::ranges::range_value_t<R>>;

// The pool a range's memory belongs to: its own pool() where it has one (a pinned_buffer), else
// `fallback` if that owns the memory. Asked of the type, so copy needs no buffer header.
template <class R>
pinned_pool* owning_pool(const R& r, const void* p, pinned_pool& fallback) {
    using plain = std::remove_cvref_t<R>;
    if constexpr (requires(const plain& b) { b.pool(); }) {
        return &r.pool();
    } else {
        return fallback.owns(p) ? &fallback : nullptr;
    }
}

// The helpers from here on are function templates with an unused parameter, so that only a
// translation unit that copies instantiates them and what they use (benchmarks/compile_cost.sh).

/// The device whose memory `p` is, or -1 where the driver does not call it device memory.
/// @throws cuda_error
template <class = void>
[[nodiscard]] int pointer_device(const void* p) {
    cudaPointerAttributes a{};
    check(cudaPointerGetAttributes(&a, p), "cudaPointerGetAttributes");
    return a.type == cudaMemoryTypeDevice ? a.device : -1;
}

template <class Unused = void>
pinned_pool& staging_pool(const copy_options& opt) {
    return opt.pool != nullptr ? *opt.pool : default_pinned_pool<dependent_t<Unused, void>>();
}

template <class Dst, class Src>
copy_plan make_plan(const Dst& dst, const Src& src, const copy_options& opt) {
    using T = std::ranges::range_value_t<Src>;
    std::size_t nd = std::ranges::size(dst);
    std::size_t ns = std::ranges::size(src);
    if (nd != ns) {
        throw usage_error("copy: destination has " + std::to_string(nd) +
                          " elements but source has " + std::to_string(ns));
    }
    if (ns == 0) {
        throw usage_error("copy: zero elements to copy");
    }
    auto* d =
        reinterpret_cast<std::byte*>(const_cast<std::remove_const_t<T>*>(std::ranges::data(dst)));
    auto* s = reinterpret_cast<const std::byte*>(std::ranges::data(src));
    if (d == nullptr || s == nullptr) {
        throw usage_error("copy: null destination or source with a non-zero size");
    }
    std::size_t bytes = ns * sizeof(T);
    if ((d < s + bytes) && (s < d + bytes)) {
        throw usage_error("copy: destination and source overlap");
    }
    copy_plan plan{d, s, bytes, kind_of(dst, d), kind_of(src, s)};
    pinned_pool& pool = staging_pool(opt);
    if (plan.dst_kind == memory_kind::pinned) {
        plan.dst_pool = owning_pool(dst, d, pool);
    }
    if (plan.src_kind == memory_kind::pinned) {
        plan.src_pool = owning_pool(src, s, pool);
    }
    if (plan.dst_kind == memory_kind::device && plan.src_kind == memory_kind::device) {
        // Even where the types state device memory, only the driver knows which device.
        plan.dst_device = pointer_device(d);
        plan.src_device = pointer_device(s);
    }
    return plan;
}

/// A copy of device memory between devices (or within one: then an ordinary device-to-device
/// copy), with peer access enabled both ways first where the pair supports it, so that a copy
/// engine of either device can move the bytes directly.
/// @throws cuda_error
template <class = void>
void enqueue_peer(void* dst, int dst_device, const void* src, int src_device, std::size_t bytes,
                  stream_ref s) {
    if (dst_device != src_device) {
        (void)enable_peer_access(src_device, dst_device);
        (void)enable_peer_access(dst_device, src_device);
    }
    check(cudaMemcpyPeerAsync(dst, dst_device, src, src_device, bytes, s.get()),
          "cudaMemcpyPeerAsync");
}

// A direct copy: one cudaMemcpyAsync (cudaMemcpyPeerAsync between devices), and pool memory on
// either side marked as used by `s`.
template <class = void>
void enqueue_direct(const copy_plan& plan, stream_ref s) {
    if (plan.peer()) {
        enqueue_peer(plan.dst, plan.dst_device, plan.src, plan.src_device, plan.bytes, s);
        return;
    }
    check(cudaMemcpyAsync(plan.dst, plan.src, plan.bytes, cudaMemcpyDefault, s.get()),
          "cudaMemcpyAsync");
    if (plan.dst_pool != nullptr) {
        plan.dst_pool->record_use(plan.dst, s);
    }
    if (plan.src_pool != nullptr) {
        plan.src_pool->record_use(plan.src, s);
    }
}

/// The stream of lane `l` that `plan` goes on: the lanes of the device whose memory it touches
/// (the destination's first; else the current device), the h2d stream where the destination
/// is device or managed memory, else the d2h stream. The device it looked up is kept in `plan`
/// (dst_device or src_device).
/// @throws cuda_error; usage_error (copy_lanes::for_device after fork)
template <class = void>
stream_ref lane_stream(copy_plan& plan, lane l) {
    const bool to_device =
        plan.dst_kind == memory_kind::device || plan.dst_kind == memory_kind::managed;
    int dev = -1;
    if (plan.dst_kind == memory_kind::device) {
        if (plan.dst_device < 0) {
            plan.dst_device = pointer_device(plan.dst);
        }
        dev = plan.dst_device;
    }
    if (dev < 0 && plan.src_kind == memory_kind::device) {
        if (plan.src_device < 0) {
            plan.src_device = pointer_device(plan.src);
        }
        dev = plan.src_device;
    }
    // Memory a range only states to be device memory, and managed or host memory on both
    // sides, has no device of its own: the current one serves it.
    const device_ref d = dev >= 0 ? device_ref(dev) : current_device();
    return copy_lanes::for_device(d).get(l, to_device ? copy_direction::h2d : copy_direction::d2h);
}

/// A copy the SMs make (copy_options::sm_copy_bytes): the addresses the device uses for each
/// side, and the device.
struct sm_copy_route {
    void* dst;
    const void* src;
    int device;
};

/// The route of `plan` through the SMs: device memory of one device on one side, page-locked
/// host memory that device can address on the other, and a device the kernel can run on (loaded
/// there now if nothing did so before: detail/sm_copy.hpp); else none (the copy engine takes it).
/// @throws cuda_error
template <class = void>
std::optional<sm_copy_route> sm_route(const copy_plan& plan) {
    const bool to_device =
        plan.dst_kind == memory_kind::device && plan.src_kind == memory_kind::pinned;
    const bool to_host =
        plan.src_kind == memory_kind::device && plan.dst_kind == memory_kind::pinned;
    if (!to_device && !to_host) {
        return std::nullopt;
    }
    const int dev = pointer_device(to_device ? static_cast<const void*>(plan.dst) : plan.src);
    if (dev < 0) {
        return std::nullopt; // stated device memory the driver does not know
    }
    if (!preload_sm_copy(device_ref(dev))) {
        return std::nullopt; // the kernel cannot run there (detail/sm_copy.hpp)
    }
    void* host = host_memory_on_device(to_device ? static_cast<const void*>(plan.src) : plan.dst,
                                       device_ref(dev));
    if (host == nullptr) {
        return std::nullopt;
    }
    return to_device ? sm_copy_route{plan.dst, host, dev} : sm_copy_route{host, plan.src, dev};
}

/// Enqueues `plan` on `s` as an SM copy by route `r`, and marks pool memory used there.
/// @throws cuda_error
template <class = void>
void enqueue_by_the_sms(const copy_plan& plan, const sm_copy_route& r, stream_ref s) {
    enqueue_sm_copy(r.dst, r.src, plan.bytes, device_ref(r.device), s);
    if (plan.dst_pool != nullptr) {
        plan.dst_pool->record_use(plan.dst, s);
    }
    if (plan.src_pool != nullptr) {
        plan.src_pool->record_use(plan.src, s);
    }
}

/// The copy of `plan` on `s`, awaited. `noted`: whether to note the work in bulk_streams after
/// each enqueue (the bulk lane's copies; detail/bulk_streams.hpp).
template <class = void>
task<void> copy_task(copy_plan plan, stream_ref s, copy_options opt, bool noted = false) {
    auto note = [&] {
        if (noted) {
            bulk_streams::instance().note_work(s.get());
        }
    };
    if (!plan.staged()) {
        enqueue_direct(plan, s);
        note();
        co_await s;
        co_return;
    }
    staged_copy sc(plan.dst, plan.src, plan.bytes, plan.to_device(), s, staging_pool(opt),
                   opt.chunk_bytes, opt.depth);
    while (cudaEvent_t ev = sc.advance()) {
        note();
        co_await event_ref(ev);
    }
    if (plan.to_device()) {
        co_await event_ref(sc.last_event());
    }
}

/// Whether a small-lane copy should go by the SMs: sm_copy_bytes asks for it, or
/// busy_sm_copy_bytes does for a device-to-host copy while a bulk D2H stream of the source's
/// device is busy (detail/bulk_streams.hpp). Whether the memory allows it is sm_route's.
/// @throws cuda_error (an error a bulk stream reports)
template <class = void>
bool by_the_sms(const copy_plan& plan, const copy_options& opt) {
    if (plan.bytes <= opt.sm_copy_bytes) {
        return true;
    }
    return plan.bytes <= opt.busy_sm_copy_bytes && plan.src_kind == memory_kind::device &&
           plan.dst_kind == memory_kind::pinned && plan.src_device >= 0 &&
           bulk_streams::instance().pending(plan.src_device);
}

/// A small-lane copy with pageable memory on one side (`plan.staged()`): through one pinned
/// block from the pool, the device side copied by the SMs where by_the_sms would send the same
/// copy of page-locked memory there (a D2H copy beside bulk D2H work), so that it does not queue
/// behind a bulk chunk on a copy engine; else as copy_task.
template <class = void>
task<void> small_lane_staged_copy(copy_plan plan, stream_ref s, copy_options opt) {
    const bool to_device = plan.to_device();
    copy_plan via = plan;
    (to_device ? via.src_kind : via.dst_kind) = memory_kind::pinned;
    if (by_the_sms(via, opt)) {
        pinned_pool& pool = staging_pool(opt);
        pinned_buffer<std::byte> block(plan.bytes, pool);
        if (to_device) {
            via.src = block.data();
            via.src_pool = &pool;
        } else {
            via.dst = block.data();
            via.dst_pool = &pool;
        }
        if (const std::optional<sm_copy_route> r = sm_route(via)) {
            if (to_device) {
                stage_in(block.data(), plan.src, plan.bytes, 0);
            }
            enqueue_by_the_sms(via, *r, s);
            co_await s;
            if (!to_device) {
                stage_out(plan.dst, block.data(), plan.bytes, 0);
            }
            co_return;
        }
    }
    co_await copy_task(plan, s, opt);
}

/// A copy on the small lane (its stream `s`): through the SMs where by_the_sms says so and the
/// memory allows it (pageable memory through a pinned block: small_lane_staged_copy), else as
/// copy_task. Decided when awaited, so that it sees the bulk work enqueued by then.
template <class = void>
task<void> small_lane_copy(copy_plan plan, stream_ref s, copy_options opt) {
    if (plan.staged()) {
        co_await small_lane_staged_copy(plan, s, opt);
        co_return;
    }
    if (by_the_sms(plan, opt)) {
        if (const std::optional<sm_copy_route> r = sm_route(plan)) {
            enqueue_by_the_sms(plan, *r, s);
            co_await s;
            co_return;
        }
    }
    enqueue_direct(plan, s);
    co_await s;
}

/// A copy on the bulk lane (its stream `s`), as copy_task; the D2H stream's work is noted after
/// each enqueue (detail/bulk_streams.hpp: the other lane streams are not registered, and nothing
/// happens). Before the D2H stream's first copy the SM copy kernel is loaded on its device: the
/// small D2H copies the SMs make beside it must not wait for a loading that waits for it.
template <class = void>
task<void> bulk_lane_copy(copy_plan plan, stream_ref s, copy_options opt) {
    if (plan.dst_kind != memory_kind::device && plan.dst_kind != memory_kind::managed) {
        (void)preload_sm_copy(device_ref(s.device())); // false: copy engines make them
    }
    co_await copy_task(plan, s, opt, true);
}

/// A copy on lane `l`, its stream `s`.
template <class = void>
task<void> lane_copy(const copy_plan& plan, stream_ref s, lane l, const copy_options& opt) {
    return l == lane::small ? small_lane_copy(plan, s, opt) : bulk_lane_copy(plan, s, opt);
}

} // namespace detail

namespace detail {

template <class Dst, class Src>
concept copyable_pair = copy_range<Dst> && copy_range<Src> &&
    std::is_same_v<std::ranges::range_value_t<Dst>, std::ranges::range_value_t<Src>> &&
    (!std::is_const_v<std::remove_reference_t<std::ranges::range_reference_t<Dst>>>);

struct copy_async_fn {
    template <class Dst, class Src>
    requires copyable_pair<Dst, Src>
    void operator()(Dst&& dst, Src&& src, stream_ref s, const copy_options& opt = {}) const {
        copy_plan plan = make_plan(dst, src, opt);
        if (!plan.staged()) {
            enqueue_direct(plan, s);
            return;
        }
        staged_copy sc(plan.dst, plan.src, plan.bytes, plan.to_device(), s, staging_pool(opt),
                       opt.chunk_bytes, opt.depth);
        while (cudaEvent_t ev = sc.advance()) {
            check(cudaEventSynchronize(ev), "cudaEventSynchronize");
        }
    }
};

struct copy_fn {
    template <class Dst, class Src>
    requires copyable_pair<Dst, Src>
    [[nodiscard]] task<void> operator()(Dst&& dst, Src&& src, stream_ref s,
                                        const copy_options& opt = {}) const {
        return copy_task(make_plan(dst, src, opt), s, opt);
    }

    template <class Dst, class Src>
    requires copyable_pair<Dst, Src>
    [[nodiscard]] task<void> operator()(Dst&& dst, Src&& src, lane l,
                                        const copy_options& opt = {}) const {
        copy_plan plan = make_plan(dst, src, opt);
        const stream_ref s = lane_stream(plan, l);
        return lane_copy(plan, s, l, opt);
    }

    template <class Dst, class Src>
    requires copyable_pair<Dst, Src>
    [[nodiscard]] task<void> operator()(Dst&& dst, Src&& src, const copy_options& opt = {}) const {
        copy_plan plan = make_plan(dst, src, opt);
        const lane l = plan.bytes <= opt.small_bytes ? lane::small : lane::bulk;
        return lane_copy(plan, lane_stream(plan, l), l, opt);
    }
};

} // namespace detail

// Both are function objects, so an unqualified call never also finds std::copy through
// argument-dependent lookup (a std::vector argument would make `copy(a, b, s)` ambiguous).

/// `copy_async(dst, src, s, options = {})` enqueues a copy of `src` into `dst` on `s`. With
/// pageable memory it returns once that side was read or written
/// (docs/copy.md#copy-and-copy_async).
/// @throws usage_error for sizes that differ, zero elements, null data or overlapping ranges;
///         cuda_error
inline constexpr detail::copy_async_fn copy_async{};

/// `co_await copy(dst, src, s, options = {})` copies `src` into `dst` in `s`'s order; awaiting
/// the task enqueues the copy and resumes once the bytes are in place. The ranges are checked at
/// the call, so bad arguments throw before anything is awaited; their memory must stay valid
/// until the await completes.
///
/// `co_await copy(dst, src, l, options = {})` makes the copy on lane `l` of the device
/// (copy_lane.hpp) instead of a stream of the caller's, and `co_await copy(dst, src, options =
/// {})` on the small lane for at most options.small_bytes, else on the bulk lane: for control
/// copies that must not wait behind bulk transfers. Such a copy is ordered with the lane's
/// earlier copies only.
/// @throws usage_error (at the call) for sizes that differ, zero elements, null data or
///         overlapping ranges; cuda_error (at the call for an unusable pointer, else from the
///         await); a lane copy also what copy_lanes::for_device throws, at the call
inline constexpr detail::copy_fn copy{};

} // namespace cudawait
