#!/bin/bash
# Session 13 device run 6: the float kernel's gate/up product applying the GLU (FLOAT_GLU_MAX_M=1):
# GPU tests (the kernel against product + XLA GLU; smollm2 Q4_1 decode against a longer prefill),
# then smollm2-135m Q4_1 A/B against FLOAT_GLU_MAX_M=0 at batch 1 and 8.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
T0=$(date +%s)
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_float_glu.py tests/test_engine.py \
  -k "gpu and (glu or matches_longer)" --tb=short 2>&1 | grep -v Warning | tail -4 | tee $OUT/run6-gpu-tests.txt
mkdir -p /tmp/m
[ -f /tmp/m/sm.gguf ] || python3 -m rjax.cli synth smollm2-135m --quant q4_1 -o /tmp/m/sm.gguf -q
G=pallas_kernels.quant_matmul.gemv
timeout $(( 590 - ($(date +%s) - T0) )) python3 benchmarks/ab.py --models /tmp/m/sm.gguf --batches 1,8 --rounds 3 \
  --arm noglu=$G:FLOAT_GLU_MAX_M=0 --out $OUT/run6-ab-sm.json 2>&1 | grep -v "Delay kernel" | tail -5
echo "elapsed $(( $(date +%s) - T0 ))"
