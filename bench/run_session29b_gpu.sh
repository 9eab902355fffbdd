#!/usr/bin/env bash
# Twenty-ninth session, second device call (right after run_session29_gpu.sh, on its warm machine): prefill TTFT
# with the routed experts on torch._grouped_mm against the Triton grouped GEMM (flash-L4-E32, 1k and 8k prompts,
# the same call), where an 8k prefill's kernel time goes now (last profiled in the 18th session), MTP with and without the drafting pause on flash-L43-E16 at concurrency 1 (k = 1; zero
# acceptance and the oracle at 0.85), then the seed's command with the seed's mtp.yml and without MTP.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
SKIP_TESTS=1 BENCH_TIMEOUT=${BENCH_TIMEOUT:-200} BENCH_TAIL=24 bash bench/device_call.sh \
  "prefill.py --preset flash-L4-E32 --lens 1024 8192" \
  "prefill.py --preset flash-L4-E32 --lens 1024 8192 --grouped-mm" \
  "profile_prefill.py --lens 8192 --top 16" \
  "mtp_speedup.py --preset flash-L43-E16 --concurrency 1 --ks 0 1 --p-right 0.85 --repeat 3 --no-gap --gen 96 --pause on off"
bash bench/run_session28e_gpu.sh
