#!/usr/bin/env bash
# The seed's command step by step: dsv4-bench's iteration log (one JSON line per engine step, its host time) for
# MTP off and the seed's MTP (and once with its kept rows unpadded), alternating, and bench/iteration_steps.py's
# tables; then the first steps of a timed
# run under the profiler (bench/first_steps_gpu.py: where the host waits, where the GPU idles), MTP's kept rows
# padded to the row counts warmup runs (as committed) against unpadded.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
. bench/seed_command.sh
seed_prepare
seed_run off1 /tmp/nomtp.yml "" 240 --iteration_log "$OUT/it_off1.jsonl"
seed_run mtp1 examples/mtp.yml "" 100 --iteration_log "$OUT/it_mtp1.jsonl"
UNPADDED="from dsv4.engine.runner import ModelRunner; ModelRunner.mtp_rows_padded = False"
seed_run unpadded1 examples/mtp.yml "$UNPADDED" 100 --iteration_log "$OUT/it_unpadded1.jsonl"
seed_run off2 /tmp/nomtp.yml "" 100 --iteration_log "$OUT/it_off2.jsonl"
python3 bench/iteration_steps.py off1="$OUT/it_off1.jsonl" mtp1="$OUT/it_mtp1.jsonl" \
  unpadded1="$OUT/it_unpadded1.jsonl" off2="$OUT/it_off2.jsonl" --first 12
cd bench && timeout 200 python3 first_steps_gpu.py --runs off mtp-unpadded mtp --steps 4 2>&1 | grep -v "Warn\|USDT\|TRTLLM"
