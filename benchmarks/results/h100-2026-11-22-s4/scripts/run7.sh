#!/bin/bash
# Device run 7: the Q6_K output layer (128256 x 4096 / 2048, M=1): float tiles and the int8 kernel.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
timeout 250 python3 benchmarks/quant_matmul.py --mode sweep --types Q6_K --ms 1 --timing kernels \
  --shapes 128256x4096,128256x2048 --out $OUT/q6k-float-sweep.json 2>&1 | grep -E "best|^  |HBM copy" | tail -12
timeout 250 python3 benchmarks/quant_matmul.py --mode int8 --types Q6_K --ms 1 --timing kernels \
  --shapes 128256x4096,128256x2048 --int8-block-n 8,16,32 --int8-values 256,512 --out $OUT/q6k-int8-sweep.json 2>&1 | grep -E "best|^  |HBM copy" | tail -14
