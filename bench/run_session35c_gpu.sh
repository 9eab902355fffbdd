#!/usr/bin/env bash
# Thirty-fifth session, one call on one GPU: where issue 20 stands with the code of today (no kernel changed since
# the twenty-ninth session's torch._grouped_mm switch, which was never profiled): an 8k prefill's kernel time by
# kind, TTFT at 1k / 8k, and the decode step against its floor at batch 1 / 32 (flash-L4-E32, bf16; then
# flash-L20-E128 in its checkpoint's precision, FP4 experts and FP8 linears, while BUDGET allows).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
START=$SECONDS
END=$((SECONDS + ${BUDGET:-560}))
cd bench
F="Warn|USDT|TRTLLM|cuda_graph_config"
timeout $((END - SECONDS)) python3 profile_prefill.py --lens 8192 --top 16 2>&1 | grep -Ev "$F" | tail -40
timeout $((END - SECONDS)) python3 prefill.py --lens 1024 8192 --repeat 3 2>&1 | grep -Ev "$F" | tail -8
timeout $((END - SECONDS)) python3 decode_floor.py --batch 1 32 2>&1 | grep -Ev "$F" | tail -10
[ $((END - SECONDS)) -gt 120 ] && timeout $((END - SECONDS)) python3 decode_floor.py --preset flash-L20-E128 \
  --expert-format fp4 --linear-format fp8 --batch 1 32 2>&1 | grep -Ev "$F" | tail -10
echo "total: $((SECONDS - START)) s"
