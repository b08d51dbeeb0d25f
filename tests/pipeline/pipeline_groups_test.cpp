// SPDX-License-Identifier: Apache-2.0
// pipeline_test: chunk groups, grouped staging and streaming, streamed views.
#include "pipeline_checks.hpp"

namespace {
using namespace cudawait::testing::pipeline_checks;
} // namespace

// ---- chunk groups (pipeline_options::memory_options::group_bytes)
// ----------------------------------------------

namespace {

using cudawait::detail::chunk_group;
using cudawait::detail::group_chunks_for;
using cudawait::detail::plan_group;

// The group size: off, a chunk at or above group_bytes, a floor of the quotient, the cap.
TEST(pipeline_groups, the_group_size_is_the_chunks_that_fit_in_group_bytes) {
    EXPECT_EQ(group_chunks_for(0, 64_KiB, 256), 1u) << "0: no grouping";
    EXPECT_EQ(group_chunks_for(4_MiB, 64_MiB, 256), 1u) << "large chunks are not grouped";
    EXPECT_EQ(group_chunks_for(4_MiB, 4_MiB, 256), 1u);
    EXPECT_EQ(group_chunks_for(4_MiB, 64_KiB, 256), 64u);
    EXPECT_EQ(group_chunks_for(4_MiB, 1_MiB, 256), 4u);
    EXPECT_EQ(group_chunks_for(4_MiB, 3_MiB, 256), 1u) << "a quotient below 2 is no group";
    EXPECT_EQ(group_chunks_for(1_MiB, 300'000, 256), 3u) << "chunks that do not divide it";
    EXPECT_EQ(group_chunks_for(1_GiB, 4, 256), 256u) << "capped";
    EXPECT_EQ(group_chunks_for(1_GiB, 4, 0), 1u);
}

// Every group covers the chunks after the one before, and the elements of exactly those chunks,
// in the input and in the output, with a short last chunk and outputs of another size.
TEST(pipeline_groups, groups_cover_each_chunk_and_element_once_in_order) {
    struct plan_case {
        std::size_t inputs, chunk, outputs, group;
    };
    for (const plan_case& c : {plan_case{1000, 100, 100, 4}, plan_case{1001, 100, 100, 4},
                               plan_case{999, 100, 30, 3}, plan_case{5, 100, 100, 8},
                               plan_case{1000, 100, 250, 1}, plan_case{100 * 64 + 1, 100, 7, 64}}) {
        SCOPED_TRACE(std::to_string(c.inputs) + " inputs, chunk " + std::to_string(c.chunk) +
                     ", outputs " + std::to_string(c.outputs) + ", group " +
                     std::to_string(c.group));
        const std::size_t total = (c.inputs + c.chunk - 1) / c.chunk;
        std::size_t next = 0;
        std::size_t in_at = 0;
        std::size_t out_at = 0;
        std::size_t groups = 0;
        while (next < total) {
            const chunk_group g = plan_group(next, c.group, c.inputs, c.chunk, c.outputs);
            ++groups;
            EXPECT_EQ(g.first, next);
            ASSERT_GE(g.chunks, 1u);
            EXPECT_LE(g.chunks, c.group);
            EXPECT_EQ(g.in_offset, in_at);
            EXPECT_EQ(g.out_offset, out_at);
            // Sum of the chunks' own sizes, as the pipeline cuts a batch into chunks.
            std::size_t in_sum = 0;
            std::size_t out_sum = 0;
            for (std::size_t ch = g.first; ch < g.first + g.chunks; ++ch) {
                const std::size_t k = std::min(c.chunk, c.inputs - ch * c.chunk);
                in_sum += k;
                out_sum += (k * c.outputs + c.chunk - 1) / c.chunk;
                if (ch + 1 < g.first + g.chunks) {
                    EXPECT_EQ(k, c.chunk) << "only a group's last chunk may be short";
                }
            }
            EXPECT_EQ(g.in_count, in_sum);
            EXPECT_EQ(g.out_count, out_sum);
            EXPECT_EQ(g.last_in, g.in_count - (g.chunks - 1) * c.chunk);
            EXPECT_EQ(g.full(c.group, c.chunk), g.chunks == c.group && g.last_in == c.chunk);
            next += g.chunks;
            in_at += g.in_count;
            out_at += g.out_count;
        }
        EXPECT_EQ(next, total);
        EXPECT_EQ(in_at, c.inputs);
        EXPECT_EQ(groups, (total + c.group - 1) / c.group);
    }
}

// The group context cuts chunk j's spans out of the group's, and makes its stage_context.
TEST(pipeline_groups, the_group_context_cuts_out_each_chunk) {
    std::vector<u32> in(250);
    std::vector<u32> out(75);
    cudawait::group_context g{
        cudawait::stream_ref(cudaStreamPerThread), 1, 2, 0, 40, 3, 100, 30, {}};
    for (std::size_t j = 0; j < 3; ++j) {
        const std::span<u32> i = g.input_chunk(std::span<u32>(in), j);
        const std::span<u32> o = g.output_chunk(std::span<u32>(out), j);
        EXPECT_EQ(i.data(), in.data() + j * 100);
        EXPECT_EQ(i.size(), j < 2 ? 100u : 50u);
        EXPECT_EQ(o.data(), out.data() + j * 30);
        EXPECT_EQ(o.size(), j < 2 ? 30u : 15u);
        const cudawait::stage_context c = g.chunk_context(j);
        EXPECT_EQ(c.chunk, 40 + j);
        EXPECT_EQ(c.slot, 1u);
        EXPECT_EQ(c.stage, 2u);
    }
}

/// A group stage: one affine launch over the whole group (index-independent, so one launch is
/// the same as one per chunk).
constexpr u32 affine_a = 2654435761u;
constexpr u32 affine_b = 0x9e3779b9u;
struct affine_group_stage {
    void operator()(std::span<u32> in, std::span<u32> out, const cudawait::group_context& g) const {
        cudawait::check(cudawait::testing::launch_affine(in.data(), out.data(), in.size(), affine_a,
                                                         affine_b, g.stream.get()),
                        "launch_affine");
    }
};
/// A group stage that launches the transform once per chunk (the index restarts per chunk),
/// cutting the chunks out with the group context.
struct transform_group_stage {
    void operator()(std::span<u32> in, std::span<u32> out, const cudawait::group_context& g) const {
        for (std::size_t j = 0; j < g.chunks; ++j) {
            const std::span<u32> i = g.input_chunk(in, j);
            cudawait::check(cudawait::testing::launch_transform(i.data(),
                                                                g.output_chunk(out, j).data(),
                                                                i.size(), salt, 0, g.stream.get()),
                            "launch_transform");
        }
    }
};

std::vector<u32> affine_expected(const std::vector<u32>& in) {
    std::vector<u32> out(in.size());
    cudawait::testing::affine_on_host(in.data(), out.data(), in.size(), affine_a, affine_b);
    return out;
}

enum class group_stage_kind { per_chunk, group_transform, group_affine };

struct group_case {
    unsigned depth;
    std::size_t chunk;       // elements
    std::size_t group_bytes; // G = group_bytes / (chunk x 4)
    std::size_t n;           // input elements
    group_stage_kind kind;
    bool graph;
    bool pinned;
};

void PrintTo(const group_case& c, std::ostream* os) {
    *os << "depth " << c.depth << ", chunk " << c.chunk << ", group_bytes " << c.group_bytes
        << ", n " << c.n << ", kind " << static_cast<int>(c.kind) << (c.graph ? ", graph" : "")
        << (c.pinned ? ", pinned" : ", pageable");
}

std::string kind_name(group_stage_kind k) {
    switch (k) {
    case group_stage_kind::per_chunk:
        return "per_chunk";
    case group_stage_kind::group_transform:
        return "group_transform";
    case group_stage_kind::group_affine:
        return "group_affine";
    }
    return "unknown";
}

class pipeline_grouped : public pipeline_gpu, public ::testing::WithParamInterface<group_case> {};

// Grouped batches: every element right, with per-chunk and group stages, groups that do and do
// not divide the chunk count, a ragged last chunk, depths 2..4, plain and graph, pinned and
// pageable; stats count chunks; a second run reuses the slots (and replays the graphs).
TEST_P(pipeline_grouped, every_element_is_right_and_stats_count_chunks) {
    const group_case c = GetParam();
    auto in = random_words(c.n, c.n + c.depth);
    const auto want =
        c.kind == group_stage_kind::group_affine ? affine_expected(in) : expected(in, c.chunk);
    pipeline_options o;
    o.depth = c.depth;
    o.chunk_elements = c.chunk;
    o.memory.group_bytes = c.group_bytes;
    o.graph = c.graph;
    std::vector<pipe_t::stage> stages;
    switch (c.kind) {
    case group_stage_kind::per_chunk:
        stages.push_back(transform_stage());
        break;
    case group_stage_kind::group_transform:
        stages.emplace_back(transform_group_stage{});
        break;
    case group_stage_kind::group_affine:
        stages.emplace_back(affine_group_stage{});
        break;
    }
    pipe_t pipe(o, std::move(stages));
    const std::size_t chunks = (c.n + c.chunk - 1) / c.chunk;
    cudawait::scheduler sched;
    for (int round = 0; round < 2; ++round) {
        SCOPED_TRACE("round " + std::to_string(round));
        if (c.pinned) {
            pinned_buffer<u32> pin(c.n);
            pinned_buffer<u32> pout(c.n);
            copy_into(pin, in);
            std::fill(pout.begin(), pout.end(), 0xdeadbeefu);
            cudawait::sync_wait(sched, pipe.run(pin.span(), pout.span()));
            ASSERT_EQ(first_mismatch(std::vector<u32>(pout.begin(), pout.end()), want), c.n);
        } else {
            std::vector<u32> out(c.n, 0xdeadbeefu);
            cudawait::sync_wait(sched, pipe.run(in, out));
            ASSERT_EQ(first_mismatch(out, want), c.n);
        }
        const auto st = pipe.stats();
        EXPECT_EQ(st.chunks, chunks);
        EXPECT_EQ(st.gpu_chunks, chunks);
        EXPECT_EQ(st.fallback_chunks + st.failed_chunks + st.retries, 0u);
        EXPECT_EQ(st.input_bytes, c.n * sizeof(u32));
        EXPECT_EQ(st.output_bytes, c.n * sizeof(u32));
        EXPECT_EQ(st.latency.samples, chunks) << "a latency sample per chunk";
    }
}

INSTANTIATE_TEST_SUITE_P(
    configurations, pipeline_grouped,
    ::testing::Values(
        // 4 chunks per group, 24 chunks: groups divide the chunks.
        group_case{2, 4096, 64_KiB, 4096 * 24, group_stage_kind::per_chunk, false, true},
        group_case{3, 4096, 64_KiB, 4096 * 24, group_stage_kind::group_affine, false, true},
        // 3 chunks per group (group_bytes not a multiple of the chunk), ragged last chunk.
        group_case{4, 5000, 64_KiB, 5000 * 20 + 777, group_stage_kind::group_transform, false,
                   true},
        group_case{2, 5000, 64_KiB, 5000 * 20 + 777, group_stage_kind::per_chunk, false, false},
        group_case{3, 5000, 64_KiB, 5000 * 20 + 777, group_stage_kind::group_affine, true, true},
        group_case{4, 4096, 64_KiB, 4096 * 25 + 1, group_stage_kind::per_chunk, true, true},
        group_case{2, 4096, 64_KiB, 4096 * 22 + 100, group_stage_kind::group_transform, true,
                   false},
        // Fewer chunks than one group; and 64 chunks of 1 KiB per group.
        group_case{3, 1000, 1_MiB, 2500, group_stage_kind::per_chunk, false, true},
        group_case{4, 256, 64_KiB, 256 * 300 + 5, group_stage_kind::group_affine, false, true},
        group_case{2, 256, 64_KiB, 256 * 300 + 5, group_stage_kind::per_chunk, true, true}),
    [](const ::testing::TestParamInfo<group_case>& info) {
        const group_case& c = info.param;
        return "depth" + std::to_string(c.depth) + "_chunk" + std::to_string(c.chunk) + "_n" +
               std::to_string(c.n) + "_" + kind_name(c.kind) + (c.graph ? "_graph" : "") +
               (c.pinned ? "_pinned" : "_pageable");
    });

/// What a group stage was told, per call.
struct group_call {
    std::size_t first_chunk, chunks, in_stride, out_stride, in_size, out_size, scratch_size;
    unsigned slot, stage;
    int device;
    cudaStream_t stream;
};

struct recording_group_stage {
    std::shared_ptr<std::vector<group_call>> calls;
    void operator()(std::span<u32> in, std::span<u32> out, const cudawait::group_context& g) const {
        calls->push_back({g.first_chunk, g.chunks, g.in_stride, g.out_stride, in.size(), out.size(),
                          g.scratch.size(), g.slot, g.stage, g.device, g.stream.get()});
        affine_group_stage{}(in, out, g);
    }
};

// The group context: consecutive groups from chunk 0, G chunks each but the last, the strides,
// spans as long as the group's chunks, the slot below the depth, a compute stream, the scratch;
// and a per-chunk stage is called once per chunk, in order, with each chunk's index.
TEST_F(pipeline_gpu, a_group_stage_is_told_the_chunks_of_its_group) {
    const std::size_t chunk = 3000;          // 12000 bytes: 5 chunks per 64 KiB group
    const std::size_t n = chunk * 23 + 1234; // 24 chunks: groups of 5, 5, 5, 5, 4
    auto in = random_words(n, 77);
    auto calls = std::make_shared<std::vector<group_call>>();
    auto per_chunk = std::make_shared<std::vector<std::size_t>>();
    pipeline_options o;
    o.depth = 3;
    o.chunk_elements = chunk;
    o.memory.group_bytes = 64_KiB;
    o.memory.scratch_bytes = 512;
    pipe_t::stage counting = [per_chunk](std::span<u32> a, std::span<u32> b,
                                         const cudawait::stage_context& ctx) {
        per_chunk->push_back(ctx.chunk);
        EXPECT_EQ(a.size(), b.size());
        EXPECT_EQ(ctx.scratch.size(), 512u);
        cudawait::check(
            cudawait::testing::launch_affine(a.data(), b.data(), a.size(), 1, 0, ctx.stream.get()),
            "launch_affine");
    };
    pipe_t pipe(o, {recording_group_stage{calls}, counting});
    // Pinned ranges: a batch that stages pageable ones moves one chunk per flight.
    pinned_buffer<u32> pin(n);
    pinned_buffer<u32> pout(n);
    copy_into(pin, in);
    std::fill(pout.begin(), pout.end(), 0xdeadbeefu);
    cudawait::scheduler sched;
    cudawait::sync_wait(sched, pipe.run(pin.span(), pout.span()));
    EXPECT_EQ(first_mismatch(std::vector<u32>(pout.begin(), pout.end()), affine_expected(in)), n);
    ASSERT_EQ(calls->size(), 5u);
    std::size_t next = 0;
    for (std::size_t i = 0; i < calls->size(); ++i) {
        const group_call& c = (*calls)[i];
        SCOPED_TRACE("group " + std::to_string(i));
        EXPECT_EQ(c.first_chunk, next);
        EXPECT_EQ(c.chunks, i < 4 ? 5u : 4u);
        EXPECT_EQ(c.in_stride, chunk);
        EXPECT_EQ(c.out_stride, chunk);
        const std::size_t elements = i < 4 ? 5 * chunk : 3 * chunk + 1234;
        EXPECT_EQ(c.in_size, elements);
        EXPECT_EQ(c.out_size, elements);
        EXPECT_EQ(c.scratch_size, 512u);
        EXPECT_LT(c.slot, 3u);
        EXPECT_EQ(c.stage, 0u);
        EXPECT_EQ(c.device, 0);
        EXPECT_EQ(c.stream, pipe.compute_stream(0).get());
        next += c.chunks;
    }
    EXPECT_EQ(next, 24u);
    std::vector<std::size_t> all(24);
    for (std::size_t i = 0; i < all.size(); ++i) {
        all[i] = i;
    }
    EXPECT_EQ(*per_chunk, all) << "the per-chunk stage: once per chunk, in order";
}

/// A group stage that fails to launch (non-sticky) whenever its group holds chunk `bad`.
struct failing_group_stage {
    std::size_t bad;
    std::shared_ptr<int> failures;
    void operator()(std::span<u32> in, std::span<u32> out, const cudawait::group_context& g) const {
        if (g.first_chunk <= bad && bad < g.first_chunk + g.chunks) {
            ++*failures;
            cudawait::check(cudawait::testing::launch_bad_config(g.stream.get()),
                            "launch_bad_config");
        }
        transform_group_stage{}(in, out, g);
    }
};

// A group that keeps failing is retried (the records name the group), then retried once chunk by
// chunk: only the chunk that fails alone goes to the fallback (its record names it), the others
// come from the GPU; pipeline_error without a fallback lists that chunk.
TEST_F(pipeline_gpu, a_failing_group_is_retried_chunk_by_chunk_and_only_its_failing_chunk_is_lost) {
    const std::size_t chunk = 4096; // 4 chunks per 64 KiB group
    const std::size_t n = chunk * 18 + 99;
    auto in = random_words(n, 91);
    const auto want = expected(in, chunk);
    for (bool with_fallback : {true, false}) {
        SCOPED_TRACE(with_fallback ? "fallback" : "no fallback");
        auto failures = std::make_shared<int>(0);
        std::vector<std::size_t> fallback_calls;
        std::vector<cudawait::chunk_failure> records;
        pipeline_options o;
        o.chunk_elements = chunk;
        o.memory.group_bytes = 64_KiB;
        o.depth = 3;
        o.recovery.max_retries = 2;
        o.recovery.on_degrade = [&](const cudawait::chunk_failure& f) { records.push_back(f); };
        pipe_t::fallback fb;
        if (with_fallback) {
            fb = [&](std::size_t c, std::span<const u32> a, std::span<u32> b) {
                fallback_calls.push_back(c);
                host_fallback(c, a, b);
            };
        }
        pipe_t p(o, {failing_group_stage{9, failures}}, fb); // group 2: chunks 8..11
        // Pinned ranges, so that the batch moves groups (a staged one moves single chunks).
        pinned_buffer<u32> pin(n);
        pinned_buffer<u32> pout(n);
        copy_into(pin, in);
        std::fill(pout.begin(), pout.end(), 0xdeadbeefu);
        cudawait::scheduler sched;
        auto outputs = [&] { return std::vector<u32>(pout.begin(), pout.end()); };
        if (with_fallback) {
            cudawait::sync_wait(sched, p.run(pin.span(), pout.span()));
            EXPECT_EQ(first_mismatch(outputs(), want), n);
            EXPECT_EQ(fallback_calls, (std::vector<std::size_t>{9}));
        } else {
            try {
                cudawait::sync_wait(sched, p.run(pin.span(), pout.span()));
                ADD_FAILURE() << "no pipeline_error";
            } catch (const pipeline_error& e) {
                EXPECT_EQ(e.failed(), (std::vector<std::size_t>{9}));
                EXPECT_EQ(e.completed().size(), 18u);
            }
            const std::vector<u32> out = outputs();
            for (std::size_t i = 0; i < n; ++i) {
                if (i / chunk != 9) {
                    ASSERT_EQ(out[i], want[i]) << "element " << i;
                }
            }
        }
        EXPECT_EQ(*failures, 4) << "the group's first try, max_retries retries, chunk 9 alone";
        const auto st = p.stats();
        EXPECT_EQ(st.gpu_chunks, 18u);
        EXPECT_EQ(with_fallback ? st.fallback_chunks : st.failed_chunks, 1u);
        EXPECT_EQ(st.retries, 3u) << "max_retries, and the retry chunk by chunk";
        ASSERT_EQ(records.size(), 4u);
        for (std::size_t i = 0; i < 3; ++i) {
            EXPECT_EQ(records[i].chunk, 8u);
            EXPECT_EQ(records[i].chunks, 4u);
            EXPECT_EQ(records[i].elements, 4 * chunk);
            EXPECT_EQ(records[i].offset, 8 * chunk);
            EXPECT_EQ(records[i].level, cudawait::degrade_level::retry);
        }
        EXPECT_EQ(records.back().chunk, 9u);
        EXPECT_EQ(records.back().chunks, 1u);
        EXPECT_EQ(records.back().elements, chunk);
        EXPECT_EQ(records.back().offset, 9 * chunk);
        EXPECT_EQ(records.back().level, cudawait::degrade_level::give_up);
    }
}

// Streaming through a grouped pipeline: small items of random sizes, each delivered in order
// with every element checked.
TEST_F(pipeline_gpu, streaming_small_items_through_a_grouped_pipeline_stays_in_order) {
    const std::size_t chunk = 2048;
    std::vector<std::vector<u32>> chunks;
    std::mt19937 sizes(5);
    for (std::size_t i = 0; i < 100; ++i) {
        chunks.push_back(random_words(1 + sizes() % chunk, 500 + i));
    }
    for (bool graph : {false, true}) {
        pipeline_options o;
        o.chunk_elements = chunk;
        o.memory.group_bytes = 64_KiB;
        o.depth = 3;
        o.graph = graph;
        pipe_t p(o, {transform_stage()});
        cudawait::scheduler sched;
        const auto seen = cudawait::sync_wait(sched, stream_chunks(p, chunks));
        ASSERT_EQ(seen.size(), chunks.size());
        for (std::size_t i = 0; i < seen.size(); ++i) {
            EXPECT_TRUE(seen[i].right) << "item " << i << (graph ? ", graph" : "");
            EXPECT_FALSE(seen[i].by_fallback);
        }
        EXPECT_EQ(p.stats().gpu_chunks, chunks.size());
    }
}

} // namespace

// ---- chunk groups and staged batches in one pipeline ------------------------------------------

namespace {

// A grouped pipeline moves a pinned batch in groups and a pageable (staged) batch one chunk per
// flight, and runs of either kind may follow each other on one pipeline: the group stage is told
// groups of G chunks (the last shorter) for pinned ranges and groups of one chunk, in order, for
// pageable ones; graph replays built by a pinned run serve the next pinned run after a pageable
// one; every element checked after every run, stats per chunk.
TEST_F(pipeline_gpu, grouped_pinned_and_per_chunk_staged_batches_alternate_on_one_pipeline) {
    const std::size_t chunk = 4096;         // 16 KiB: 4 chunks per 64 KiB group
    const std::size_t n = chunk * 13 + 517; // 14 chunks: groups of 4, 4, 4, 2
    auto in = random_words(n, 4242);
    const auto want = affine_expected(in);
    pinned_buffer<u32> pin(n);
    pinned_buffer<u32> pout(n);
    copy_into(pin, in);
    for (bool graph : {false, true}) {
        SCOPED_TRACE(graph ? "graph" : "plain");
        auto calls = std::make_shared<std::vector<group_call>>();
        pipeline_options o;
        o.chunk_elements = chunk;
        o.memory.group_bytes = 64_KiB;
        o.depth = 3;
        o.graph = graph;
        pipe_t pipe(o, {recording_group_stage{calls}});
        cudawait::scheduler sched;
        for (int round = 0; round < 3; ++round) {
            for (bool pinned : {true, false}) {
                SCOPED_TRACE(testing::Message()
                             << "round " << round << (pinned ? ", pinned" : ", pageable"));
                calls->clear();
                std::vector<u32> out(n, 0xdeadbeefu);
                if (pinned) {
                    std::fill(pout.begin(), pout.end(), 0xdeadbeefu);
                    cudawait::sync_wait(sched, pipe.run(pin.span(), pout.span()));
                    out.assign(pout.begin(), pout.end());
                } else {
                    cudawait::sync_wait(sched, pipe.run(in, out));
                }
                ASSERT_EQ(first_mismatch(out, want), n);
                const auto st = pipe.stats();
                EXPECT_EQ(st.chunks, 14u);
                EXPECT_EQ(st.gpu_chunks, 14u);
                EXPECT_EQ(st.latency.samples, 14u);
                EXPECT_EQ(st.input_bytes, n * sizeof(u32));
                // In graph mode the stage is called only when a slot's graph is captured.
                if (graph && pinned) {
                    EXPECT_LE(calls->size(), (round == 0 ? 3u : 0u) + 1u)
                        << "graphs captured once per slot; the short last group runs plainly";
                    for (const group_call& c : *calls) {
                        EXPECT_TRUE(c.chunks == 4 || (c.first_chunk == 12 && c.chunks == 2));
                    }
                    continue;
                }
                const std::size_t groups = pinned ? 4 : 14;
                ASSERT_EQ(calls->size(), groups);
                std::size_t next = 0;
                for (const group_call& c : *calls) {
                    EXPECT_EQ(c.first_chunk, next);
                    const std::size_t want_chunks =
                        pinned ? std::min<std::size_t>(4, 14 - next) : 1;
                    EXPECT_EQ(c.chunks, want_chunks);
                    const std::size_t elements = std::min(want_chunks * chunk, n - next * chunk);
                    EXPECT_EQ(c.in_size, elements);
                    EXPECT_EQ(c.out_size, elements);
                    EXPECT_LT(c.slot, 3u);
                    next += c.chunks;
                }
                EXPECT_EQ(next, 14u);
            }
        }
    }
}

// In a grouped pipeline a staged batch retries, records and hands to the fallback single
// chunks: a launch failing for chunk 9 sends chunk 9 alone to the fallback, and the records
// name one chunk; a pinned batch through the same pipeline retries the group, then its chunks
// one by one, and also sends chunk 9 alone to the fallback.
TEST_F(pipeline_gpu, a_staged_batch_in_a_grouped_pipeline_fails_single_chunks) {
    const std::size_t chunk = 4096; // 4 chunks per 64 KiB group
    const std::size_t n = chunk * 18 + 99;
    auto in = random_words(n, 93);
    const auto want = expected(in, chunk);
    auto failures = std::make_shared<int>(0);
    std::vector<std::size_t> fallback_calls;
    std::vector<cudawait::chunk_failure> records;
    pipeline_options o;
    o.chunk_elements = chunk;
    o.memory.group_bytes = 64_KiB;
    o.depth = 3;
    o.recovery.max_retries = 1;
    o.recovery.on_degrade = [&](const cudawait::chunk_failure& f) { records.push_back(f); };
    pipe_t p(o, {failing_group_stage{9, failures}},
             [&](std::size_t c, std::span<const u32> a, std::span<u32> b) {
                 fallback_calls.push_back(c);
                 host_fallback(c, a, b);
             });
    cudawait::scheduler sched;
    std::vector<u32> out(n, 0xdeadbeefu);
    cudawait::sync_wait(sched, p.run(in, out));
    EXPECT_EQ(first_mismatch(out, want), n);
    EXPECT_EQ(fallback_calls, std::vector<std::size_t>{9});
    EXPECT_EQ(*failures, 2);
    ASSERT_EQ(records.size(), 2u);
    for (const auto& r : records) {
        EXPECT_EQ(r.chunk, 9u);
        EXPECT_EQ(r.chunks, 1u);
        EXPECT_EQ(r.elements, chunk);
        EXPECT_EQ(r.offset, 9 * chunk);
    }
    auto st = p.stats();
    EXPECT_EQ(st.gpu_chunks, 18u);
    EXPECT_EQ(st.fallback_chunks, 1u);
    EXPECT_EQ(st.latency.samples, 19u);

    records.clear();
    fallback_calls.clear();
    pinned_buffer<u32> pin(n);
    pinned_buffer<u32> pout(n);
    copy_into(pin, in);
    std::fill(pout.begin(), pout.end(), 0xdeadbeefu);
    cudawait::sync_wait(sched, p.run(pin.span(), pout.span()));
    EXPECT_EQ(first_mismatch(std::vector<u32>(pout.begin(), pout.end()), want), n);
    EXPECT_EQ(fallback_calls, (std::vector<std::size_t>{9}));
    ASSERT_EQ(records.size(), 3u)
        << "the group's retry, the retry chunk by chunk, chunk 9's give-up";
    EXPECT_EQ(records.front().chunks, 4u);
    EXPECT_EQ(records.back().chunk, 9u);
    EXPECT_EQ(records.back().chunks, 1u);
    st = p.stats();
    EXPECT_EQ(st.gpu_chunks, 18u);
    EXPECT_EQ(st.fallback_chunks, 1u);
}

} // namespace

// ---- streaming in chunk groups ----------------------------------------------------------------

namespace {

/// A pipeline of 4096-element chunks in groups of 4 (64 KiB), whose group stage records its
/// calls and runs the per-chunk transform over each chunk of the run.
struct grouped_stream_setup {
    std::shared_ptr<std::vector<group_call>> calls = std::make_shared<std::vector<group_call>>();
    pipeline_options options(unsigned depth, bool graph) const {
        pipeline_options o;
        o.chunk_elements = 4096;
        o.memory.group_bytes = 64_KiB;
        o.depth = depth;
        o.graph = graph;
        o.recovery.chunk_timeout = 20s; // a wait that hangs fails the test instead of hanging it
        return o;
    }
};

/// Records the run, then the transform per chunk (group_context cuts the chunks out).
struct recording_transform_group_stage {
    std::shared_ptr<std::vector<group_call>> calls;
    void operator()(std::span<u32> in, std::span<u32> out, const cudawait::group_context& g) const {
        calls->push_back({g.first_chunk, g.chunks, g.in_stride, g.out_stride, in.size(), out.size(),
                          g.scratch.size(), g.slot, g.stage, g.device, g.stream.get()});
        transform_group_stage{}(in, out, g);
    }
};

bool transformed_right(std::span<const u32> got, const std::vector<u32>& in) {
    std::vector<u32> want(in.size());
    cudawait::testing::transform_on_host(in.data(), want.data(), in.size(), salt);
    return std::equal(want.begin(), want.end(), got.begin(), got.end());
}

/// Acquires and submits items[first..last) (each item's data), nothing else.
cudawait::task<void> submit_items(pipe_t& p, const std::vector<std::vector<u32>>& items,
                                  std::size_t first, std::size_t last) {
    for (std::size_t i = first; i < last; ++i) {
        auto slot = co_await p.acquire();
        std::copy(items[i].begin(), items[i].end(), slot.data().begin());
        p.submit(std::move(slot), items[i].size());
    }
}

/// Takes `count` results with next(timeout): each must be item `first + k`, right and from the
/// GPU. Returns how many were.
cudawait::task<std::size_t> take_items(pipe_t& p, const std::vector<std::vector<u32>>& items,
                                       std::size_t first, std::size_t count) {
    std::size_t good = 0;
    for (std::size_t k = 0; k < count; ++k) {
        auto r = co_await p.next(10s);
        if (r && r->chunk() == first + k && !r->by_fallback() &&
            transformed_right(r->data(), items[first + k])) {
            ++good;
        }
    }
    co_return good;
}

// Full groups: items submitted in order fill the slot groups and go as one flight each (the
// group stage is told runs of 4 chunks from chunk 0 on), every element right, in order; a
// short last item ends its run; stats count items. Graph mode replays the full groups.
TEST_F(pipeline_gpu, streaming_in_groups_sends_full_groups_as_one_flight) {
    for (bool graph : {false, true}) {
        SCOPED_TRACE(graph ? "graph" : "plain");
        grouped_stream_setup setup;
        pipe_t p(setup.options(3, graph), {recording_transform_group_stage{setup.calls}});
        std::vector<std::vector<u32>> items;
        for (std::size_t i = 0; i < 22; ++i) {
            items.push_back(random_words(i == 21 ? 1000 : 4096, 700 + i));
        }
        cudawait::scheduler sched;
        cudawait::sync_wait(sched, [&]() -> cudawait::task<void> {
            // 12 items fill the three slot groups; the producer then must wait for results.
            co_await submit_items(p, items, 0, 12);
            EXPECT_EQ(co_await take_items(p, items, 0, 12), 12u);
            co_await submit_items(p, items, 12, 22);
            p.close();
            EXPECT_EQ(co_await take_items(p, items, 12, 10), 10u);
            EXPECT_FALSE(co_await p.next(10s)) << "the session ends";
        }());
        const auto st = p.stats();
        EXPECT_EQ(st.chunks, 22u);
        EXPECT_EQ(st.gpu_chunks, 22u);
        EXPECT_EQ(st.latency.samples, 22u);
        EXPECT_EQ(st.input_bytes, (21 * 4096 + 1000) * sizeof(u32));
        if (!graph) {
            // Runs 0-3, 4-7, 8-11, 12-15, 16-19 and 20-21 (ended by the short item 21).
            ASSERT_EQ(setup.calls->size(), 6u);
            for (std::size_t g = 0; g < 6; ++g) {
                EXPECT_EQ((*setup.calls)[g].first_chunk, 4 * g);
                EXPECT_EQ((*setup.calls)[g].chunks, g < 5 ? 4u : 2u);
                EXPECT_EQ((*setup.calls)[g].in_size, g < 5 ? 4 * 4096u : 4096u + 1000u);
            }
        }
        // The pipeline is idle again: a batch runs.
        auto in = random_words(4096 * 9, 9);
        pinned_buffer<u32> pin(in.size());
        pinned_buffer<u32> pout(in.size());
        copy_into(pin, in);
        cudawait::sync_wait(sched, p.run(pin.span(), pout.span()));
        EXPECT_EQ(first_mismatch(std::vector<u32>(pout.begin(), pout.end()), expected(in, 4096)),
                  in.size());
    }
}

// A partial run is sent when next() needs its first chunk (no flush otherwise: the group is not
// full, no acquire() waits, no close()), and when close() is called; the rest of a slot group
// serves the next items (a later run from the middle of the group).
TEST_F(pipeline_gpu, streaming_in_groups_sends_a_partial_run_for_next_and_close) {
    for (bool graph : {false, true}) {
        SCOPED_TRACE(graph ? "graph" : "plain");
        grouped_stream_setup setup;
        pipe_t p(setup.options(2, graph), {recording_transform_group_stage{setup.calls}});
        std::vector<std::vector<u32>> items;
        for (std::size_t i = 0; i < 7; ++i) {
            items.push_back(random_words(4096, 800 + i));
        }
        cudawait::scheduler sched;
        cudawait::sync_wait(sched, [&]() -> cudawait::task<void> {
            co_await submit_items(p, items, 0, 2); // chunks 0, 1 of group A: held back
            EXPECT_EQ(co_await take_items(p, items, 0, 2), 2u) << "next() sent them";
            co_await submit_items(p, items, 2, 3); // chunk 2 of group A
            EXPECT_EQ(co_await take_items(p, items, 2, 1), 1u);
            co_await submit_items(p, items, 3, 6); // chunk 3 of A, chunks 0, 1 of B
            p.close();
            EXPECT_EQ(co_await take_items(p, items, 3, 3), 3u) << "close() sent them";
            EXPECT_FALSE(co_await p.next(10s));
        }());
        if (!graph) {
            ASSERT_EQ(setup.calls->size(), 4u);
            const std::size_t first[] = {0, 2, 3, 4};
            const std::size_t chunks[] = {2, 1, 1, 2};
            for (std::size_t g = 0; g < 4; ++g) {
                EXPECT_EQ((*setup.calls)[g].first_chunk, first[g]);
                EXPECT_EQ((*setup.calls)[g].chunks, chunks[g]);
            }
        }
        EXPECT_EQ(p.stats().gpu_chunks, 6u);
    }
}

// acquire() that would wait sends what is held back first: with one slot group, three items
// submitted and the fourth acquired but not submitted, acquire(0) finds no chunk free and times
// out, and the three are on the GPU then (next() returns them); the fourth, submitted later, goes
// alone, and the group serves the producer again once its results were destroyed.
TEST_F(pipeline_gpu, streaming_in_groups_sends_the_held_run_before_acquire_waits) {
    grouped_stream_setup setup;
    pipe_t p(setup.options(1, false), {recording_transform_group_stage{setup.calls}});
    std::vector<std::vector<u32>> items;
    for (std::size_t i = 0; i < 8; ++i) {
        items.push_back(random_words(4096 - 3 * (i == 7), 900 + i));
    }
    cudawait::scheduler sched;
    cudawait::sync_wait(sched, [&]() -> cudawait::task<void> {
        co_await submit_items(p, items, 0, 3);
        auto held = co_await p.acquire(); // chunk 3 of the only group
        EXPECT_THROW((void)co_await p.acquire(0ms), cudawait::timeout_error);
        EXPECT_EQ(setup.calls->size(), 1u) << "the waiting acquire() sent chunks 0-2";
        {
            std::vector<std::optional<pipe_t::result>> results;
            for (std::size_t k = 0; k < 3; ++k) {
                results.push_back(co_await p.next(10s));
                EXPECT_TRUE(results.back() && results.back()->chunk() == k &&
                            transformed_right(results.back()->data(), items[k]));
            }
            std::copy(items[3].begin(), items[3].end(), held.data().begin());
            p.submit(std::move(held), items[3].size()); // the group's last chunk: sent
            EXPECT_EQ(setup.calls->size(), 2u);
            EXPECT_THROW((void)co_await p.acquire(0ms), cudawait::timeout_error)
                << "the group is held by results";
        }
        EXPECT_EQ(co_await take_items(p, items, 3, 1), 1u);
        co_await submit_items(p, items, 4, 8); // the group again, from its first chunk
        p.close();
        EXPECT_EQ(co_await take_items(p, items, 4, 4), 4u);
        EXPECT_FALSE(co_await p.next(10s));
    }());
    ASSERT_EQ(setup.calls->size(), 3u);
    EXPECT_EQ((*setup.calls)[2].first_chunk, 4u);
    EXPECT_EQ((*setup.calls)[2].chunks, 4u);
    EXPECT_EQ((*setup.calls)[2].in_size, 4 * 4096u - 3);
}

// Runs hold only chunks submitted in the order they were acquired, all full but the last: a
// short item ends its run, an item submitted out of order or after a dropped one starts a new
// run; the results come in submission order, each with its own data.
TEST_F(pipeline_gpu, streaming_in_groups_keeps_ragged_and_out_of_order_items_apart) {
    for (bool graph : {false, true}) {
        SCOPED_TRACE(graph ? "graph" : "plain");
        grouped_stream_setup setup;
        pipe_t p(setup.options(3, graph), {recording_transform_group_stage{setup.calls}});
        std::vector<std::vector<u32>> data;
        for (std::size_t i = 0; i < 6; ++i) {
            data.push_back(random_words(i == 1 ? 77 : 4096, 1000 + i));
        }
        cudawait::scheduler sched;
        cudawait::sync_wait(sched, [&]() -> cudawait::task<void> {
            std::vector<pipe_t::input_slot> s;
            for (std::size_t i = 0; i < 6; ++i) {
                s.push_back(co_await p.acquire()); // group A: 0-3, group B: 4, 5
                std::copy(data[i].begin(), data[i].end(), s.back().data().begin());
            }
            // Submission order: 0, 1 (short: ends the run), 3, 2 (out of order), 5 (4 dropped).
            const std::size_t order[] = {0, 1, 3, 2, 5};
            for (std::size_t i : order) {
                p.submit(std::move(s[i]), data[i].size());
            }
            s.clear(); // drops chunk 4 unused
            p.close();
            for (std::size_t k = 0; k < 5; ++k) {
                auto r = co_await p.next(10s);
                EXPECT_TRUE(r && r->chunk() == k && transformed_right(r->data(), data[order[k]]))
                    << "result " << k;
            }
            EXPECT_FALSE(co_await p.next(10s));
        }());
        if (!graph) {
            // Runs: {0, 1}, {3}, {2}, {5}.
            ASSERT_EQ(setup.calls->size(), 4u);
            EXPECT_EQ((*setup.calls)[0].chunks, 2u);
            EXPECT_EQ((*setup.calls)[0].in_size, 4096u + 77u);
            for (std::size_t g = 1; g < 4; ++g) {
                EXPECT_EQ((*setup.calls)[g].chunks, 1u);
                EXPECT_EQ((*setup.calls)[g].first_chunk, g + 1);
            }
        }
        EXPECT_EQ(p.stats().gpu_chunks, 5u);
    }
}

// Ragged items of random sizes through a per-chunk stage (its index restarts per chunk, so a
// wrong chunk boundary shows), the three-ahead producer of stream_chunks, graph off and on.
TEST_F(pipeline_gpu, streaming_in_groups_with_ragged_items_is_exact) {
    std::vector<std::vector<u32>> chunks;
    std::mt19937 sizes(17);
    for (std::size_t i = 0; i < 150; ++i) {
        const bool full = sizes() % 3 != 0;
        chunks.push_back(random_words(full ? 4096 : 1 + sizes() % 4096, 1100 + i));
    }
    for (bool graph : {false, true}) {
        grouped_stream_setup setup;
        pipe_t p(setup.options(3, graph), {transform_stage()});
        cudawait::scheduler sched;
        const auto seen = cudawait::sync_wait(sched, stream_chunks(p, chunks));
        ASSERT_EQ(seen.size(), chunks.size());
        for (std::size_t i = 0; i < seen.size(); ++i) {
            EXPECT_TRUE(seen[i].right) << "item " << i << (graph ? ", graph" : "");
        }
        EXPECT_EQ(p.stats().gpu_chunks, chunks.size());
        EXPECT_EQ(p.stats().latency.samples, chunks.size());
    }
}

// A run whose enqueue keeps failing: each of its chunks goes to the fallback once, in order,
// when next() reaches it, with one record for the run (chunks = the run's); without a fallback
// next() throws pipeline_error for each of them and the chunks after them still come.
TEST_F(pipeline_gpu, streaming_in_groups_hands_each_chunk_of_a_failed_run_to_the_fallback) {
    std::vector<std::vector<u32>> items;
    for (std::size_t i = 0; i < 12; ++i) {
        items.push_back(random_words(4096, 1200 + i));
    }
    for (bool with_fallback : {true, false}) {
        SCOPED_TRACE(with_fallback ? "fallback" : "no fallback");
        auto failures = std::make_shared<int>(0);
        std::vector<std::size_t> fallback_calls;
        std::vector<cudawait::chunk_failure> records;
        grouped_stream_setup setup;
        pipeline_options o = setup.options(3, false);
        o.recovery.max_retries = 1;
        o.recovery.on_degrade = [&](const cudawait::chunk_failure& f) { records.push_back(f); };
        pipe_t::fallback fb;
        if (with_fallback) {
            fb = [&](std::size_t c, std::span<const u32> a, std::span<u32> b) {
                fallback_calls.push_back(c);
                host_fallback(c, a, b);
            };
        }
        pipe_t p(o, {failing_group_stage{5, failures}}, fb); // the run of chunks 4..7
        cudawait::scheduler sched;
        std::vector<int> outcome; // 1 GPU, 2 fallback, 3 pipeline_error, 0 wrong
        cudawait::sync_wait(sched, [&]() -> cudawait::task<void> {
            co_await submit_items(p, items, 0, 12);
            p.close();
            for (std::size_t k = 0; k < 12; ++k) {
                try {
                    auto r = co_await p.next(10s);
                    const bool right =
                        r && r->chunk() == k && transformed_right(r->data(), items[k]);
                    outcome.push_back(!right ? 0 : r->by_fallback() ? 2 : 1);
                } catch (const pipeline_error& e) {
                    outcome.push_back(e.failed() == std::vector<std::size_t>{k} ? 3 : 0);
                }
            }
            EXPECT_FALSE(co_await p.next(10s));
        }());
        const int bad = with_fallback ? 2 : 3;
        EXPECT_EQ(outcome, (std::vector<int>{1, 1, 1, 1, bad, bad, bad, bad, 1, 1, 1, 1}));
        if (with_fallback) {
            EXPECT_EQ(fallback_calls, (std::vector<std::size_t>{4, 5, 6, 7}));
        }
        EXPECT_EQ(*failures, 2) << "first try and one retry";
        ASSERT_EQ(records.size(), 2u) << "a retry and one give-up for the run";
        for (const auto& r : records) {
            EXPECT_EQ(r.chunk, 4u);
            EXPECT_EQ(r.chunks, 4u);
            EXPECT_EQ(r.elements, 4 * 4096u);
        }
        const auto st = p.stats();
        EXPECT_EQ(st.chunks, 12u);
        EXPECT_EQ(st.gpu_chunks, 8u);
        EXPECT_EQ(with_fallback ? st.fallback_chunks : st.failed_chunks, 4u);
        EXPECT_EQ(st.retries, 1u);
    }
}

// next(timeout) on a held-back run sends it and, when the time runs out first, keeps the chunk
// first in line; a chunk_timeout that passes gives the run up: its chunks and those behind it
// fail, and the slot groups serve the producer again (fresh pinned buffers).
TEST_F(pipeline_gpu, streaming_in_groups_keeps_timeouts_per_chunk_and_gives_up_runs) {
    std::vector<std::vector<u32>> items;
    for (std::size_t i = 0; i < 8; ++i) {
        items.push_back(random_words(4096, 1300 + i));
    }
    grouped_stream_setup setup;
    pipeline_options o = setup.options(2, false);
    o.recovery.chunk_timeout = 100ms;
    o.recovery.max_retries = 0;
    o.recovery.on_degrade = [](const cudawait::chunk_failure&) {};
    pipe_t p(o, {transform_stage(300'000'000)}); // 0.3 s per chunk: past chunk_timeout
    cudawait::scheduler sched;
    cudawait::sync_wait(sched, [&]() -> cudawait::task<void> {
        co_await submit_items(p, items, 0, 6); // runs {0-3} (sent), {4, 5} (held back)
        EXPECT_THROW((void)co_await p.next(0ms), cudawait::timeout_error) << "a poll";
        std::vector<std::size_t> failed;
        for (std::size_t k = 0; k < 6; ++k) {
            try {
                (void)co_await p.next();
            } catch (const pipeline_error& e) {
                failed.insert(failed.end(), e.failed().begin(), e.failed().end());
            }
        }
        EXPECT_EQ(failed, (std::vector<std::size_t>{0, 1, 2, 3, 4, 5}));
        // Both slot groups serve the producer again at once.
        auto a = co_await p.acquire(0ms);
        p.close();
        EXPECT_FALSE(co_await p.next(10s));
    }());
    const auto st = p.stats();
    EXPECT_TRUE(st.gpu_abandoned);
    EXPECT_EQ(st.failed_chunks, 6u);
}

} // namespace

namespace {

// close() sends the run held back; an exception from on_degrade meanwhile (a retry of the
// failed enqueue) does not leave close() but reaches the next call of next(), and the run's
// chunks then come from the fallback, once each, in order.
TEST_F(pipeline_gpu, streaming_in_groups_defers_what_on_degrade_throws_in_close_to_next) {
    std::vector<std::vector<u32>> items;
    for (std::size_t i = 0; i < 2; ++i) {
        items.push_back(random_words(4096, 1400 + i));
    }
    grouped_stream_setup setup;
    pipeline_options o = setup.options(2, false);
    int degrade_calls = 0;
    o.recovery.on_degrade = [&](const cudawait::chunk_failure&) {
        if (degrade_calls++ == 0) {
            throw std::runtime_error("on_degrade refused");
        }
    };
    auto failures = std::make_shared<int>(0);
    std::vector<std::size_t> fallback_calls;
    pipe_t p(o, {failing_group_stage{1, failures}},
             [&](std::size_t c, std::span<const u32> a, std::span<u32> b) {
                 fallback_calls.push_back(c);
                 host_fallback(c, a, b);
             });
    cudawait::scheduler sched;
    cudawait::sync_wait(sched, [&]() -> cudawait::task<void> {
        co_await submit_items(p, items, 0, 2); // held back: the group is not full
        EXPECT_NO_THROW(p.close());
        EXPECT_THROW((void)co_await p.next(10s), std::runtime_error);
        for (std::size_t k = 0; k < 2; ++k) {
            auto r = co_await p.next(10s);
            EXPECT_TRUE(r && r->chunk() == k && r->by_fallback() &&
                        transformed_right(r->data(), items[k]))
                << "item " << k;
        }
        EXPECT_FALSE(co_await p.next(10s));
    }());
    EXPECT_EQ(*failures, 1);
    EXPECT_EQ(fallback_calls, (std::vector<std::size_t>{0, 1}));
    EXPECT_EQ(degrade_calls, 2) << "the retry's record and one give-up for the run";
}

} // namespace

// ---- streaming from and into the caller's own memory (submit with views) ---------------------

namespace {

using cudawait::detail::append_piece;
using cudawait::detail::copy_batch;
using cudawait::detail::copy_piece;

// Pieces join only when both are the slot's own and continue each other on both ends; the
// caller's spans stay apart even when adjacent.
TEST(pipeline_views, only_adjacent_pieces_of_the_slot_merge) {
    alignas(16) static char host[1024];
    alignas(16) static char dev[1024];
    std::vector<copy_piece> v;
    append_piece(v, dev, host, 100, true);
    append_piece(v, dev + 100, host + 100, 50, true); // continues it: merged
    ASSERT_EQ(v.size(), 1u);
    EXPECT_EQ(v[0].bytes, 150u);
    append_piece(v, dev + 150, host + 150, 10, false); // a caller's span: its own piece
    append_piece(v, dev + 160, host + 160, 10, false); // adjacent, still its own
    append_piece(v, dev + 170, host + 170, 30, true);  // after a caller's span: its own
    append_piece(v, dev + 200, host + 300, 8, true);   // not adjacent on the host
    append_piece(v, dev + 300, host + 308, 8, true);   // not adjacent on the device
    append_piece(v, dev + 308, host + 316, 4, true);   // continues the last: merged
    ASSERT_EQ(v.size(), 6u);
    const std::size_t bytes[] = {150, 10, 10, 30, 8, 12};
    const std::ptrdiff_t at[] = {0, 150, 160, 170, 300, 308};
    for (std::size_t i = 0; i < v.size(); ++i) {
        EXPECT_EQ(v[i].bytes, bytes[i]) << "piece " << i;
        EXPECT_EQ(static_cast<const char*>(v[i].src) - host, at[i]) << "piece " << i;
    }
    EXPECT_EQ(static_cast<char*>(v[5].dst) - dev, 300);
}

// The batch's arrays: one copy per piece, in order, empty ones left out, and the arrays are
// laid out anew each time.
TEST(pipeline_views, the_batch_lays_out_one_copy_per_piece_in_order) {
    alignas(16) static char host[4096];
    alignas(16) static char dev[4096];
    const std::vector<copy_piece> pieces = {{dev, host, 1000, true},
                                            {dev + 1000, host + 2000, 0, false},
                                            {dev + 1000, host + 3000, 300, false},
                                            {dev + 1300, host + 100, 256, false}};
    copy_batch b;
    b.lay_out(pieces);
    const std::vector<std::size_t> sizes = {1000, 300, 256};
    const std::vector<std::ptrdiff_t> src = {0, 3000, 100};
    const std::vector<std::ptrdiff_t> dst = {0, 1000, 1300};
    ASSERT_EQ(b.sizes().size(), sizes.size());
    for (std::size_t i = 0; i < sizes.size(); ++i) {
        EXPECT_EQ(b.sizes()[i], sizes[i]) << "copy " << i;
        EXPECT_EQ(static_cast<char*>(b.srcs()[i]) - host, src[i]) << "copy " << i;
        EXPECT_EQ(static_cast<char*>(b.dsts()[i]) - dev, dst[i]) << "copy " << i;
    }
    b.lay_out(std::span<const copy_piece>(pieces).first(1));
    ASSERT_EQ(b.sizes().size(), 1u);
    EXPECT_EQ(b.sizes()[0], 1000u);
}

enum class host_kind { pinned, registered, pageable };
constexpr host_kind all_host_kinds[] = {host_kind::pinned, host_kind::registered,
                                        host_kind::pageable};

std::string kind_name(host_kind k) {
    switch (k) {
    case host_kind::pinned:
        return "pinned";
    case host_kind::registered:
        return "registered";
    case host_kind::pageable:
        return "pageable";
    }
    return "?";
}

/// `n` words of host memory of one kind: a pinned_buffer, a registered std::vector or a plain
/// one.
template <class T = u32>
struct host_words {
    host_words(std::size_t n, host_kind k) : vec(k == host_kind::pinned ? 0 : n) {
        if (k == host_kind::pinned) {
            pin = pinned_buffer<T>(n);
        } else if (k == host_kind::registered) {
            reg = cudawait::host_registration<T>(std::span<T>(vec));
        }
    }
    std::span<T> span() { return vec.empty() ? pin.span() : std::span<T>(vec); }
    std::vector<T> copy() { return std::vector<T>(span().begin(), span().end()); }
    std::vector<T> vec;
    pinned_buffer<T> pin;
    cudawait::host_registration<T> reg; // goes before the vector
};

/// Streams `in` as items of `item` elements (the last shorter) into `out` as views (each item's
/// output at out_item x its index), every item through acquire() and submit(slot, in, out);
/// then close().
template <class P, class In, class Out>
cudawait::task<void> produce_views(P& p, std::span<const In> in, std::span<Out> out,
                                   std::size_t item, std::size_t out_item) {
    for (std::size_t off = 0, i = 0; off < in.size(); off += item, ++i) {
        const std::size_t k = std::min(item, in.size() - off);
        auto slot = co_await p.acquire();
        p.submit(std::move(slot), in.subspan(off, k), out.subspan(i * out_item, p.output_size(k)));
    }
    p.close();
}

/// Takes every result: counts those in order, from the GPU, whose data() is their place in
/// `out` (item index x out_item).
template <class P, class Out>
cudawait::task<std::size_t> take_views(P& p, std::span<Out> out, std::size_t out_item) {
    std::size_t placed = 0;
    std::size_t expect = 0;
    while (auto r = co_await p.next(20s)) {
        if (r->chunk() == expect++ && !r->by_fallback() &&
            r->data().data() == out.data() + r->chunk() * out_item) {
            ++placed;
        }
    }
    co_return placed;
}

// Every kind of host memory on either side, with and without chunk groups: pinned and
// registered spans are copied directly, pageable ones staged; every element right, a short last
// item, the result's data() the caller's output, the input untouched, stats per item.
TEST_F(pipeline_gpu, streamed_views_of_pinned_registered_and_pageable_memory_are_exact) {
    const std::size_t item = 4096;
    const std::size_t n = item * 13 + 123; // 14 items
    const auto words = random_words(n, 1500);
    const auto want = expected(words, item);
    cudawait::scheduler sched;
    for (bool grouped : {false, true}) {
        for (host_kind ki : all_host_kinds) {
            for (host_kind ko : all_host_kinds) {
                SCOPED_TRACE(std::string(grouped ? "grouped, " : "") + kind_name(ki) + " -> " +
                             kind_name(ko));
                host_words<> in(n, ki);
                host_words<> out(n, ko);
                std::copy(words.begin(), words.end(), in.span().begin());
                std::fill(out.span().begin(), out.span().end(), 0xdeadbeefu);
                pipeline_options o;
                o.chunk_elements = item;
                o.depth = 3;
                o.memory.group_bytes = grouped ? 64_KiB : 0; // 4 items per slot group
                o.recovery.chunk_timeout = 20s;
                pipe_t p(o, {transform_stage()});
                const auto [produced, placed] = cudawait::sync_wait(
                    sched, cudawait::when_all(produce_views<pipe_t, u32, u32>(
                                                  p, in.span(), out.span(), item, item),
                                              take_views<pipe_t, u32>(p, out.span(), item)));
                (void)produced;
                EXPECT_EQ(placed, 14u);
                EXPECT_EQ(first_mismatch(out.copy(), want), n);
                EXPECT_EQ(first_mismatch(in.copy(), words), n) << "the input was written";
                const auto st = p.stats();
                EXPECT_EQ(st.gpu_chunks, 14u);
                EXPECT_EQ(st.chunks, 14u);
                EXPECT_EQ(st.latency.samples, 14u);
                EXPECT_EQ(st.input_bytes, n * sizeof(u32));
            }
        }
    }
}

/// How a_grouped_run_mixes_slot_chunks_and_views submits item i: 0 slot chunk, 1 adjacent
/// views, 2 views of buffers of their own, 3 a pinned input and a pageable output.
int kind_of_item(std::size_t i) { return i / 4 == 2 ? 0 : static_cast<int>(i % 4); }

// One grouped run may mix slot chunks and views: items alternate between the slot's own input
// and views (adjacent spans of one pinned buffer, and scattered pinned buffers of their own; a
// pageable output staged among them), a group stage is told full runs of 4 chunks, and every
// element of every item is right. One run (items 8-11) is all slot chunks: in graph mode it
// replays its slot's graph, and the runs with views on that slot before and after it take the
// plain path (the stage is called for each of them: once per run in both modes).
TEST_F(pipeline_gpu, a_grouped_run_mixes_slot_chunks_and_views) {
    const std::size_t item = 4096;
    const std::size_t items = 24;
    std::vector<std::vector<u32>> data;
    for (std::size_t i = 0; i < items; ++i) {
        data.push_back(random_words(i + 1 == items ? 999 : item, 1600 + i));
    }
    for (bool graph : {false, true}) {
        SCOPED_TRACE(graph ? "graph" : "plain");
        grouped_stream_setup setup;
        pipe_t p(setup.options(3, graph), {recording_transform_group_stage{setup.calls}});
        pinned_buffer<u32> adjacent_in(items * item);  // views of items 4k+1: back to back
        pinned_buffer<u32> adjacent_out(items * item); // (and of items 4k+2 for the output)
        std::vector<pinned_buffer<u32>> own_in;        // items 4k+2: each its own buffer
        std::vector<pinned_buffer<u32>> own_out;
        std::vector<std::vector<u32>> pageable_out(items); // items 4k+3: pinned in, pageable out
        std::fill(adjacent_out.begin(), adjacent_out.end(), 0xdeadbeefu);
        cudawait::scheduler sched;
        cudawait::sync_wait(sched, [&]() -> cudawait::task<void> {
            for (std::size_t i = 0; i < items; ++i) {
                auto slot = co_await p.acquire();
                const std::vector<u32>& d = data[i];
                const std::size_t out_n = p.output_size(d.size());
                switch (kind_of_item(i)) {
                case 0: // the slot's own buffers
                    std::copy(d.begin(), d.end(), slot.data().begin());
                    p.submit(std::move(slot), d.size());
                    break;
                case 1: { // adjacent views of one buffer
                    std::span<u32> in = adjacent_in.span().subspan(i * item, d.size());
                    std::copy(d.begin(), d.end(), in.begin());
                    p.submit(std::move(slot), in, adjacent_out.span().subspan(i * item, out_n));
                    break;
                }
                case 2: { // scattered views: buffers of their own
                    own_in.emplace_back(d.size());
                    own_out.emplace_back(out_n);
                    std::copy(d.begin(), d.end(), own_in.back().begin());
                    std::fill(own_out.back().begin(), own_out.back().end(), 0xdeadbeefu);
                    p.submit(std::move(slot), own_in.back().span(), own_out.back().span());
                    break;
                }
                default: { // a pinned input, a pageable output
                    std::span<u32> in = adjacent_in.span().subspan(i * item, d.size());
                    std::copy(d.begin(), d.end(), in.begin());
                    pageable_out[i].assign(out_n, 0xdeadbeefu);
                    p.submit(std::move(slot), in, std::span<u32>(pageable_out[i]));
                    break;
                }
                }
                // Results are kept (their slot groups with them) so the producer runs ahead,
                // up to the three slot groups; then the oldest are taken.
                if (i % 12 == 11) {
                    for (std::size_t k = i - 11; k <= i; ++k) {
                        auto r = co_await p.next(20s);
                        EXPECT_TRUE(r && r->chunk() == k && !r->by_fallback()) << "item " << k;
                        if (r) {
                            EXPECT_TRUE(transformed_right(r->data(), data[k])) << "item " << k;
                            if (kind_of_item(k) == 3) {
                                EXPECT_EQ(r->data().data(), pageable_out[k].data());
                            }
                        }
                    }
                }
            }
            p.close();
            EXPECT_FALSE(co_await p.next(20s));
        }());
        for (std::size_t i = 0, own = 0; i < items; ++i) {
            std::span<const u32> out;
            if (kind_of_item(i) == 1) {
                out = adjacent_out.span().subspan(i * item, data[i].size());
            } else if (kind_of_item(i) == 2) {
                out = own_out[own++].span();
            } else if (kind_of_item(i) == 3) {
                out = pageable_out[i];
            } else {
                continue; // checked through its result
            }
            EXPECT_TRUE(transformed_right(out, data[i])) << "item " << i << " in its view";
        }
        ASSERT_EQ(setup.calls->size(), items / 4) << "one run per full slot group";
        for (std::size_t g = 0; g < items / 4; ++g) {
            EXPECT_EQ((*setup.calls)[g].first_chunk, 4 * g);
            EXPECT_EQ((*setup.calls)[g].chunks, 4u);
        }
        EXPECT_EQ(p.stats().gpu_chunks, items);
    }
}

/// Out != In: one word per item, the sum of the item (launch_sum), in a wrapper type.
struct word_sum {
    u32 value;
};
using sum_pipe = pipeline<u32, word_sum>;

// In != Out with output_elements: each item's output is one element in the caller's output
// (adjacent one-word views), with and without chunk groups, graph mode off and on.
TEST_F(pipeline_gpu, views_carry_outputs_of_another_type_and_size) {
    const std::size_t item = 4096;
    const std::size_t n = item * 10 + 17; // 11 items
    const auto words = random_words(n, 1700);
    for (bool grouped : {false, true}) {
        for (bool graph : {false, true}) {
            SCOPED_TRACE(std::string(grouped ? "grouped" : "single") + (graph ? ", graph" : ""));
            pipeline_options o;
            o.chunk_elements = item;
            o.output_elements = 1;
            o.depth = 2;
            o.graph = graph;
            o.memory.group_bytes = grouped ? 64_KiB : 0;
            o.recovery.chunk_timeout = 20s;
            sum_pipe p(o, {[](std::span<u32> in, std::span<word_sum> out, cudawait::stream_ref s) {
                           cudawait::check(cudawait::testing::launch_sum(
                                               in.data(), in.size(),
                                               reinterpret_cast<u32*>(out.data()), s.get()),
                                           "launch_sum");
                       }});
            pinned_buffer<u32> in(n);
            std::copy(words.begin(), words.end(), in.begin());
            pinned_buffer<word_sum> out(11);
            std::fill(out.begin(), out.end(), word_sum{0xdeadbeefu});
            cudawait::scheduler sched;
            const auto [produced, placed] = cudawait::sync_wait(
                sched, cudawait::when_all(produce_views<sum_pipe, u32, word_sum>(
                                              p, in.span(), out.span(), item, 1),
                                          take_views<sum_pipe, word_sum>(p, out.span(), 1)));
            (void)produced;
            EXPECT_EQ(placed, 11u);
            for (std::size_t c = 0; c < 11; ++c) {
                u32 sum = 0;
                for (std::size_t i = c * item; i < std::min(n, (c + 1) * item); ++i) {
                    sum += words[i];
                }
                EXPECT_EQ(out[c].value, sum) << "item " << c;
            }
        }
    }
}

// A view chunk that fails goes to the fallback with the caller's spans: its output lands in
// `out` (pinned or pageable), the result says so and points there; the chunks around it come
// from the GPU. Without groups (a stage failing on one call) and in a grouped run (the group
// fails: each of its chunks once).
TEST_F(pipeline_gpu, the_fallback_takes_a_failed_view_chunk_into_its_output) {
    const std::size_t item = 4096;
    const std::size_t n = item * 8;
    const auto words = random_words(n, 1800);
    const auto want = expected(words, item);
    for (bool grouped : {false, true}) {
        for (host_kind ko : {host_kind::pinned, host_kind::pageable}) {
            SCOPED_TRACE(std::string(grouped ? "grouped, " : "") + kind_name(ko));
            std::vector<std::size_t> fallback_calls;
            std::vector<const u32*> fallback_in;
            std::vector<u32*> fallback_out;
            pipeline_options o;
            o.chunk_elements = item;
            o.depth = 2;
            o.recovery.max_retries = 0;
            o.recovery.chunk_timeout = 20s;
            o.recovery.on_degrade = [](const cudawait::chunk_failure&) {};
            o.memory.group_bytes = grouped ? 64_KiB : 0;
            auto failures = std::make_shared<int>(0);
            pipe_t::stage stage =
                grouped ? pipe_t::stage(failing_group_stage{5, failures})
                        : flaky_stage(std::make_shared<std::vector<int>>(std::vector<int>{5}),
                                      failures);
            pipe_t p(o, {stage}, [&](std::size_t c, std::span<const u32> a, std::span<u32> b) {
                fallback_calls.push_back(c);
                fallback_in.push_back(a.data());
                fallback_out.push_back(b.data());
                host_fallback(c, a, b);
            });
            pinned_buffer<u32> in(n);
            std::copy(words.begin(), words.end(), in.begin());
            host_words<> out(n, ko);
            std::fill(out.span().begin(), out.span().end(), 0xdeadbeefu);
            cudawait::scheduler sched;
            std::vector<int> outcome; // 1 GPU, 2 fallback, 0 wrong
            cudawait::sync_wait(sched, [&]() -> cudawait::task<void> {
                for (std::size_t i = 0; i < 8; ++i) {
                    auto slot = co_await p.acquire();
                    p.submit(std::move(slot), in.span().subspan(i * item, item),
                             out.span().subspan(i * item, item));
                    if (i % 2 == 1) { // two at a time: the slots come back
                        for (std::size_t k = i - 1; k <= i; ++k) {
                            auto r = co_await p.next(20s);
                            const bool right = r && r->chunk() == k &&
                                               r->data().data() == out.span().data() + k * item;
                            outcome.push_back(!right ? 0 : r->by_fallback() ? 2 : 1);
                        }
                    }
                }
                p.close();
                EXPECT_FALSE(co_await p.next(20s));
            }());
            // Items go two at a time, so the runs are {0, 1}, {2, 3}, ...: the group stage fails
            // the run {4, 5}, the per-chunk stage chunk 5.
            const std::vector<int> g = {1, 1, 1, 1, 2, 2, 1, 1};
            const std::vector<int> s = {1, 1, 1, 1, 1, 2, 1, 1};
            EXPECT_EQ(outcome, grouped ? g : s);
            const std::vector<std::size_t> calls =
                grouped ? std::vector<std::size_t>{4, 5} : std::vector<std::size_t>{5};
            EXPECT_EQ(fallback_calls, calls);
            for (std::size_t j = 0; j < fallback_calls.size(); ++j) {
                EXPECT_EQ(fallback_in[j], in.data() + fallback_calls[j] * item);
                EXPECT_EQ(fallback_out[j], out.span().data() + fallback_calls[j] * item);
            }
            EXPECT_EQ(first_mismatch(out.copy(), want), n);
            EXPECT_EQ(p.stats().fallback_chunks, calls.size());
            EXPECT_EQ(p.stats().gpu_chunks, 8 - calls.size());
        }
    }
}

// Bad views are usage errors and leave the slot the caller's: a mis-sized, null or device
// output, an empty, null, too long or device input, an empty slot, and after close(); the slot
// then still submits a right chunk.
TEST_F(pipeline_gpu, bad_views_are_usage_errors_and_the_slot_stays_usable) {
    const std::size_t item = 4096;
    pipeline_options o;
    o.chunk_elements = item;
    o.depth = 2;
    o.recovery.chunk_timeout = 20s;
    pipe_t p(o, {transform_stage()});
    const auto words = random_words(item + 1, 1900);
    pinned_buffer<u32> in(item + 1);
    std::copy(words.begin(), words.end(), in.begin());
    pinned_buffer<u32> out(item + 1);
    std::fill(out.begin(), out.end(), 0xdeadbeefu);
    cudawait::stream alloc(cudawait::device_ref(0));
    cudawait::device_buffer<u32> dev(item, alloc);
    alloc.sync();
    const std::span<const u32> good_in = in.span().first(item);
    const std::span<u32> good_out = out.span().first(item);
    cudawait::scheduler sched;
    cudawait::sync_wait(sched, [&]() -> cudawait::task<void> {
        auto slot = co_await p.acquire();
        EXPECT_THROW(p.submit(std::move(slot), good_in, out.span().first(item - 1)), usage_error);
        EXPECT_THROW(p.submit(std::move(slot), good_in, out.span()), usage_error) << "mis-sized";
        EXPECT_THROW(p.submit(std::move(slot), good_in, std::span<u32>()), usage_error);
        EXPECT_THROW(p.submit(std::move(slot), in.span().first(0), out.span().first(0)),
                     usage_error)
            << "empty";
        EXPECT_THROW(p.submit(std::move(slot), std::span<const u32>(), good_out), usage_error);
        EXPECT_THROW(p.submit(std::move(slot), in.span(), out.span()), usage_error)
            << "longer than a chunk";
        EXPECT_THROW(p.submit(std::move(slot), good_in, dev.span()), usage_error) << "device";
        EXPECT_THROW(p.submit(std::move(slot), std::span<const u32>(dev.span()), good_out),
                     usage_error);
        pipe_t::input_slot empty;
        EXPECT_THROW(p.submit(std::move(empty), good_in, good_out), usage_error);
        // Still the caller's: a right chunk goes through.
        p.submit(std::move(slot), good_in, good_out);
        auto r = co_await p.next(20s);
        const std::vector<u32> first(words.begin(), words.begin() + item);
        EXPECT_TRUE(r && r->data().data() == out.data() && transformed_right(r->data(), first));
        auto late = co_await p.acquire();
        p.close();
        EXPECT_THROW(p.submit(std::move(late), good_in, good_out), usage_error) << "closed";
        EXPECT_NO_THROW((void)late.data()) << "the slot is still the caller's after close()";
        r.reset();
        late = pipe_t::input_slot();
        EXPECT_FALSE(co_await p.next(20s));
    }());
    EXPECT_EQ(out[item], 0xdeadbeefu) << "nothing written past the view";
    EXPECT_EQ(p.stats().gpu_chunks, 1u);
}

// Default options (memory.group_bytes unset): the pipeline groups 64 KiB chunks by
// default_group_bytes, replays the groups as graphs when the stage is replayable() (the stage is
// then called only to capture a slot group's graph, and for the short last group), calls it for
// every chunk otherwise, and every element comes back right in both, run after run.
TEST_F(pipeline_gpu, default_options_group_small_chunks_and_replay_a_replayable_stage) {
    const std::size_t chunk = 64_KiB / sizeof(u32);
    const std::size_t group = pipeline_options::default_group_bytes / 64_KiB; // 64 chunks
    const std::size_t chunks = 4 * group + 45;                                // a short last group
    const std::size_t n = chunks * chunk - 123;
    const auto in = random_words(n, 4242);
    const auto want = expected(in, chunk);
    for (bool replay : {false, true}) {
        SCOPED_TRACE(replay ? "replayable" : "not replayable");
        pipeline_options o;
        o.chunk_elements = chunk;
        auto calls = std::make_shared<std::size_t>(0);
        auto stage = [calls](std::span<u32> a, std::span<u32> b, cudawait::stream_ref s) {
            ++*calls;
            cudawait::check(
                cudawait::testing::launch_transform(a.data(), b.data(), a.size(), salt, 0, s.get()),
                "launch_transform");
        };
        pipe_t p(o, {replay ? pipe_t::stage(cudawait::replayable(stage)) : pipe_t::stage(stage)});
        EXPECT_EQ(p.options().memory.group_bytes, pipeline_options::default_group_bytes);
        EXPECT_EQ(p.options().graph, replay);
        cudawait::scheduler sched;
        constexpr int kRuns = 3;
        for (int run = 0; run < kRuns; ++run) {
            SCOPED_TRACE("run " + std::to_string(run));
            pinned_buffer<u32> pin(n);
            pinned_buffer<u32> pout(n);
            copy_into(pin, in);
            std::fill(pout.begin(), pout.end(), 0xdeadbeefu);
            cudawait::sync_wait(sched, p.run(pin.span(), pout.span()));
            ASSERT_EQ(first_mismatch(std::vector<u32>(pout.begin(), pout.end()), want), n);
            EXPECT_EQ(p.stats().gpu_chunks, chunks);
        }
        if (replay) {
            // Each slot group's graph captured once (depth 2), the short last group run plainly.
            EXPECT_LE(*calls, 2 * group + kRuns * 45);
        } else {
            EXPECT_EQ(*calls, kRuns * chunks);
        }
    }
}

} // namespace
