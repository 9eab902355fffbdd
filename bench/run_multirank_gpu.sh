#!/usr/bin/env bash
# Multi-rank cells on 2 GPUs against one process on the same weights (bench/multirank_gpu.py), CUDA graphs
# across ranks included. A cell that runs past CELL_TIMEOUT stops the loop (every rank has printed its
# Python stacks by then: DSV4_DUMP_STACKS_S).
#   bash bench/run_multirank_gpu.sh "tp2+ep2 0 off" "tp2+ep2 2 on" "tp2+ep2 0 on off" ...
#   (mode, draft length, graphs[, overlap: default on]); CELL_ARGS: more multirank_gpu.py flags for every cell
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export DSV4_DUMP_STACKS_S=${DSV4_DUMP_STACKS_S:-75} DSV4_DIST_TIMEOUT_S=${DSV4_DIST_TIMEOUT_S:-90}
CELL_TIMEOUT=${CELL_TIMEOUT:-110}
echo "| mapping | MTP k | graphs | overlapped | graph replays | requests | identical to 1 process | first divergence | time |"
echo "|---|---|---|---|---|---|---|---|---|"
for cell in "$@"; do
  set -- $cell
  timeout -k 5 $CELL_TIMEOUT python3 bench/multirank_gpu.py --model ${M:-tiny} --dtype ${DTYPE:-fp32} \
    --mode $1 --mtp $2 --graphs $3 --overlap ${4:-on} ${CELL_ARGS:-} > /tmp/cell.log 2>&1
  rc=$?
  grep "^|\|^pause:" /tmp/cell.log || { echo "cell '$cell' rc=$rc:"; grep -v Warning /tmp/cell.log | tail -${TAIL:-120}; }
  [ $rc = 124 ] && { echo "cell '$cell' timed out after $CELL_TIMEOUT s; stopping"; break; }
done
if [ -n "${FAIL_AT:-}" ]; then  # e.g. FAIL_AT=1:forward:30 -> rank 1 raises in its 30th forward (graphs on)
  echo "== failure injection DSV4_INJECT_FAILURE=$FAIL_AT, tp2+ep2, MTP 2, graphs on"
  start=$(date +%s)
  DSV4_INJECT_FAILURE=$FAIL_AT timeout -k 5 $CELL_TIMEOUT python3 bench/multirank_gpu.py --model ${M:-tiny} \
    --dtype ${DTYPE:-fp32} --mode tp2+ep2 --mtp 2 --graphs on > /tmp/fail.log 2>&1
  rc=$?
  echo "rc=$rc after $(( $(date +%s) - start )) s (the single-process reference run included); last lines:"
  grep -v Warning /tmp/fail.log | grep -E "RankError|rank 1|Timeout|injected|File" | tail -${TAIL:-25}
  sleep 2; echo "python processes left: $(pgrep -c -f dsv4.parallel.worker || true)"
fi
