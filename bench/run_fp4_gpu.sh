#!/usr/bin/env bash
# One device-machine call for issue 20 (packed FP4 experts, prefill on the kernels): the CUDA tests ($TESTS,
# default: the kernel tests and the MTP tests of run_mtp_gpu.sh unless SKIP_MTP is set; SKIP_TESTS skips them),
# then each bench command line given as an argument (default: the FP4 tile choices, the decode floor on
# flash-L4-E32 with the experts dequantised and packed, on Flash's full layer stack with half its experts
# (flash-E128, FP4 only: the bf16 experts would be 290 GB), and prefill TTFT at 1k/8k/32k), each under
# BENCH_TIMEOUT seconds, appending to $OUT/BENCHMARKS.part.md.
#   bash bench/run_fp4_gpu.sh ["decode_floor.py --expert-format fp4" ...]
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
t0=$(date +%s)
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
if [ -z "${SKIP_TESTS:-}" ]; then
  tests=${TESTS:-tests/test_kernels_cuda.py}
  [ -z "${TESTS:-}" ] && [ -z "${SKIP_MTP:-}" ] && tests="$tests tests/test_kernel_mini_cuda.py"
  timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider -m cuda --tb=short $tests 2>&1 \
    | grep -v "CUDA warning" > "$OUT/cuda_tests.txt"
  tail -${TEST_TAIL:-15} "$OUT/cuda_tests.txt"
  echo "tests: $(( $(date +%s) - t0 )) s"
fi
cd bench
benches=("$@")
[ ${#benches[@]} -eq 0 ] && benches=("grouped_gemm_configs.py --fp4" "decode_floor.py --preset flash-L4-E32"
  "decode_floor.py --preset flash-L4-E32 --expert-format fp4"
  "decode_floor.py --preset flash-E128 --expert-format fp4 --steps 10" "prefill.py --preset flash-L4-E32")
for b in "${benches[@]}"; do
  echo "== $b"
  timeout "${BENCH_TIMEOUT:-300}" python3 $b --append "$OUT/BENCHMARKS.part.md" 2>&1 | grep -v Warning | tail -12
  echo "($(( $(date +%s) - t0 )) s)"
done
