#!/bin/bash
# Device run 5: the failing GPU test's traceback; the quantized-matmul GPU tests; end-to-end bench with the GPU layout.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
T0=$(date +%s)
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_quant_matmul_gpu.py -k "int8 or Q4_K or Q8_0" --tb=short > $OUT/gpu-tests.txt 2>&1
grep -E "passed|failed|Error|error:|assert" $OUT/gpu-tests.txt | head -30
echo "elapsed $(( $(date +%s) - T0 ))"
LEFT=$(( 580 - ($(date +%s) - T0) ))
timeout $LEFT python3 benchmarks/e2e.py --out /tmp/e2e --budget $(( LEFT - 25 )) > /tmp/e2e.txt 2>&1
grep -A 8 "^model " /tmp/e2e.txt | tail -9
cd /tmp/e2e && tar czf $OUT/e2e.tgz *.json *.png
echo "elapsed $(( $(date +%s) - T0 ))"
