#!/bin/bash
# Session 13 device run 7: smollm2-135m Q4_1 batch-1 profiles with the float GLU product (default)
# and without (FLOAT_GLU_MAX_M=0).
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
G=pallas_kernels.quant_matmul.gemv
python3 benchmarks/profile_decode.py --shape smollm2-135m --quant q4_1 --batch 1 --top 12 --out $OUT 2>&1 | grep -v "Delay kernel" | tail -20 > $OUT/run7-prof-sm-glu.txt
python3 benchmarks/profile_decode.py --shape smollm2-135m --quant q4_1 --batch 1 --top 12 --set $G:FLOAT_GLU_MAX_M=0 --tag noglu --out $OUT 2>&1 | grep -v "Delay kernel" | tail -20 > $OUT/run7-prof-sm-noglu.txt
cat $OUT/run7-prof-sm-glu.txt $OUT/run7-prof-sm-noglu.txt
