#!/usr/bin/env bash
# For the next session's first device call (written in the thirty-second, not run): where the seed's command's
# first-wave prompt steps still lose 15-30 ms with MTP (BENCHMARKS.md, thirty-second session, part 3).
# 1. The first 6 steps of a timed run under the profiler (bench/first_steps_gpu.py): MTP off; MTP as dsv4-bench
#    leaves it after its two warmup requests (paused, within the ring's span of the next probe: the prompt steps
#    keep the MTP ring up); paused far from a probe (the prompt steps skip the keep-up pass); drafting. With Python
#    frames: each call's host events by self time, to name the host work that holds the first mixed step's call
#    (225-250 ms in every run, MTP off's too, with no CUDA call blocking in it: thirty-second session, part 3).
# 2. The seed's command, MTP and off alternating twice (dsv4-bench; the first run compiles: 240 s).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
(cd bench && timeout 280 python3 first_steps_gpu.py --runs off mtp mtp-far mtp-drafting --steps 6 --stack \
  --min-ms 2 2>&1 \
  | grep -v "Warn\|USDT\|TRTLLM\|cuda_graph_config" | tee "$OUT/first_steps.txt")
. bench/seed_command.sh
seed_prepare
for i in 1 2; do
  seed_run "off$i" /tmp/nomtp.yml "" 60 --iteration_log "$OUT/it_off$i.jsonl"
  seed_run "mtp$i" examples/mtp.yml "" 60 --iteration_log "$OUT/it_mtp$i.jsonl"
done
python3 bench/iteration_steps.py off1="$OUT/it_off1.jsonl" mtp1="$OUT/it_mtp1.jsonl" off2="$OUT/it_off2.jsonl" \
  mtp2="$OUT/it_mtp2.jsonl" --first 8
