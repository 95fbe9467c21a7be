#!/bin/bash
# Session 11 device run 8: the e2e table of the final code (rjax bench on the four synthetic models).
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
T0=$(date +%s)
B=$(( 575 - ($(date +%s) - T0) ))
timeout $B python3 benchmarks/e2e.py --out /tmp/e2e --budget $(( B - 25 )) > /tmp/e2e.txt 2>&1
grep -v "Delay kernel" /tmp/e2e.txt > $OUT/e2e.txt; grep -A6 "^model  " $OUT/e2e.txt; grep "decode B=\|ok in\|partial" $OUT/e2e.txt | tail -20
cd /tmp/e2e && tar czf $OUT/e2e.tgz *.json *.png 2>/dev/null
echo "elapsed $(( $(date +%s) - T0 ))"
