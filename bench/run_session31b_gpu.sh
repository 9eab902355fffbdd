#!/usr/bin/env bash
# Thirty-first session, second machine: what a paused MTP decode step runs that MTP off does not.
# 1. mtp_step_gpu.py --diff: every kernel whose time per step differs from MTP off's, with launches per step
#    (flash-L4-E32, c = 32, zero acceptance, probes off: paused steps only).
# 2. seed_steps_gpu.py: the seed's workload with the slim paused step (no acceptance kernels) against the wide one,
#    and with neither keep-up nor probes (mtp-bare: what a paused step costs beyond them), alternating with off.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
cd bench
timeout 200 python3 mtp_step_gpu.py --preset flash-L4-E32 --concurrency 32 --ks 0 1 --prompt-len 768 --gen 128 \
  --top 4 --diff 40 --no-probes --append "$OUT/BENCHMARKS.part.md" 2>&1 | grep -v Warn | tail -52
timeout 330 python3 seed_steps_gpu.py --runs off mtp mtp-wide-keep mtp-bare off mtp mtp-wide-keep mtp-bare \
  --append "$OUT/BENCHMARKS.part.md" 2>&1 | grep -v Warn | tail -10
