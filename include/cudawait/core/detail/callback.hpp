// SPDX-License-Identifier: Apache-2.0
#pragma once

// detail::callback: a move-only `void()` callable, what the scheduler keeps for posted work and
// timer callbacks. Held in place when it is at most three pointers and nothrow-movable (a
// coroutine handle, a lambda capturing a pointer or two), on the heap otherwise. Its own type,
// not std::function, so that the scheduler's face does not include <functional>.

#include <cstddef>
#include <new>
#include <type_traits>
#include <utility>

namespace cudawait::detail {

class callback {
public:
    callback() noexcept = default;
    callback(std::nullptr_t) noexcept {} // NOLINT(google-explicit-constructor): like std::function

    /// Takes `f`, which must be callable with no arguments (its result is discarded).
    template <class F>
    requires(!std::is_same_v<std::remove_cvref_t<F>, callback> &&
             !std::is_same_v<std::remove_cvref_t<F>, std::nullptr_t> &&
             std::is_invocable_v<std::decay_t<F>&>)
        callback(
            F&& f) { // NOLINT(google-explicit-constructor): a lambda converts, as to std::function
        using D = std::decay_t<F>;
        if constexpr (fits<D>) {
            ::new (static_cast<void*>(m_storage)) D(std::forward<F>(f));
            m_ops = &in_place_ops<D>;
        } else {
            ::new (static_cast<void*>(m_storage)) D*(new D(std::forward<F>(f)));
            m_ops = &on_heap_ops<D>;
        }
    }

    callback(callback&& other) noexcept : m_ops(std::exchange(other.m_ops, nullptr)) {
        if (m_ops != nullptr) {
            m_ops->relocate(m_storage, other.m_storage);
        }
    }
    callback& operator=(callback&& other) noexcept {
        if (this != &other) {
            reset();
            m_ops = std::exchange(other.m_ops, nullptr);
            if (m_ops != nullptr) {
                m_ops->relocate(m_storage, other.m_storage);
            }
        }
        return *this;
    }
    callback& operator=(std::nullptr_t) noexcept {
        reset();
        return *this;
    }
    callback(const callback&) = delete;
    callback& operator=(const callback&) = delete;
    ~callback() { reset(); }

    [[nodiscard]] explicit operator bool() const noexcept { return m_ops != nullptr; }
    /// Calls the callable; it must hold one.
    void operator()() { m_ops->call(m_storage); }

private:
    static constexpr std::size_t capacity = 3 * sizeof(void*);
    template <class D>
    static constexpr bool
        fits = sizeof(D) <= capacity &&
               alignof(D) <= alignof(void*) && std::is_nothrow_move_constructible_v<D>;

    struct ops {
        void (*call)(void* storage);
        /// Moves the callable at `from` to `to` and destroys what is left at `from`.
        void (*relocate)(void* to, void* from) noexcept;
        void (*destroy)(void* storage) noexcept;
    };
    template <class D>
    static D& in_place(void* storage) noexcept {
        return *std::launder(static_cast<D*>(storage));
    }
    template <class D>
    static D*& on_heap(void* storage) noexcept {
        return *std::launder(static_cast<D**>(storage));
    }
    template <class D>
    static constexpr ops in_place_ops{
        [](void* s) { (void)in_place<D>(s)(); },
        [](void* to, void* from) noexcept {
            ::new (to) D(std::move(in_place<D>(from)));
            in_place<D>(from).~D();
        },
        [](void* s) noexcept { in_place<D>(s).~D(); },
    };
    template <class D>
    static constexpr ops on_heap_ops{
        [](void* s) { (void)(*on_heap<D>(s))(); },
        [](void* to, void* from) noexcept { ::new (to) D*(on_heap<D>(from)); },
        [](void* s) noexcept { delete on_heap<D>(s); },
    };

    void reset() noexcept {
        if (const ops* o = std::exchange(m_ops, nullptr)) {
            o->destroy(m_storage);
        }
    }

    alignas(void*) unsigned char m_storage[capacity];
    const ops* m_ops = nullptr;
};

} // namespace cudawait::detail
