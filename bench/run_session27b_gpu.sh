#!/usr/bin/env bash
# Issue 17 on the current kernels (written and run in the twenty-seventh session): MTP on vs off on
# flash-L20-E128 with FP4 experts and FP8 linears (the preset issue 20 measures; MTP was last measured at depth
# on bf16 weights, before the one-row kernels), the kernels of an MTP step (k = 1, batch 1) against a plain one,
# and mini's real acceptance at concurrency 1.
set -u
P="--preset flash-L20-E128 --expert-format fp4 --linear-format fp8"
SKIP_TESTS=1 BENCH_TIMEOUT=${BENCH_TIMEOUT:-170} BENCH_TAIL=14 bash bench/device_call.sh \
  "mtp_speedup.py $P --concurrency 1 --ks 0 1 2 --p-right 0.85 --repeat 2 --no-gap --gen 96" \
  "profile_decode.py $P --kernels-only --steps 5 --top 22 --batch 1 --mtp 1 --no-pdl-release" \
  "mini_mtp.py --concurrency 1 --ks 0 1 2 --repeat 3" \
  "mtp_speedup.py $P --concurrency 32 --ks 0 1 --p-right 0.85 --repeat 2 --no-gap --gen 96"
