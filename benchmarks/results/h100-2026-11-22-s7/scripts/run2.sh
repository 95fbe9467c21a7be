#!/bin/bash
# Session 7 device run 2: quant planes as int32 words at load: GPU tests; decode kernel times (session 6 code = bytes, new = words), M=1 and 16.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1
R=$(pwd); T0=$(date +%s)
el() { echo "elapsed $(( $(date +%s) - T0 ))"; }
PYTHONPATH=/tmp/site:. timeout 260 python3 -m pytest -q -p no:cacheprovider tests/test_int8_gemv.py tests/test_quant_matmul_gpu.py tests/test_engine.py -m gpu -k "not 300" --tb=short > $OUT/gpu-tests.txt 2>&1
grep -E "passed|failed|FAILED|Error" $OUT/gpu-tests.txt | head -20; el
S=14336x4096,4096x14336,28672x4096,6144x4096,128256x4096,16384x2048,2048x8192,3072x2048
for v in head new; do root=$R; [ $v = head ] && root=$R/devruns/head
  (cd $root && PYTHONPATH=/tmp/site:$root timeout 150 python3 $root/benchmarks/quant_matmul.py --mode decode --types Q4_K,Q8_0,Q6_K,Q4_1 --shapes $S --ms 1,16 --timing kernels --out /tmp/qd-$v.json --time-budget 120 > /tmp/qd-$v.txt 2>&1)
  echo $v; grep -E "^(qmatmul|float_gemv)|HBM copy|Error|error" /tmp/qd-$v.txt | cut -c1-120; el; done
cd /tmp && tar czf $OUT/run2.tgz qd-*.json qd-*.txt
