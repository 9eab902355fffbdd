#!/usr/bin/env bash
# Thirty-sixth session, one call on one GPU: the prefill's small kernels (q's norm + rope and the output's inverse
# rope loaded contiguously, the output's rope in place, the router's tensor-core logits, the indexer's scores in
# runs of blocks) against the code before them, BASE (a checkout of the previous head, e.g. `git archive fd60b0c
# dsv4 | tar -x -C .abbase`), in the same call: their CUDA tests, each kernel alone at 8k tokens, TTFT at 1k / 8k,
# the 8k profile; then the decode step, which runs the same norm + rope kernel.
set -u
export PYTHONUNBUFFERED=1
ROOT=$PWD
BASE=${BASE:-$ROOT/.abbase}
START=$SECONDS
END=$((SECONDS + ${BUDGET:-560}))
F="Warn|USDT|TRTLLM|cuda_graph_config|_warn_once"
left() { echo $((END - SECONDS)); }
PYTHONPATH=$ROOT timeout $(left) python3 -m pytest -q -x tests/test_kernels_cuda.py -k "gate or rope or indexer or norm or mhc" \
  2>&1 | tail -5
cd bench
for tree in "$BASE" "$ROOT"; do
  echo "== tree: $tree"
  PYTHONPATH=$tree timeout $(left) python3 prefill_small_kernels_gpu.py 2>&1 | grep -Ev "$F" | tail -14
  PYTHONPATH=$tree timeout $(left) python3 prefill.py --lens 1024 8192 --repeat 5 2>&1 | grep -Ev "$F" | tail -5
done
PYTHONPATH=$ROOT timeout $(left) python3 profile_prefill.py --lens 8192 --top 24 --ops 2>&1 | grep -Ev "$F" | tail -64
for tree in "$ROOT" "$BASE"; do
  [ $(left) -gt 90 ] && PYTHONPATH=$tree timeout $(left) python3 decode_floor.py --batch 1 32 2>&1 | grep -Ev "$F" | tail -6
done
echo "total: $((SECONDS - START)) s"
