#!/usr/bin/env bash
# Thirty-first session, the one call left: the seed's command (dsv4-bench, 64 x 1024/128 at concurrency 32 on
# flash-L4-E32, the seed's mtp.yml, and the same without speculative_config) with this session's paused steps
# (no acceptance kernels in a keep-up step's graph; probes backing off) against the previous behaviour
# ("before": GraphRunner.slim_keep_step off, pause_max_probe_interval 32), alternating with off; between them
# mtp_step_gpu.py --diff (every kernel a paused step runs beyond MTP off's). In order of need: what does not
# fit the call's time is cut from the end. The first run compiles the Triton kernels on a fresh machine: in the
# thirty-first session 100 s killed it (MTP off's first report lost); it has 240 s now.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m dsv4.bench.cli --model flash-L4-E32 prepare-dataset --output /tmp/ds.jsonl token-norm-dist \
  --num-requests 64 --input-mean 1024 --output-mean 128 --input-stdev 0 --output-stdev 0 > /dev/null
grep -v "speculative_config\|decoding_type\|num_nextn" examples/mtp.yml > /tmp/nomtp.yml
cp examples/mtp.yml /tmp/before.yml && echo "  pause_max_probe_interval: 32" >> /tmp/before.yml
run() {  # $1: label, $2: config, $3: slim_keep_step
  echo "== $1"
  timeout ${RUN_TIMEOUT:-100} python3 -c "
import sys
from dsv4.engine.graphs import GraphRunner
GraphRunner.slim_keep_step = $3
from dsv4.bench.cli import main
sys.argv = ['dsv4-bench'] + sys.argv[1:]
main()" --model flash-L4-E32 --model_path flash-L4-E32 throughput \
    --tp 1 --ep 1 --dataset /tmp/ds.jsonl --max_batch_size 64 --max_num_tokens 8192 --concurrency 32 \
    --num_requests 64 --kv_cache_free_gpu_mem_fraction 0.8 --config $2 --device cuda --no_progress \
    --report_json "$OUT/report_$1.json" 2>&1 \
    | grep -i "output throughput\|drafting paused\|Error\|Traceback" | head -4
}
RUN_TIMEOUT=240 run off1 /tmp/nomtp.yml True
run mtp1 examples/mtp.yml True
run off2 /tmp/nomtp.yml True
run mtp2 examples/mtp.yml True
cd bench
timeout 110 python3 mtp_step_gpu.py --preset flash-L4-E32 --concurrency 32 --ks 0 1 --prompt-len 768 --gen 128 \
  --top 3 --diff 30 --no-probes --append "$OUT/BENCHMARKS.part.md" 2>&1 | grep -v Warn | tail -40
cd ..
run before1 /tmp/before.yml False
run off3 /tmp/nomtp.yml True
run before2 /tmp/before.yml False
