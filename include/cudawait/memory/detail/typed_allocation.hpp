// SPDX-License-Identifier: Apache-2.0
#pragma once

// detail::typed_allocation<T, Release>: what pinned_buffer, device_buffer and mapped_buffer
// share, written once: an owned pointer to `count` elements, its release policy, the accessors.

#include <cudawait/runtime/error.hpp>

#include <cstddef>
#include <span>
#include <string>
#include <utility>

namespace cudawait::detail {

/// `count` elements of T at one pointer, owned, freed by `Release`. Empty when default
/// constructed, moved from or reset: then every accessor that would expose the pointer throws.
///
/// Each buffer adds only how it allocates and its extras. `Release` is a small copyable policy:
///
///   struct Release {
///       static constexpr const char* name = "x_buffer";  // for the error messages
///       void operator()(void* data) const noexcept;       // frees; must not throw
///       ...                                               // what the buffer needs beside the
///   };                                                    // pointer: its pool, its stream
///
/// A move copies the policy and empties the source: the policy is only ever used together with a
/// pointer, so a moved-from buffer's copy is inert (device_buffer keeps answering stream()).
template <class T, class Release>
class typed_allocation {
public:
    using value_type = T;

    typed_allocation(const typed_allocation&) = delete;
    typed_allocation& operator=(const typed_allocation&) = delete;
    typed_allocation(typed_allocation&& other) noexcept
        : m_data(std::exchange(other.m_data, nullptr)), m_count(std::exchange(other.m_count, 0)),
          m_release(other.m_release) {}
    typed_allocation& operator=(typed_allocation&& other) noexcept {
        if (this != &other) {
            reset();
            m_data = std::exchange(other.m_data, nullptr);
            m_count = std::exchange(other.m_count, 0);
            m_release = other.m_release;
        }
        return *this;
    }
    ~typed_allocation() { reset(); }

    /// Frees now (see the buffer for what that means); the buffer becomes empty.
    void reset() noexcept {
        if (m_data != nullptr) {
            m_release(static_cast<void*>(m_data));
            m_data = nullptr;
            m_count = 0;
        }
    }

    /// @throws usage_error on an empty (moved-from) buffer
    [[nodiscard]] T* data() const {
        throw_if_empty();
        return m_data;
    }
    [[nodiscard]] std::size_t size() const noexcept { return m_count; }
    [[nodiscard]] std::size_t size_bytes() const noexcept { return m_count * sizeof(T); }
    [[nodiscard]] bool empty() const noexcept { return m_count == 0; }
    [[nodiscard]] explicit operator bool() const noexcept { return m_data != nullptr; }

    /// @throws usage_error on an empty buffer
    [[nodiscard]] std::span<T> span() const { return {data(), m_count}; }
    /// @throws usage_error on an empty buffer
    [[nodiscard]] T* begin() const { return data(); }
    /// @throws usage_error on an empty buffer
    [[nodiscard]] T* end() const { return data() + m_count; }
    /// Element `i` (not checked against size(), as with std::span).
    /// @throws usage_error on an empty buffer, like data()
    [[nodiscard]] T& operator[](std::size_t i) const { return data()[i]; }

protected:
    typed_allocation() noexcept = default;

    /// The byte size of `count` elements, checked before anything is allocated.
    /// @throws usage_error for a zero count or one whose byte size overflows
    [[nodiscard]] static std::size_t checked_bytes(std::size_t count) {
        if (count == 0) {
            throw usage_error(std::string(Release::name) + ": zero elements requested");
        }
        if (count > std::size_t(-1) / sizeof(T)) {
            throw usage_error(std::string(Release::name) +
                              ": element count overflows the byte size");
        }
        return count * sizeof(T);
    }

    /// Takes ownership of `count` elements at `data`, which `release` frees. The allocation
    /// must be empty (the buffers call this once, from their constructors).
    void adopt(T* data, std::size_t count, const Release& release) noexcept {
        m_data = data;
        m_count = count;
        m_release = release;
    }

    /// @throws usage_error on an empty buffer, naming the buffer type
    void throw_if_empty() const {
        if (m_data == nullptr) {
            throw usage_error(std::string(Release::name) +
                              ": use of an empty or moved-from buffer");
        }
    }

    [[nodiscard]] const Release& release_fn() const noexcept { return m_release; }
    [[nodiscard]] Release& release_fn() noexcept { return m_release; }

private:
    T* m_data = nullptr;
    std::size_t m_count = 0;
    Release m_release{};
};

} // namespace cudawait::detail
