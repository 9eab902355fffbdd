#!/usr/bin/env bash
# The CUDA tests of the last two sessions (keep-up rings, sampled MTP, grouped MoE on torch._grouped_mm, the
# kept-rows MTP pass), then TTFT with MTP off / on over the kept rows / on over every row (flash-L4-E32, 1k
# and 8k prompts), then MTP at concurrency 8 on flash-L43-E16 with the bandwidth ceiling.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
TESTS="tests/test_engine_cuda.py tests/test_kernels_cuda.py::test_grouped_moe_matches_torch tests/test_kernels_cuda.py::test_grouped_moe_on_the_library_grouped_mm_matches_the_kernel_and_replays_in_a_graph" \
  TEST_TIMEOUT=${TEST_TIMEOUT:-200} TEST_TAIL=10 BENCH_TIMEOUT=${BENCH_TIMEOUT:-170} BENCH_TAIL=8 bash bench/device_call.sh \
  "prefill.py --lens 1024 8192 --mtp 0 1 --mtp-rows kept all --repeat 5" \
  "mtp_speedup.py --preset flash-L43-E16 --concurrency 8 --ks 0 1 3 --p-right 0.85 --repeat 3 --no-gap --gen 96 --pause on"
