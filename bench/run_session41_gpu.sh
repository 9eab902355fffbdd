#!/usr/bin/env bash
# Forty-first session, calls on one GPU (the fortieth session's work, none of it run on a GPU before; the device
# is scarce, so the first call carries what decides the defaults).
# PART=a: the CUDA tests of the changes on by default (the top-k's early stop, the store that skips the null row)
#   and of the attention's switches (SPLIT_SCORES, EXP2, FUSE_Q_NORM / FUSE_ROPE_OUT); the attention alone at 8k
#   with SPLIT_SCORES and EXP2 off / on; TTFT at 1k / 8k on BASE (`git archive 9b703b2 dsv4` in .abbase: before the
#   fortieth session), this tree, this tree with --split-scores --exp2, and with --fuse-q-norm as well, twice in
#   turn.
# PART=b: the engine's CUDA tests and batch invariance with the switches on (FUSE_Q_NORM, SPLIT=1, EXP2=1 by
#   default), the small kernels at 8k on both trees, the 8k prefill's kernels and torch ops (profile_prefill.py
#   --ops) with the switches on.
# PART=c: with EXP2 and SPLIT_SCORES on by default and the compressor-state ring's writes on the store that skips
#   the null row: the attention's variants, the engine's CUDA tests and batch invariance; the 8k prefill's
#   index_put / store launches and TTFT.
source bench/call_budget.sh
on() {  # a bench script or pytest with the switches set before anything builds an engine
  python3 -c "import sys, runpy; import dsv4.kernels.sparse_attention as s; s.FUSE_Q_NORM = bool(${QN:-1}); \
s.EXP2 = bool(${EXP2:-1}); s.SPLIT_SCORES = bool(${SPLIT:-1}); \
sys.argv = sys.argv[1:]; runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True) if sys.argv[0] == 'pytest' \
else runpy.run_path(sys.argv[0], run_name='__main__')" "$@"
}
if [ "${PART:-a}" = a ]; then
  T=$(left); [ $T -gt 170 ] && T=170
  PYTHONPATH=$ROOT timeout $T python3 -m pytest -q -x tests/test_kernels_cuda.py tests/test_kernel_store_cuda.py \
    tests/test_kernel_sparse_attention_cuda.py -k "topk or store_kept or variants or fp8_rows or raw_q" 2>&1 | tail -2
  cd bench
  T=$(left); [ $T -gt 100 ] && T=100
  PYTHONPATH=$ROOT timeout $T python3 prefill_attention_gpu.py --tokens 8192 --tiles 64/64/8/2 --skip 2 \
    --exp2 off on --split-scores off on 2>&1 | grep -Ev "$F" | grep "^|"
  S="--split-scores --exp2"
  for run in "$BASE|" "$ROOT|" "$ROOT|$S" "$ROOT|--fuse-q-norm $S" "$BASE|" "$ROOT|" "$ROOT|$S" \
      "$ROOT|--fuse-q-norm $S"; do
    tree=${run%%|*}; args=${run#*|}
    echo "== prefill.py $tree $args"
    PYTHONPATH=$tree timeout $(left) python3 prefill.py --lens 1024 8192 --repeat 5 $args 2>&1 | grep -Ev "$F" \
      | grep "compiled after\|^| off"
  done
elif [ "${PART}" = c ]; then  # the defaults after PART=a (EXP2 and SPLIT_SCORES on) and the state ring's store
  PYTHONPATH=$ROOT timeout 60 python3 -m pytest -q -x tests/test_kernel_sparse_attention_cuda.py \
    tests/test_kernel_store_cuda.py -k "variants or store_kept" 2>&1 | tail -2  # (-k applies to every file)
  PYTHONPATH=$ROOT timeout $(($(left) - 75)) python3 -m pytest -q -x tests/test_engine_cuda.py \
    tests/test_batch_invariant.py 2>&1 | tail -3
  cd bench
  PYTHONPATH=$ROOT timeout $(left) python3 profile_prefill.py --lens 8192 --top 40 --ops 2>&1 | grep -Ev "$F" \
    | grep "TTFT\|index_put\|_store_kept\|^| attention"
elif [ "${PART}" = d ]; then  # PART=c cut to the device time left: the engine's CUDA tests PART=b's run did not reach
  PYTHONPATH=$ROOT timeout $(($(left) * 3 / 5)) python3 -m pytest -q -x tests/test_engine_cuda.py \
    -k "keep_up or far_from or kept_rows or overlap_scheduler or teacher_forced" 2>&1 | tail -2
  PYTHONPATH=$ROOT timeout $(left) python3 -m pytest -q -x tests/test_batch_invariant.py 2>&1 | tail -2
else
  T=$(left); [ $T -gt 200 ] && T=200
  PYTHONPATH=$ROOT timeout $T bash -c "$(declare -f on); on pytest -q -x tests/test_engine_cuda.py \
tests/test_batch_invariant.py" 2>&1 | tail -3
  cd bench
  for tree in "$BASE" "$ROOT"; do
    echo "== tree: $tree"
    PYTHONPATH=$tree timeout $(left) python3 prefill_small_kernels_gpu.py --tokens 8192 2>&1 | grep -Ev "$F" \
      | grep "^|"
  done
  PYTHONPATH=$ROOT timeout $(left) bash -c "$(declare -f on); on profile_prefill.py --lens 8192 --top 40 --gaps --ops" \
    2>&1 | grep -Ev "$F" | grep "^|\|TTFT"
fi
echo "total: $((SECONDS - START)) s"
