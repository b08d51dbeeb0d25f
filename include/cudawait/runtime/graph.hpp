// SPDX-License-Identifier: Apache-2.0
#pragma once

// Synopsis
//   class graph;       owning cudaGraph_t: graph::create(), add_memcpy_1d(...), add_child(...),
//                      instantiate()
//   class graph_exec;  owning cudaGraphExec_t: launch(stream), set_memcpy_1d(node, ...)
//   graph g = capture(s, [&](stream_ref s) { launch kernels on s; });
//
// Both owners are move-only, destroy their handle with them and throw usage_error when empty;
// capture() ends the capture and drops its partial graph when the callable throws
// (docs/runtime.md#graphs).

#include <cudawait/runtime/error.hpp>
#include <cudawait/runtime/stream.hpp>

#include <cstddef>
#include <initializer_list>
#include <utility>

#include <cuda_runtime_api.h>

namespace cudawait {

class graph_exec;

/// An owning CUDA graph. Move-only; using an empty (default-constructed, moved-from or
/// released) graph throws usage_error.
class graph {
public:
    /// An empty graph that owns nothing.
    graph() noexcept = default;
    graph(const graph&) = delete;
    graph& operator=(const graph&) = delete;
    graph(graph&& o) noexcept : m_handle(std::exchange(o.m_handle, nullptr)) {}
    graph& operator=(graph&& o) noexcept {
        graph(std::move(o)).swap(*this);
        return *this;
    }
    ~graph() {
        if (m_handle != nullptr) {
            detail::report(cudaGraphDestroy(m_handle), "cudaGraphDestroy");
        }
    }

    /// A new graph without nodes.
    /// @throws cuda_error
    [[nodiscard]] static graph create() {
        cudaGraph_t g = nullptr;
        check(cudaGraphCreate(&g, 0), "cudaGraphCreate");
        return graph(g);
    }
    /// Takes ownership of `handle`, which must have been made by cudaGraphCreate or a capture.
    /// @throws usage_error for a null handle
    [[nodiscard]] static graph from_native_handle(cudaGraph_t handle) {
        if (handle == nullptr) {
            throw usage_error("graph::from_native_handle: null handle");
        }
        return graph(handle);
    }
    /// Gives up ownership: the caller destroys the returned handle.
    [[nodiscard]] cudaGraph_t release() noexcept { return std::exchange(m_handle, nullptr); }

    /// @throws usage_error when empty
    [[nodiscard]] cudaGraph_t get() const {
        if (m_handle == nullptr) {
            throw usage_error("cudawait::graph is empty (default-constructed, moved from or "
                              "released)");
        }
        return m_handle;
    }
    [[nodiscard]] explicit operator bool() const noexcept { return m_handle != nullptr; }

    /// Adds a 1D memcpy node after `deps`.
    /// @throws usage_error when empty; cuda_error
    cudaGraphNode_t add_memcpy_1d(void* dst, const void* src, std::size_t bytes,
                                  cudaMemcpyKind kind,
                                  std::initializer_list<cudaGraphNode_t> deps = {}) {
        cudaGraphNode_t node = nullptr;
        check(cudaGraphAddMemcpyNode1D(&node, get(), deps.begin(), deps.size(), dst, src, bytes,
                                       kind),
              "cudaGraphAddMemcpyNode1D");
        return node;
    }
    /// Adds `child` (cloned into this graph) as one node after `deps`.
    /// @throws usage_error when either graph is empty; cuda_error
    cudaGraphNode_t add_child(const graph& child,
                              std::initializer_list<cudaGraphNode_t> deps = {}) {
        cudaGraphNode_t node = nullptr;
        check(cudaGraphAddChildGraphNode(&node, get(), deps.begin(), deps.size(), child.get()),
              "cudaGraphAddChildGraphNode");
        return node;
    }
    /// An executable instance of the graph as it is now.
    /// @throws usage_error when empty; cuda_error
    [[nodiscard]] inline graph_exec instantiate() const;

    void swap(graph& o) noexcept { std::swap(m_handle, o.m_handle); }

private:
    explicit graph(cudaGraph_t adopted) noexcept : m_handle(adopted) {}
    cudaGraph_t m_handle = nullptr;
};

/// An owning executable graph. Move-only; using an empty one throws usage_error.
class graph_exec {
public:
    /// An empty executable graph that owns nothing.
    graph_exec() noexcept = default;
    graph_exec(const graph_exec&) = delete;
    graph_exec& operator=(const graph_exec&) = delete;
    graph_exec(graph_exec&& o) noexcept : m_handle(std::exchange(o.m_handle, nullptr)) {}
    graph_exec& operator=(graph_exec&& o) noexcept {
        graph_exec(std::move(o)).swap(*this);
        return *this;
    }
    ~graph_exec() {
        if (m_handle != nullptr) {
            detail::report(cudaGraphExecDestroy(m_handle), "cudaGraphExecDestroy");
        }
    }

    /// Takes ownership of `handle`, which must have been made by cudaGraphInstantiate*.
    /// @throws usage_error for a null handle
    [[nodiscard]] static graph_exec from_native_handle(cudaGraphExec_t handle) {
        if (handle == nullptr) {
            throw usage_error("graph_exec::from_native_handle: null handle");
        }
        return graph_exec(handle);
    }
    /// Gives up ownership: the caller destroys the returned handle.
    [[nodiscard]] cudaGraphExec_t release() noexcept { return std::exchange(m_handle, nullptr); }

    /// @throws usage_error when empty
    [[nodiscard]] cudaGraphExec_t get() const {
        if (m_handle == nullptr) {
            throw usage_error("cudawait::graph_exec is empty (default-constructed, moved from "
                              "or released)");
        }
        return m_handle;
    }
    [[nodiscard]] explicit operator bool() const noexcept { return m_handle != nullptr; }

    /// Enqueues one replay on `s`.
    /// @throws usage_error when empty; cuda_error
    void launch(stream_ref s) const { check(cudaGraphLaunch(get(), s.get()), "cudaGraphLaunch"); }
    /// Points memcpy node `node` (of the graph this was instantiated from) at new addresses for
    /// the launches that follow; launches already enqueued keep the old ones.
    /// @throws usage_error when empty; cuda_error
    void set_memcpy_1d(cudaGraphNode_t node, void* dst, const void* src, std::size_t bytes,
                       cudaMemcpyKind kind) {
        check(cudaGraphExecMemcpyNodeSetParams1D(get(), node, dst, src, bytes, kind),
              "cudaGraphExecMemcpyNodeSetParams1D");
    }

    void swap(graph_exec& o) noexcept { std::swap(m_handle, o.m_handle); }

private:
    explicit graph_exec(cudaGraphExec_t adopted) noexcept : m_handle(adopted) {}
    cudaGraphExec_t m_handle = nullptr;
};

inline graph_exec graph::instantiate() const {
    cudaGraphExec_t exec = nullptr;
    check(cudaGraphInstantiate(&exec, get(), 0), "cudaGraphInstantiate");
    return graph_exec::from_native_handle(exec);
}

/// Records the work `record(s)` enqueues on `s` into a new graph (nothing runs). `s` must not
/// be the legacy default stream.
/// @throws cuda_error; what `record` throws (the capture is ended and discarded first)
template <class F>
[[nodiscard]] graph capture(stream_ref s, F&& record) {
    check(cudaStreamBeginCapture(s.get(), cudaStreamCaptureModeThreadLocal),
          "cudaStreamBeginCapture");
    try {
        std::forward<F>(record)(s);
    } catch (...) {
        // The capture may have been invalidated by what failed, so ending it may fail too; the
        // exception in flight is the error that matters, and the stream must leave capture mode.
        cudaGraph_t partial = nullptr;
        if (cudaStreamEndCapture(s.get(), &partial) != cudaSuccess) {
            (void)cudaGetLastError();
        }
        if (partial != nullptr) {
            detail::report(cudaGraphDestroy(partial), "cudaGraphDestroy");
        }
        throw;
    }
    cudaGraph_t g = nullptr;
    check(cudaStreamEndCapture(s.get(), &g), "cudaStreamEndCapture");
    return graph::from_native_handle(g);
}

} // namespace cudawait
