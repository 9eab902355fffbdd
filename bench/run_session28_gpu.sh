#!/usr/bin/env bash
# For the next device call (written in the twenty-seventh session, not yet run): the bf16 row kernel's grouped
# products (the attention's wo_a with bf16 weights, 1 to 4 rows; committed without a GPU) and the CUDA files that
# have not run whole since the side streams went on by default (the split-attention file stopped at 37 of 42, the
# sparse one has not run); then, with FP4 experts and bf16 linears (the dequantised linears' path, wo_a now on the
# row kernel at a few rows), whether MTP on gives MTP off's tokens at concurrency 1 as it does with FP8 linears,
# and the decode step with and without the bf16 row kernel (--no-bf16-row-kernel: cuBLAS and einsum).
set -u
P="--preset flash-L20-E128 --expert-format fp4"
TESTS="tests/test_kernel_bf16_gemv_cuda.py tests/test_kernel_sparse_attention_cuda.py \
tests/test_kernel_attention_split_cuda.py" TEST_TIMEOUT=${TEST_TIMEOUT:-300} TEST_TAIL=8 \
  BENCH_TIMEOUT=${BENCH_TIMEOUT:-150} BENCH_TAIL=8 bash bench/device_call.sh \
  "mtp_speedup.py $P --concurrency 1 --ks 0 1 --p-right 0.85 --repeat 2 --no-gap --gen 96" \
  "decode_floor.py $P --batch 1 2 --steps 10" \
  "decode_floor.py $P --batch 1 2 --steps 10 --no-bf16-row-kernel"
