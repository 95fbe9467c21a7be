#!/bin/bash
# Session 9 device run 6: the int8 MMA kernel's GPU tests, then its tiles at M = 8..32 beside the float kernel.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
T0=$(date +%s)
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_int8_mma.py --tb=short 2>&1 | grep -v "Delay kernel" | tail -15 | tee $OUT/gpu-tests-mma.txt
echo "tests done $(( $(date +%s) - T0 ))"
timeout $(( 560 - ($(date +%s) - T0) )) python3 benchmarks/quant_matmul.py --mode decode --mma --types Q4_K,Q8_0 \
  --shapes 14336x4096,4096x14336,16384x2048 --ms 1,8,16,32 --timing kernels --time-budget 330 \
  --out $OUT/mma.json > /tmp/qm.txt 2>&1
grep -v "Delay kernel" /tmp/qm.txt > $OUT/mma.txt; grep -A200 "best per" $OUT/mma.txt | head -80
echo "elapsed $(( $(date +%s) - T0 ))"
