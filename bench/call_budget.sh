# Sourced by the one-GPU session scripts (bench/run_session*_gpu.sh) from the repository root: unbuffered Python,
# ROOT (this tree), BASE (a checkout of earlier code for A/B runs, default .abbase: `git archive <rev> dsv4 | tar -x
# -C .abbase`), F (log lines to drop), and left(): the seconds left of BUDGET (default 560) since sourcing, each
# step's timeout, so a call ends inside the device's limit with its output.
set -u
export PYTHONUNBUFFERED=1
ROOT=$PWD
BASE=${BASE:-$ROOT/.abbase}
START=$SECONDS
END=$((SECONDS + ${BUDGET:-560}))
F="Warn|USDT|TRTLLM|cuda_graph_config|_warn_once"
left() { echo $((END - SECONDS)); }
