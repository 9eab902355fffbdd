#!/usr/bin/env bash
# Ran as the twenty-sixth session's fourth call on 4c481b3 (BENCHMARKS.md); that commit's experiment (POST_IN_MIX,
# --no-post-in-mix, the posted column of mhc_collapse_gpu.py) measured slower and was reverted in the next one.
# The twenty-sixth session's fourth device call: the mHC write-back computed by the next collapse's partials kernel
# (model.mhc.POST_IN_MIX): the twin tests, the engine and mini files, the split attention; then the collapse
# alone (posted against apart), the step at batch 1 with and without, and the defaults at batch 8 and 32.
set -u
P="--preset flash-L20-E128 --expert-format fp4 --linear-format fp8"
TESTS="tests/test_kernels_cuda.py::test_mhc_kernels_match_twins tests/test_engine_cuda.py \
tests/test_kernel_mini_cuda.py tests/test_kernel_attention_split_cuda.py" \
  TEST_TIMEOUT=${TEST_TIMEOUT:-270} TEST_TAIL=12 BENCH_TIMEOUT=${BENCH_TIMEOUT:-60} BENCH_TAIL=4 \
  bash bench/device_call.sh \
  "mhc_collapse_gpu.py" \
  "decode_floor.py $P --batch 1 --steps 10" \
  "decode_floor.py $P --batch 1 --steps 10 --no-post-in-mix" \
  "decode_floor.py $P --batch 8 --steps 10" \
  "decode_floor.py $P --batch 32 --steps 10"
