#!/usr/bin/env bash
# For the next session's first device call (written in the twenty-ninth, not run: its device time ran out).
# 1. Where the keep-up pass's window rings differ from the whole MTP pass's on CUDA: both of
#    tests/test_engine_cuda.py::test_keep_up_pass_stores_the_whole_passs_window_rows_on_cuda failed on the H100
#    (tokens and drafts equal at every step; some ring rows not). bench/keepup_diag_gpu.py prints, per step, the
#    layers, slots (0: the null slot padded rows write) and ring rows that differ.
# 2. The CUDA tests of this session's code (sampled MTP on == off on CUDA passed in its call 1; the keyed draws'
#    rows are now made 32 at a time), and the grouped MoE now on torch._grouped_mm by default.
# 3. MTP at concurrency 8 on flash-L43-E16 (k = 1, 2, 3; zero acceptance with the pause; the oracle at 0.85).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 170 python3 bench/keepup_diag_gpu.py 2>&1 | grep -v "Warn\|warning" | tail -25
TESTS="tests/test_engine_cuda.py tests/test_kernels_cuda.py::test_grouped_moe_matches_torch tests/test_kernels_cuda.py::test_grouped_moe_on_the_library_grouped_mm_matches_the_kernel_and_replays_in_a_graph" \
  TEST_TIMEOUT=${TEST_TIMEOUT:-220} TEST_TAIL=8 BENCH_TIMEOUT=${BENCH_TIMEOUT:-200} BENCH_TAIL=12 bash bench/device_call.sh \
  "mtp_speedup.py --preset flash-L43-E16 --concurrency 8 --ks 0 1 2 3 --p-right 0.85 --repeat 3 --no-gap --gen 96 --pause on"
