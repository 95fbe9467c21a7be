#!/bin/bash
# Session 9 device run 5: the issue 7 table (benchmarks/e2e.py) with the fused rope+attention on,
# then the int8 GEMV tile sweep at M = 1, 8, 16 (issue 6).
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
T0=$(date +%s)
timeout 380 python3 benchmarks/e2e.py --out /tmp/e2e --budget 360 > /tmp/e2e.txt 2>&1
grep -v "Delay kernel" /tmp/e2e.txt | grep "compiled\|e2e\|^model\|B=" | tail -40
cd /tmp/e2e && tar czf $OUT/e2e.tgz *.json *.png 2>/dev/null; cp /tmp/e2e.txt $OUT/; cd - >/dev/null
echo "e2e done $(( $(date +%s) - T0 ))"
timeout $(( 585 - ($(date +%s) - T0) )) python3 benchmarks/quant_matmul.py --mode int8 --types Q4_K,Q8_0 \
  --shapes 14336x4096,4096x14336 --ms 1,8,16 --int8-block-n 4,8,16 --int8-values 512,1024 --timing kernels --time-budget 120 \
  --out $OUT/int8-m16.json > /tmp/qm.txt 2>&1
grep -v "Delay kernel" /tmp/qm.txt | tail -45; cp /tmp/qm.txt $OUT/
echo "elapsed $(( $(date +%s) - T0 ))"
