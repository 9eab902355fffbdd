#!/usr/bin/env bash
# The seed's command with the drafting pause (written in the twenty-eighth session, not run): dsv4-bench, 64
# requests of 1024 in / 128 out at concurrency 32 on flash-L4-E32 (a 4-layer model: the MTP layer is a fifth of
# its layers, so even the keep-up pass weighs more than at Flash's depth), with the seed's mtp.yml byte for byte,
# then the same without speculative_config (1927 against 2758 tok/s in an earlier session, before the pause).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m dsv4.bench.cli --model flash-L4-E32 prepare-dataset --output /tmp/ds.jsonl token-norm-dist \
  --num-requests 64 --input-mean 1024 --output-mean 128 --input-stdev 0 --output-stdev 0 > /dev/null
grep -v "speculative_config\|decoding_type\|num_nextn" examples/mtp.yml > /tmp/nomtp.yml
for cfg in examples/mtp.yml /tmp/nomtp.yml; do
  echo "== seed's command, $cfg"
  timeout 200 python3 -m dsv4.bench.cli --model flash-L4-E32 --model_path flash-L4-E32 throughput \
    --tp 1 --ep 1 --dataset /tmp/ds.jsonl --max_batch_size 64 --max_num_tokens 8192 --concurrency 32 \
    --num_requests 64 --kv_cache_free_gpu_mem_fraction 0.8 --config $cfg --device cuda --no_progress \
    --report_json "$OUT/report_$(basename $cfg .yml).json" 2>&1 \
    | grep -i "output throughput\|acceptance rate\|drafting paused\|Request throughput" | head -6
done
