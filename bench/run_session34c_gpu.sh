#!/usr/bin/env bash
# Thirty-fourth session, a short last call (little device time left): run_session34b_gpu.sh's parts, most
# wanted first: the seed's command MTP / off alternating with the MTP inputs built from list slices, then the
# first steps of MTP profiled with lazy and with eager module loading, while BUDGET (default 230 s) allows.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
START=$SECONDS
END=$((SECONDS + ${BUDGET:-230}))
. bench/seed_command.sh
seed_prepare
seed_runs $END 120 ${SEED:-mtp1 off1 mtp2 off2}
for mode in LAZY EAGER; do
  [ $((END - SECONDS)) -lt 45 ] && break
  (cd bench && CUDA_MODULE_LOADING=$mode timeout $((END - SECONDS)) python3 first_steps_gpu.py --runs mtp --steps 6 \
    --stack --min-ms 2 2>&1 | grep --line-buffered -v "Warn\|USDT\|TRTLLM\|cuda_graph_config" > "$OUT/first_$mode.txt")
  grep "^###\|^| step\|^- step\|^Triton" "$OUT/first_$mode.txt" | cut -c1-330
done
echo "total: $((SECONDS - START)) s"
