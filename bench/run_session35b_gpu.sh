#!/usr/bin/env bash
# Thirty-fifth session, one call on one GPU: issue 17's matrix at Flash's depth, batch-invariant (so the oracle
# drafter's known answers stay right at every concurrency): MTP off against k = 1, 2, 3 at concurrency 1, 8, 32,
# the real MTP layer (random weights: zero acceptance, the drafting pause on) and the oracle at 0.6 / 0.8 / 0.9.
# Rows print as they finish (a call stopped part way keeps them). KS picks the draft lengths (MTP off first).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
cd bench && timeout "${BUDGET:-580}" python3 mtp_speedup.py --preset flash-L43-E16 --concurrency 1 8 32 \
  --ks ${KS:-0 1 2 3} --p-right 0.6 0.8 0.9 --batch-invariant --repeat 2 --no-gap --gen 96 --pause on \
  --append "$OUT/matrix.md" 2>&1 | grep -v "Warn\|USDT\|TRTLLM\|cuda_graph_config" | tee "$OUT/matrix_rows.txt" | tail -60
