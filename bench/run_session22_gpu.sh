#!/usr/bin/env bash
# The twenty-second session's unverified GPU work, for the next device call: the CUDA tests of the kernels'
# stores into the cache (norm-rope into entries / index keys / the window ring, bf16 or FP8-quantised; the
# compressor rows into the state ring), the rope and FP8 GEMV tests against the restored GEMV, the engine against the dense reference,
# then the decode step on flash-L20-E128 (fits an H100; compare with BENCHMARKS' twenty-first session, 5.41 /
# 11.75 ms at batch 1 / 8 on 9a8aa6f, or with BASE_TREE: a checkout of an earlier commit, run in the same call).
set -u
PYTEST_ADDOPTS="-k 'rope or project or compressor_rows or fp8_linear or pool or equals_dense_reference or fp8_cache or graphs or overlap'" \
  TESTS="tests/test_kernel_fp8_linear_cuda.py tests/test_kernels_cuda.py tests/test_engine_cuda.py" TEST_TIMEOUT=${TEST_TIMEOUT:-240} \
  TEST_TAIL=25 BENCH_TIMEOUT=170 BENCH_TAIL=20 \
  bash bench/device_call.sh "decode_floor.py --preset flash-L20-E128 --expert-format fp4 --linear-format fp8 --batch 1 8 --steps 10"
if [ -n "${BASE_TREE:-}" ]; then
  (cd "$BASE_TREE" && SKIP_TESTS=1 BENCH_TIMEOUT=170 BENCH_TAIL=20 bash bench/device_call.sh \
    "decode_floor.py --preset flash-L20-E128 --expert-format fp4 --linear-format fp8 --batch 1 8 --steps 10")
fi
