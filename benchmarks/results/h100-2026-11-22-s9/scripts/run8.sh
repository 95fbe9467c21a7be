#!/bin/bash
# Session 9 device run 8: llama-8b (8 layers) batch-8 decode profiles, int8 MMA on (default) and off.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
T0=$(date +%s)
P="python3 benchmarks/profile_decode.py --out $OUT --shape llama-8b --quant q4_k --batch 8 --layers 8 --top 14"
$P > $OUT/prof-l8b-b8-mma.txt 2>&1
$P --tag=-off --set pallas_kernels.quant_matmul.gemv:INT8_MMA_MAX_M=0 > $OUT/prof-l8b-b8-off.txt 2>&1
for f in $OUT/prof-l8b-b8-*.txt; do grep -v "Delay kernel" $f | tail -22; done
echo "elapsed $(( $(date +%s) - T0 ))"
