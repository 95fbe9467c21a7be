#!/bin/bash
# Session 18 device run 8: the e2e table on this session's code, with 128 steps per dispatch
# beside 16 and 1 (one dispatch per tg128 run).
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
T0=$(date +%s)
timeout 570 python3 benchmarks/e2e.py --out /tmp/e2e --budget 380 2>&1 | grep -v "Delay kernel" | grep -v "^I0000\|^W0000" | tail -14 > $OUT/run8-e2e.txt
tar czf $OUT/run8-e2e.tgz -C /tmp e2e 2>/dev/null
cat $OUT/run8-e2e.txt
echo "elapsed $(( $(date +%s) - T0 ))"
