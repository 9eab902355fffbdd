#!/usr/bin/env bash
# One device-machine call: the CUDA tests named in $TESTS (SKIP_TESTS skips them; the whole log goes to
# $OUT/cuda_tests.txt, its last TEST_TAIL lines to the output), then each bench command line given as an
# argument, run in bench/ under BENCH_TIMEOUT seconds and appending to $OUT/BENCHMARKS.part.md (its last
# BENCH_TAIL lines shown). run_fp4_gpu.sh and run_mtp_gpu.sh call it with their defaults.
#   TESTS="tests/test_kernels_cuda.py" bash bench/device_call.sh "decode_floor.py --expert-format fp4" ...
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
t0=$(date +%s)
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
if [ -z "${SKIP_TESTS:-}" ] && [ -n "${TESTS:-}" ]; then
  timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider -m cuda --tb=short $TESTS 2>&1 \
    | grep -v "CUDA warning" > "$OUT/cuda_tests.txt"
  tail -${TEST_TAIL:-15} "$OUT/cuda_tests.txt"
  echo "tests: $(( $(date +%s) - t0 )) s"
fi
cd bench
for b in "$@"; do
  echo "== $b"
  timeout "${BENCH_TIMEOUT:-300}" python3 $b --append "$OUT/BENCHMARKS.part.md" 2>&1 | grep -v Warning \
    | tail -${BENCH_TAIL:-12}
  echo "($(( $(date +%s) - t0 )) s)"
done
