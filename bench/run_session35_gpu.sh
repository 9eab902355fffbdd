#!/usr/bin/env bash
# Thirty-fifth session, calls on 2 GPUs (nvidia-h100-x2): MTP drafting paused on several ranks, whole-step graphs
# on ranks that share one plan.
# Part 1 (CELLS, comma-separated; "" skips it): run_multirank_gpu.sh's cells, by default tp2+ep2 and attention DP
#   2 + ep2, MTP 2, CUDA graphs, 64 tokens a request: fp32 tiny against one process; random weights, so drafting
#   pauses after a few steps and probes once (the row's pause line says so).
# Part 2 (MATRIX; "" skips it): the seed's matrix through run_matrix_gpu.sh at --tp 2 --ep 2 (64 x 1024/128,
#   concurrency 32, the seed's mtp.yml with its FP8 cache): MTP:attention-DP cells, MTP off / on (paused) /
#   nopause (pause_below_acceptance 0: the multi-rank engine before this session), by default without attention DP.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
START=$SECONDS
python3 -c "import torch; print('GPUs:', torch.cuda.device_count(), torch.cuda.get_device_name(0))"
CELLS=${CELLS-tp2+ep2 2 on,adp2+ep2 2 on}
if [ -n "$CELLS" ]; then
  IFS=, read -ra cells <<< "$CELLS"
  CELL_ARGS="--max-tokens 64" bash bench/run_multirank_gpu.sh "${cells[@]}"
  echo "part 1: $((SECONDS - START)) s"
fi
MATRIX=${MATRIX-off:off on:off nopause:off}
if [ -n "$MATRIX" ]; then
  RANKS=2 N=64 CELL_TIMEOUT=${CELL_TIMEOUT:-150} CELLS="$MATRIX" bash bench/run_matrix_gpu.sh
fi
echo "total: $((SECONDS - START)) s"
