#!/usr/bin/env bash
# Forty-second session, calls on one GPU.
# PART=a: the mHC write-back that computes the next collapse's mixing partials (model.mhc.POST_MIX, off until
#   this runs): its CUDA test and the mHC twins; the write-back + collapse alone, apart and fused (chunks of 64 /
#   32 channels, 4 / 8 warps); TTFT at 1k / 8k with it off and on (two turns); the decode step off and on.
# PART=b: the engine's CUDA tests and batch invariance with POST_MIX on (PM=0: off), which also runs what the
#   forty-first session's PART=d did not (EXP2 and SPLIT_SCORES on by default since f5f20fa); the 8k profile.
source bench/call_budget.sh
pm() {  # a bench script or pytest with model.mhc.POST_MIX set to $1 before anything builds an engine
  local v=$1; shift
  python3 -c "import sys, runpy; import dsv4.model.mhc as m; m.POST_MIX = bool($v); sys.argv = sys.argv[1:]; \
runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True) if sys.argv[0] == 'pytest' \
else runpy.run_path(sys.argv[0], run_name='__main__')" "$@"
}
if [ "${PART:-a}" = a ]; then
  PYTHONPATH=$ROOT timeout 90 python3 -m pytest -q -x tests/test_kernel_mhc_cuda.py 2>&1 | tail -2
  cd bench
  PYTHONPATH=$ROOT timeout 120 python3 mhc_prefill_gpu.py --post-mix --tokens 1 32 1024 8192 2>&1 | grep -Ev "$F" \
    | grep "^|"
  for turn in 1 2; do
    for v in off on; do
      echo "== prefill.py --post-mix $v (turn $turn)"
      PYTHONPATH=$ROOT timeout $(($(left) / 2)) python3 prefill.py --lens 1024 8192 --repeat 5 --post-mix $v 2>&1 \
        | grep -Ev "$F" | grep "compiled after\|^| off"
    done
  done
  for v in 0 1; do
    echo "== decode_floor.py, POST_MIX=$v"
    PYTHONPATH=$ROOT timeout $(($(left) / (2 - v))) bash -c "$(declare -f pm); pm $v decode_floor.py --batch 1 32 \
--steps 10" 2>&1 | grep -Ev "$F" | grep "compiled after\|^| [0-9]"
  done
else
  PYTHONPATH=$ROOT timeout $(($(left) * 3 / 5)) bash -c "$(declare -f pm); pm ${PM:-1} pytest -q -x \
tests/test_engine_cuda.py -k 'keep_up or far_from or kept_rows or overlap_scheduler or teacher_forced or \
equals_dense or graphs'" 2>&1 | tail -2
  PYTHONPATH=$ROOT timeout $(($(left) - 60)) bash -c "$(declare -f pm); pm ${PM:-1} pytest -q -x \
tests/test_batch_invariant.py" 2>&1 | tail -2
  cd bench
  PYTHONPATH=$ROOT timeout $(left) bash -c "$(declare -f pm); pm ${PM:-1} profile_prefill.py --lens 8192 --top 40 \
--ops" 2>&1 | grep -Ev "$F" | grep "TTFT\|index_put\|_store_kept\|_post\|_mix\|_collapse\|^| mHC\|^| attention"
fi
echo "total: $((SECONDS - START)) s"
