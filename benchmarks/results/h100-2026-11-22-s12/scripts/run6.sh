#!/bin/bash
# Session 12 device run 6: the int8 GEMV GPU test on Q6_K at an output layer's size, then the
# e2e table (rjax bench on the four synthetic models) with Q6_K's scales as words.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
T0=$(date +%s)
timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_quant_matmul_gpu.py -k "int8_gemv_gpu and Q6_K" \
  --tb=short 2>&1 | grep -v Warning | tail -3 | tee $OUT/gpu-tests.txt
B=$(( 580 - ($(date +%s) - T0) ))
timeout $B python3 benchmarks/e2e.py --out /tmp/e2e --budget $(( B - 25 )) > /tmp/e2e.txt 2>&1
grep -v "Delay kernel" /tmp/e2e.txt > $OUT/e2e.txt; grep -A6 "^model  " $OUT/e2e.txt; grep "decode B=\|ok in\|partial" $OUT/e2e.txt | tail -20
cd /tmp/e2e && tar czf $OUT/e2e.tgz *.json *.png 2>/dev/null
echo "elapsed $(( $(date +%s) - T0 ))"
