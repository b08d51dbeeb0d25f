#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The GPU suite: build, run every test (none may be skipped), the benchmarks, then the test
# programs under compute-sanitizer memcheck. Logs go to $1 (default: gpu-logs/).
#   scripts/gpu_suite.sh [log-dir] [stages...]     stages: build test bench memcheck racecheck
#                                                  (default: all)
set -uo pipefail
# NVLink multicast stays off on these machines; the NCCL tests and examples set it too.
export NCCL_NVLS_ENABLE=0
logs=${1:-gpu-logs}
shift || true
stages=${*:-build test bench memcheck racecheck}
mkdir -p "$logs"
build=build-gpu
status=0
has() { [[ " $stages " == *" $1 "* ]]; }

if has build; then
  echo "== build"
  # Torch's CMake package, where Python has it: the torch_stage example is built and tested then.
  torch_prefix=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)' 2>/dev/null || true)
  { cmake --preset gpu ${torch_prefix:+-DCMAKE_PREFIX_PATH=$torch_prefix} && cmake --build --preset gpu; } >"$logs/build.log" 2>&1 || { tail -50 "$logs/build.log"; exit 1; }
fi
if has test; then
  echo "== test"
  ctest --test-dir "$build" --output-on-failure -j4 --timeout 180 >"$logs/ctest.log" 2>&1 || status=1
  grep -E "tests passed|Skipped|Failed|\*\*\*" "$logs/ctest.log" | tail -30
fi
if has bench; then
  echo "== benchmarks"
  # Every *_bench the build made (await, lane, memory, pipeline, nccl where NCCL was found).
  for b in "$build"/benchmarks/*_bench; do
    name=$(basename "$b")
    timeout 300 "$b" --benchmark_out="$logs/$name.json" --benchmark_out_format=json >"$logs/$name.log" 2>&1 || status=1
    sed -n '/summary/,$p' "$logs/$name.log"
  done
fi
if has memcheck; then
  echo "== compute-sanitizer memcheck"
  # Only the programs with GPU tests. The fault test and the no-device tests run in child
  # processes on purpose (one kills its context, the others hide the devices); the pipeline's
  # timeout tests depend on timings the sanitizer's slowdown would change. Tests whose CUDA calls
  # fail on purpose (an impossible allocation, the elapsed time of an event without timing,
  # launches with a bad configuration) run in a second pass with API errors not reported, so
  # that pass still catches every memory error. The 10,000-coroutine test (a million launches)
  # runs on its own, under a limit.
  : >"$logs/memcheck.log"
  run_memcheck() {
    local bin=$1 filter=$2 limit=$3
    shift 3
    timeout "$limit" compute-sanitizer --tool memcheck --error-exitcode 3 "$@" \
      "$build/tests/$bin" --gtest_filter="$filter" >>"$logs/memcheck.log" 2>&1
    local rc=$?
    echo "memcheck $bin [$filter]${*:+ $*}: rc=$rc $(grep -E 'ERROR SUMMARY' "$logs/memcheck.log" | tail -1)"
    [ $rc -eq 0 ] || status=1
  }
  failing_calls='*impossible_size*:*timing_disabled*'
  # The sanitizer waits for each kernel before the launch returns, so the pool test that frees a
  # block while a kernel still waits for a host flag cannot run under it (the kernel times out).
  for t in device stream event graph pinned_pool pinned_buffer device_buffer mapped_buffer copy timeout; do
    run_memcheck "${t}_test" "-*kernel_fault*:*no_device*:*without_a_device*:*churn*:*freed_in_stream_order*:$failing_calls" 180
  done
  run_memcheck device_buffer_test "$failing_calls" 120 --report-api-errors no
  # The copy lanes: the test that a lane copy passes a busy stream times it against a kernel;
  # the kernel-loading tests run in child processes, which do not finish under the sanitizer.
  run_memcheck copy_lane_test '-*without_a_device*:*does_not_wait*:*cannot_be_loaded*:*fails_the_preload*' 180
  run_memcheck event_test "$failing_calls" 120 --report-api-errors no
  # Registered ranges (cudaHostRegister).
  run_memcheck host_registration_test '-*without_a_device*:*no_device*:*registering_twice*' 180
  run_memcheck host_registration_test '*registering_twice*' 120 --report-api-errors no
  failing_launches='*launch_error*:*failed_chunk*:*keeps_failing*:*without_a_fallback*:*throwing_fallback*:*writes_the_report*:*depth_recovers*:*failing_group*:*fails_single_chunks*:*defers_what_on_degrade*:*failed_run*:*failed_view_chunk*'
  # The chunk-size, stage-overlap and slow-chunk tests compare times, which the sanitizer skews;
  # so do the tests of waits that cannot be set up and of chunks waited for again (chunk_timeout
  # against a kernel's length).
  run_memcheck pipeline_test \
    "-*no_device*:*without_a_device*:*sticky_fault*:*timeout*:*hung*:*slow_chunk*:*suggested_chunk_size*:*overlap*:*cannot_be_set_up*:*waited_for_again*:$failing_launches" 300
  run_memcheck pipeline_test "$failing_launches" 300 --report-api-errors no
  # The doorbell tests time the loop blocking while a kernel runs; the sanitizer returns from a
  # launch only once the kernel finished, so the loop never blocks there.
  run_memcheck scheduler_test '-*kernel_fault*:*no_device*:*ten_thousand*:*doorbell*:*without_stream_memory*' 120
  # Foreign streams and events, the legacy stream, managed memory and prefetch.
  run_memcheck interop_test '-*no_device*:*without_a_device*' 180
  run_memcheck managed_buffer_test '-*no_device*:*without_a_device*' 180
  # The timeline's overlap test and the demo's trace measure overlap, the link's utilisation test
  # the host's pace; describe_link's test asks for a device that does not exist on purpose.
  run_memcheck timeline_test '-*overlaps*:*the_demo*' 180
  run_memcheck link_test '-*utilisation*' 180 --report-api-errors no
  # numa_test asks for a device that does not exist on purpose.
  run_memcheck numa_test '*' 180 --report-api-errors no
  # The multi pipeline: its timeout and abandoned-GPU tests time chunks; the rescue tests inject
  # failing launches (second pass, API errors not reported).
  multi_failing='*gives_up*:*fails*:*without_a_fallback*:*out_of_range*'
  run_memcheck multi_pipeline_test "-*timeouts*:*abandoned*:*without_a_device*:$multi_failing" 300
  run_memcheck multi_pipeline_test "$multi_failing" 300 --report-api-errors no
  # NCCL: the stall tests time their aborts and the child test starts a process; NCCL probes
  # features with calls that may fail, so API errors are not reported.
  if [ -x "$build/tests/nccl_test" ]; then
    run_memcheck nccl_test '-*times_out*:*child*' 300 --report-api-errors no
  fi
  # fork_test is not run here: a child forked from a process under compute-sanitizer inherits
  # the sanitizer's state and did not exit within the test's 10 s deadline (it passes in ctest).
  # The watchdog's tests time their reports to 10% of the window, which the sanitizer's slowdown
  # breaks; here only memory errors count (rc 3), not a late report (rc 1).
  timeout 300 compute-sanitizer --tool memcheck --error-exitcode 3 "$build/tests/watchdog_test" \
    >>"$logs/memcheck.log" 2>&1
  rc=$?
  echo "memcheck watchdog_test (memory errors only): rc=$rc $(grep -E 'ERROR SUMMARY' "$logs/memcheck.log" | tail -1)"
  [ $rc -ne 3 ] && [ $rc -ne 124 ] || status=1
  run_memcheck scheduler_test '*ten_thousand*' "${MEMCHECK_LONG_LIMIT:-240}"
fi
if has racecheck; then
  echo "== compute-sanitizer racecheck"
  : >"$logs/racecheck.log"
  for t in pinned_pool pinned_buffer device_buffer mapped_buffer copy host_registration pipeline; do
    timeout 300 compute-sanitizer --tool racecheck --error-exitcode 3 \
      "$build/tests/${t}_test" \
      --gtest_filter='-*no_device*:*without_a_device*:*sticky_fault*:*launch_error*:*failed_chunk*:*keeps_failing*:*without_a_fallback*:*throwing_fallback*:*timeout*:*hung*:*impossible_size*:*suggested_chunk_size*:*churn*:*overlap*' \
      >>"$logs/racecheck.log" 2>&1
    rc=$?
    echo "racecheck ${t}_test: rc=$rc $(grep -E 'RACECHECK SUMMARY|ERROR SUMMARY' "$logs/racecheck.log" | tail -1)"
    [ $rc -eq 0 ] || status=1
  done
fi
exit $status
