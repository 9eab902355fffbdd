#!/usr/bin/env bash
# For the next device call (written in the twenty-eighth session, NOT run: no machine could be started after its
# second call). Code committed without a GPU: the engine's drafting pause (engine/spec_pause.py: drafting paused
# while fewer than 0.3 of the last 32 drafts are accepted; paused steps of one row a request on a second graph
# runner, the keep-up runner, whose whole-step graph runs the target pass, the argmax and the MTP layer's keep-up
# pass; a probe every 32 paused steps) and the keep-up pass itself (DeepseekV4.mtp_keep_up: only the window rows
# the MTP layer's attention stores). First their CUDA tests (the keep-up graphs captured in the verify buckets'
# pool; the keep-up pass against the whole pass, window rings bit for bit, fp32 and bf16) with the rest of
# tests/test_engine_cuda.py (its helper's dtype became a default; every MTP test there now pauses after 32 drafts); then MTP on vs off with the pause and without at zero acceptance (and the oracle at 0.85, which must
# not pause) on flash-L20-E128 (FP4 experts, FP8 linears; 169 vs 264 tok/s at k = 1 in the 27th session); then
# run_session28d_gpu.sh (flash-L43-E16) and the seed's command (run_session28e_gpu.sh).
set -u
P8="--preset flash-L20-E128 --expert-format fp4 --linear-format fp8"
TESTS="tests/test_engine_cuda.py" TEST_TIMEOUT=${TEST_TIMEOUT:-300} \
  TEST_TAIL=10 BENCH_TIMEOUT=${BENCH_TIMEOUT:-200} BENCH_TAIL=12 bash bench/device_call.sh \
  "mtp_speedup.py $P8 --concurrency 1 --ks 0 1 2 --p-right 0.85 --repeat 3 --no-gap --gen 128 --pause on off" \
  "mtp_speedup.py $P8 --concurrency 32 --ks 0 1 --p-right --repeat 3 --no-gap --gen 96 --pause on off"
