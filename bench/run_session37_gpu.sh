#!/usr/bin/env bash
# Thirty-seventh session, one call on one GPU: the changed kernels' CUDA tests; the indexer's scores alone at 8k
# (a token at a time against tiles of tokens x entries) on BASE (a checkout of earlier code, e.g.
# `git archive HEAD dsv4 | tar -x -C .abbase`) and on this tree; the prefill attention's loop forms (UNIFIED / SKIP
# in dsv4.kernels.sparse_attention) and tiles at 8k tokens, with a hot-rows diagnosis; TTFT at 1k / 8k on both
# trees; the 8k prefill's device timeline (profile_prefill.py --gaps); the decode step; the engine's CUDA tests.
source bench/call_budget.sh
PYTHONPATH=$ROOT timeout $(left) python3 -m pytest -q -x tests/test_kernel_sparse_attention_cuda.py \
  tests/test_kernels_cuda.py -k "indexer or sparse" 2>&1 | tail -3
cd bench
for tree in "$BASE" "$ROOT"; do
  PYTHONPATH=$tree timeout $(left) python3 prefill_small_kernels_gpu.py 2>&1 | grep -Ev "$F" | grep -i "index\|kernel"
done
PYTHONPATH=$ROOT timeout $(left) python3 prefill_attention_gpu.py ${ATTN_ARGS:---tiles 64/32/8/3 --variants 0/0 1/0 1/1 --hot} 2>&1 | grep -Ev "$F" | tail -40
for tree in "$BASE" "$ROOT"; do
  echo "== tree: $tree"
  PYTHONPATH=$tree timeout $(left) python3 prefill.py --lens 1024 8192 --repeat 5 2>&1 | grep -Ev "$F" | tail -4
done
PYTHONPATH=$ROOT timeout $(left) python3 profile_prefill.py --lens 8192 --top 12 --gaps 2>&1 | grep -Ev "$F" | tail -50
[ $(left) -gt 300 ] && PYTHONPATH=$ROOT timeout $(left) python3 decode_floor.py --batch 1 32 2>&1 | grep -Ev "$F" | tail -4
cd "$ROOT"
[ $(left) -gt 60 ] && PYTHONPATH=$ROOT timeout $(left) python3 -m pytest -q -x tests/test_engine_cuda.py \
  tests/test_batch_invariant.py 2>&1 | tail -3
echo "total: $((SECONDS - START)) s"
