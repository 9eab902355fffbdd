#!/usr/bin/env bash
# For the next device call (written in the twenty-sixth session, not yet run): the L2 prefetch's same-bits engine
# test; tests/test_kernels_cuda.py whole and the early-release engine test (the router's logits and the mHC
# partials now load their weights first, before the wait under early release; the collapse, RMSNorm and norm +
# RoPE kernels issue every load before their first sum); then the attention CUDA files, not run whole
# since the side streams went on by default (the split file stopped at 14 of 42, the sparse one at 5 of 15);
# whether an L2 prefetch of a GEMV's weight during a chain of small kernels pays alone (l2_prefetch_gpu.py) and
# in the step (--l2-prefetch: wo_a during the attention; --l2-prefetch-wo: then wo_b during wo_a; against the
# default in the same call); the step's kernel map without early release (with it, a released kernel's time
# includes its wait for the one before). The tests stop at 330 s, so the attention files may not finish.
set -u
P="--preset flash-L20-E128 --expert-format fp4 --linear-format fp8"
TESTS="tests/test_engine_cuda.py::test_l2_prefetch_on_a_side_stream_gives_the_same_bits \
tests/test_kernels_cuda.py \
tests/test_kernel_fp8_linear_cuda.py::test_early_release_with_weights_read_before_the_wait_gives_the_same_bits \
tests/test_kernel_attention_split_cuda.py tests/test_kernel_sparse_attention_cuda.py" \
  TEST_TIMEOUT=${TEST_TIMEOUT:-330} TEST_TAIL=12 BENCH_TIMEOUT=${BENCH_TIMEOUT:-70} BENCH_TAIL=12 \
  bash bench/device_call.sh \
  "decode_floor.py $P --batch 1 --steps 10" \
  "decode_floor.py $P --batch 1 --steps 10 --l2-prefetch" \
  "decode_floor.py $P --batch 1 --steps 10 --l2-prefetch-wo" \
  "l2_prefetch_gpu.py" \
  "profile_decode.py $P --kernels-only --steps 5 --top 24 --batch 1 --no-pdl-release"
