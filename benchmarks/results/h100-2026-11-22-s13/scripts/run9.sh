#!/bin/bash
# Session 13 device run 9: the float GLU GPU tests (its switch now off), then the e2e table
# (rjax bench on the four synthetic models) with the decode loop as one CUDA graph.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
T0=$(date +%s)
timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_float_glu.py \
  --tb=short 2>&1 | grep -v Warning | tail -2 | tee $OUT/run9-gpu-tests.txt
B=$(( 585 - ($(date +%s) - T0) ))
timeout $B python3 benchmarks/e2e.py --out /tmp/e2e --budget $(( B - 25 )) > /tmp/e2e.txt 2>&1
grep -v "Delay kernel" /tmp/e2e.txt > $OUT/run9-e2e.txt; grep -A6 "^model  " $OUT/run9-e2e.txt; grep "decode B=\|ok in\|partial" $OUT/run9-e2e.txt | tail -20
cd /tmp/e2e && tar czf $OUT/run9-e2e.tgz *.json *.png 2>/dev/null
echo "elapsed $(( $(date +%s) - T0 ))"
