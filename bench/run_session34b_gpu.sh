#!/usr/bin/env bash
# Thirty-fourth session, second call: after run_session34_gpu.sh found the prompt steps' host time in
# device_draft_inputs (a Python loop over every row, 19-27 ms a step of 8192 tokens; now list slices) and host
# holds inside aten::mm at a GEMM size's first use (202 ms in MTP off's first mixed step without warmup's
# first-wave path, 93-95 ms in MTP's fifth step): the compile watch's CUDA test; the first steps profiled with
# CUDA's lazy module loading (torch's default) and with CUDA_MODULE_LOADING=EAGER (is the hold a kernel module
# loaded at first use?); then the seed's command, MTP / off alternating, while BUDGET (default 450 s) allows.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
START=$SECONDS
END=$((SECONDS + ${BUDGET:-450}))
timeout 120 python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_compiles.py 2>&1 | tail -2
first() {  # first_steps_gpu.py: $1 the loading mode, then the runs
  local mode=$1; shift
  (cd bench && CUDA_MODULE_LOADING=$mode timeout 200 python3 first_steps_gpu.py --runs "$@" --steps 6 --stack \
    --min-ms 2 2>&1 | grep --line-buffered -v "Warn\|USDT\|TRTLLM\|cuda_graph_config" > "$OUT/first_$mode.txt")
  grep "^###\|^| step\|^- step\|^Triton" "$OUT/first_$mode.txt" | cut -c1-330
  echo "($((SECONDS - START)) s)"
}
first LAZY mtp
first EAGER ${EAGER_RUNS:-off-nowave mtp}
. bench/seed_command.sh
seed_prepare
seed_runs $END 50 ${SEED:-mtp1 off1 mtp2 off2 mtp3 off3}
echo "total: $((SECONDS - START)) s"
