#!/usr/bin/env bash
# Thirty-first session, the one call left: the seed's command (dsv4-bench, 64 x 1024/128 at concurrency 32 on
# flash-L4-E32, the seed's mtp.yml, and the same without speculative_config) with this session's paused steps
# (no acceptance kernels in a keep-up step's graph; probes backing off) against the previous behaviour
# ("before": GraphRunner.slim_keep_step off, pause_max_probe_interval 32), alternating with off; between them
# mtp_step_gpu.py --diff (every kernel a paused step runs beyond MTP off's). In order of need: what does not
# fit the call's time is cut from the end. The first run compiles the Triton kernels on a fresh machine: in the
# thirty-first session 100 s killed it (MTP off's first report lost); it has 240 s now. (Written before the
# skipped keep-up passes: "before" here keeps them.)
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
. bench/seed_command.sh
seed_prepare
OLD="GraphRunner.slim_keep_step = False"  # (the acceptance kernels in a paused step's graph)
seed_run off1 /tmp/nomtp.yml "" 240
seed_run mtp1 examples/mtp.yml "" 100
seed_run off2 /tmp/nomtp.yml "" 100
seed_run mtp2 examples/mtp.yml "" 100
cd bench
timeout 110 python3 mtp_step_gpu.py --preset flash-L4-E32 --concurrency 32 --ks 0 1 --prompt-len 768 --gen 128 \
  --top 3 --diff 30 --no-probes --append "$OUT/BENCHMARKS.part.md" 2>&1 | grep -v Warn | tail -40
cd ..
seed_run before1 /tmp/before.yml "$OLD" 100
seed_run off3 /tmp/nomtp.yml "" 100
seed_run before2 /tmp/before.yml "$OLD" 100
