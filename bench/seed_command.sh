# Sourced by the session scripts that run the seed's command: dsv4-bench on flash-L4-E32, 64 requests of 1024
# in / 128 out at concurrency 32, with a config file (the seed's examples/mtp.yml, or a variant of it).
# seed_prepare: the dataset, /tmp/nomtp.yml (the seed's file without speculative_config) and /tmp/before.yml (the
# seed's file with a probe every 32 paused steps, as before the thirty-first session).
# seed_run LABEL CONFIG PRELUDE TIMEOUT [ARGS...]: one run, its report in $OUT/report_LABEL.json (ARGS go to
# dsv4-bench, e.g. --iteration_log PATH); PRELUDE is Python run in
# the process first (switches of an A/B); the first run on a fresh machine compiles the Triton kernels (~2 min).
seed_prepare() {
  python3 -m dsv4.bench.cli --model flash-L4-E32 prepare-dataset --output /tmp/ds.jsonl token-norm-dist \
    --num-requests 64 --input-mean 1024 --output-mean 128 --input-stdev 0 --output-stdev 0 > /dev/null
  grep -v "speculative_config\|decoding_type\|num_nextn" examples/mtp.yml > /tmp/nomtp.yml
  cp examples/mtp.yml /tmp/before.yml && echo "  pause_max_probe_interval: 32" >> /tmp/before.yml
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
    --tp 1 --ep 1 --dataset /tmp/ds.jsonl --max_batch_size 64 --max_num_tokens 8192 --concurrency 32 \
    --num_requests 64 --kv_cache_free_gpu_mem_fraction 0.8 --config "$2" --device cuda --no_progress \
    --report_json "$OUT/report_$1.json" "${@:5}" 2>&1 \
    | grep -i "output throughput\|drafting paused\|CUDA graphs\|Kernels compiled\|Error\|Traceback" | head -6
}
