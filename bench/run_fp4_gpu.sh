#!/usr/bin/env bash
# One device-machine call for issue 20 (packed FP4 experts, prefill on the kernels), through device_call.sh:
# the CUDA tests ($TESTS, default: the kernel tests and the MTP tests of run_mtp_gpu.sh unless SKIP_MTP is
# set; SKIP_TESTS skips them), then each bench command line given as an argument (default: the FP4 tile
# choices, the decode floor on flash-L4-E32 with the experts dequantised and packed, on Flash's full layer
# stack with half its experts (flash-E128, FP4 only: the bf16 experts would be 290 GB), and prefill TTFT at
# 1k/8k/32k), appending to $OUT/BENCHMARKS.part.md.
#   bash bench/run_fp4_gpu.sh ["decode_floor.py --expert-format fp4" ...]
set -u
if [ -z "${TESTS:-}" ]; then
  TESTS="tests/test_kernels_cuda.py tests/test_kernel_fp4_cuda.py tests/test_kernel_fp8_linear_cuda.py tests/test_kernel_sparse_attention_cuda.py"
  [ -z "${SKIP_MTP:-}" ] && TESTS="$TESTS tests/test_kernel_mini_cuda.py"
fi
benches=("$@")
[ ${#benches[@]} -eq 0 ] && benches=("grouped_gemm_configs.py --fp4" "decode_floor.py --preset flash-L4-E32"
  "decode_floor.py --preset flash-L4-E32 --expert-format fp4"
  "decode_floor.py --preset flash-E128 --expert-format fp4 --steps 10" "prefill.py --preset flash-L4-E32")
TESTS=$TESTS exec bash "$(dirname "$0")/device_call.sh" "${benches[@]}"
