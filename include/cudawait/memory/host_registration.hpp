// SPDX-License-Identifier: Apache-2.0
#pragma once

// Synopsis
//   host_registration reg(v);                 page-locks v's pages (cudaHostRegister) for reg's
//                                             lifetime; cudaHostUnregister when it goes
//   registered_span<float> s = reg.span();    the range, stated pinned: copied with no staging
//   reg.data(), reg.size(), reg.bytes(), reg.reset(), explicit operator bool
//
// For pageable buffers refilled for every batch: register once, and every later transfer runs at
// the pinned rate. Move-only. The registration must outlive every copy that uses the memory (an
// asynchronous one included). See docs/memory.md#host-registration.

#include <cudawait/memory/memory_kind.hpp>
#include <cudawait/runtime/error.hpp>

#include <cstddef>
#include <iterator>
#include <ranges>
#include <span>
#include <type_traits>
#include <utility>

#include <cuda_runtime_api.h>

namespace cudawait {

/// A view of host memory that is page-locked for as long as the host_registration it came from
/// lives: copy() and the pipeline take it as pinned memory without asking the driver.
template <class T>
class registered_span {
public:
    /// Where the elements live (copy asks the type instead of the driver).
    static constexpr memory_kind memory = memory_kind::pinned;

    using element_type = T;
    using value_type = std::remove_cv_t<T>;
    using iterator = typename std::span<T>::iterator;

    registered_span() noexcept = default;

    [[nodiscard]] T* data() const noexcept { return m_span.data(); }
    [[nodiscard]] std::size_t size() const noexcept { return m_span.size(); }
    [[nodiscard]] std::size_t size_bytes() const noexcept { return m_span.size_bytes(); }
    [[nodiscard]] bool empty() const noexcept { return m_span.empty(); }
    [[nodiscard]] iterator begin() const noexcept { return m_span.begin(); }
    [[nodiscard]] iterator end() const noexcept { return m_span.end(); }
    [[nodiscard]] T& operator[](std::size_t i) const noexcept { return m_span[i]; }

    /// The same elements as a std::span (which pipeline::run takes; the driver then reports
    /// them pinned).
    [[nodiscard]] std::span<T> span() const noexcept { return m_span; }

    /// Elements [offset, offset + count) of the range: registered too.
    [[nodiscard]] registered_span subspan(std::size_t offset,
                                          std::size_t count = std::dynamic_extent) const {
        return registered_span(m_span.subspan(offset, count));
    }

private:
    template <class>
    friend class host_registration;
    explicit registered_span(std::span<T> s) noexcept : m_span(s) {}

    std::span<T> m_span;
};

/// Page-locks a range of pageable host memory (cudaHostRegister) for its lifetime.
template <class T>
class host_registration {
    static_assert(std::is_trivially_copyable_v<std::remove_cv_t<T>>,
                  "host_registration: the GPU copies the elements, which must be trivially "
                  "copyable");

public:
    /// Nothing registered; only assignment and destruction are useful.
    host_registration() noexcept = default;

    /// Registers `range` with `flags` (cudaHostRegisterDefault; cudaHostRegisterPortable makes
    /// it pinned for every device's context, cudaHostRegisterMapped maps it into the device's
    /// address space too).
    /// @throws usage_error for an empty range or a null pointer; cuda_error, with status()
    ///         cudaErrorHostMemoryAlreadyRegistered when (part of) the range is registered
    ///         already
    explicit host_registration(std::span<T> range, unsigned flags = cudaHostRegisterDefault) {
        if (range.empty() || range.data() == nullptr) {
            throw usage_error("host_registration: empty range (nothing to page-lock)");
        }
        void* p = const_cast<void*>(static_cast<const volatile void*>(range.data()));
        cudaError_t st = cudaHostRegister(p, range.size_bytes(), flags);
        if (st == cudaErrorHostMemoryAlreadyRegistered) {
            (void)cudaGetLastError(); // not sticky: clear it so later calls do not see it
            throw cuda_error(st, "cudaHostRegister (the range, or part of it, is registered "
                                 "already)");
        }
        check(st, "cudaHostRegister");
        m_span = range;
    }

    host_registration(host_registration&& o) noexcept : m_span(std::exchange(o.m_span, {})) {}
    host_registration& operator=(host_registration&& o) noexcept {
        if (this != &o) {
            reset();
            m_span = std::exchange(o.m_span, {});
        }
        return *this;
    }
    host_registration(const host_registration&) = delete;
    host_registration& operator=(const host_registration&) = delete;

    /// Unregisters the range (errors are reported on stderr, never thrown).
    ~host_registration() { reset(); }

    /// Unregisters the range now; the registration becomes empty.
    void reset() noexcept {
        if (m_span.data() != nullptr) {
            void* p = const_cast<void*>(static_cast<const volatile void*>(m_span.data()));
            detail::report(cudaHostUnregister(p), "cudaHostUnregister");
            m_span = {};
        }
    }

    /// The registered range, stated pinned (valid while this registration lives).
    /// @throws usage_error on an empty registration
    [[nodiscard]] registered_span<T> span() const {
        if (m_span.data() == nullptr) {
            throw usage_error("host_registration::span: nothing is registered");
        }
        return registered_span<T>(m_span);
    }

    [[nodiscard]] T* data() const noexcept { return m_span.data(); }
    [[nodiscard]] std::size_t size() const noexcept { return m_span.size(); }
    [[nodiscard]] std::size_t bytes() const noexcept { return m_span.size_bytes(); }
    [[nodiscard]] explicit operator bool() const noexcept { return m_span.data() != nullptr; }

private:
    std::span<T> m_span;
};

template <class T, std::size_t E>
host_registration(std::span<T, E>, unsigned = 0) -> host_registration<T>;

/// `host_registration reg(vector)`: any contiguous range held by the caller.
template <std::ranges::contiguous_range R>
host_registration(R&, unsigned = 0)
    -> host_registration<std::remove_reference_t<std::ranges::range_reference_t<R>>>;

} // namespace cudawait

/// A registered_span does not own its elements: a std::span made from a temporary one (what
/// `pipe.run(reg.span(), ...)` does) stays valid.
namespace std::ranges {
template <class T>
inline constexpr bool enable_borrowed_range<cudawait::registered_span<T>> = true;
} // namespace std::ranges
