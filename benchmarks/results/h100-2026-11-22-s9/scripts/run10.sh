#!/bin/bash
# Session 9 device run 10: smollm2 and llama-1b Q4_K rows that run 9's budget skipped.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
T0=$(date +%s)
timeout 200 python3 benchmarks/e2e.py --models smollm2-135m:q4_1,llama-1b:q4_k --out /tmp/e2e --budget 190 > /tmp/e2e.txt 2>&1
grep -v "Delay kernel" /tmp/e2e.txt > $OUT/e2e.txt; grep -A5 "^model  " $OUT/e2e.txt; grep "decode B=\|ok in\|partial" $OUT/e2e.txt
cd /tmp/e2e && tar czf $OUT/e2e.tgz *.json *.png 2>/dev/null
echo "elapsed $(( $(date +%s) - T0 ))"
