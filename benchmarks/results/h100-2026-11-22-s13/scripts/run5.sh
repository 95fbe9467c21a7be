#!/bin/bash
# Session 13 device run 5: with the decode loop one CUDA graph, launch-saving switches measured
# before are A/B'd again at batch 1: smollm2-135m Q4_1 with the GLU applied by the down product
# (GATED_X_MAX_M=1), on the int8 GEMV everywhere (with add + norm fused), and that with the GLU
# in the gate/up product; llama-1b Q4_K with the GLU in the gate/up product (GLU_MAX_M=1).
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
T0=$(date +%s)
mkdir -p /tmp/m
[ -f /tmp/m/sm.gguf ] || python3 -m rjax.cli synth smollm2-135m --quant q4_1 -o /tmp/m/sm.gguf -q
[ -f /tmp/m/l1b.gguf ] || python3 -m rjax.cli synth llama-1b --quant q4_k -o /tmp/m/l1b.gguf -q
G=pallas_kernels.quant_matmul.gemv
I8=$G:INT8_MIN_VALUES[Q4_1]=0,$G:INT8_PRODUCER_MIN_VALUES[Q4_1]=0
timeout 380 python3 benchmarks/ab.py --models /tmp/m/sm.gguf --batches 1 --rounds 3 \
  --arm gated=$G:GATED_X_MAX_M=1 --arm int8=$I8 --arm int8glu=$I8,$G:GLU_MAX_M=1 \
  --out $OUT/run5-ab-sm.json 2>&1 | grep -v "Delay kernel" | tail -5
timeout $(( 590 - ($(date +%s) - T0) )) python3 benchmarks/ab.py --models /tmp/m/l1b.gguf --batches 1 --rounds 2 \
  --arm glu=$G:GLU_MAX_M=1 --out $OUT/run5-ab-l1b.json 2>&1 | grep -v "Delay kernel" | tail -3
echo "elapsed $(( $(date +%s) - T0 ))"
