#!/bin/bash
# Session 13 device run 8: smollm2-135m Q4_1 batch 1, the float GLU product with 4 gate rows per
# program (384 programs, the default) and with 8 (FLOAT_GLU_PROGRAMS=132: 192 programs), against
# no GLU in the product (FLOAT_GLU_MAX_M=0).
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
T0=$(date +%s)
mkdir -p /tmp/m
[ -f /tmp/m/sm.gguf ] || python3 -m rjax.cli synth smollm2-135m --quant q4_1 -o /tmp/m/sm.gguf -q
G=pallas_kernels.quant_matmul.gemv
timeout $(( 590 - ($(date +%s) - T0) )) python3 benchmarks/ab.py --models /tmp/m/sm.gguf --batches 1 --rounds 3 \
  --arm glu8=$G:FLOAT_GLU_PROGRAMS=132 --arm noglu=$G:FLOAT_GLU_MAX_M=0 --out $OUT/run8-ab-sm.json 2>&1 | grep -v "Delay kernel" | tail -4
echo "elapsed $(( $(date +%s) - T0 ))"
