#!/usr/bin/env bash
# Thirty-third session: where the seed's command's first-wave prompt steps still lose 15-30 ms with MTP
# (BENCHMARKS.md, thirty-second session, part 3).
#   bash bench/run_session33_gpu.sh 1: the first 6 steps of a timed run under the profiler (bench/first_steps_gpu.py):
#     MTP off without warmup's new first-wave path, and with it; MTP as dsv4-bench leaves it after its two warmup
#     requests (paused, within the ring's span of the next probe: the prompt steps keep the last rows of each
#     prompt the probe will read); the same keeping each prompt's last swa_cap rows (as before this session).
#     With Python frames: each call's host self time by function, to name what holds the first mixed step's call
#     (225-250 ms in every run, MTP off's too, with no CUDA call blocking in it).
#   bash bench/run_session33_gpu.sh 3: the CUDA twins of the pause's paths.
#   bash bench/run_session33_gpu.sh all: parts 1 and 2 in one call (fewer runs).
#   bash bench/run_session33_gpu.sh 2: the seed's command, off / MTP / MTP keeping every prompt's last swa_cap rows
#     near a probe, twice (dsv4-bench with its iteration log; the first run on a fresh machine compiles: ~2 min).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ "${1:-1}" = all ]; then  # parts 1 and 2 in one call, shorter (BUDGET seconds: the seed runs that fit)
  END=$((SECONDS + ${BUDGET:-470}))
  (cd bench && timeout ${FIRST_S:-250} python3 first_steps_gpu.py --runs ${RUNS:-off-nowave off mtp mtp-full-keep} --steps 6 --stack \
    --min-ms 2 2>&1 | grep --line-buffered -v "Warn\|USDT\|TRTLLM\|cuda_graph_config" > "$OUT/first_steps.txt")
  grep "^| step\|^###" "$OUT/first_steps.txt" | head -40
  . bench/seed_command.sh
  seed_prepare
  FULL="K = DraftPause.keep_rows; DraftPause.keep_rows = lambda self, m: m if K(self, m) > 0 else 0"
  runs=()
  for r in "off1 /tmp/nomtp.yml" "mtp1 examples/mtp.yml" "full1 examples/mtp.yml" "off2 /tmp/nomtp.yml" \
           "mtp2 examples/mtp.yml"; do
    set -- $r
    [ $((END - SECONDS)) -lt 50 ] && break
    if [ "${1%?}" = full ]; then pre="$FULL"; else pre=""; fi
    seed_run "$1" "$2" "$pre" 50 --iteration_log "$OUT/it_$1.jsonl"
    runs+=("$1=$OUT/it_$1.jsonl")
  done
  python3 bench/iteration_steps.py "${runs[@]}" --first 6 > "$OUT/steps.txt" 2>&1
  tail -8 "$OUT/steps.txt"
elif [ "${1:-1}" = 3 ]; then  # the CUDA twins of the pause's paths (far from a probe, near one, warmup's)
  timeout 300 python3 -m pytest -q tests/test_engine_cuda.py -k "far_from_a_probe or kept_rows or warmup or pause" \
    2>&1 | tail -5
elif [ "${1:-1}" = 1 ]; then
  (cd bench && timeout 420 python3 first_steps_gpu.py --runs off-nowave off mtp mtp-full-keep --steps 6 --stack --min-ms 2 2>&1 \
    | grep -v "Warn\|USDT\|TRTLLM\|cuda_graph_config" | tee "$OUT/first_steps.txt")
else
  . bench/seed_command.sh
  seed_prepare
  FULL="K = DraftPause.keep_rows; DraftPause.keep_rows = lambda self, m: m if K(self, m) > 0 else 0"
  for i in 1 2; do
    seed_run "off$i" /tmp/nomtp.yml "" 90 --iteration_log "$OUT/it_off$i.jsonl"
    seed_run "mtp$i" examples/mtp.yml "" 60 --iteration_log "$OUT/it_mtp$i.jsonl"
    seed_run "full$i" examples/mtp.yml "$FULL" 60 --iteration_log "$OUT/it_full$i.jsonl"
  done
  python3 bench/iteration_steps.py off1="$OUT/it_off1.jsonl" mtp1="$OUT/it_mtp1.jsonl" full1="$OUT/it_full1.jsonl" \
    off2="$OUT/it_off2.jsonl" mtp2="$OUT/it_mtp2.jsonl" full2="$OUT/it_full2.jsonl" --first 8
fi
