#!/usr/bin/env bash
# For the next device call (written in the twenty-eighth session): the engine's drafting pause
# (engine/spec_pause.py: drafting paused while fewer than 0.3 of the last 32 drafts are accepted, steps of one
# row with the MTP layer's keep-up pass, a probe every 32 paused steps). Its CUDA test (the keep-up runner's
# graphs captured beside the verify buckets); then MTP on vs off on the preset, flash-L43-E16 (Flash's
# full depth, 16 experts, bf16), at concurrency 1 and 32, k = 1, zero acceptance, each MTP row with the pause and without; and the
# seed's command (dsv4-bench, 64 x 1024/128, concurrency 32, the seed's mtp.yml and the same without
# speculative_config) on flash-L4-E32.
set -u
TESTS="tests/test_engine_cuda.py::test_paused_drafting_on_captured_graphs_equals_dense_reference" \
  TEST_TIMEOUT=${TEST_TIMEOUT:-100} \
  TEST_TAIL=8 BENCH_TIMEOUT=${BENCH_TIMEOUT:-260} BENCH_TAIL=30 bash bench/device_call.sh \
  "mtp_speedup.py --preset flash-L43-E16 --concurrency 1 32 --ks 0 1 --p-right --repeat 3 --no-gap --gen 96 --pause on off"
OUT=${OUT:-/tmp/out}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python3 -m dsv4.bench.cli --model flash-L4-E32 prepare-dataset --output /tmp/ds.jsonl token-norm-dist \
  --num-requests 64 --input-mean 1024 --output-mean 128 --input-stdev 0 --output-stdev 0 > /dev/null
grep -v "speculative_config\|decoding_type\|num_nextn" examples/mtp.yml > /tmp/nomtp.yml
for cfg in examples/mtp.yml /tmp/nomtp.yml; do
  echo "== seed's command, $cfg"
  timeout 90 python3 -m dsv4.bench.cli --model flash-L4-E32 --model_path flash-L4-E32 throughput \
    --tp 1 --ep 1 --dataset /tmp/ds.jsonl --max_batch_size 64 --max_num_tokens 8192 --concurrency 32 \
    --num_requests 64 --kv_cache_free_gpu_mem_fraction 0.8 --config $cfg --device cuda --no_progress \
    --report_json "$OUT/report_$(basename $cfg .yml).json" 2>&1 \
    | grep -i "output throughput\|acceptance rate\|drafting paused\|total wall\|Request throughput" | head -6
done
