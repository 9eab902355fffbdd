#!/usr/bin/env bash
# Thirty-third session (prepared, not run: no device machine started): where the seed's command's first-wave
# prompt steps still lose 15-30 ms with MTP (BENCHMARKS.md, thirty-second session, part 3).
#   bash bench/run_session33_gpu.sh all: first the first 6 steps of a timed run under the profiler
#     (bench/first_steps_gpu.py, with Python frames: each call's host self time by function, to name what holds
#     the first mixed step's call, 225-250 ms in every run, MTP off's too), by default MTP off without warmup's
#     first-wave path and with it, MTP as dsv4-bench leaves it (paused, 18 steps before a probe: the prompt steps
#     keep the rows the probe will read), and MTP keeping each prompt's last swa_cap rows (as before this
#     session); then the seed's command (dsv4-bench with its iteration log): off / MTP / MTP keeping the last
#     swa_cap rows / off / MTP, as many as BUDGET seconds (default 470) allow. RUNS and FIRST_S choose the
#     profiled runs and their time limit, SEED the seed-command runs (off*, mtp*, full*).
#   bash bench/run_session33_gpu.sh 3: the CUDA twins of the pause's paths (far from a probe, near one, warmup's).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ "${1:-all}" = 3 ]; then
  timeout 300 python3 -m pytest -q tests/test_compiles.py tests/test_engine_cuda.py -k "far_from_a_probe or kept_rows or warmup or pause or compile" \
    2>&1 | tail -5
  exit
fi
END=$((SECONDS + ${BUDGET:-470}))
(cd bench && timeout ${FIRST_S:-250} python3 first_steps_gpu.py --runs ${RUNS:-off-nowave off mtp mtp-full-keep} \
  --steps 6 --stack --min-ms 2 2>&1 | grep --line-buffered -v "Warn\|USDT\|TRTLLM\|cuda_graph_config" \
  > "$OUT/first_steps.txt")
grep "^| step\|^###" "$OUT/first_steps.txt" | head -40
. bench/seed_command.sh
seed_prepare
FULL="from bench.common import keep_whole_span; DraftPause.keep_rows = keep_whole_span(DraftPause.keep_rows)"
runs=()
for r in ${SEED:-off1 mtp1 full1 off2 mtp2}; do
  case $r in off*) set -- $r /tmp/nomtp.yml ;; *) set -- $r examples/mtp.yml ;; esac
  [ $((END - SECONDS)) -lt 50 ] && break
  if [ "${1%?}" = full ]; then pre="$FULL"; else pre=""; fi
  seed_run "$1" "$2" "$pre" 50 --iteration_log "$OUT/it_$1.jsonl"
  runs+=("$1=$OUT/it_$1.jsonl")
done
[ ${#runs[@]} -gt 0 ] && python3 bench/iteration_steps.py "${runs[@]}" --first 6 > "$OUT/steps.txt" 2>&1
tail -8 "$OUT/steps.txt" 2>/dev/null
