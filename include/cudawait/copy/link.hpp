// SPDX-License-Identifier: Apache-2.0
#pragma once

// Synopsis
//   link_info l = describe_link(0);   the host link of device 0: PCIe generation and width (now
//                                     and at most), copy engines, the measured one-way peak
//   std::puts(to_string(l).c_str());  "device 0 (0000:3b:00.0): PCIe gen 5 x16 ..."
//   link_peak_gbps(0)                 the peak alone (detail/link_peak.hpp)
//
// What a bandwidth or utilisation alert should be read against. The PCIe figures come from NVML,
// else sysfs; where neither answers they are 0 and link_info::source says why. See
// docs/copy.md#the-link-model.

#include <cudawait/copy/detail/link_peak.hpp>
#include <cudawait/runtime/device.hpp>
#include <cudawait/runtime/error.hpp>

#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <string>

#include <cuda_runtime_api.h>

#if defined(__unix__)
#include <dlfcn.h>
#endif

namespace cudawait {

/// The host link of one device, as describe_link() found it. 0 means unknown.
struct link_info {
    int device = 0;
    std::string pci_bus_id;      ///< "0000:3b:00.0" (lower case, as sysfs names it)
    int pcie_generation = 0;     ///< the generation the link runs at now
    int pcie_width = 0;          ///< lanes in use now
    int max_pcie_generation = 0; ///< the best the device and its slot support
    int max_pcie_width = 0;
    int copy_engines = 0; ///< cudaDevAttrAsyncEngineCount
    double peak_gbps = 0; ///< measured one-way peak (link_peak_gbps)
    /// Where the PCIe figures came from: "nvml", "sysfs" or, when neither answered, why not.
    std::string source;
};

namespace detail {

/// The PCIe generation of a sysfs link speed ("16.0 GT/s PCIe", "2.5 GT/s"); 0 when unknown.
[[nodiscard]] inline int pcie_generation_of_speed(const std::string& text) noexcept {
    double gts = std::strtod(text.c_str(), nullptr);
    // Gen 1 to 6: 2.5, 5, 8, 16, 32, 64 GT/s.
    const double speeds[] = {2.5, 5.0, 8.0, 16.0, 32.0, 64.0};
    for (int g = 0; g < 6; ++g) {
        if (gts > speeds[g] * 0.9 && gts < speeds[g] * 1.1) {
            return g + 1;
        }
    }
    return 0;
}

/// The first line of a small sysfs file, or an empty string.
[[nodiscard]] inline std::string read_sysfs_line(const std::string& path) {
    std::string text;
    if (std::FILE* f = std::fopen(path.c_str(), "r")) {
        char buf[128] = {};
        if (std::fgets(buf, sizeof buf, f) != nullptr) {
            text = buf;
        }
        std::fclose(f);
    }
    while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back())) != 0) {
        text.pop_back();
    }
    return text;
}

/// Fills the PCIe fields of `info` from `root`/sys/bus/pci/devices/<info.pci_bus_id>/
/// {current,max}_link_{speed,width}; false (and `why` set) when the speed or width cannot be
/// read. `root` is empty for the real files; tests point it at a fake tree.
inline bool pcie_from_sysfs(link_info& info, std::string& why, const std::string& root = {}) {
    std::string dir = root + "/sys/bus/pci/devices/" + info.pci_bus_id + "/";
    auto number = [](const std::string& s) { return std::atoi(s.c_str()); };
    info.pcie_generation = pcie_generation_of_speed(read_sysfs_line(dir + "current_link_speed"));
    info.pcie_width = number(read_sysfs_line(dir + "current_link_width"));
    info.max_pcie_generation = pcie_generation_of_speed(read_sysfs_line(dir + "max_link_speed"));
    info.max_pcie_width = number(read_sysfs_line(dir + "max_link_width"));
    if (info.pcie_generation > 0 && info.pcie_width > 0) {
        return true;
    }
    info.pcie_generation = info.pcie_width = info.max_pcie_generation = info.max_pcie_width = 0;
    why = "sysfs: " + dir + "current_link_speed/_width unreadable or unknown";
    return false;
}

/// Fills the PCIe fields of `info` through NVML, loaded at run time; false (and `why` set) when
/// it cannot be loaded or does not answer.
inline bool pcie_from_nvml(link_info& info, std::string& why) {
#if defined(__unix__)
    // NVML's C interface, declared here so that no NVML header is needed: nvmlReturn_t is an
    // int enumeration (0: success) and nvmlDevice_t an opaque pointer.
    using init_fn = int (*)();
    using shutdown_fn = int (*)();
    using by_bus_fn = int (*)(const char*, void**);
    using value_fn = int (*)(void*, unsigned*);
    void* lib = ::dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
        why = "nvml: libnvidia-ml.so.1 not loadable";
        return false;
    }
    auto init = reinterpret_cast<init_fn>(::dlsym(lib, "nvmlInit_v2"));
    auto shutdown = reinterpret_cast<shutdown_fn>(::dlsym(lib, "nvmlShutdown"));
    auto by_bus = reinterpret_cast<by_bus_fn>(::dlsym(lib, "nvmlDeviceGetHandleByPciBusId_v2"));
    const char* names[] = {"nvmlDeviceGetCurrPcieLinkGeneration", "nvmlDeviceGetCurrPcieLinkWidth",
                           "nvmlDeviceGetMaxPcieLinkGeneration", "nvmlDeviceGetMaxPcieLinkWidth"};
    int* fields[] = {&info.pcie_generation, &info.pcie_width, &info.max_pcie_generation,
                     &info.max_pcie_width};
    value_fn getters[4] = {};
    bool complete = init != nullptr && shutdown != nullptr && by_bus != nullptr;
    for (int i = 0; i < 4 && complete; ++i) {
        getters[i] = reinterpret_cast<value_fn>(::dlsym(lib, names[i]));
        complete = getters[i] != nullptr;
    }
    bool ok = false;
    if (!complete) {
        why = "nvml: libnvidia-ml.so.1 lacks the PCIe link queries";
    } else if (int st = init(); st != 0) {
        why = "nvml: nvmlInit_v2 failed (" + std::to_string(st) + ")";
    } else {
        void* dev = nullptr;
        if (int st2 = by_bus(info.pci_bus_id.c_str(), &dev); st2 != 0) {
            why = "nvml: no device at " + info.pci_bus_id + " (" + std::to_string(st2) + ")";
        } else {
            ok = true;
            for (int i = 0; i < 4; ++i) {
                unsigned v = 0;
                ok = ok && getters[i](dev, &v) == 0;
                *fields[i] = static_cast<int>(v);
            }
            if (!ok) {
                why = "nvml: a PCIe link query failed";
            }
        }
        (void)shutdown();
    }
    // The library stays loaded: unloading NVML while another user in the process holds it is
    // not safe, and dlopen counts references, so repeated calls do not load it again.
    if (!ok) {
        info.pcie_generation = info.pcie_width = info.max_pcie_generation = info.max_pcie_width = 0;
    }
    return ok;
#else
    (void)info;
    why = "nvml: not looked for on this platform";
    return false;
#endif
}

} // namespace detail

/// Describes the host link of `device`: PCIe generation and width (NVML if it loads, else
/// sysfs; 0 and a reason in `source` when neither answers), its copy engines, and the measured
/// one-way peak (a few milliseconds the first time per device and process).
/// @throws cuda_error for an invalid device or when the peak cannot be measured
/// (A function template, called as `describe_link(dev)`: only a translation unit that calls it
/// instantiates the peak's measurement.)
template <class Unused = void>
[[nodiscard]] link_info describe_link(int device) {
    link_info info;
    info.device = device;
    device_ref dev(device);
    char bus[32] = {};
    check(cudaDeviceGetPCIBusId(bus, static_cast<int>(sizeof bus), dev.get()),
          "cudaDeviceGetPCIBusId");
    for (char* c = bus; *c != '\0'; ++c) {
        *c = static_cast<char>(std::tolower(static_cast<unsigned char>(*c)));
    }
    info.pci_bus_id = bus;
    check(cudaDeviceGetAttribute(&info.copy_engines, cudaDevAttrAsyncEngineCount, dev.get()),
          "cudaDeviceGetAttribute");
    std::string nvml_why;
    std::string sysfs_why;
    if (detail::pcie_from_nvml(info, nvml_why)) {
        info.source = "nvml";
    } else if (detail::pcie_from_sysfs(info, sysfs_why)) {
        info.source = "sysfs";
    } else {
        info.source = "unknown: " + nvml_why + "; " + sysfs_why;
    }
    info.peak_gbps = link_peak_gbps(device);
    return info;
}

/// One line for a log, e.g. "device 0 (0000:3b:00.0): PCIe gen 5 x16 (max gen 5 x16), 2 copy
/// engines, peak 53.1 GB/s [nvml]"; unknown figures read "?".
[[nodiscard]] inline std::string to_string(const link_info& l) {
    auto n = [](int v) { return v > 0 ? std::to_string(v) : std::string("?"); };
    char peak[32];
    std::snprintf(peak, sizeof peak, "%.1f", l.peak_gbps);
    return "device " + std::to_string(l.device) + " (" + l.pci_bus_id + "): PCIe gen " +
           n(l.pcie_generation) + " x" + n(l.pcie_width) + " (max gen " + n(l.max_pcie_generation) +
           " x" + n(l.max_pcie_width) + "), " + n(l.copy_engines) + " copy engines, peak " + peak +
           " GB/s [" + l.source + "]";
}

} // namespace cudawait
