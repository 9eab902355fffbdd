#!/usr/bin/env bash
# Thirty-ninth session, calls on one GPU.
# PART=a: mHC's mixing partials in bfloat16 products (the mixing rows split in three parts): the mHC CUDA tests,
#   the partials alone in every layout (mhc_prefill_gpu.py), TTFT at 1k / 8k on this tree and on BASE (a checkout
#   of earlier code: `git archive <rev> dsv4 | tar -x -C .abbase`) with any compile after warmup.
#   Then a prefill's synchronising calls (sync_points.py --prefill 8192).
# PART=b: the engine's CUDA tests and batch invariance, and sparse attention's (SKIP = 2 has not run on a GPU).
# PART=c: the mHC CUDA test (the write-back's two tiles), TTFT at 1k / 8k on BASE and this tree, and the 8k
#   prefill's kernels, device timeline and host functions (profile_prefill.py --gaps --host).
source bench/call_budget.sh
if [ "${PART:-a}" = a ]; then
  PYTHONPATH=$ROOT timeout $(left) python3 -m pytest -q -x tests/test_kernels_cuda.py -k "mhc" 2>&1 | tail -2
  cd bench
  PYTHONPATH=$ROOT timeout $(left) python3 mhc_prefill_gpu.py --tokens 8192 1024 2>&1 | grep -Ev "$F" | grep -v "^\["
  PYTHONPATH=$ROOT timeout $(left) python3 mhc_prefill_gpu.py --tokens 32 1 --quick 2>&1 | grep -Ev "$F" \
    | grep -v "^\["
  for tree in "$BASE" "$ROOT"; do
    echo "== tree: $tree"
    PYTHONPATH=$tree timeout $(left) python3 prefill.py --lens 1024 8192 --repeat 5 2>&1 | grep -Ev "$F" \
      | grep "compiled after\|^|"
  done
  PYTHONPATH=$ROOT timeout $(left) python3 sync_points.py --prefill 8192 2>&1 | grep -Ev "$F" | tail -15
elif [ "${PART}" = c ]; then
  PYTHONPATH=$ROOT timeout $(left) python3 -m pytest -q -x tests/test_kernels_cuda.py -k "mhc" 2>&1 | tail -2
  cd bench
  for tree in "$BASE" "$ROOT"; do
    echo "== tree: $tree"
    PYTHONPATH=$tree timeout $(left) python3 prefill.py --lens 1024 8192 --repeat 5 2>&1 | grep -Ev "$F" \
      | grep "compiled after\|^| off"
  done
  PYTHONPATH=$ROOT timeout $(left) python3 profile_prefill.py --lens 8192 --top 30 --gaps --host 2>&1 \
    | grep -Ev "$F" | grep "^|\|TTFT"
else
  T=$(left); [ $T -gt 120 ] && T=120
  PYTHONPATH=$ROOT timeout $T python3 -m pytest -q -x tests/test_kernel_sparse_attention_cuda.py 2>&1 | tail -2
  PYTHONPATH=$ROOT timeout $(left) python3 -m pytest -q -x tests/test_engine_cuda.py tests/test_batch_invariant.py \
    2>&1 | tail -3
fi
echo "total: $((SECONDS - START)) s"
