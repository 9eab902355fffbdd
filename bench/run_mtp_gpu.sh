#!/usr/bin/env bash
# One device-machine call for the MTP work: the CUDA tests of MTP with graphs (mini in fp32 against the dense
# reference, the whole-step graph against the separate graphs, bf16 batch-invariant MTP on == off), then the
# MTP step benchmarks given as arguments (each one quoted word), appending to $OUT/BENCHMARKS.part.md.
#   bash bench/run_mtp_gpu.sh "mtp_step_gpu.py --preset mini --concurrency 1 32 --ks 0 1 2 --gen 128 --separate"
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
t0=$(date +%s)
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_kernel_mini_cuda.py \
    tests/test_batch_invariant.py 2>&1 | tail -15 | tee "$OUT/cuda_tests.txt"
  echo "tests: $(( $(date +%s) - t0 )) s"
fi
cd bench
for b in "$@"; do
  echo "== $b"
  timeout "${BENCH_TIMEOUT:-400}" python3 $b --append "$OUT/BENCHMARKS.part.md" 2>&1 | grep -v Warning | tail -30
  echo "($(( $(date +%s) - t0 )) s)"
done
