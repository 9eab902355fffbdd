#!/usr/bin/env bash
# Twentieth session's device call: CUDA tests of the new and unverified kernels, the FP4 GEMV bench with its
# sweep, and on a card that holds flash-E128 (an H200) its decode step.
set -u
TESTS="tests/test_kernel_fp4_cuda.py tests/test_kernel_fp8_linear_cuda.py tests/test_kernels_cuda.py tests/test_kernel_sparse_attention_cuda.py" \
  TEST_TIMEOUT=${TEST_TIMEOUT:-260} TEST_TAIL=25 BENCH_TIMEOUT=170 BENCH_TAIL=60 \
  bash bench/device_call.sh "fp4_gemv_gpu.py --batch 1 8 32 --sweep"
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [ "$mem" -gt 100000 ]; then
  SKIP_TESTS=1 BENCH_TIMEOUT=150 BENCH_TAIL=30 bash bench/device_call.sh \
    "decode_floor.py --preset flash-E128 --expert-format fp4 --linear-format fp8 --steps 10"
fi
