// SPDX-License-Identifier: Apache-2.0
#pragma once

// Synopsis
//   enum class lane { small, bulk };          a queue of a device's copy lanes
//   enum class copy_direction { h2d, d2h };   h2d: the copy writes device memory
//   class copy_lanes;   per device, process-wide: small and bulk streams per direction
//   copy_lanes::for_device(dev).get(lane::small, copy_direction::h2d)
//   small_copy_stream(dev, dir)       the small lane's stream of one direction
//   co_await copy(dst, src, lane::small);   (copy.hpp) on the small lane, whatever the size
//
// A copy on a lane is ordered with the lane's earlier copies only: make its source ready first.
// The streams are never destroyed. See docs/copy.md#copy-lanes.

#include <cudawait/copy/detail/bulk_streams.hpp>
#include <cudawait/runtime/detail/fork_guard.hpp>
#include <cudawait/runtime/device.hpp>
#include <cudawait/runtime/error.hpp>
#include <cudawait/runtime/stream.hpp>

#include <cstddef>
#include <mutex>
#include <string_view>
#include <vector>

#include <cuda_runtime_api.h>

namespace cudawait {

/// A queue of a device's copy lanes (copy_lanes).
enum class lane {
    small, ///< control-sized copies, at the device's highest stream priority
    bulk   ///< everything else, at the default priority
};

/// Which way a copy goes, for the choice of a lane's stream.
enum class copy_direction {
    h2d, ///< the copy writes device (or managed) memory
    d2h  ///< the copy writes host memory
};

/// The enumerator's name, e.g. "small".
[[nodiscard]] constexpr std::string_view to_string(lane l) noexcept {
    switch (l) {
    case lane::small:
        return "small";
    case lane::bulk:
        return "bulk";
    }
    return "unknown";
}

/// The enumerator's name, e.g. "h2d".
[[nodiscard]] constexpr std::string_view to_string(copy_direction d) noexcept {
    switch (d) {
    case copy_direction::h2d:
        return "h2d";
    case copy_direction::d2h:
        return "d2h";
    }
    return "unknown";
}

/// One device's transfer streams: a small and a bulk lane, each with one stream per direction,
/// all non-blocking; the small lane's at the device's highest priority. Made on the device's
/// first for_device() and kept for the process (docs/copy.md#copy-lanes).
class copy_lanes {
public:
    /// The lanes of `dev`, made on first use (thread-safe; later calls take a mutex and return).
    /// The first call for a device makes its four streams under that device's own mutex, not the
    /// registry's, so that calls for other devices go on meanwhile (CUDA calls on a device wait
    /// while the driver loads a module there); it loads no kernel and waits for no work of the
    /// device. A template (of an unused parameter) so that only a translation unit that uses the
    /// lanes instantiates what they are made of.
    /// @throws usage_error in a child process forked after the parent used the lanes;
    ///         cuda_error
    template <class = void>
    [[nodiscard]] static copy_lanes& for_device(device_ref dev) {
        registry& r = registry::instance();
        const auto id = static_cast<std::size_t>(dev.get());
        registry::slot* slot = nullptr;
        {
            std::lock_guard lock(r.mutex);
            if (r.stamp.inherited()) {
                throw usage_error("cudawait::copy_lanes::for_device used in a child process after "
                                  "fork(); CUDA state cannot be inherited: use CUDA in the child "
                                  "only if the parent did not, or exec a new program");
            }
            if (r.slots.size() <= id) {
                r.slots.resize(id + 1);
            }
            if (r.slots[id] == nullptr) {
                r.slots[id] = new registry::slot();
            }
            slot = r.slots[id];
            if (slot->lanes != nullptr) {
                return *slot->lanes;
            }
        }
        // One caller makes them; the others for the device wait here, and find them made. The
        // lanes are written under both mutexes, so reading them under either is safe.
        std::lock_guard making(slot->mutex);
        if (slot->lanes == nullptr) {
            // A throw leaves the slot empty (the streams made so far are destroyed), so that a
            // later call tries again.
            copy_lanes* made = new copy_lanes(dev);
            std::lock_guard lock(r.mutex);
            slot->lanes = made;
        }
        return *slot->lanes;
    }

    copy_lanes(const copy_lanes&) = delete;
    copy_lanes& operator=(const copy_lanes&) = delete;

    /// The stream of lane `l` for copies going `d`.
    [[nodiscard]] stream_ref get(lane l, copy_direction d) const noexcept {
        const bool in = d == copy_direction::h2d;
        if (l == lane::small) {
            return in ? m_small_h2d : m_small_d2h;
        }
        return in ? m_bulk_h2d : m_bulk_d2h;
    }

    /// The device the streams belong to.
    [[nodiscard]] int device() const noexcept { return m_device; }

private:
    /// The lanes of every device used so far. Never destroyed, like the streams.
    struct registry {
        /// One device's lanes, and the mutex their making holds.
        struct slot {
            std::mutex mutex;
            copy_lanes* lanes = nullptr;
        };
        std::mutex mutex;
        detail::fork_stamp stamp; ///< the process whose CUDA context owns the streams
        /// By device id. Never deleted (as the registry); plain pointers, because a vector of
        /// std::unique_ptr here would be instantiated in every translation unit.
        std::vector<slot*> slots;

        static registry& instance() {
            static registry* r = new registry();
            return *r;
        }
    };

    // Each stream is made as a cudawait::stream (non-blocking, with the priority) and released
    // at once: nothing destroys it, and stream::live_count() counts the streams users own. A
    // template for the reason for_device() is one.
    template <class = void>
    explicit copy_lanes(device_ref dev) : m_device(dev.get()) {
        const int high = priority_high(dev);
        const int low = priority_low(dev);
        stream small_h2d(dev, high);
        stream small_d2h(dev, high);
        stream bulk_h2d(dev, low);
        stream bulk_d2h(dev, low);
        // The bulk D2H stream is one that makes small D2H copies go by the SMs while busy.
        // Registered last, once nothing here can throw: a destroyed stream left in the registry
        // would be queried by every small D2H copy.
        (void)detail::bulk_streams::instance().add(m_device, {bulk_d2h.get()});
        m_small_h2d = small_h2d.release();
        m_small_d2h = small_d2h.release();
        m_bulk_h2d = bulk_h2d.release();
        m_bulk_d2h = bulk_d2h.release();
    }

    int m_device;
    cudaStream_t m_small_h2d = nullptr;
    cudaStream_t m_small_d2h = nullptr;
    cudaStream_t m_bulk_h2d = nullptr;
    cudaStream_t m_bulk_d2h = nullptr;
};

/// The small lane's stream of `dev` for copies going `d`: for copies of one's own (a kernel's
/// parameters through cudaMemcpyAsync, say) that must not queue behind bulk transfers.
/// @throws as copy_lanes::for_device
template <class = void>
[[nodiscard]] stream_ref small_copy_stream(device_ref dev, copy_direction d) {
    return copy_lanes::for_device(dev).get(lane::small, d);
}

} // namespace cudawait
