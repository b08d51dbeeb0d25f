// SPDX-License-Identifier: Apache-2.0
#pragma once

// Synopsis
//   when_all(a, b, c...)   -> task<std::tuple<Ra, Rb, Rc...>>   (void results as std::monostate)
//   when_all(range)        -> task<std::vector<R>>               (task<void> for void results)
//
// Starts every child at once on the awaiting coroutine's scheduler and resumes the awaiter when
// the last one finished. If any child threw, the first exception to occur is rethrown, and only
// after all children finished: nothing is left running behind the caller's back.

#include <cudawait/core/task.hpp>
#include <cudawait/runtime/error.hpp>

#include <atomic>
#include <coroutine>
#include <cstddef>
#include <exception>
#include <iterator>
#include <optional>
#include <ranges>
#include <tuple>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

namespace cudawait {

namespace detail {

/// Counts finished children; the last one hands control back to the awaiting coroutine.
class when_all_latch {
public:
    explicit when_all_latch(std::size_t children) noexcept : m_count(children + 1) {}

    /// Called once by the awaiter after starting all children. True when it must suspend.
    bool try_suspend(std::coroutine_handle<> awaiter) noexcept {
        m_awaiter = awaiter;
        return m_count.fetch_sub(1, std::memory_order_acq_rel) > 1;
    }
    /// Called by each child as it finishes; returns who runs next.
    std::coroutine_handle<> arrive() noexcept {
        if (m_count.fetch_sub(1, std::memory_order_acq_rel) == 1) {
            return m_awaiter;
        }
        return std::noop_coroutine();
    }
    void record(std::exception_ptr e) noexcept {
        bool expected = false;
        if (m_failed.compare_exchange_strong(expected, true, std::memory_order_acq_rel)) {
            m_error = std::move(e);
        }
    }
    void rethrow_if_failed() const {
        if (m_failed.load(std::memory_order_acquire)) {
            std::rethrow_exception(m_error);
        }
    }

private:
    std::atomic<std::size_t> m_count;
    std::coroutine_handle<> m_awaiter;
    std::atomic<bool> m_failed{false};
    std::exception_ptr m_error;
};

template <class R>
using stored_t = std::conditional_t<std::is_void_v<R>, std::monostate, R>;

/// One child of a when_all: awaits its work, keeps the result, reports to the latch.
template <class R>
class when_all_child {
public:
    class promise_type : public promise_base {
    public:
        when_all_child get_return_object() noexcept {
            return when_all_child(std::coroutine_handle<promise_type>::from_promise(*this));
        }
        std::suspend_always initial_suspend() noexcept { return {}; }
        struct final_awaiter {
            bool await_ready() noexcept { return false; }
            std::coroutine_handle<> await_suspend(std::coroutine_handle<promise_type> h) noexcept {
                return h.promise().m_latch->arrive();
            }
            void await_resume() noexcept {}
        };
        final_awaiter final_suspend() noexcept { return {}; }
        template <class U>
        void return_value(U&& v) {
            m_value.emplace(std::forward<U>(v));
        }
        void unhandled_exception() noexcept { m_latch->record(std::current_exception()); }

        when_all_latch* m_latch = nullptr;
        std::optional<stored_t<R>> m_value;
    };

    explicit when_all_child(std::coroutine_handle<promise_type> h) noexcept : m_handle(h) {}
    when_all_child(const when_all_child&) = delete;
    when_all_child& operator=(const when_all_child&) = delete;
    when_all_child(when_all_child&& o) noexcept : m_handle(std::exchange(o.m_handle, {})) {}
    when_all_child& operator=(when_all_child&&) = delete;
    ~when_all_child() {
        if (m_handle) {
            m_handle.destroy();
        }
    }

    template <class P>
    void start(when_all_latch& latch, std::coroutine_handle<P> parent) noexcept {
        m_handle.promise().m_latch = &latch;
        inherit_scheduler(parent, m_handle.promise());
        m_handle.resume();
    }
    stored_t<R> take() { return std::move(*m_handle.promise().m_value); }

private:
    std::coroutine_handle<promise_type> m_handle;
};

template <class R, class A>
when_all_child<R> make_when_all_child(A a) {
    if constexpr (std::is_void_v<R>) {
        co_await std::move(a);
        co_return std::monostate{};
    } else {
        co_return co_await std::move(a);
    }
}

/// Starts the children when awaited; resumes the awaiter when all finished.
template <class Children>
class when_all_awaiter {
public:
    when_all_awaiter(Children& children, when_all_latch& latch) noexcept
        : m_children(children), m_latch(latch) {}
    bool await_ready() const noexcept { return false; }
    template <class P>
    bool await_suspend(std::coroutine_handle<P> parent) noexcept {
        for_each_child([&](auto& c) { c.start(m_latch, parent); });
        return m_latch.try_suspend(parent);
    }
    void await_resume() const { m_latch.rethrow_if_failed(); }

private:
    template <class F>
    void for_each_child(F&& f) {
        if constexpr (requires { std::tuple_size<Children>::value; }) {
            std::apply([&](auto&... c) { (f(c), ...); }, m_children);
        } else {
            for (auto& c : m_children) {
                f(c);
            }
        }
    }
    Children& m_children;
    when_all_latch& m_latch;
};

} // namespace detail

/// Awaits all of `work...` (tasks or other awaitables, moved in) concurrently.
/// @returns a task yielding a tuple of the results, std::monostate standing for void
/// @throws the first exception any child threw, once all children finished
template <class... A>
[[nodiscard]] task<std::tuple<detail::stored_t<detail::awaited_t<A>>...>> when_all(A... work) {
    std::tuple<detail::when_all_child<detail::awaited_t<A>>...> children(
        detail::make_when_all_child<detail::awaited_t<A>>(std::move(work))...);
    detail::when_all_latch latch(sizeof...(A));
    co_await detail::when_all_awaiter<decltype(children)>(children, latch);
    co_return std::apply([](auto&... c) { return std::make_tuple(c.take()...); }, children);
}

/// Awaits every element of `range` (moved in; tasks or other awaitables) concurrently.
/// @returns a task yielding the results in range order (task<void> when they are void)
/// @throws the first exception any child threw, once all children finished
template <std::ranges::input_range Range>
[[nodiscard]] auto when_all(Range range) -> task<
    std::conditional_t<std::is_void_v<detail::awaited_t<std::ranges::range_value_t<Range>>>, void,
                       std::vector<detail::awaited_t<std::ranges::range_value_t<Range>>>>> {
    using R = detail::awaited_t<std::ranges::range_value_t<Range>>;
    std::vector<detail::when_all_child<R>> children;
    if constexpr (std::ranges::sized_range<Range>) {
        children.reserve(std::ranges::size(range));
    }
    for (auto&& w : range) {
        children.push_back(detail::make_when_all_child<R>(std::move(w)));
    }
    detail::when_all_latch latch(children.size());
    co_await detail::when_all_awaiter<decltype(children)>(children, latch);
    if constexpr (!std::is_void_v<R>) {
        std::vector<R> out;
        out.reserve(children.size());
        for (auto& c : children) {
            out.push_back(c.take());
        }
        co_return out;
    }
}

} // namespace cudawait
