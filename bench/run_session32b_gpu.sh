#!/usr/bin/env bash
# The seed's command step by step, and paused prompt steps far from a probe: dsv4-bench's iteration log (one JSON
# line per engine step, its host time) for MTP off, the seed's MTP as committed (a paused step far from the next
# probe leaves prompt rows stale too) and MTP keeping up over every step with prompt rows (as before: "old"),
# alternating; bench/iteration_steps.py's tables; then the first steps of a timed run under the profiler
# (bench/first_steps_gpu.py: where the host waits, where the GPU idles).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
. bench/seed_command.sh
seed_prepare
OLD="from dsv4.engine.engine import LLMEngine as E
f = E._drafting_and_keep_up
E._drafting_and_keep_up = lambda self, seqs: (lambda d, k: (d, k or any(s.num_new > 1 or not s.sample
                                                                           for s in seqs)))(*f(self, seqs))"
seed_run off1 /tmp/nomtp.yml "" 240 --iteration_log "$OUT/it_off1.jsonl"
seed_run mtp1 examples/mtp.yml "" 100 --iteration_log "$OUT/it_mtp1.jsonl"
seed_run old1 examples/mtp.yml "$OLD" 100 --iteration_log "$OUT/it_old1.jsonl"
seed_run off2 /tmp/nomtp.yml "" 100 --iteration_log "$OUT/it_off2.jsonl"
seed_run mtp2 examples/mtp.yml "" 100 --iteration_log "$OUT/it_mtp2.jsonl"
seed_run old2 examples/mtp.yml "$OLD" 100 --iteration_log "$OUT/it_old2.jsonl"
python3 bench/iteration_steps.py off1="$OUT/it_off1.jsonl" mtp1="$OUT/it_mtp1.jsonl" old1="$OUT/it_old1.jsonl" \
  off2="$OUT/it_off2.jsonl" mtp2="$OUT/it_mtp2.jsonl" old2="$OUT/it_old2.jsonl" --first 14
cd bench && timeout 200 python3 first_steps_gpu.py --runs off mtp mtp-all-rows off mtp --steps 5 2>&1 | grep -v "Warn\|USDT\|TRTLLM"
