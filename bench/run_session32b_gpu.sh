#!/usr/bin/env bash
# Where the seed's command's first prefill group loses time with MTP: the first steps of a timed run under the
# profiler (bench/first_steps_gpu.py: where the host waits, where the GPU idles), MTP off, MTP with its kept rows
# unpadded (as before) and padded to the row counts warmup runs (as committed); then the seed's command itself
# (dsv4-bench with its iteration log, bench/iteration_steps.py's tables): MTP, off, MTP unpadded.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
(cd bench && timeout 230 python3 first_steps_gpu.py --runs off mtp-unpadded mtp --steps 4 2>&1 \
  | grep -v "Warn\|USDT\|TRTLLM\|cuda_graph_config")
. bench/seed_command.sh
seed_prepare
UNPADDED="from dsv4.engine.runner import ModelRunner; ModelRunner.mtp_rows_padded = False"
seed_run mtp1 examples/mtp.yml "" 45 --iteration_log "$OUT/it_mtp1.jsonl"
seed_run off1 /tmp/nomtp.yml "" 45 --iteration_log "$OUT/it_off1.jsonl"
seed_run unpadded1 examples/mtp.yml "$UNPADDED" 45 --iteration_log "$OUT/it_unpadded1.jsonl"
python3 bench/iteration_steps.py mtp1="$OUT/it_mtp1.jsonl" off1="$OUT/it_off1.jsonl" \
  unpadded1="$OUT/it_unpadded1.jsonl" --first 8
