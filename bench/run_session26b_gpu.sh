#!/usr/bin/env bash
# The twenty-sixth session's second device call: the CUDA tests of the mHC collapse with the sub-block's RMSNorm
# folded in (kernels.mhc._collapse, one program a token) and of PDL early release by default in one-row passes
# (the fp8 release test, the engine file, mini's file), then the step: defaults at batch 1 and 8, and at batch 1
# the A/Bs of both changes.
set -u
P="--preset flash-L20-E128 --expert-format fp4 --linear-format fp8"
TESTS="tests/test_kernels_cuda.py::test_mhc_kernels_match_twins \
tests/test_kernel_fp8_linear_cuda.py::test_early_release_with_weights_read_before_the_wait_gives_the_same_bits \
tests/test_engine_cuda.py tests/test_kernel_mini_cuda.py" \
  TEST_TIMEOUT=${TEST_TIMEOUT:-330} TEST_TAIL=14 BENCH_TIMEOUT=${BENCH_TIMEOUT:-60} BENCH_TAIL=3 \
  bash bench/device_call.sh \
  "decode_floor.py $P --batch 1 --steps 10" \
  "decode_floor.py $P --batch 1 --steps 10 --no-norm-in-collapse" \
  "decode_floor.py $P --batch 1 --steps 10 --no-pdl-release" \
  "decode_floor.py $P --batch 8 --steps 10"
