// SPDX-License-Identifier: Apache-2.0
#pragma once

// An in-process NVTX tool for the tests: it records every domain push/pop and start/end range,
// per thread, so that a test can assert what a profiler would show. It attaches through NVTX3's
// static injection: the program defines InitializeInjectionNvtx2_fnptr, and the NVTX headers'
// first call hands that function the export table, through which it installs its handlers.
//
// Include it in ONE file of a test program, before any header that includes NVTX (the NVTX
// headers otherwise define the hook weakly in the same file, which would be a redefinition).
// A profiler's injection (NVTX_INJECTION64_PATH, as Nsight Systems sets it) takes precedence;
// then installed() is false and the tests that need the recorder skip.

#ifdef NVTX_VERSION
#error "include nvtx_recorder.hpp before any header that includes NVTX (cudawait/observe/trace.hpp)"
#endif
#include <cstdint>

// NVTX's static-injection hook (nvtxDetail/nvtxInit.h), declared before the NVTX headers, which
// with NVTX_STATIC_INJECTION_IMPL leave it to the tool; defined at the end of this file.
extern "C" {
extern int (*InitializeInjectionNvtx2_fnptr)(const void* (*get_export_table)(std::uint32_t));
}
#define NVTX_STATIC_INJECTION_IMPL
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <nvtx3/nvToolsExt.h>

namespace cudawait::testing {

/// A range as the recorder saw it.
struct nvtx_range {
    bool push_pop = false; ///< pushed and popped (false: started and ended)
    std::string domain;
    std::string message;
    std::uint64_t payload = 0;
    std::thread::id opened_on;
    std::thread::id closed_on; ///< default-constructed while open
};

/// The recorder of this program; instance() is the one NVTX reports to.
class nvtx_recorder {
public:
    static nvtx_recorder& instance() {
        static nvtx_recorder r;
        return r;
    }

    /// Whether NVTX initialised this recorder as its tool (false under a profiler's injection,
    /// or before the program's first NVTX call).
    [[nodiscard]] bool installed() const {
        std::lock_guard lock(m_mutex);
        return m_installed;
    }
    /// Forgets closed ranges and errors; open ranges stay tracked.
    void clear() {
        std::lock_guard lock(m_mutex);
        m_closed.clear();
        m_errors.clear();
    }
    /// The calling thread's open push/pop ranges, outermost first.
    [[nodiscard]] std::vector<nvtx_range> open_pushes() const {
        std::lock_guard lock(m_mutex);
        auto it = m_stacks.find(std::this_thread::get_id());
        return it == m_stacks.end() ? std::vector<nvtx_range>{} : it->second;
    }
    /// Open push/pop ranges on every thread.
    [[nodiscard]] std::size_t open_push_count() const {
        std::lock_guard lock(m_mutex);
        std::size_t n = 0;
        for (const auto& [thread, stack] : m_stacks) {
            n += stack.size();
        }
        return n;
    }
    /// Start/end ranges not ended yet.
    [[nodiscard]] std::vector<nvtx_range> open_starts() const {
        std::lock_guard lock(m_mutex);
        std::vector<nvtx_range> v;
        for (const auto& [id, r] : m_started) {
            v.push_back(r);
        }
        return v;
    }
    /// Ranges closed since the last clear(), in the order they closed.
    [[nodiscard]] std::vector<nvtx_range> closed() const {
        std::lock_guard lock(m_mutex);
        return m_closed;
    }
    /// What no correct use of NVTX does: a pop on a thread with no open push range, a pop in
    /// another domain than the range it closes, an end of an id that is not open.
    [[nodiscard]] std::vector<std::string> errors() const {
        std::lock_guard lock(m_mutex);
        return m_errors;
    }

    /// NVTX's tool entry point: installs the handlers below.
    static int initialize(NvtxGetExportTableFunc_t get_table) {
        auto* callbacks =
            static_cast<const NvtxExportTableCallbacks*>(get_table(NVTX_ETID_CALLBACKS));
        if (callbacks == nullptr || callbacks->struct_size < sizeof(NvtxExportTableCallbacks)) {
            return 0;
        }
        NvtxFunctionTable table = nullptr;
        unsigned size = 0;
        if (callbacks->GetModuleFunctionTable(NVTX_CB_MODULE_CORE2, &table, &size) == 0 ||
            size < NVTX_CBID_CORE2_DomainCreateA + 1) {
            return 0;
        }
        auto set = [&](int id, auto fn) { *table[id] = reinterpret_cast<NvtxFunctionPointer>(fn); };
        set(NVTX_CBID_CORE2_DomainCreateA, &domain_create);
        set(NVTX_CBID_CORE2_DomainRangePushEx, &push);
        set(NVTX_CBID_CORE2_DomainRangePop, &pop);
        set(NVTX_CBID_CORE2_DomainRangeStartEx, &start);
        set(NVTX_CBID_CORE2_DomainRangeEnd, &end);
        nvtx_recorder& r = instance();
        std::lock_guard lock(r.m_mutex);
        r.m_installed = true;
        return 1;
    }

private:
    nvtx_recorder() = default;

    static nvtxDomainHandle_t domain_create(const char* name) {
        nvtx_recorder& r = instance();
        std::lock_guard lock(r.m_mutex);
        r.m_domains.emplace_back(name != nullptr ? name : "");
        return reinterpret_cast<nvtxDomainHandle_t>(&r.m_domains.back());
    }
    // Under the lock.
    static std::string domain_name(nvtxDomainHandle_t d) {
        return d == nullptr ? std::string() : *reinterpret_cast<const std::string*>(d);
    }
    static nvtx_range make(bool push_pop, nvtxDomainHandle_t d, const nvtxEventAttributes_t* a) {
        nvtx_range r;
        r.push_pop = push_pop;
        r.domain = domain_name(d);
        if (a != nullptr && a->messageType == NVTX_MESSAGE_TYPE_ASCII && a->message.ascii) {
            r.message = a->message.ascii;
        }
        if (a != nullptr && a->payloadType == NVTX_PAYLOAD_TYPE_UNSIGNED_INT64) {
            r.payload = a->payload.ullValue;
        }
        r.opened_on = std::this_thread::get_id();
        return r;
    }

    static int push(nvtxDomainHandle_t d, const nvtxEventAttributes_t* a) {
        nvtx_recorder& r = instance();
        std::lock_guard lock(r.m_mutex);
        auto& stack = r.m_stacks[std::this_thread::get_id()];
        stack.push_back(make(true, d, a));
        return static_cast<int>(stack.size()) - 1;
    }
    static int pop(nvtxDomainHandle_t d) {
        nvtx_recorder& r = instance();
        std::lock_guard lock(r.m_mutex);
        auto& stack = r.m_stacks[std::this_thread::get_id()];
        if (stack.empty()) {
            r.m_errors.push_back("a pop with no open push range on its thread");
            return -2;
        }
        nvtx_range range = stack.back();
        stack.pop_back();
        if (range.domain != domain_name(d)) {
            r.m_errors.push_back("a pop in domain '" + domain_name(d) + "' closed '" +
                                 range.message + "' of domain '" + range.domain + "'");
        }
        range.closed_on = std::this_thread::get_id();
        r.m_closed.push_back(range);
        return static_cast<int>(stack.size());
    }
    static nvtxRangeId_t start(nvtxDomainHandle_t d, const nvtxEventAttributes_t* a) {
        nvtx_recorder& r = instance();
        std::lock_guard lock(r.m_mutex);
        nvtxRangeId_t id = ++r.m_next_id;
        r.m_started.emplace(id, make(false, d, a));
        return id;
    }
    static void end(nvtxDomainHandle_t d, nvtxRangeId_t id) {
        nvtx_recorder& r = instance();
        std::lock_guard lock(r.m_mutex);
        auto it = r.m_started.find(id);
        if (it == r.m_started.end()) {
            r.m_errors.push_back("an end of range id " + std::to_string(id) +
                                 ", which is not open");
            return;
        }
        nvtx_range range = it->second;
        r.m_started.erase(it);
        if (range.domain != domain_name(d)) {
            r.m_errors.push_back("an end in domain '" + domain_name(d) + "' closed '" +
                                 range.message + "' of domain '" + range.domain + "'");
        }
        range.closed_on = std::this_thread::get_id();
        r.m_closed.push_back(range);
    }

    mutable std::mutex m_mutex;
    bool m_installed = false;
    std::deque<std::string> m_domains; // stable addresses: the handles
    std::map<std::thread::id, std::vector<nvtx_range>> m_stacks;
    std::map<nvtxRangeId_t, nvtx_range> m_started;
    nvtxRangeId_t m_next_id = 0;
    std::vector<nvtx_range> m_closed;
    std::vector<std::string> m_errors;
};

} // namespace cudawait::testing

/// Called on the program's first NVTX call.
extern "C" {
NvtxInitializeInjectionNvtxFunc_t InitializeInjectionNvtx2_fnptr =
    cudawait::testing::nvtx_recorder::initialize;
}
