#!/bin/bash
# Session 7 device run 4: GPU tests of the final code (int8 GEMV, engine); Q4_K word planes: int8 GEMV against the float kernel at M = 1..8 (where INT8_MAX_M should sit).
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
T0=$(date +%s)
el() { echo "elapsed $(( $(date +%s) - T0 ))"; }
timeout 250 python3 -m pytest -q -p no:cacheprovider tests/test_int8_gemv.py tests/test_engine.py tests/test_quant_matmul_gpu.py -m gpu -k "not 300 and not 64" --tb=short > $OUT/gpu-tests4.txt 2>&1
grep -E "passed|failed|FAILED" $OUT/gpu-tests4.txt | head; el
timeout 200 python3 benchmarks/quant_matmul.py --mode int8 --types Q4_K --shapes 14336x4096,4096x14336,16384x2048 --ms 2,3,4,8 --timing kernels --int8-block-n 8,16 --int8-values 1024 --out /tmp/q4k-m.json --time-budget 170 > /tmp/q4k-m.txt 2>&1
grep -A200 "best per" /tmp/q4k-m.txt | cut -c1-150; el
cp /tmp/q4k-m.txt /tmp/q4k-m.json $OUT/
