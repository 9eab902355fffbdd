#!/usr/bin/env bash
# Ran as the twenty-sixth session's first call, on ad90610 (BENCHMARKS.md); --pdl-release has since become the
# default in one-row passes (decode_floor.py --no-pdl-release / --pdl-release-always are its A/Bs).
# For the next device call (written in the twenty-fifth session, not yet run): the CUDA tests of what has not run
# on its committed form (the one-row GEMVs with their wait after the address arithmetic; the early-release test;
# PDL's test with its new constants; mini's file whole, with graph captures now pausing Python's collector, after
# one unreproduced capture failure; the attention files, not run since the side streams went on by default),
# then the step with PDL early release (every kernel releases its successor after its wait, the one-row GEMVs
# read their first weight chunk before theirs) against without, at batch 1 and 8.
set -u
P="--preset flash-L20-E128 --expert-format fp4 --linear-format fp8"
TESTS="tests/test_kernel_bf16_gemv_cuda.py tests/test_kernel_fp8_linear_cuda.py \
tests/test_engine_cuda.py::test_pdl_launches_give_the_bits_of_plain_launches tests/test_kernel_mini_cuda.py \
tests/test_kernel_sparse_attention_cuda.py tests/test_kernel_attention_split_cuda.py" \
  PYTEST_ADDOPTS="-v ${PYTEST_ADDOPTS:-}" TEST_TIMEOUT=${TEST_TIMEOUT:-300} TEST_TAIL=14 \
  BENCH_TIMEOUT=${BENCH_TIMEOUT:-70} BENCH_TAIL=4 bash bench/device_call.sh \
  "decode_floor.py $P --batch 1 --steps 10" \
  "decode_floor.py $P --batch 1 --steps 10 --pdl-release" \
  "decode_floor.py $P --batch 8 --steps 10" \
  "decode_floor.py $P --batch 8 --steps 10 --pdl-release"
