#!/usr/bin/env bash
# The twenty-fifth session's device call: the new one-row bf16 GEMV's twin and dispatch tests, the engine tests
# (the mHC Sinkhorn on the side stream gives the same bits; the dense reference with graphs), the router and mHC
# kernel twins, then the decode step with every change against each one turned off in the same call (the
# Sinkhorn on the main stream, one-row bf16 products on cuBLAS), the bf16 GEMV against cuBLAS per product, and
# the batch-1 kernel map.
set -u
P="--preset flash-L20-E128 --expert-format fp4 --linear-format fp8"
TESTS="tests/test_kernel_bf16_gemv_cuda.py tests/test_kernels_cuda.py::test_gate_kernels_match_twin \
tests/test_kernels_cuda.py::test_mhc_kernels_match_twins tests/test_engine_cuda.py ${EXTRA_TESTS:-}" \
  PYTEST_ADDOPTS="-v ${PYTEST_ADDOPTS:-}" TEST_TIMEOUT=${TEST_TIMEOUT:-260} TEST_TAIL=12 \
  BENCH_TIMEOUT=${BENCH_TIMEOUT:-90} BENCH_TAIL=6 bash bench/device_call.sh \
  "decode_floor.py $P --batch 1 --steps 10" \
  "decode_floor.py $P --batch 1 --steps 10 --no-mhc-overlap" \
  "decode_floor.py $P --batch 1 --steps 10 --no-bf16-row-kernel" \
  "bf16_row_gpu.py" \
  "profile_decode.py $P --kernels-only --steps 5 --top 30 --batch 1"
