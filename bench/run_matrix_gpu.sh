#!/usr/bin/env bash
# The seed's bisect matrix (MTP on/off x attention DP on/off) through dsv4-bench on several GPUs with NCCL:
#   RANKS=2 bash bench/run_matrix_gpu.sh      (--tp RANKS --ep RANKS; the seed used 4)
#   OVERLAP=off ...                            (disable_overlap_scheduler: true in every cell, for the ratio)
# NVLink multicast stays off (the device machines require it; NCCL_NVLS_ENABLE=0 is set there already).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
M=${M:-flash-L4-E32}; N=${N:-64}; ISL=${ISL:-1024}; OSL=${OSL:-128}; RANKS=${RANKS:-2}; KV=${KV:-fp8}
python3 -c "import torch; print('GPUs:', torch.cuda.device_count())"
python3 -m dsv4.bench.cli --model $M prepare-dataset --output /tmp/ds.jsonl token-norm-dist --num-requests $N \
  --input-mean $ISL --output-mean $OSL --input-stdev 0 --output-stdev 0
sed "s/dtype: fp8/dtype: $KV/" examples/mtp.yml > /tmp/mtp_on.yml
grep -v "speculative_config\|decoding_type\|num_nextn" /tmp/mtp_on.yml > /tmp/mtp_off.yml
cp /tmp/mtp_on.yml /tmp/mtp_nopause.yml && echo "  pause_below_acceptance: 0" >> /tmp/mtp_nopause.yml
for cell in ${CELLS:-on:off on:on off:off off:on}; do  # MTP:attention-DP (MTP: on, off, or nopause: never paused)
  mtp=${cell%:*} adp=${cell#*:}
  cfg=/tmp/cell_mtp${mtp}_adp${adp}.yml
  cp /tmp/mtp_$mtp.yml $cfg
  [ $adp = on ] && echo "enable_attention_dp: true" >> $cfg
  [ "${OVERLAP:-on}" = off ] && echo "disable_overlap_scheduler: true" >> $cfg
  echo "== MTP $mtp, attention DP $adp ($cfg)"
  timeout ${CELL_TIMEOUT:-280} python3 -m dsv4.bench.cli --model $M --model_path $M throughput \
      --tp $RANKS --ep $RANKS --dataset /tmp/ds.jsonl \
      --max_batch_size 64 --max_num_tokens 8192 \
      --concurrency 32 --num_requests $N \
      --kv_cache_free_gpu_mem_fraction 0.8 --config $cfg --device cuda --no_progress \
      --report_json "$OUT/matrix_mtp${mtp}_adp${adp}.json" 2>&1 | grep -v Warning \
      | grep -E "Requests \(|CUDA graphs|Overlap|output throughput|Per GPU|acceptance|Drafting paused|Parallel|Error|error|refuse|failed|Traceback|rank" | head -20
  echo "rc=${PIPESTATUS[0]}"
done
