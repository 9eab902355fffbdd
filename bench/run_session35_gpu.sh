#!/usr/bin/env bash
# Thirty-fifth session, one call on 2 GPUs (nvidia-h100-x2): MTP drafting paused on several ranks.
# Part 1: run_multirank_gpu.sh's cells (default: tp2+ep2 and tp2, MTP 2, CUDA graphs, 64 tokens a request; fp32
#   tiny against one process; random weights, so drafting pauses after a few steps and probes once).
# Part 2: the seed's command at --tp 2 --ep 2 (seed_command.sh, SEED_TP=2): MTP off / the seed's MTP (paused) /
#   MTP never paused (pause_below_acceptance 0: the multi-rank engine before this session), while BUDGET allows.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
START=$SECONDS
END=$((SECONDS + ${BUDGET:-560}))
python3 -c "import torch; print('GPUs:', torch.cuda.device_count(), torch.cuda.get_device_name(0))"
if [ -n "${CELLS-tp2+ep2 2 on,tp2 2 on}" ]; then
  IFS=, read -ra cells <<< "${CELLS-tp2+ep2 2 on,tp2 2 on}"
  CELL_ARGS="--max-tokens 64" bash bench/run_multirank_gpu.sh "${cells[@]}"
  echo "part 1: $((SECONDS - START)) s"
fi
. bench/seed_command.sh
seed_prepare
SEED_TP=2 seed_runs $END 200 ${SEED:-off1 mtp1 nopause1 off2 mtp2 nopause2}
echo "total: $((SECONDS - START)) s"
