#!/usr/bin/env bash
# The seed's trtllm-bench command through dsv4-bench on one GPU, with the seed's mtp.yml byte for byte
# (fp8 KV: the plain-torch attention path) and a bf16-KV variant (Triton kernels + CUDA graphs), MTP on
# and off, on a reduced-depth Flash model with random weights. 1k-in / 1k-out shaped, scaled to fit.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
M=${M:-flash-L4-E32}; N=${N:-64}; ISL=${ISL:-1024}; OSL=${OSL:-256}
bench() { python3 -m dsv4.bench.cli "$@"; }
bench --model $M prepare-dataset --output /tmp/ds.jsonl token-norm-dist --num-requests $N \
  --input-mean $ISL --output-mean $OSL --input-stdev 0 --output-stdev 0
grep -v "speculative_config\|decoding_type\|num_nextn" examples/mtp.yml > /tmp/nomtp.yml
sed 's/dtype: fp8/dtype: auto/' examples/mtp.yml > /tmp/mtp_bf16.yml
sed 's/dtype: fp8/dtype: auto/' /tmp/nomtp.yml > /tmp/nomtp_bf16.yml
for cfg in examples/mtp.yml /tmp/nomtp.yml /tmp/mtp_bf16.yml /tmp/nomtp_bf16.yml; do
  name=$(basename $cfg .yml)
  echo "== $cfg"
  timeout 240 python3 -m dsv4.bench.cli --model $M --model_path $M throughput \
    --tp 1 --ep 1 --dataset /tmp/ds.jsonl \
    --max_batch_size 64 --max_num_tokens 8192 \
    --concurrency 32 --num_requests $N \
    --kv_cache_free_gpu_mem_fraction 0.8 --config $cfg --device cuda --no_progress \
    --report_json "$OUT/report_$name.json" 2>&1 | grep -v Warning | tail -45
done
