#!/usr/bin/env bash
# For the next session's first two device calls (written in the thirty-first, not run): `bash
# bench/run_session32_gpu.sh 1`, then `... 2` on the warm machine (each fits one call's 600 s).
# 1. The seed's command (dsv4-bench, 64 x 1024/128 at concurrency 32 on flash-L4-E32, the seed's mtp.yml, and the
#    same without speculative_config): MTP as committed (paused steps far from a probe skip the keep-up pass, no
#    acceptance kernels in a paused step's graph, probes backing off) against MTP as the thirtieth session left it
#    ("before": keep-up at every paused step, the acceptance kernels, a probe every 32 paused steps), alternating
#    with off. The first run compiles the Triton kernels on a fresh machine: 240 s for it.
# 2. The engine's CUDA tests (this session's bare keep-up graph and its twin included), then seed_steps_gpu.py
#    by kind of step (MTP against MTP keeping up at every paused step) and the paused step's kernel diff.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ "${1:-1}" = 1 ]; then
python3 -m dsv4.bench.cli --model flash-L4-E32 prepare-dataset --output /tmp/ds.jsonl token-norm-dist \
  --num-requests 64 --input-mean 1024 --output-mean 128 --input-stdev 0 --output-stdev 0 > /dev/null
grep -v "speculative_config\|decoding_type\|num_nextn" examples/mtp.yml > /tmp/nomtp.yml
cp examples/mtp.yml /tmp/before.yml && echo "  pause_max_probe_interval: 32" >> /tmp/before.yml
run() {  # $1: label, $2: config, $3: python run before the bench (the "before" switches), $4: timeout
  echo "== $1"
  timeout $4 python3 -c "
import sys
from dsv4.engine.graphs import GraphRunner
from dsv4.engine.spec_pause import DraftPause
$3
from dsv4.bench.cli import main
sys.argv = ['dsv4-bench'] + sys.argv[1:]
main()" --model flash-L4-E32 --model_path flash-L4-E32 throughput \
    --tp 1 --ep 1 --dataset /tmp/ds.jsonl --max_batch_size 64 --max_num_tokens 8192 --concurrency 32 \
    --num_requests 64 --kv_cache_free_gpu_mem_fraction 0.8 --config $2 --device cuda --no_progress \
    --report_json "$OUT/report_$1.json" 2>&1 \
    | grep -i "output throughput\|drafting paused\|CUDA graphs\|Error\|Traceback" | head -5
}
BEFORE="GraphRunner.slim_keep_step = False; DraftPause.keeps_up = lambda self, margin: True"
run off1 /tmp/nomtp.yml "" 240
run mtp1 examples/mtp.yml "" 100
run before1 /tmp/before.yml "$BEFORE" 100
run off2 /tmp/nomtp.yml "" 100
run mtp2 examples/mtp.yml "" 100
run before2 /tmp/before.yml "$BEFORE" 100
else
timeout 250 python3 -m pytest -q -p no:cacheprovider -m cuda --tb=short tests/test_engine_cuda.py 2>&1 \
  | grep -v "CUDA warning" | tail -8
cd bench
timeout 200 python3 seed_steps_gpu.py --runs off mtp mtp-keep-every-step off mtp mtp-keep-every-step \
  --append "$OUT/BENCHMARKS.part.md" 2>&1 | grep -v Warn | tail -9
timeout 110 python3 mtp_step_gpu.py --preset flash-L4-E32 --concurrency 32 --ks 0 1 --prompt-len 768 --gen 128 \
  --top 3 --diff 25 --no-probes --append "$OUT/BENCHMARKS.part.md" 2>&1 | grep -v Warn | tail -34
fi
