#!/bin/bash
# Session 8 device run 5: the issue 7 table (benchmarks/e2e.py) with the programs compiled ahead, concurrently.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
T0=$(date +%s)
timeout 540 python3 benchmarks/e2e.py --out /tmp/e2e --budget 520 > /tmp/e2e.txt 2>&1
grep -v "Delay kernel" /tmp/e2e.txt | grep "compiled\|e2e\|^model\|B=" | tail -40
cd /tmp/e2e && tar czf $OUT/e2e.tgz *.json *.png 2>/dev/null; cp /tmp/e2e.txt $OUT/
echo "elapsed $(( $(date +%s) - T0 ))"
