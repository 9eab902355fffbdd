#!/usr/bin/env bash
# Thirty-sixth session, one call on one GPU: this session's prefill changes against BASE (a checkout of earlier code,
# e.g. `git archive fd60b0c dsv4 | tar -x -C .abbase`) in the same call: the changed kernels' CUDA tests, each small
# kernel alone at 8k tokens, TTFT at 1k / 8k (both trees), the 8k profile with the torch ops behind the kernels, the
# decode step. CALL=ab (calls 4 and 5): the kernel tests of the router, rope, norm, indexer and mHC, then the decode
# step on both trees. CALL=closing (the default, call 6): the bf16 GEMV and indexer tests, the decode step on this
# tree (batch 32 takes the batched wo_a GEMM), then the engine's CUDA tests.
set -u
export PYTHONUNBUFFERED=1
ROOT=$PWD
BASE=${BASE:-$ROOT/.abbase}
CALL=${CALL:-closing}
START=$SECONDS
END=$((SECONDS + ${BUDGET:-560}))
F="Warn|USDT|TRTLLM|cuda_graph_config|_warn_once"
left() { echo $((END - SECONDS)); }
if [ "$CALL" = ab ]; then
  PYTHONPATH=$ROOT timeout $(left) python3 -m pytest -q -x tests/test_kernels_cuda.py \
    -k "gate or rope or indexer or norm or mhc" 2>&1 | tail -5
else
  PYTHONPATH=$ROOT timeout $(left) python3 -m pytest -q tests/test_kernel_bf16_gemv_cuda.py \
    "tests/test_kernels_cuda.py::test_indexer_kernels_match_twins" 2>&1 | tail -3
fi
cd bench
for tree in "$BASE" "$ROOT"; do
  echo "== tree: $tree"
  PYTHONPATH=$tree timeout $(left) python3 prefill_small_kernels_gpu.py 2>&1 | grep -Ev "$F" | tail -12
  PYTHONPATH=$tree timeout $(left) python3 prefill.py --lens 1024 8192 --repeat 5 2>&1 | grep -Ev "$F" | tail -4
done
PYTHONPATH=$ROOT timeout $(left) python3 profile_prefill.py --lens 8192 --top 24 --ops 2>&1 | grep -Ev "$F" | tail -56
TREES=$ROOT
[ "$CALL" = ab ] && TREES="$ROOT $BASE"
for tree in $TREES; do
  [ $(left) -gt 90 ] && PYTHONPATH=$tree timeout $(left) python3 decode_floor.py --batch 1 32 2>&1 | grep -Ev "$F" | tail -4
done
cd "$ROOT"
[ "$CALL" = ab ] || PYTHONPATH=$ROOT timeout $(left) python3 -m pytest -q -x tests/test_engine_cuda.py \
  tests/test_batch_invariant.py 2>&1 | tail -3
echo "total: $((SECONDS - START)) s"
