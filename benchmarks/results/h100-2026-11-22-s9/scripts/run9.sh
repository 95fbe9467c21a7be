#!/bin/bash
# Session 9 device run 9: the issue 7 table with this session's defaults (fused rope+attention on,
# Q8_0 on the dp4a kernel up to 4 rows, the int8 MMA kernel off).
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
T0=$(date +%s)
timeout 330 python3 benchmarks/e2e.py --out /tmp/e2e --budget 320 > /tmp/e2e.txt 2>&1
grep -v "Delay kernel" /tmp/e2e.txt > $OUT/e2e.txt; grep -A8 "^model  " $OUT/e2e.txt; grep "compiled .* ahead\|ok in" $OUT/e2e.txt
cd /tmp/e2e && tar czf $OUT/e2e.tgz *.json *.png 2>/dev/null
echo "elapsed $(( $(date +%s) - T0 ))"
