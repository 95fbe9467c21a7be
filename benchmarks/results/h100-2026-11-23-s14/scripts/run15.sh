#!/bin/bash
# Session 14 device run 15: the e2e table on the final code (bf16x2 for Q4_K, Q4_0 and Q4_1)

python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
T0=$(date +%s)
timeout 560 python3 benchmarks/e2e.py --out /tmp/e2e --budget 530 > /tmp/e2e.txt 2>&1
grep -v "Delay kernel" /tmp/e2e.txt > $OUT/run15-e2e.txt; grep -A6 "^model  " $OUT/run15-e2e.txt; grep "decode B=\|ok in\|partial" $OUT/run15-e2e.txt | tail -20
cd /tmp/e2e && tar czf $OUT/run15-e2e.tgz *.json *.png 2>/dev/null
echo "elapsed $(( $(date +%s) - T0 ))"
