#!/usr/bin/env bash
# The twenty-third session's unverified GPU work, for the next device call: the shared expert captured on a side
# stream (model.moe.SHARED_OVERLAP, off by default until this passes and measures faster): its CUDA test (same
# bits as the main stream), the PDL and padded-graph tests, then the decode step on flash-L20-E128 (fits an H100)
# with the side stream and without it, in the same call (BENCHMARKS' twenty-third session: 4.85 / 11.17 ms
# overlapped at batch 1 / 8 with the shared expert on the main stream), then the batch-1 kernel map after the
# twenty-first to twenty-third sessions' changes (rope angles, stores into the cache, PDL), for why PDL's
# 0.36 us a boundary in bench/pdl_gpu.py showed as 0.07 ms in the step.
set -u
PYTEST_ADDOPTS="-k 'side_stream or pdl or padded_buckets or equals_dense_reference'" \
  TESTS="tests/test_engine_cuda.py" TEST_TIMEOUT=${TEST_TIMEOUT:-200} TEST_TAIL=10 BENCH_TIMEOUT=110 BENCH_TAIL=40 \
  bash bench/device_call.sh \
  "decode_floor.py --preset flash-L20-E128 --expert-format fp4 --linear-format fp8 --batch 1 8 --steps 10 --shared-overlap" \
  "decode_floor.py --preset flash-L20-E128 --expert-format fp4 --linear-format fp8 --batch 1 8 --steps 10" \
  "profile_decode.py --preset flash-L20-E128 --expert-format fp4 --linear-format fp8 --kernels-only --steps 5 --top 36 --batch 1"
