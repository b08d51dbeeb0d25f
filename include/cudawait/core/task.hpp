// SPDX-License-Identifier: Apache-2.0
#pragma once

// Synopsis
//   template <class T = void> class task;   lazy, move-only coroutine; `co_await` it for its value
//   this_scheduler()      inside a task: `scheduler& s = co_await this_scheduler();` (.cpp and .cu)
//
// A task starts only when awaited (or handed to sync_wait / a scope). It inherits the scheduler
// of the coroutine that awaits it, and its promise routes `co_await` on streams, events, timers
// and `schedule()` to that scheduler (scheduler.hpp). Streams and events of other libraries
// (stream_like, event_like: stream.hpp, event.hpp) are awaited as the raw handle they name.
// Completion hands control straight back to the awaiting coroutine (symmetric transfer), so deep
// chains do not grow the stack.

#include <cudawait/runtime/detail/refs.hpp>
#include <cudawait/runtime/error.hpp>

#include <concepts>
#include <coroutine>
#include <exception>
#include <new>
#include <source_location>
#include <type_traits>
#include <utility>

#include <cuda_runtime_api.h>

namespace cudawait {

class scheduler;

namespace detail {

template <class A>
decltype(auto) get_awaiter(A&& a) {
    if constexpr (requires { std::forward<A>(a).operator co_await(); }) {
        return std::forward<A>(a).operator co_await();
    } else if constexpr (requires { operator co_await(std::forward<A>(a)); }) {
        return operator co_await(std::forward<A>(a));
    } else {
        return std::forward<A>(a);
    }
}

/// Forwards to an awaiter held by reference.
template <class Awaiter>
struct awaiter_ref {
    Awaiter& awaiter;
    decltype(auto) await_ready() { return awaiter.await_ready(); }
    template <class P>
    decltype(auto) await_suspend(std::coroutine_handle<P> h) {
        return awaiter.await_suspend(h);
    }
    decltype(auto) await_resume() { return awaiter.await_resume(); }
};

/// What every coroutine type of the library shares: the scheduler it runs on, and an
/// await_transform that binds scheduler-aware awaitables (streams, events, timers) to it.
///
/// An awaitable opts in by providing `await_on(detail::promise_base&, A, std::source_location)`
/// findable by argument-dependent lookup; anything else is awaited unchanged.
class promise_base {
public:
    /// The scheduler this coroutine runs on, or nullptr before it was started by one.
    [[nodiscard]] scheduler* current_scheduler() const noexcept { return m_scheduler; }
    void set_scheduler(scheduler* s) noexcept { m_scheduler = s; }

    /// @throws usage_error when the coroutine was not started through a scheduler
    [[nodiscard]] scheduler& require_scheduler() const {
        if (m_scheduler == nullptr) {
            throw usage_error("cudawait: this coroutine has no scheduler; start it with "
                              "sync_wait, a scope or scheduler::spawn, or await it from one that "
                              "has");
        }
        return *m_scheduler;
    }

    template <class A>
    decltype(auto) await_transform(A&& a,
                                   std::source_location where = std::source_location::current()) {
        // Spelled through a dependent type so that await_on is looked up where the awaitable's
        // header (scheduler.hpp) has declared it.
        typename dependent<A, promise_base>::type& self = *this;
        if constexpr (requires { await_on(self, std::forward<A>(a), where); }) {
            return await_on(self, std::forward<A>(a), where);
        } else if constexpr (std::is_convertible_v<A, stream_ref>) {
            return await_on(self, stream_ref(a), where);
        } else if constexpr (std::is_convertible_v<A, event_ref>) {
            return await_on(self, event_ref(a), where);
        } else if constexpr (stream_like<A> || event_like<A>) {
            // Another library's stream or event type that names its handle only through a member
            // or an explicit conversion: the view's constructor from it is explicit (stream.hpp
            // says why), and awaiting it says plainly which handle is meant.
            static_assert(!(stream_like<A> && event_like<A>),
                          "cudawait: this type names both a stream and an event; co_await "
                          "stream_ref(native_stream(x)) or event_ref(native_event(x))");
            if constexpr (stream_like<A>) {
                return await_on(self, stream_ref(native_stream(a)), where);
            } else {
                return await_on(self, event_ref(native_event(a)), where);
            }
        } else {
            // Awaiters are handed back by value. g++ 12 (seen with 12.2; clang 14 is fine) copies
            // an awaiter that a call returns by lvalue reference, as await_transform would here,
            // instead of using the object referred to: a non-copyable awaiter fails with "use of
            // deleted function" at the co_await. GCC bug 99575 tracks this (`co_await f()` where f
            // returns A&, e.g. std::forward<A&>). So an lvalue awaiter travels behind a small
            // forwarding wrapper instead.
            using awaiter_type = decltype(get_awaiter(std::forward<A>(a)));
            if constexpr (std::is_lvalue_reference_v<awaiter_type>) {
                return awaiter_ref<std::remove_reference_t<awaiter_type>>{
                    get_awaiter(std::forward<A>(a))};
            } else {
                return std::remove_cvref_t<awaiter_type>(get_awaiter(std::forward<A>(a)));
            }
        }
    }

private:
    scheduler* m_scheduler = nullptr;
};

template <class P>
void inherit_scheduler(std::coroutine_handle<P> parent, promise_base& child) noexcept {
    if constexpr (std::is_base_of_v<promise_base, P>) {
        if (child.current_scheduler() == nullptr) {
            child.set_scheduler(parent.promise().current_scheduler());
        }
    }
}

/// Holds a coroutine's outcome: nothing yet, a value, or an exception. (Raw storage rather than
/// a std::variant: <variant> costs every translation unit that includes a task.)
template <class T>
class result_slot {
public:
    result_slot() noexcept {}
    result_slot(result_slot&& o) noexcept(std::is_nothrow_move_constructible_v<T>)
        : m_error(std::move(o.m_error)) {
        if (o.m_has_value) {
            ::new (static_cast<void*>(m_storage)) T(std::move(o.value()));
            m_has_value = true;
        }
    }
    result_slot& operator=(result_slot&& o) noexcept(std::is_nothrow_move_constructible_v<T>) {
        if (this != &o) {
            reset();
            m_error = std::move(o.m_error);
            if (o.m_has_value) {
                ::new (static_cast<void*>(m_storage)) T(std::move(o.value()));
                m_has_value = true;
            }
        }
        return *this;
    }
    ~result_slot() { reset(); }

    template <class U>
    void set_value(U&& v) {
        reset();
        ::new (static_cast<void*>(m_storage)) T(std::forward<U>(v));
        m_has_value = true;
    }
    void set_exception(std::exception_ptr e) noexcept {
        reset();
        m_error = std::move(e);
    }
    [[nodiscard]] bool has_exception() const noexcept { return m_error != nullptr; }
    [[nodiscard]] std::exception_ptr exception() const noexcept { return m_error; }

    /// Moves the value out, or rethrows the stored exception.
    T take() {
        if (m_error) {
            std::rethrow_exception(m_error);
        }
        if (!m_has_value) {
            throw usage_error("cudawait: result taken twice or before completion");
        }
        T v = std::move(value());
        reset();
        return v;
    }

private:
    T& value() noexcept { return *std::launder(reinterpret_cast<T*>(m_storage)); }
    void reset() noexcept {
        if (m_has_value) {
            value().~T();
            m_has_value = false;
        }
    }

    alignas(T) unsigned char m_storage[sizeof(T)];
    bool m_has_value = false;
    std::exception_ptr m_error;
};

template <>
class result_slot<void> {
public:
    void set_value() noexcept { m_done = true; }
    void set_exception(std::exception_ptr e) noexcept { m_error = std::move(e); }
    [[nodiscard]] bool has_exception() const noexcept { return m_error != nullptr; }
    [[nodiscard]] std::exception_ptr exception() const noexcept { return m_error; }
    void take() {
        if (m_error) {
            std::rethrow_exception(m_error);
        }
        if (!m_done) {
            throw usage_error("cudawait: result taken before completion");
        }
    }

private:
    std::exception_ptr m_error;
    bool m_done = false;
};

template <class T>
class task_promise;

class task_promise_common : public promise_base {
public:
    std::suspend_always initial_suspend() noexcept { return {}; }

    struct final_awaiter {
        bool await_ready() noexcept { return false; }
        template <class P>
        std::coroutine_handle<> await_suspend(std::coroutine_handle<P> self) noexcept {
            std::coroutine_handle<> next = self.promise().m_continuation;
            return next ? next : std::noop_coroutine();
        }
        void await_resume() noexcept {}
    };
    final_awaiter final_suspend() noexcept { return {}; }

    void set_continuation(std::coroutine_handle<> c) noexcept { m_continuation = c; }

private:
    std::coroutine_handle<> m_continuation;
};

template <class T>
class task_promise : public task_promise_common {
public:
    std::coroutine_handle<task_promise> handle() noexcept {
        return std::coroutine_handle<task_promise>::from_promise(*this);
    }
    inline auto get_return_object() noexcept;
    template <class U>
    requires std::convertible_to<U&&, T>
    void return_value(U&& v) { m_result.set_value(std::forward<U>(v)); }
    void unhandled_exception() noexcept { m_result.set_exception(std::current_exception()); }
    result_slot<T>& result() noexcept { return m_result; }

private:
    result_slot<T> m_result;
};

template <>
class task_promise<void> : public task_promise_common {
public:
    inline auto get_return_object() noexcept;
    void return_void() noexcept { m_result.set_value(); }
    void unhandled_exception() noexcept { m_result.set_exception(std::current_exception()); }
    result_slot<void>& result() noexcept { return m_result; }

private:
    result_slot<void> m_result;
};

} // namespace detail

/// A lazy coroutine producing a `T` (or nothing, for `task<>`). Move-only.
///
/// `co_await` a task from another library coroutine to start it and get its value; an exception
/// thrown inside rethrows at that `co_await`. A task may be awaited once.
template <class T = void>
class [[nodiscard]] task {
public:
    using promise_type = detail::task_promise<T>;
    using value_type = T;
    using handle_type = std::coroutine_handle<promise_type>;

    task() noexcept = default;
    explicit task(handle_type h) noexcept : m_handle(h) {}
    task(const task&) = delete;
    task& operator=(const task&) = delete;
    task(task&& o) noexcept : m_handle(std::exchange(o.m_handle, {})) {}
    task& operator=(task&& o) noexcept {
        if (this != &o) {
            if (m_handle) {
                m_handle.destroy();
            }
            m_handle = std::exchange(o.m_handle, {});
        }
        return *this;
    }
    ~task() {
        if (m_handle) {
            m_handle.destroy();
        }
    }

    /// False for a default-constructed or moved-from task.
    [[nodiscard]] bool valid() const noexcept { return static_cast<bool>(m_handle); }
    /// True once the coroutine ran to its end.
    [[nodiscard]] bool done() const noexcept { return m_handle && m_handle.done(); }

    struct awaiter {
        handle_type m_handle;
        bool await_ready() const noexcept { return false; }
        template <class P>
        std::coroutine_handle<> await_suspend(std::coroutine_handle<P> parent) noexcept {
            detail::inherit_scheduler(parent, m_handle.promise());
            m_handle.promise().set_continuation(parent);
            return m_handle;
        }
        T await_resume() { return m_handle.promise().result().take(); }
    };

    /// @throws usage_error for a moved-from task
    awaiter operator co_await() & { return awaiter{checked()}; }
    /// @throws usage_error for a moved-from task
    awaiter operator co_await() && { return awaiter{checked()}; }

    /// The coroutine handle, still owned by the task (for drivers such as sync_wait).
    [[nodiscard]] handle_type handle() const noexcept { return m_handle; }

private:
    handle_type checked() const {
        if (!m_handle) {
            throw usage_error("cudawait::task awaited after it was moved from");
        }
        if (m_handle.done()) {
            throw usage_error("cudawait::task awaited twice");
        }
        return m_handle;
    }
    handle_type m_handle;
};

namespace detail {
template <class T>
auto task_promise<T>::get_return_object() noexcept {
    return task<T>(std::coroutine_handle<task_promise<T>>::from_promise(*this));
}
inline auto task_promise<void>::get_return_object() noexcept {
    return task<void>(std::coroutine_handle<task_promise<void>>::from_promise(*this));
}

/// `co_await this_scheduler()` yields the scheduler the awaiting coroutine runs on.
struct this_scheduler_t {};

/// What `co_await this_scheduler()` yields: a reference to the scheduler, as a class that converts
/// to `scheduler&` (std::reference_wrapper's interface, without <functional>).
class scheduler_reference {
public:
    explicit scheduler_reference(scheduler& s) noexcept : m_scheduler(&s) {}
    operator scheduler&() const noexcept { return *m_scheduler; }
    [[nodiscard]] scheduler& get() const noexcept { return *m_scheduler; }

private:
    scheduler* m_scheduler;
};

/// Yields a scheduler_reference, not a `scheduler&`: nvcc 13.0 (V13.0.88; its EDG front end)
/// treats every `co_await` expression as a prvalue, whatever await_resume returns, so in a .cu
/// file `S& s = co_await a;` with `S& await_resume()` fails with "initial value of reference to
/// non-const must be an lvalue" (g++ and clang accept it, as [expr.await] makes it an lvalue). No
/// public NVIDIA bug report for it is known. The wrapper prvalue converts to `scheduler&` under
/// every compiler.
struct this_scheduler_awaiter {
    scheduler* m_scheduler;
    bool await_ready() const noexcept { return true; }
    void await_suspend(std::coroutine_handle<>) const noexcept {}
    scheduler_reference await_resume() const noexcept { return scheduler_reference(*m_scheduler); }
};

inline this_scheduler_awaiter await_on(promise_base& p, this_scheduler_t, std::source_location) {
    return {&p.require_scheduler()};
}

/// What `co_await a` yields for an awaitable `a` inside a library coroutine.
template <class A>
using await_result_t = decltype(std::declval<promise_base&>().await_transform(std::declval<A>()));

/// The type `co_await a` produces inside a library coroutine.
template <class A>
using awaited_t = decltype(get_awaiter(std::declval<await_result_t<A>>()).await_resume());

} // namespace detail

/// Inside a library coroutine: `scheduler& s = co_await this_scheduler();`, in .cpp and .cu files
/// alike. The `co_await` yields a reference wrapper, which converts to `scheduler&`
/// (`auto s = co_await this_scheduler();` keeps the wrapper; use `s.get()`).
/// @throws usage_error when the coroutine runs without a scheduler
[[nodiscard]] constexpr detail::this_scheduler_t this_scheduler() noexcept { return {}; }

} // namespace cudawait
