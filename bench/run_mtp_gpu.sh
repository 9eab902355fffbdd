#!/usr/bin/env bash
# One device-machine call for the MTP work, through device_call.sh: the CUDA tests of MTP with graphs (mini in
# fp32 against the dense reference, the whole-step graph against the separate graphs, bf16 batch-invariant MTP
# on == off), then the MTP step benchmarks given as arguments (each one quoted word), appending to
# $OUT/BENCHMARKS.part.md.
#   bash bench/run_mtp_gpu.sh "mtp_step_gpu.py --preset mini --concurrency 1 32 --ks 0 1 2 --gen 128 --separate"
TESTS=${TESTS:-"tests/test_kernel_mini_cuda.py tests/test_batch_invariant.py"} BENCH_TIMEOUT=${BENCH_TIMEOUT:-400} \
  BENCH_TAIL=${BENCH_TAIL:-30} exec bash "$(dirname "$0")/device_call.sh" "$@"
