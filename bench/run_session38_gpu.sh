#!/usr/bin/env bash
# Thirty-eighth session, two calls on one GPU.
# PART=a (prefill): the changed kernels' CUDA tests (mHC, sparse attention, FP4 decode); mHC's collapse alone at 8k
#   with the prefill's partials summed MIX_LOOP chunks a program, against the batch-invariant layout and against
#   BASE (a checkout of earlier code: `git archive HEAD dsv4 | tar -x -C .abbase`); the prefill attention's SKIP
#   per source at 8k and 1k tokens; TTFT at 1k / 8k on both trees; the 8k prefill's kernel kinds, device timeline
#   and host functions (profile_prefill.py --gaps --host).
# PART=c: the last two changes (mHC's run length an argument, sparse attention's SKIP = 2): their CUDA tests, the 8k
#   window and HCA layers' SKIP rows, TTFT at 1k / 8k on both trees with any compile after warmup (SHORT=1: the tests
#   and this tree's TTFT only).
# PART=b (decode): the FP4 tensor-core GEMM with one product a decoded pair (FOLD) alone at batch 8 and 32, the
#   decode step of flash-L20-E128 (FP4 experts, FP8 linears) at batch 32 with and without it; the engine's CUDA tests.
source bench/call_budget.sh
if [ "${PART:-a}" = a ]; then
  PYTHONPATH=$ROOT timeout $(left) python3 -m pytest -q -x tests/test_kernels_cuda.py -k "mhc" \
    tests/test_kernel_sparse_attention_cuda.py 2>&1 | tail -3
  PYTHONPATH=$ROOT timeout $(left) python3 -m pytest -q -x tests/test_kernel_fp4_cuda.py -k "every_code" 2>&1 | tail -3
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
  PYTHONPATH=$ROOT timeout $(left) python3 profile_prefill.py --lens 8192 --top 14 --gaps --host 2>&1 \
    | grep -Ev "$F" | tail -110
elif [ "${PART}" = c ]; then  # after the first two: mHC's run length as an argument, SKIP = 2
  PYTHONPATH=$ROOT timeout $(left) python3 -m pytest -q -x tests/test_kernels_cuda.py -k "mhc" 2>&1 | tail -2
  T=$(left); [ $T -gt 120 ] && T=120
  PYTHONPATH=$ROOT timeout $T python3 -m pytest -q -x tests/test_kernel_sparse_attention_cuda.py 2>&1 | tail -2
  cd bench
  [ -z "${SHORT:-}" ] && PYTHONPATH=$ROOT timeout $(left) python3 prefill_attention_gpu.py --tokens 8192 \
    --kinds window HCA --tiles --skip 0 2 3 2>&1 | grep -Ev "$F" | grep "auto"
  TREES="$BASE $ROOT"
  [ -n "${SHORT:-}" ] && TREES=$ROOT
  for tree in $TREES; do
    echo "== tree: $tree"
    PYTHONPATH=$tree timeout $(left) python3 prefill.py --lens 1024 8192 --repeat 5 2>&1 | grep -Ev "$F" \
      | grep "compiled after\|^| off"
  done
else
  cd bench
  PYTHONPATH=$ROOT timeout $(left) python3 fp4_gemv_gpu.py --batch 8 32 2>&1 | grep -Ev "$F" | grep -i "TC\|batch\|--" | head -30
  P="--preset flash-L20-E128 --expert-format fp4 --linear-format fp8 --batch 32 --steps 10"
  PYTHONPATH=$ROOT timeout $(left) python3 decode_floor.py $P 2>&1 | grep -Ev "$F" | tail -4
  PYTHONPATH=$ROOT timeout $(left) python3 decode_floor.py $P --no-fp4-fold 2>&1 | grep -Ev "$F" | tail -4
  cd "$ROOT"
  [ $(left) -gt 60 ] && PYTHONPATH=$ROOT timeout $(left) python3 -m pytest -q -x tests/test_engine_cuda.py \
    tests/test_batch_invariant.py 2>&1 | tail -3
fi
echo "total: $((SECONDS - START)) s"
