// SPDX-License-Identifier: Apache-2.0
#pragma once

// Synopsis
//   pinned_buffer<float> buf(n);          n floats of page-locked memory from default_pinned_pool()
//   pinned_buffer<float> buf(n, pool);    ... from `pool`
//   std::span<float> s = buf.span();      host access (also data(), begin(), end(), operator[])
//   buf.record_use(stream);               reused only after `stream` passed this point
//   buf.reset();                          gives the block back now
//
// Move-only; the elements are not initialised. See docs/memory.md#buffers.

#include <cudawait/memory/detail/typed_allocation.hpp>
#include <cudawait/memory/memory_kind.hpp>
#include <cudawait/memory/pinned_pool.hpp>
#include <cudawait/runtime/error.hpp>
#include <cudawait/runtime/stream.hpp>

#include <cstddef>
#include <cstdio>
#include <exception>
#include <span>
#include <type_traits>

namespace cudawait {

namespace detail {
/// How a pinned_buffer gives its block back: to the pool it came from.
struct pinned_block_release {
    static constexpr const char* name = "pinned_buffer";
    pinned_pool* pool = nullptr;

    void operator()(void* block) const noexcept {
        try {
            pool->deallocate(block);
        } catch (const std::exception& e) {
            std::fprintf(stderr, "cudawait: pinned_buffer: %s\n", e.what());
        }
    }
};
} // namespace detail

/// `count` elements of page-locked host memory from a pinned_pool. The elements are not
/// initialised (T must be trivially copyable: the GPU writes them).
///
/// data(), size(), span(), begin(), end(), operator[] and the moves: detail::typed_allocation.
template <class T>
class pinned_buffer : public detail::typed_allocation<T, detail::pinned_block_release> {
    static_assert(std::is_trivially_copyable_v<T>, "pinned_buffer holds trivially copyable types");
    using base = detail::typed_allocation<T, detail::pinned_block_release>;

public:
    /// Where the elements live (copy asks the type instead of the driver).
    static constexpr memory_kind memory = memory_kind::pinned;

    /// An empty buffer; only assignment and destruction are allowed on it.
    pinned_buffer() noexcept = default;

    /// @throws usage_error for a zero count; pool_exhausted at the pool's cap
    explicit pinned_buffer(
        std::size_t count,
        pinned_pool& pool = default_pinned_pool<detail::dependent_t<T, void>>()) {
        std::size_t bytes = base::checked_bytes(count);
        void* block = pool.allocate(bytes, alignof(T) < 256 ? 256 : alignof(T));
        this->adopt(static_cast<T*>(block), count, detail::pinned_block_release{&pool});
    }

    /// Gives the block back to its pool now; the buffer becomes empty.
    using base::reset;

    /// Records that work enqueued on `s` so far may use this memory.
    /// @throws usage_error on an empty buffer; cuda_error
    void record_use(stream_ref s) const { pool().record_use(this->data(), s); }

    /// The pool the block came from.
    /// @throws usage_error on an empty buffer
    [[nodiscard]] pinned_pool& pool() const {
        this->throw_if_empty();
        return *this->release_fn().pool;
    }
};

} // namespace cudawait
