#!/usr/bin/env bash
# For the next device call (written in the twenty-seventh session, not yet run), code committed without a GPU:
# the bf16 row kernel's grouped products (the attention's wo_a with bf16 linears, 1 to 4 rows) and the FP8 row
# kernel's and the bf16 row kernel's BCAST experiments (inputs loaded in the words' layout, no shared-memory
# relayout): their CUDA tests first; then the FP8 step at batch 1 and 2 with neither, with --fp8-row-bcast and with
# both (the bf16 row kernel takes the head and the compressors there); with FP4 experts and bf16 linears,
# whether MTP on gives MTP off's tokens at concurrency 1 (as it does with FP8 linears) and the step with and
# without the bf16 row kernel (--no-bf16-row-kernel: cuBLAS and einsum); mini's MTP at concurrency 1, whose widths
# (256, 128, 96) the bf16 row kernel now takes in smaller chunks (0.835 of its tokens identical to MTP off in the
# 27th session, before). run_session28b_gpu.sh runs the attention
# CUDA files that have not run whole since the side streams went on by default.
set -u
P8="--preset flash-L20-E128 --expert-format fp4 --linear-format fp8"
PB="--preset flash-L20-E128 --expert-format fp4"
TESTS="tests/test_kernel_bf16_gemv_cuda.py \
tests/test_kernel_fp8_linear_cuda.py::test_fp8_row_kernel_gives_each_row_the_bits_it_gets_alone \
tests/test_kernel_fp8_linear_cuda.py::test_fp8_linear_kernel_matches_twin" TEST_TIMEOUT=${TEST_TIMEOUT:-200} \
  TEST_TAIL=8 BENCH_TIMEOUT=${BENCH_TIMEOUT:-120} BENCH_TAIL=6 bash bench/device_call.sh \
  "decode_floor.py $P8 --batch 1 2 --steps 10" \
  "decode_floor.py $P8 --batch 1 2 --steps 10 --fp8-row-bcast" \
  "decode_floor.py $P8 --batch 1 2 --steps 10 --fp8-row-bcast --bf16-row-bcast" \
  "mtp_speedup.py $PB --concurrency 1 --ks 0 1 --p-right 0.85 --repeat 2 --no-gap --gen 96" \
  "decode_floor.py $PB --batch 1 --steps 10" \
  "decode_floor.py $PB --batch 1 --steps 10 --no-bf16-row-kernel" \
  "mini_mtp.py --concurrency 1 --ks 0 1 2 --repeat 3"
