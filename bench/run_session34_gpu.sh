#!/usr/bin/env bash
# Thirty-fourth session: one device call for what the thirty-third and this session prepared (the device is
# scarce: one call may be all there is).
#   1. the CUDA twins of the code not yet run on a GPU (the pause's keep_rows near a probe, warmup's first-wave
#      path, the compile watch), under TEST_S seconds (default 150);
#   2. then `run_session33_gpu.sh all` with what is left: the first steps of a timed run profiled (MTP off without
#      and with warmup's first-wave path, MTP), now with the Triton kernels compiled in each step and the caching
#      allocator's cudaMalloc / cudaFree / retries, then seed-command runs (off / MTP alternating) while BUDGET
#      (default 560, from the call's start) allows.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
START=$SECONDS
nvidia-smi --query-gpu=name --format=csv,noheader
timeout ${TEST_S:-150} python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_compiles.py tests/test_engine_cuda.py \
  -k "far_from_a_probe or kept_rows or warmup or pause or compile" 2>&1 | grep -v "CUDA warning" > "$OUT/cuda_tests.txt"
tail -4 "$OUT/cuda_tests.txt"; echo "tests: $((SECONDS - START)) s"
LEFT=$(( ${BUDGET:-560} - (SECONDS - START) ))
FIRST_S=${FIRST_S:-220} BUDGET=$LEFT RUNS=${RUNS:-off-nowave off mtp} SEED=${SEED:-off1 mtp1 off2 mtp2 off3 mtp3} \
  bash bench/run_session33_gpu.sh all
grep "^Triton\|allocator\|^| step" "$OUT/first_steps.txt" | head -30
echo "total: $((SECONDS - START)) s"
