#!/bin/bash
# Device run 4: GPU tests of the quantized matmuls (Q4_K chunk layout included); end-to-end bench.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
T0=$(date +%s)
timeout 170 python3 -m pytest -q -p no:cacheprovider tests/test_quant_matmul_gpu.py -k "int8 or Q4_K or Q8_0" -x 2>&1 | tail -4
echo "elapsed $(( $(date +%s) - T0 ))"
LEFT=$(( 575 - ($(date +%s) - T0) ))
timeout $LEFT python3 benchmarks/e2e.py --out $OUT/e2e --budget $(( LEFT - 25 )) > /tmp/e2e.txt 2>&1
grep -B2 -A 10 "^model " /tmp/e2e.txt | tail -14
echo "elapsed $(( $(date +%s) - T0 ))"
