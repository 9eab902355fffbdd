#!/usr/bin/env bash
# The twenty-fifth session's second device call: the bf16 GEMV on the head's width, the align kernel computing
# only the blocks that can hold pairs (its twin and the grouped MoE), the FP4 kernels with the joined-tile option,
# the padded-graph engine test and mini's MTP tests (not yet run with the side streams on by default); then the
# step with everything against one-row bf16 products on cuBLAS, batch 8, the FP4 GEMV with joined tiles against
# its defaults, and the batch-1 kernel map.
set -u
P="--preset flash-L20-E128 --expert-format fp4 --linear-format fp8"
TESTS="tests/test_kernel_bf16_gemv_cuda.py tests/test_kernels_cuda.py::test_align_kernel_equals_twin \
tests/test_kernels_cuda.py::test_grouped_moe_matches_torch tests/test_kernel_fp4_cuda.py \
tests/test_engine_cuda.py::test_cuda_graphs_padded_buckets_equal_dense_reference tests/test_kernel_mini_cuda.py" \
  PYTEST_ADDOPTS="-v ${PYTEST_ADDOPTS:-}" TEST_TIMEOUT=${TEST_TIMEOUT:-250} TEST_TAIL=14 \
  BENCH_TIMEOUT=${BENCH_TIMEOUT:-90} BENCH_TAIL=6 bash bench/device_call.sh \
  "decode_floor.py $P --batch 1 --steps 10" \
  "decode_floor.py $P --batch 1 --steps 10 --no-bf16-row-kernel" \
  "decode_floor.py $P --batch 8 --steps 10" \
  "fp4_gemv_gpu.py --batch 1 --join-sweep" \
  "profile_decode.py $P --kernels-only --steps 5 --top 24 --batch 1"
