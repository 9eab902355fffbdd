#!/usr/bin/env bash
# One device-machine call: CUDA tests (kernels vs torch twins, engine vs dense reference), then the
# benchmarks, each appending its table to $OUT/BENCHMARKS.part.md (copied into BENCHMARKS.md by hand).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_kernel*_cuda.py 2>&1 | tail -20 | tee "$OUT/cuda_tests.txt"
cd bench
for b in "$@"; do  # a script with its arguments is one quoted word: "decode_floor.py --prompt-len 4096"
  echo "== $b"
  python3 $b --append "$OUT/BENCHMARKS.part.md" 2>&1 | grep -v Warning | tail -12
done
