#!/bin/bash
# Session 6 device run 6: end-to-end table (benchmarks/e2e.py: four synthetic models, prompt 512, 128 generated, batch 1/8/32).
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
T0=$(date +%s)
timeout 570 python3 benchmarks/e2e.py --out /tmp/e2e --budget 545 > /tmp/e2e.txt 2>&1
grep -B2 -A 10 "^model " /tmp/e2e.txt | tail -14
cd /tmp/e2e && tar czf $OUT/e2e.tgz *.json *.png 2>/dev/null; cp /tmp/e2e.txt $OUT/
echo "elapsed $(( $(date +%s) - T0 ))"
