#!/usr/bin/env bash
# After run_session28c_gpu.sh (written in the twenty-eighth session, not run): MTP on vs off on the issue's
# preset, flash-L43-E16 (Flash's full depth, 16 experts, bf16 weights), at concurrency 1 and 8 (k = 1, 2, 3; zero
# acceptance and the oracle at 0.85) and at 32 (zero acceptance), each MTP row with the drafting pause and
# without it (--pause on off).
set -u
P="--preset flash-L43-E16"
SKIP_TESTS=1 BENCH_TIMEOUT=${BENCH_TIMEOUT:-290} BENCH_TAIL=30 bash bench/device_call.sh \
  "mtp_speedup.py $P --concurrency 1 8 --ks 0 1 2 3 --p-right 0.85 --repeat 3 --no-gap --gen 96 --pause on off" \
  "mtp_speedup.py $P --concurrency 32 --ks 0 1 --p-right --repeat 3 --no-gap --gen 96 --pause on off"
