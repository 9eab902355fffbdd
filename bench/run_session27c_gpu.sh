#!/usr/bin/env bash
# The row kernels at 1 to 4 rows (written and run in the twenty-seventh session): their CUDA tests (each row's bits
# those of the row alone, the twins, early release), then the MTP step's kernels at k = 1 (against call 2's, where
# its 2-row products ran on the FP8 tensor-core kernel and cuBLAS), MTP on vs off with and without the few-row
# kernels (--one-row-kernels: as before), and the plain decode step at batch 1 and 2.
set -u
P="--preset flash-L20-E128 --expert-format fp4 --linear-format fp8"
TESTS="tests/test_kernel_fp8_linear_cuda.py::test_fp8_row_kernel_gives_each_row_the_bits_it_gets_alone \
tests/test_kernel_bf16_gemv_cuda.py tests/test_kernel_fp8_linear_cuda.py::test_fp8_linear_kernel_matches_twin \
tests/test_kernel_fp8_linear_cuda.py::test_early_release_with_weights_read_before_the_wait_gives_the_same_bits" \
  TEST_TIMEOUT=${TEST_TIMEOUT:-170} TEST_TAIL=8 BENCH_TIMEOUT=${BENCH_TIMEOUT:-150} BENCH_TAIL=8 \
  bash bench/device_call.sh \
  "profile_decode.py $P --kernels-only --steps 5 --top 16 --batch 1 --mtp 1 --no-pdl-release" \
  "mtp_speedup.py $P --concurrency 1 --ks 0 1 2 --p-right 0.85 --repeat 2 --no-gap --gen 96" \
  "mtp_speedup.py $P --concurrency 1 --ks 0 1 --p-right 0.85 --repeat 2 --no-gap --gen 96 --one-row-kernels" \
  "decode_floor.py $P --batch 1 2 --steps 10"
