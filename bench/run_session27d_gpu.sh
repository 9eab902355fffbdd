#!/usr/bin/env bash
# The FP4 GEMV's prefetch (written and run in the twenty-seventh session): its CUDA tests (every prefetch level gives
# the same bits, the twins), then the decode step at batch 1 and 8 with the words a chunk ahead (the default), with
# none (--no-fp4-prefetch) and with row 0's inputs too (--fp4-prefetch-inputs); then the MTP step's kernels (k = 1,
# batch 1) with early release in its two-row passes too (--pdl-release-always) against the default, which releases
# in one-row passes only.
set -u
P="--preset flash-L20-E128 --expert-format fp4 --linear-format fp8"
TESTS="tests/test_kernel_fp4_cuda.py" TEST_TIMEOUT=${TEST_TIMEOUT:-150} TEST_TAIL=6 \
  BENCH_TIMEOUT=${BENCH_TIMEOUT:-100} BENCH_TAIL=5 bash bench/device_call.sh \
  "decode_floor.py $P --batch 1 8 --steps 10" \
  "decode_floor.py $P --batch 1 8 --steps 10 --no-fp4-prefetch" \
  "decode_floor.py $P --batch 1 8 --steps 10 --fp4-prefetch-inputs" \
  "profile_decode.py $P --kernels-only --steps 5 --top 6 --batch 1 --mtp 1" \
  "profile_decode.py $P --kernels-only --steps 5 --top 6 --batch 1 --mtp 1 --pdl-release-always"
