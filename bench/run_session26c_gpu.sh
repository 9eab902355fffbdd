#!/usr/bin/env bash
# The twenty-sixth session's third device call: why folding the RMSNorm into the mHC collapse measured even at
# batch 1 (3.66 against 3.65 ms): the collapse alone at decode sizes, folded and apart, at 4 / 8 / 16 warps;
# the step's kernel map with and without; batch 8 without.
set -u
P="--preset flash-L20-E128 --expert-format fp4 --linear-format fp8"
SKIP_TESTS=1 BENCH_TIMEOUT=${BENCH_TIMEOUT:-90} BENCH_TAIL=${BENCH_TAIL:-30} bash bench/device_call.sh \
  "mhc_collapse_gpu.py" \
  "profile_decode.py $P --kernels-only --steps 5 --top 22 --batch 1" \
  "profile_decode.py $P --kernels-only --steps 5 --top 22 --batch 1 --no-norm-in-collapse" \
  "decode_floor.py $P --batch 8 --steps 10 --no-norm-in-collapse"
