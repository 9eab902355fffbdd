#!/usr/bin/env bash
# Fortieth session, calls on one GPU.
# PART=a: the attention's raw-q path (q's RMSNorm + RoPE in the single pass's prologue, FUSE_Q_NORM; the output's
#   inverse rope in its epilogue, FUSE_ROPE_OUT), its lazy rescale (RESCALE_TAU), its weights by one ex2 (EXP2) and
#   its scores computed once, split between the warpgroups (SPLIT_SCORES), their first GPU run: the sparse
#   attention CUDA tests, the kernels alone at 8k (prefill_attention_gpu.py --q-norm --tau --exp2 --split-scores),
#   TTFT at 1k / 8k with the switches off and on (alternating, same tree).
# PART=b (run it first: these changes are on by default and have not run on a GPU), against BASE (`git archive
#   9b703b2 dsv4` in .abbase: the session's first head; carry .abbase): the top-k's and the window store's CUDA
#   tests, the small kernels at 8k on both trees (the top-k that stops at each token's last visible column), TTFT
#   at 1k / 8k on both trees (that, the streams gathered from the embedding in one gather, the window store that
#   skips the null row).
# PART=c: the engine's CUDA tests and batch invariance with FUSE_Q_NORM on (and RESCALE_TAU=$TAU, EXP2=1, SPLIT=1),
#   then the 8k prefill's kernels and torch ops with them on (profile_prefill.py --ops).
source bench/call_budget.sh
on() {  # a bench script or pytest with the switches set before anything builds an engine
  python3 -c "import sys, runpy; import dsv4.kernels.sparse_attention as s; s.FUSE_Q_NORM = True; \
s.RESCALE_TAU = float('${TAU:-0}'); s.EXP2 = bool(${EXP2:-0}); s.SPLIT_SCORES = bool(${SPLIT:-0}); \
sys.argv = sys.argv[1:]; runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True) if sys.argv[0] == 'pytest' \
else runpy.run_path(sys.argv[0], run_name='__main__')" "$@"
}
if [ "${PART:-a}" = a ]; then
  T=$(left); [ $T -gt 150 ] && T=150
  PYTHONPATH=$ROOT timeout $T python3 -m pytest -q -x tests/test_kernel_sparse_attention_cuda.py 2>&1 | tail -2
  cd bench
  PYTHONPATH=$ROOT timeout $(left) python3 prefill_attention_gpu.py --tokens 8192 --tiles 64/64/8/2 --skip 2 \
    --tau 0 8 --exp2 off on --split-scores off on --q-norm 2>&1 | grep -Ev "$F" | grep "^|"
  S="--split-scores --exp2"
  for args in "" "$S" "--fuse-q-norm" "--fuse-q-norm $S" "" "$S" "--fuse-q-norm" "--fuse-q-norm $S" "--exp2" \
      "--split-scores"; do
    echo "== prefill.py $args"
    PYTHONPATH=$ROOT timeout $(left) python3 prefill.py --lens 1024 8192 --repeat 5 $args 2>&1 | grep -Ev "$F" \
      | grep "compiled after\|^| off"
  done
elif [ "${PART}" = b ]; then
  PYTHONPATH=$ROOT timeout $(left) python3 -m pytest -q -x tests/test_kernels_cuda.py \
    -k "topk or indexer or store_kept" 2>&1 | tail -2
  cd bench
  for tree in "$BASE" "$ROOT"; do
    echo "== tree: $tree"
    PYTHONPATH=$tree timeout $(left) python3 prefill_small_kernels_gpu.py --tokens 8192 2>&1 | grep -Ev "$F" \
      | grep "^|"
  done
  for tree in "$BASE" "$ROOT" "$BASE" "$ROOT"; do
    echo "== tree: $tree"
    PYTHONPATH=$tree timeout $(left) python3 prefill.py --lens 1024 8192 --repeat 5 2>&1 | grep -Ev "$F" \
      | grep "compiled after\|^| off"
  done
else
  PYTHONPATH=$ROOT timeout $(left) bash -c "$(declare -f on); on pytest -q -x tests/test_engine_cuda.py \
tests/test_batch_invariant.py" 2>&1 | tail -3
  cd bench
  PYTHONPATH=$ROOT timeout $(left) bash -c "$(declare -f on); on profile_prefill.py --lens 8192 --top 40 --gaps --ops" \
    2>&1 | grep -Ev "$F" | grep "^|\|TTFT"
fi
echo "total: $((SECONDS - START)) s"
