#!/usr/bin/env bash
# The seed's command (as run_session28e_gpu.sh: dsv4-bench, 64 x 1024/128 at concurrency 32 on flash-L4-E32,
# the seed's mtp.yml, then the same without speculative_config), plus MTP with its catch-up pass over every row
# of a prefill chunk (ModelRunner.mtp_tail_rows = False, the behaviour before engine/mtp_rows.py) for the ratio.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m dsv4.bench.cli --model flash-L4-E32 prepare-dataset --output /tmp/ds.jsonl token-norm-dist \
  --num-requests 64 --input-mean 1024 --output-mean 128 --input-stdev 0 --output-stdev 0 > /dev/null
grep -v "speculative_config\|decoding_type\|num_nextn" examples/mtp.yml > /tmp/nomtp.yml
run() {  # $1: label, $2: config, $3: mtp_tail_rows
  echo "== $1"
  timeout ${SEED_TIMEOUT:-180} python3 -c "
import sys
from dsv4.engine.runner import ModelRunner
ModelRunner.mtp_tail_rows = $3
from dsv4.bench.cli import main
sys.argv = ['dsv4-bench'] + sys.argv[1:]
main()" --model flash-L4-E32 --model_path flash-L4-E32 throughput \
    --tp 1 --ep 1 --dataset /tmp/ds.jsonl --max_batch_size 64 --max_num_tokens 8192 --concurrency 32 \
    --num_requests 64 --kv_cache_free_gpu_mem_fraction 0.8 --config $2 --device cuda --no_progress \
    --report_json "$OUT/report_$1.json" 2>&1 \
    | grep -i "output throughput\|acceptance rate\|drafting paused\|Request throughput\|Error\|Traceback" | head -6
}
run off /tmp/nomtp.yml True
run mtp_tail examples/mtp.yml True
run mtp_all_rows examples/mtp.yml False
run off_again /tmp/nomtp.yml True
