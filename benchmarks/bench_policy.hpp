// SPDX-License-Identifier: Apache-2.0
#pragma once

// Section 2b of pipeline_bench: the heavy pipeline under every preset poll policy of the
// scheduler (docs/core.md#poll-policies), at depths 2, 3 and 4, against the hand-written ring of
// the same depth and against section 2's max-stage bound, so that a policy that slows the
// pipeline down shows in the summary. Here: the presets, the depths, the targets, the variants'
// names, the bound taken from section 2's runs and the summary; pipeline_bench.cu measures the
// variants (measure_heavy_policy) with its checked runs.

#include <cudawait/core/poll_policy.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "bench_pipeline_work.hpp"
#include "bench_support.hpp"

namespace bench {

/// A preset poll policy and the name its variants carry.
struct policy_preset {
    const char* name;
    cudawait::poll_policy policy;
};
/// Every preset of cudawait::poll_policy, the default first.
inline constexpr policy_preset kPolicyPresets[] = {
    {"balanced", cudawait::poll_policy::balanced()},
    {"sentinels", cudawait::poll_policy::sentinels()},
    {"sleeping", cudawait::poll_policy::sleeping()},
    {"yielding", cudawait::poll_policy::yielding()},
    {"spinning", cudawait::poll_policy::spinning()}};
inline constexpr unsigned kPolicyDepths[] = {2, 3, 4}; ///< pipeline depths and ring sizes
inline constexpr double kPolicyRingTarget = 0.99;      ///< library / ring throughput, at least
inline constexpr double kPolicyBoundTarget = 0.95;     ///< library / max-stage bound, at least

/// "<preset>_depth<d>": the pipeline at depth d on a scheduler with the preset's policy.
inline std::string policy_variant(const policy_preset& p, unsigned depth) {
    return std::string(p.name) + "_depth" + std::to_string(depth);
}
/// "raw_ring<d>": the hand-written pipeline with a ring of d slots.
inline std::string policy_ring_variant(unsigned depth) {
    return "raw_ring" + std::to_string(depth);
}
/// The variants measured side by side at one depth: every preset in order, then the ring.
inline std::vector<std::string> policy_variants(unsigned depth) {
    std::vector<std::string> v;
    for (const policy_preset& p : kPolicyPresets) {
        v.push_back(policy_variant(p, depth));
    }
    v.push_back(policy_ring_variant(depth));
    return v;
}

/// What the summary of 2b prints, filled by its benchmarks.
struct policy_results {
    std::map<std::string, double> seconds; ///< variant -> median seconds per run
    std::optional<double> bound;           ///< max(bidirectional, kernel alone) of 2, seconds
    std::optional<double> one_way;         ///< max(h2d, kernel, d2h alone) of 2, seconds
};
inline policy_results g_policy;

/// Takes both max-stage bounds from the medians of section 2's samples.
/// @throws std::runtime_error when a stage's runs are missing
inline void set_policy_bounds(const runs_by_variant& heavy) {
    const double h2d = median(samples_of(heavy, "h2d_alone"));
    const double kernel = median(samples_of(heavy, "kernel_alone"));
    const double d2h = median(samples_of(heavy, "d2h_alone"));
    const double both = median(samples_of(heavy, "bidirectional"));
    g_policy.bound = std::max(both, kernel);
    g_policy.one_way = std::max({h2d, kernel, d2h});
}

/// "   <ratio> ok|MISSED", the verdict padded to `pad` columns, or "-"; records a miss as
/// "<variant> / <what>".
inline void print_policy_cell(std::optional<double> r, double target, int pad,
                              const std::string& variant, const char* what,
                              std::vector<std::string>& missed) {
    if (!r) {
        std::printf("   %7s%*s", "-", pad > 0 ? pad + 1 : 0, "");
        return;
    }
    std::printf("   %7.3f %-*s", *r, pad, verdict(*r >= target));
    if (*r < target) {
        missed.push_back(variant + " / " + what);
    }
}

/// Per depth the ring's time, then per preset the library's time, library / ring and library /
/// bound (throughputs: the other's time over the library's) against their targets; a last line
/// names every miss. `bytes`: the input bytes of one run.
inline void print_policy_summary(std::size_t bytes, std::int64_t rounds) {
    if (g_policy.seconds.empty()) {
        return;
    }
    std::printf("\n2b. Heavy kernel (K = %d) by poll policy, 4 GiB, 64 MiB chunks, depths 2-4\n"
                "   (median wall time of %lld interleaved rounds per depth; library / X = X's time "
                "/ the library's)\n",
                g_cal.k, static_cast<long long>(rounds));
    const auto ms = [](std::optional<double> s) {
        return map_value(s, [](double x) { return x * 1e3; });
    };
    const auto rate = [bytes](std::optional<double> s) {
        return map_value(s, [bytes](double x) { return gbps(bytes, x); });
    };
    print_row("max-stage bound = max(h2d and d2h together, kernel alone) of 2", 64,
              {{ms(g_policy.bound), 7, 1, " ms"}});
    print_row("one-way bound = max(h2d, kernel, d2h alone) (for information)", 64,
              {{ms(g_policy.one_way), 7, 1, " ms"}});
    std::printf("  %-22s %9s %8s   / ring >= %.2f    / bound >= %.2f\n", "variant", "ms", "GB/s",
                kPolicyRingTarget, kPolicyBoundTarget);
    std::vector<std::string> missed;
    for (unsigned depth : kPolicyDepths) {
        const std::string ring_name = policy_ring_variant(depth);
        const auto ring = find(g_policy.seconds, ring_name);
        print_row(ring_name, 22, {{ms(ring), 9, 1}, {rate(ring), 8, 2}});
        for (const policy_preset& p : kPolicyPresets) {
            const std::string v = policy_variant(p, depth);
            const auto lib = find(g_policy.seconds, v);
            std::printf("  %-22s", v.c_str());
            print_cell(ms(lib), 9, 1);
            print_cell(rate(lib), 8, 2);
            print_policy_cell(ratio_of(ring, lib), kPolicyRingTarget, 7, v, "ring", missed);
            print_policy_cell(ratio_of(g_policy.bound, lib), kPolicyBoundTarget, 0, v, "bound",
                              missed);
            std::printf("\n");
        }
    }
    std::printf("  every preset and depth measured, against both targets: %s\n",
                missed.empty() ? "ok" : "MISSED");
    for (const std::string& m : missed) {
        std::printf("    MISSED %s\n", m.c_str());
    }
}

} // namespace bench
