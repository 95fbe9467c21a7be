#!/bin/bash
# Session 14 device run 12: the e2e table (rjax bench on the four synthetic models) with Q4_K's
# bf16x2 dequantization in the batched decode products.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
T0=$(date +%s)
timeout 560 python3 benchmarks/e2e.py --out /tmp/e2e --budget 530 > /tmp/e2e.txt 2>&1
grep -v "Delay kernel" /tmp/e2e.txt > $OUT/run12-e2e.txt; grep -A6 "^model  " $OUT/run12-e2e.txt; grep "decode B=\|ok in\|partial" $OUT/run12-e2e.txt | tail -20
cd /tmp/e2e && tar czf $OUT/run12-e2e.tgz *.json *.png 2>/dev/null
echo "elapsed $(( $(date +%s) - T0 ))"
