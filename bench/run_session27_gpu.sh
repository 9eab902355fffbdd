#!/usr/bin/env bash
# For the next device call (written in the twenty-sixth session, not yet run): the attention CUDA files, not run
# whole since the side streams went on by default (the split file stopped at 14 of 42, the sparse one at 5 of 15);
# whether an L2 prefetch of a GEMV's weight during a chain of small kernels pays (l2_prefetch_gpu.py, a question
# before any engine change); the step's kernel map without early release (with it, a released kernel's time
# includes its wait for the one before); the batch-1 default as the baseline of the call.
set -u
P="--preset flash-L20-E128 --expert-format fp4 --linear-format fp8"
TESTS="tests/test_kernel_attention_split_cuda.py tests/test_kernel_sparse_attention_cuda.py" \
  TEST_TIMEOUT=${TEST_TIMEOUT:-300} TEST_TAIL=12 BENCH_TIMEOUT=${BENCH_TIMEOUT:-80} BENCH_TAIL=12 \
  bash bench/device_call.sh \
  "l2_prefetch_gpu.py" \
  "decode_floor.py $P --batch 1 --steps 10" \
  "profile_decode.py $P --kernels-only --steps 5 --top 24 --batch 1 --no-pdl-release"
