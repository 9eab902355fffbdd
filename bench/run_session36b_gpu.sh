#!/usr/bin/env bash
# Thirty-sixth session, the closing call on one GPU: this session's prefill changes against BASE (a checkout of the
# session's first head, e.g. `git archive fd60b0c dsv4 | tar -x -C .abbase`) in the same call: the changed kernels'
# CUDA tests, each small kernel alone at 8k tokens, TTFT at 1k / 8k, the 8k profile with the torch ops behind the
# kernels, the decode step (batch 32 now takes the batched wo_a GEMM), then the engine's CUDA tests.
set -u
export PYTHONUNBUFFERED=1
ROOT=$PWD
BASE=${BASE:-$ROOT/.abbase}
START=$SECONDS
END=$((SECONDS + ${BUDGET:-560}))
F="Warn|USDT|TRTLLM|cuda_graph_config|_warn_once"
left() { echo $((END - SECONDS)); }
PYTHONPATH=$ROOT timeout $(left) python3 -m pytest -q tests/test_kernel_bf16_gemv_cuda.py \
  "tests/test_kernels_cuda.py::test_indexer_kernels_match_twins" 2>&1 | tail -3
cd bench
for tree in "$BASE" "$ROOT"; do
  echo "== tree: $tree"
  PYTHONPATH=$tree timeout $(left) python3 prefill_small_kernels_gpu.py 2>&1 | grep -Ev "$F" | tail -12
  PYTHONPATH=$tree timeout $(left) python3 prefill.py --lens 1024 8192 --repeat 5 2>&1 | grep -Ev "$F" | tail -4
done
PYTHONPATH=$ROOT timeout $(left) python3 profile_prefill.py --lens 8192 --top 16 --ops 2>&1 | grep -Ev "$F" | tail -48
PYTHONPATH=$ROOT timeout $(left) python3 decode_floor.py --batch 1 32 2>&1 | grep -Ev "$F" | tail -4
cd "$ROOT"
PYTHONPATH=$ROOT timeout $(left) python3 -m pytest -q -x tests/test_engine_cuda.py tests/test_batch_invariant.py 2>&1 | tail -3
echo "total: $((SECONDS - START)) s"
