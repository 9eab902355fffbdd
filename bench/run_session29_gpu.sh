#!/usr/bin/env bash
# Twenty-ninth session, first device call: the CUDA tests of the drafting pause (committed in the 28th session
# without a GPU: tests/test_engine_cuda.py whole, with this session's sampled MTP on == off on CUDA) and of the routed experts' prefill GEMMs on torch._grouped_mm
# (moe.GROUPED_MM, new, off by default); the grouped GEMM's A/B at prefill sizes (Triton row blocks of 64 / 128
# against torch._grouped_mm over segments of 16, cuBLAS bmm as the peer); then MTP with and without the pause
# at zero acceptance and at the oracle's 0.85 on flash-L20-E128 (FP4 experts, FP8 linears).
set -u
P8="--preset flash-L20-E128 --expert-format fp4 --linear-format fp8"
TESTS="tests/test_engine_cuda.py tests/test_kernels_cuda.py::test_grouped_moe_on_the_library_grouped_mm_matches_the_kernel_and_replays_in_a_graph tests/test_kernels_cuda.py::test_grouped_moe_matches_torch" \
  TEST_TIMEOUT=${TEST_TIMEOUT:-270} TEST_TAIL=12 BENCH_TIMEOUT=${BENCH_TIMEOUT:-150} BENCH_TAIL=16 bash bench/device_call.sh \
  "prefill_moe_gpu.py --tokens 1024 8192 --block-n 256 --warps 8 --stages 4" \
  "mtp_speedup.py $P8 --concurrency 1 --ks 0 1 --p-right 0.85 --repeat 3 --no-gap --gen 96 --pause on off"
