#!/usr/bin/env bash
# The twenty-fourth session's unrun checks, for the next device call: the CUDA test files that did not run with
# the shared expert's side stream on by default and PDL (FP4, attention, mini, the rest of the engine tests), the
# engine at Flash's widths taking the one-row FP8 kernel in its graphs (written after the last call), then
# the decode step with the one-row FP8 kernel at BLOCK_N 8 (the per-projection sweep's best on most shapes) against
# the default 16 in the same call, and the batch-1 kernel map with the one-row kernel.
set -u
TESTS="tests/test_engine_cuda.py tests/test_kernel_fp8_linear_cuda.py tests/test_kernel_fp4_cuda.py \
tests/test_kernel_sparse_attention_cuda.py tests/test_kernel_attention_split_cuda.py tests/test_kernel_mini_cuda.py" TEST_TIMEOUT=${TEST_TIMEOUT:-330} TEST_TAIL=10 \
  BENCH_TIMEOUT=110 BENCH_TAIL=40 bash bench/device_call.sh \
  "decode_floor.py --preset flash-L20-E128 --expert-format fp4 --linear-format fp8 --batch 1 --steps 10" \
  "decode_floor.py --preset flash-L20-E128 --expert-format fp4 --linear-format fp8 --batch 1 --steps 10 --fp8-row-tile 8/512/1" \
  "profile_decode.py --preset flash-L20-E128 --expert-format fp4 --linear-format fp8 --kernels-only --steps 5 --top 30 --batch 1"
