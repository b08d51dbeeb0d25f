// SPDX-License-Identifier: Apache-2.0
#pragma once

// Synopsis
//   struct stage_context;          what a pipeline stage is told about the chunk it launches:
//                                  stream, slot, stage index, device, chunk, scratch
//   pipeline_stage<In, Out> st = [](std::span<In> in, std::span<Out> out,
//                                   const stage_context& ctx) { launch on ctx.stream; };
//   pipeline_stage<In, Out> st = [](std::span<In> in, std::span<Out> out, stream_ref s) {...};
//   st(in, out, ctx);              calls either form
//
// pipeline<In, Out>::stage is this type. Both forms are stored as the context form, once, when
// the stage is made: calling it allocates nothing. A callable that accepts the stream form is
// taken as that form (so existing stages, generic lambdas among them, keep their meaning); one
// written for the context should name `const cudawait::stage_context&` as its parameter type.
// An empty std::function or a null function pointer makes an empty stage, as std::function does.

#include <cudawait/stream.hpp>

#include <concepts>
#include <cstddef>
#include <functional>
#include <span>
#include <type_traits>
#include <utility>

namespace cudawait {

/// What a pipeline stage is told about the chunk it launches (pipeline.hpp).
struct stage_context {
    /// Launch the chunk's work here: the chunk's compute stream, with `stage_streams` this
    /// stage's own stream, in graph mode the capture stream.
    stream_ref stream;
    unsigned slot;  ///< the slot the chunk runs on, 0 .. depth-1
    unsigned stage; ///< this stage's index
    int device;
    std::size_t chunk; ///< the chunk's index in the batch, or its submission index
    /// The slot's device scratch (pipeline_options::scratch_bytes, 256-byte aligned, the same
    /// bytes for every chunk of the slot, uninitialised); empty when scratch_bytes is 0.
    std::span<std::byte> scratch;
};

template <class In, class Out>
class pipeline_stage;

namespace detail {
template <class F>
struct is_std_function : std::false_type {};
template <class Sig>
struct is_std_function<std::function<Sig>> : std::true_type {};

// A name for the type: clang-format 14 misreads `const stage_context&>` closing a template
// argument list (as a comparison) and splits it over lines.
using stage_context_ref = const stage_context&;

/// A stage of the older form (taking the stream alone), called as an lvalue.
template <class F, class In, class Out>
concept stream_stage = std::invocable<F&, std::span<In>, std::span<Out>, stream_ref>;
/// A stage of the context form, called as an lvalue.
template <class F, class In, class Out>
concept context_stage = std::invocable<F&, std::span<In>, std::span<Out>, stage_context_ref>;
/// What pipeline_stage<In, Out> wraps: a callable of either form (the stream form is tried
/// first), not a pipeline_stage itself (that is copied).
template <class F, class In, class Out>
concept stage_callable =
    !std::is_same_v<std::remove_cvref_t<F>, pipeline_stage<In, Out>> &&
    (stream_stage<std::decay_t<F>, In, Out> || context_stage<std::decay_t<F>, In, Out>);
} // namespace detail

/// A pipeline stage: a callable of either form, `(in, out, const stage_context&)` or the older
/// `(in, out, stream_ref)`, stored as the first. Copyable; default-constructed it is empty.
template <class In, class Out>
class pipeline_stage {
public:
    /// An empty stage (the pipeline refuses it).
    pipeline_stage() noexcept = default;

    /// Wraps `f`, of either form; the stream form is called with `ctx.stream`.
    template <detail::stage_callable<In, Out> F>
    pipeline_stage(F&& f) { // NOLINT(google-explicit-constructor): stages are given as lambdas
        using fn = std::decay_t<F>;
        if constexpr (std::is_pointer_v<fn>) {
            fn p = f;
            if (p == nullptr) {
                return;
            }
        } else if constexpr (detail::is_std_function<fn>::value) {
            if (!f) {
                return;
            }
        }
        if constexpr (detail::stream_stage<fn, In, Out>) {
            // Called as an lvalue, as std::function calls its target: mutable lambdas work.
            m_fn = [g = fn(std::forward<F>(f))](std::span<In> in, std::span<Out> out,
                                                const stage_context& ctx) mutable {
                g(in, out, ctx.stream);
            };
        } else {
            m_fn = fn(std::forward<F>(f));
        }
    }

    /// False for an empty stage.
    [[nodiscard]] explicit operator bool() const noexcept { return static_cast<bool>(m_fn); }

    /// Launches the chunk's work.
    /// @throws what the callable throws; std::bad_function_call for an empty stage
    void operator()(std::span<In> in, std::span<Out> out, const stage_context& ctx) const {
        m_fn(in, out, ctx);
    }

private:
    std::function<void(std::span<In>, std::span<Out>, const stage_context&)> m_fn;
};

} // namespace cudawait
