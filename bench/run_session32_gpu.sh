#!/usr/bin/env bash
# For the next session's first two device calls (written in the thirty-first, not run): `bash
# bench/run_session32_gpu.sh 1`, then `... 2` on the warm machine (each fits one call's 600 s).
# 1. The seed's command (dsv4-bench, 64 x 1024/128 at concurrency 32 on flash-L4-E32, the seed's mtp.yml, and the
#    same without speculative_config): MTP as committed (paused steps far from a probe skip the keep-up pass, no
#    acceptance kernels in a paused step's graph, probes backing off) against MTP as the thirtieth session left it
#    ("before": keep-up at every paused step, the acceptance kernels, a probe every 32 paused steps), alternating
#    with off. The first run compiles the Triton kernels on a fresh machine: 240 s for it.
# 2. The engine's CUDA tests (this session's bare keep-up graph and its twin included), then seed_steps_gpu.py
#    by kind of step (MTP against MTP keeping up at every paused step) and the paused step's kernel diff.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ "${1:-1}" = 1 ]; then
. bench/seed_command.sh
seed_prepare
BEFORE="GraphRunner.slim_keep_step = False; DraftPause.keep_rows = lambda self, margin: margin"
seed_run off1 /tmp/nomtp.yml "" 240
seed_run mtp1 examples/mtp.yml "" 100
seed_run before1 /tmp/before.yml "$BEFORE" 100
seed_run off2 /tmp/nomtp.yml "" 100
seed_run mtp2 examples/mtp.yml "" 100
seed_run before2 /tmp/before.yml "$BEFORE" 100
else
timeout 250 python3 -m pytest -q -p no:cacheprovider -m cuda --tb=short tests/test_engine_cuda.py 2>&1 \
  | grep -v "CUDA warning" | tail -8
cd bench
timeout 200 python3 seed_steps_gpu.py --runs off mtp mtp-keep-every-step off mtp mtp-keep-every-step \
  --append "$OUT/BENCHMARKS.part.md" 2>&1 | grep -v Warn | tail -9
timeout 110 python3 mtp_step_gpu.py --preset flash-L4-E32 --concurrency 32 --ks 0 1 --prompt-len 768 --gen 128 \
  --top 3 --diff 25 --no-probes --append "$OUT/BENCHMARKS.part.md" 2>&1 | grep -v Warn | tail -34
fi
