#!/bin/bash
# Session 18 device run 4: smollm2-135m Q4_1 at batch 1 with the PendingNorm: profile, and A/B
# of the GLU applied by the down product as it loads x (GATED_X_MAX_M=1).
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
T0=$(date +%s)
timeout 100 python3 benchmarks/profile_decode.py --shape smollm2-135m --quant q4_1 --batch 1 --top 40 --out $OUT 2>&1 | grep -v "Delay kernel" | tail -42 > $OUT/run4-prof-sm.txt
head -24 $OUT/run4-prof-sm.txt
echo "elapsed $(( $(date +%s) - T0 ))"
mkdir -p /tmp/m
[ -f /tmp/m/sm.gguf ] || python3 -m rjax.cli synth smollm2-135m --quant q4_1 -o /tmp/m/sm.gguf -q
G=pallas_kernels.quant_matmul.gemv
timeout $(( 590 - ($(date +%s) - T0) )) python3 benchmarks/ab.py --models /tmp/m/sm.gguf --batches 1 --rounds 2 \
  --arm gated=$G:GATED_X_MAX_M=1 --out $OUT/run4-ab-sm.json 2>&1 | grep -v "Delay kernel" | tail -5
echo "elapsed $(( $(date +%s) - T0 ))"
