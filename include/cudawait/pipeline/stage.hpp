// SPDX-License-Identifier: Apache-2.0
#pragma once

// Synopsis
//   pipeline_stage<In, Out> st = [](std::span<In> in, std::span<Out> out,
//                                   const stage_context& ctx) { launch on ctx.stream; };
//   pipeline_stage<In, Out> st = [](std::span<In> in, std::span<Out> out, stream_ref s) {...};
//   pipeline_stage<In, Out> st = [](std::span<In> in, std::span<Out> out,
//                                   const group_context& g) { one launch for g.chunks chunks };
//   st(in, out, ctx);  st.run_group(in, out, g);   a per-chunk stage runs once per chunk
//   pipeline_stage<In, Out> st = replayable(f);   f launches the same work for every chunk of
//                                  a slot: small chunks' groups may replay it as a CUDA graph
//
// pipeline<In, Out>::stage is this type; a stage is stored once, as the context form, so calling
// it allocates nothing. A callable that accepts the stream form is taken as that form. See
// docs/pipeline.md#stages.

#include <cudawait/runtime/stream.hpp>

#include <algorithm>
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
    int device; ///< the pipeline's device (pipeline_options::stream_options::device), current in
                ///< the call
    std::size_t chunk; ///< the chunk's index in the batch, or its submission index
    /// The slot's device scratch (pipeline_options::memory_options::scratch_bytes, 256-byte
    /// aligned, the same bytes for every chunk of the slot, uninitialised); empty when
    /// scratch_bytes is 0.
    std::span<std::byte> scratch;
};

/// What a group stage is told about the run of consecutive chunks it launches as one
/// (pipeline_options::memory_options::group_bytes): chunk j of the group is chunk first_chunk + j,
/// its input at j x in_stride in the stage's `in` and its output at j x out_stride in `out`; all
/// chunks but the last are full.
struct group_context {
    /// Launch the group's work here (as stage_context::stream).
    stream_ref stream;
    unsigned slot;  ///< the slot group the chunks run on, 0 .. depth-1
    unsigned stage; ///< this stage's index
    int device; ///< the pipeline's device (pipeline_options::stream_options::device), current in
                ///< the call
    std::size_t first_chunk; ///< the first chunk's index in the batch, or its submission index
    std::size_t chunks;      ///< chunks in the group, at least 1
    std::size_t in_stride;   ///< input elements of a full chunk in this stage's `in`
    std::size_t out_stride;  ///< output elements of a full chunk in this stage's `out`
    /// The slot's device scratch, as stage_context::scratch; shared by the group's chunks.
    std::span<std::byte> scratch;

    /// Chunk j's part of `in` (this stage's input span): in_stride elements, or what is left.
    template <class T>
    [[nodiscard]] std::span<T> input_chunk(std::span<T> in, std::size_t j) const noexcept {
        return part(in, in_stride, j);
    }
    /// Chunk j's part of `out` (this stage's output span).
    template <class T>
    [[nodiscard]] std::span<T> output_chunk(std::span<T> out, std::size_t j) const noexcept {
        return part(out, out_stride, j);
    }
    /// The stage_context of chunk j, as a per-chunk stage is called with it.
    [[nodiscard]] stage_context chunk_context(std::size_t j) const noexcept {
        return stage_context{stream, slot, stage, device, first_chunk + j, scratch};
    }

private:
    template <class T>
    static std::span<T> part(std::span<T> s, std::size_t stride, std::size_t j) noexcept {
        const std::size_t at = std::min(s.size(), j * stride);
        return s.subspan(at, std::min(stride, s.size() - at));
    }
};

template <class In, class Out>
class pipeline_stage;

/// A stage callable marked replayable (replayable()): calls it as it is called.
template <class F>
struct replayable_stage {
    F fn;
    template <class... Args>
    requires std::invocable<F&, Args...>
    void operator()(Args&&... args) { fn(std::forward<Args>(args)...); }
};

/// Marks a stage callable as replayable: what it launches for a chunk depends only on the
/// spans, stream and scratch it is given (not on `ctx.chunk`, nor on host state that changes
/// between chunks), so a graph captured from one call may stand in for later calls on the same
/// slot. A pipeline whose memory.group_bytes is unset then replays each slot group's work as a
/// CUDA graph when its chunks are small (docs/pipeline.md#chunk-groups); an explicit setting
/// decides on its own.
template <class F>
[[nodiscard]] replayable_stage<std::decay_t<F>> replayable(F&& f) {
    return {std::forward<F>(f)};
}

namespace detail {
template <class F>
struct is_replayable : std::false_type {};
template <class F>
struct is_replayable<replayable_stage<F>> : std::true_type {};

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
using group_context_ref = const group_context&;
/// A group stage (called once per chunk group), called as an lvalue.
template <class F, class In, class Out>
concept group_stage = std::invocable<F&, std::span<In>, std::span<Out>, group_context_ref>;
/// What pipeline_stage<In, Out> wraps: a callable of any form (the stream form is tried
/// first, then the context form, then the group form), not a pipeline_stage itself (that is
/// copied).
template <class F, class In, class Out>
concept stage_callable =
    !std::is_same_v<std::remove_cvref_t<F>, pipeline_stage<In, Out>> &&
    (stream_stage<std::decay_t<F>, In, Out> || context_stage<std::decay_t<F>, In, Out> ||
     group_stage<std::decay_t<F>, In, Out>);
} // namespace detail

/// A pipeline stage: a per-chunk callable, `(in, out, const stage_context&)` or the older
/// `(in, out, stream_ref)`, stored as the first; or a group stage, `(in, out, const
/// group_context&)`. Copyable; default-constructed it is empty.
template <class In, class Out>
class pipeline_stage {
public:
    /// An empty stage (the pipeline refuses it).
    pipeline_stage() noexcept = default;

    /// Wraps `f`, of any form; the stream form is called with `ctx.stream`.
    template <detail::stage_callable<In, Out> F>
    pipeline_stage(F&& f) { // NOLINT(google-explicit-constructor): stages are given as lambdas
        using fn = std::decay_t<F>;
        if constexpr (detail::is_replayable<fn>::value) {
            if (!is_set(f.fn)) {
                return;
            }
            m_replayable = true;
        } else if (!is_set(f)) {
            return;
        }
        if constexpr (detail::stream_stage<fn, In, Out>) {
            // Called as an lvalue, as std::function calls its target: mutable lambdas work.
            m_fn = [g = fn(std::forward<F>(f))](std::span<In> in, std::span<Out> out,
                                                const stage_context& ctx) mutable {
                g(in, out, ctx.stream);
            };
        } else if constexpr (detail::context_stage<fn, In, Out>) {
            m_fn = fn(std::forward<F>(f));
        } else {
            m_group = fn(std::forward<F>(f));
        }
    }

    /// False for an empty stage.
    [[nodiscard]] explicit operator bool() const noexcept {
        return static_cast<bool>(m_fn) || static_cast<bool>(m_group);
    }

    /// True for a group stage (one call per chunk group).
    [[nodiscard]] bool takes_group() const noexcept { return static_cast<bool>(m_group); }

    /// True for a stage made from replayable(f).
    [[nodiscard]] bool is_replayable() const noexcept { return m_replayable; }

    /// Launches the chunk's work (a group stage: as a group of this one chunk).
    /// @throws what the callable throws; std::bad_function_call for an empty stage
    void operator()(std::span<In> in, std::span<Out> out, const stage_context& ctx) const {
        if (m_group) {
            m_group(in, out,
                    group_context{ctx.stream, ctx.slot, ctx.stage, ctx.device, ctx.chunk, 1,
                                  in.size(), out.size(), ctx.scratch});
            return;
        }
        m_fn(in, out, ctx);
    }

    /// Launches a group's work: a group stage once, a per-chunk stage once per chunk of the
    /// group, in order, each with its chunk's spans and stage_context.
    /// @throws what the callable throws (the chunks before it were launched);
    /// std::bad_function_call
    ///         for an empty stage
    void run_group(std::span<In> in, std::span<Out> out, const group_context& g) const {
        if (m_group) {
            m_group(in, out, g);
            return;
        }
        for (std::size_t j = 0; j < g.chunks; ++j) {
            m_fn(g.input_chunk(in, j), g.output_chunk(out, j), g.chunk_context(j));
        }
    }

private:
    // False for a null function pointer or an empty std::function (an empty stage).
    template <class G>
    static bool is_set(const G& g) noexcept {
        if constexpr (std::is_pointer_v<G>) {
            return g != nullptr;
        } else if constexpr (detail::is_std_function<G>::value) {
            return static_cast<bool>(g);
        } else {
            return true;
        }
    }

    std::function<void(std::span<In>, std::span<Out>, const stage_context&)> m_fn;
    std::function<void(std::span<In>, std::span<Out>, const group_context&)> m_group;
    bool m_replayable = false;
};

} // namespace cudawait
