#!/bin/bash
# Device run 3: int8 GEMV tiles with in-kernel activation rounding (Q4_K, Q8_0, M=1).
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
timeout 400 python3 benchmarks/quant_matmul.py --mode int8 --types Q4_K,Q8_0 --ms 1 --timing kernels \
  --shapes 14336x4096,4096x14336,28672x4096,6144x4096,16384x2048,2048x8192 \
  --int8-block-n 8,16,32 --int8-values 512,1024 --out $OUT/int8-inkernel-sweep.json 2>&1 | grep -v "^$" | tail -80
