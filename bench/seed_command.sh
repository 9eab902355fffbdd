# Sourced by the session scripts that run the seed's command: dsv4-bench on flash-L4-E32, 64 requests of 1024
# in / 128 out at concurrency 32, with a config file (the seed's examples/mtp.yml, or a variant of it).
# seed_prepare: the dataset, /tmp/nomtp.yml (the seed's file without speculative_config), /tmp/before.yml (the
# seed's file with a probe every 32 paused steps, as before the thirty-first session) and /tmp/nopause.yml (the
# seed's file with drafting never paused: pause_below_acceptance 0).
# seed_run LABEL CONFIG PRELUDE TIMEOUT [ARGS...]: one run, its report in $OUT/report_LABEL.json (ARGS go to
# dsv4-bench, e.g. --iteration_log PATH); PRELUDE is Python run in
# the process first (switches of an A/B); the first run on a fresh machine compiles the Triton kernels (~2 min).
# SEED_TP=N: --tp N --ep N (N GPUs; the seed itself ran 4).
seed_prepare() {
  python3 -m dsv4.bench.cli --model flash-L4-E32 prepare-dataset --output /tmp/ds.jsonl token-norm-dist \
    --num-requests 64 --input-mean 1024 --output-mean 128 --input-stdev 0 --output-stdev 0 > /dev/null
  grep -v "speculative_config\|decoding_type\|num_nextn" examples/mtp.yml > /tmp/nomtp.yml
  cp examples/mtp.yml /tmp/before.yml && echo "  pause_max_probe_interval: 32" >> /tmp/before.yml
  cp examples/mtp.yml /tmp/nopause.yml && echo "  pause_below_acceptance: 0" >> /tmp/nopause.yml
}

seed_run() {
  echo "== $1"
  timeout "$4" python3 -c "
import sys
from dsv4.engine.graphs import GraphRunner
from dsv4.engine.spec_pause import DraftPause
$3
from dsv4.bench.cli import main
sys.argv = ['dsv4-bench'] + sys.argv[1:]
main()" --model flash-L4-E32 --model_path flash-L4-E32 throughput \
    --tp "${SEED_TP:-1}" --ep "${SEED_TP:-1}" --dataset /tmp/ds.jsonl --max_batch_size 64 --max_num_tokens 8192 --concurrency 32 \
    --num_requests 64 --kv_cache_free_gpu_mem_fraction 0.8 --config "$2" --device cuda --no_progress \
    --report_json "$OUT/report_$1.json" "${@:5}" 2>&1 \
    | grep -i "output throughput\|drafting paused\|CUDA graphs\|Kernels compiled\|Error\|Traceback" | head -6
}

# seed_runs END TIMEOUT LABEL...: seed_run for each label (off*: without speculative_config, nopause*: never
# paused, else the seed's mtp.yml) with its iteration log, while 30 s or more are left before END (a $SECONDS value); then the table of
# their steps (bench/iteration_steps.py).
seed_runs() {
  local end=$1 limit=$2 r cfg
  shift 2
  local runs=()
  for r in "$@"; do
    case $r in off*) cfg=/tmp/nomtp.yml ;; nopause*) cfg=/tmp/nopause.yml ;; *) cfg=examples/mtp.yml ;; esac
    [ $((end - SECONDS)) -lt 30 ] && break
    seed_run "$r" "$cfg" "" "$limit" --iteration_log "$OUT/it_$r.jsonl"
    runs+=("$r=$OUT/it_$r.jsonl")
  done
  [ ${#runs[@]} -gt 0 ] && python3 bench/iteration_steps.py "${runs[@]}" --first 6 2>&1 | tail -9
}
