#!/usr/bin/env bash
# One device-machine call for packed FP4 experts: the CUDA twin tests (the grouped GEMM decoding FP4 against
# the same GEMMs on the decoded weights, the engine with FP4 experts against its dequantised twin, and the MTP
# tests of run_mtp_gpu.sh unless SKIP_MTP is set), then the decode floor on flash-L4-E32 with the experts
# dequantised and packed, and on Flash's full layer stack with half its experts (flash-E128, FP4 only: the bf16
# experts would be 290 GB), appending to $OUT/BENCHMARKS.part.md.
#   bash bench/run_fp4_gpu.sh
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
t0=$(date +%s)
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
if [ -z "${SKIP_TESTS:-}" ]; then
  tests="tests/test_kernels_cuda.py"
  [ -z "${SKIP_MTP:-}" ] && tests="$tests tests/test_kernel_mini_cuda.py"
  timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider -m cuda $tests 2>&1 | tail -15 \
    | tee "$OUT/cuda_tests.txt"
  echo "tests: $(( $(date +%s) - t0 )) s"
fi
cd bench
for b in "grouped_gemm_configs.py --fp4" "decode_floor.py --preset flash-L4-E32" \
         "decode_floor.py --preset flash-L4-E32 --expert-format fp4" \
         "decode_floor.py --preset flash-E128 --expert-format fp4 --steps 10"; do
  echo "== $b"
  timeout "${BENCH_TIMEOUT:-300}" python3 $b --append "$OUT/BENCHMARKS.part.md" 2>&1 | grep -v Warning | tail -12
  echo "($(( $(date +%s) - t0 )) s)"
done
