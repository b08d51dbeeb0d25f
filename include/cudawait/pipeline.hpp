// SPDX-License-Identifier: Apache-2.0
#pragma once

// The pipeline module: N-buffered H2D -> stages -> D2H over chunks, in batches or streaming.
//   pipeline<In, Out> p(options, stages); co_await p.run(in, out)  pipeline/pipeline.hpp
//   pipeline_options                                              pipeline/options.hpp
//   pipeline_stage, stage_context, group_context                  pipeline/stage.hpp
//   write_report(out, options, stats, failures)                   pipeline/report.hpp
//   multi_pipeline (one shard per device)                         pipeline/multi_pipeline.hpp
// Manual: docs/pipeline.md.

#include <cudawait/pipeline/multi_pipeline.hpp>
#include <cudawait/pipeline/options.hpp>
#include <cudawait/pipeline/pipeline.hpp>
#include <cudawait/pipeline/report.hpp>
#include <cudawait/pipeline/stage.hpp>
