#!/usr/bin/env bash
# Thirty-eighth session, one call on one GPU: the changed kernels' CUDA tests (mHC, sparse attention); mHC's
# collapse alone at 8k with the prefill's partials summed MIX_LOOP chunks a program, against the batch-invariant
# layout and against BASE (a checkout of earlier code: `git archive HEAD dsv4 | tar -x -C .abbase`); the prefill
# attention's SKIP per source at 8k and 1k tokens; TTFT at 1k / 8k on both trees; the 8k prefill's kernel kinds,
# device timeline and host functions (profile_prefill.py --gaps --host); the engine's CUDA tests.
set -u
export PYTHONUNBUFFERED=1
ROOT=$PWD
BASE=${BASE:-$ROOT/.abbase}
START=$SECONDS
END=$((SECONDS + ${BUDGET:-560}))
F="Warn|USDT|TRTLLM|cuda_graph_config|_warn_once"
left() { echo $((END - SECONDS)); }
PYTHONPATH=$ROOT timeout $(left) python3 -m pytest -q -x tests/test_kernels_cuda.py -k "mhc" \
  tests/test_kernel_sparse_attention_cuda.py 2>&1 | tail -3
cd bench
for tree in "$BASE" "$ROOT"; do
  PYTHONPATH=$tree timeout $(left) python3 prefill_small_kernels_gpu.py 2>&1 | grep -Ev "$F" | grep -i "mhc\|kernel"
done
PYTHONPATH=$ROOT timeout $(left) python3 prefill_attention_gpu.py --tokens 8192 1024 --tiles --skip 0 2 3 2>&1 \
  | grep -Ev "$F" | tail -22
for tree in "$BASE" "$ROOT"; do
  echo "== tree: $tree"
  PYTHONPATH=$tree timeout $(left) python3 prefill.py --lens 1024 8192 --repeat 5 2>&1 | grep -Ev "$F" | tail -4
done
PYTHONPATH=$ROOT timeout $(left) python3 profile_prefill.py --lens 8192 --top 14 --gaps --host 2>&1 | grep -Ev "$F" | tail -110
cd "$ROOT"
[ $(left) -gt 60 ] && PYTHONPATH=$ROOT timeout $(left) python3 -m pytest -q -x tests/test_engine_cuda.py \
  tests/test_batch_invariant.py 2>&1 | tail -3
echo "total: $((SECONDS - START)) s"
