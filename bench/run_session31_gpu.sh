#!/usr/bin/env bash
# For the next session's first two device calls (written in the thirtieth, not run: its device time ran out):
# `bash bench/run_session31_gpu.sh 1`, then `... 2` on the warm machine (each fits one call's 600 s).
# 1. Where the seed's workload loses its last 5% with MTP paused (bench/seed_steps_gpu.py: wall time by kind of
#    step; MTP with its keep-up pass skipped, without probes, against MTP off, alternating).
#    And the same decode steps under torch.profiler (mtp_step_gpu.py): GPU busy against wall time per step, MTP
#    off against MTP k = 1 (paused after its first verify: zero acceptance), to tell GPU work from host time.
# 2. The engine's CUDA tests, then Flash depth in the default mode: k = 3 at concurrency 1 with the oracle at 0.85 (bandwidth ceiling 1.75x),
#    and zero acceptance at concurrency 32 (issue 17's <= 5% goal, measured at 1 and 8 so far).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
cd bench
if [ "${1:-1}" = 1 ]; then
timeout 330 python3 seed_steps_gpu.py --runs off mtp mtp-no-keep-up mtp-no-probes off mtp \
  --append "$OUT/BENCHMARKS.part.md" 2>&1 | grep -v Warn | tail -10
timeout 200 python3 mtp_step_gpu.py --preset flash-L4-E32 --concurrency 32 --ks 0 1 --prompt-len 768 --gen 128 \
  --top 12 --append "$OUT/BENCHMARKS.part.md" 2>&1 | grep -v Warn | tail -8
else
cd ..  # the CUDA tests of the engine (the keep-up pass's write_window, committed without a GPU, included)
timeout 220 python3 -m pytest -q -p no:cacheprovider -m cuda --tb=short tests/test_engine_cuda.py 2>&1 \
  | grep -v "CUDA warning" | tail -8
cd bench
timeout 300 python3 mtp_speedup.py --preset flash-L43-E16 --concurrency 1 32 --ks 0 1 3 --p-right 0.85 --repeat 3 \
  --no-gap --gen 96 --pause on --append "$OUT/BENCHMARKS.part.md" 2>&1 | grep -v Warn | tail -10
fi
