// SPDX-License-Identifier: Apache-2.0
#pragma once

// Synopsis
//   pinned_buffer<float> buf(n);          n floats of page-locked memory from default_pinned_pool()
//   pinned_buffer<float> buf(n, pool);    ... from `pool`
//   std::span<float> s = buf.span();      host access (also data(), begin(), end(), operator[])
//   buf.record_use(stream);               the block is handed out again only after `stream`
//                                         passed this point (copy.hpp's copies do this for you)
//   buf.reset();                          gives the block back now
//
// Move-only; the elements are not initialised. The block goes back to its pool when the buffer
// is destroyed or reset.

#include <cudawait/error.hpp>
#include <cudawait/memory_kind.hpp>
#include <cudawait/pinned_pool.hpp>
#include <cudawait/stream.hpp>

#include <cstddef>
#include <cstdio>
#include <exception>
#include <span>
#include <type_traits>
#include <utility>

namespace cudawait {

/// `count` elements of page-locked host memory from a pinned_pool. The elements are not
/// initialised (T must be trivially copyable: the GPU writes them).
template <class T>
class pinned_buffer {
    static_assert(std::is_trivially_copyable_v<T>, "pinned_buffer holds trivially copyable types");

public:
    using value_type = T;
    /// Where the elements live (copy asks the type instead of the driver).
    static constexpr memory_kind memory = memory_kind::pinned;

    /// An empty buffer; only assignment and destruction are allowed on it.
    pinned_buffer() noexcept = default;

    /// @throws usage_error for a zero count; pool_exhausted at the pool's cap
    explicit pinned_buffer(std::size_t count, pinned_pool& pool = default_pinned_pool())
        : m_pool(&pool), m_count(count) {
        if (count == 0) {
            throw usage_error("pinned_buffer: zero elements requested");
        }
        if (count > std::size_t(-1) / sizeof(T)) {
            throw usage_error("pinned_buffer: element count overflows the byte size");
        }
        m_data =
            static_cast<T*>(pool.allocate(count * sizeof(T), alignof(T) < 256 ? 256 : alignof(T)));
    }

    pinned_buffer(pinned_buffer&& other) noexcept
        : m_pool(std::exchange(other.m_pool, nullptr)),
          m_data(std::exchange(other.m_data, nullptr)), m_count(std::exchange(other.m_count, 0)) {}
    pinned_buffer& operator=(pinned_buffer&& other) noexcept {
        if (this != &other) {
            reset();
            m_pool = std::exchange(other.m_pool, nullptr);
            m_data = std::exchange(other.m_data, nullptr);
            m_count = std::exchange(other.m_count, 0);
        }
        return *this;
    }
    pinned_buffer(const pinned_buffer&) = delete;
    pinned_buffer& operator=(const pinned_buffer&) = delete;
    ~pinned_buffer() { reset(); }

    /// Gives the block back to its pool now; the buffer becomes empty.
    void reset() noexcept {
        if (m_data != nullptr) {
            try {
                m_pool->deallocate(m_data);
            } catch (const std::exception& e) {
                std::fprintf(stderr, "cudawait: pinned_buffer: %s\n", e.what());
            }
            m_data = nullptr;
            m_count = 0;
        }
    }

    /// Records that work enqueued on `s` so far may use this memory.
    /// @throws usage_error on an empty buffer; cuda_error
    void record_use(stream_ref s) const { pool().record_use(data(), s); }

    /// @throws usage_error on an empty (moved-from) buffer
    [[nodiscard]] T* data() const {
        if (m_data == nullptr) {
            throw usage_error("pinned_buffer: use of an empty or moved-from buffer");
        }
        return m_data;
    }
    [[nodiscard]] std::size_t size() const noexcept { return m_count; }
    [[nodiscard]] std::size_t size_bytes() const noexcept { return m_count * sizeof(T); }
    [[nodiscard]] bool empty() const noexcept { return m_count == 0; }
    [[nodiscard]] explicit operator bool() const noexcept { return m_data != nullptr; }

    [[nodiscard]] std::span<T> span() const { return {data(), m_count}; }
    [[nodiscard]] T* begin() const { return data(); }
    [[nodiscard]] T* end() const { return data() + m_count; }
    [[nodiscard]] T& operator[](std::size_t i) const { return m_data[i]; }

    /// @throws usage_error on an empty buffer
    [[nodiscard]] pinned_pool& pool() const {
        if (m_pool == nullptr) {
            throw usage_error("pinned_buffer: use of an empty or moved-from buffer");
        }
        return *m_pool;
    }

private:
    pinned_pool* m_pool = nullptr;
    T* m_data = nullptr;
    std::size_t m_count = 0;
};

} // namespace cudawait
